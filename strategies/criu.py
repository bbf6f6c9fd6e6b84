"""criu: restore the whole initialized engine from a CRIU snapshot.

The restored process must answer a real completion and give the same canary;
anything else (identity mismatch, PIDs taken, a corrupt image, CRIU missing)
goes to recovery, and the snapshot is marked suspect, never deleted.
"""
from __future__ import annotations

import time

from restartkit.strategies.base import BaseStrategy, Facts, Outcome, adapter_available, model_loadable
from restartkit.strategies.criu_checks import PREREQUISITES


class CriuStrategy(BaseStrategy):
    name = "criu"
    prerequisites = [adapter_available, model_loadable, *PREREQUISITES]

    def execute(self, service, facts: Facts) -> Outcome:
        from restartkit.snapshot.ops import restore, snapshot_metrics, store_for
        store = store_for(service)
        snap = store.current()
        phases: dict[str, float] = {}
        t0 = time.monotonic()
        service.stop()
        phases["stop"] = round(time.monotonic() - t0, 4)
        try:
            proc, restore_phases = restore(service, facts, snap)
        except Exception as e:
            store.mark_suspect(snap, str(e)[:300])
            snapshot_metrics(service)
            tail = getattr(e, "log_tail", "")
            return Outcome(self.name, ok=False, phases=phases, error=f"restore of snapshot {snap.id} failed: {e}",
                           detail={"criu_log_tail": tail, "snapshot": snap.id, "snapshot_kept": True})
        phases.update(restore_phases)
        phases["start_to_ready"] = round(time.monotonic() - t0 - phases["stop"], 4)
        return Outcome(self.name, ok=True, phases=phases,
                       proof={"path": f"CRIU restore of snapshot {snap.id}", "restored_pid": proc.pid,
                              "snapshot": snap.id, "image_bytes": snap.manifest.get("image_bytes"),
                              "snapshot_canary_matches": None})
