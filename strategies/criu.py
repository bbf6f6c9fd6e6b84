"""criu: restore the whole initialized engine from a CRIU snapshot.

The restored process must answer a real completion and give the same canary;
anything else (identity mismatch, PIDs taken, a corrupt image, CRIU missing)
goes to recovery.  The snapshot is marked suspect (never deleted) only when
its own images fail to restore or the restored engine answers a different
canary; a port or PIDs held by others, or a restored engine killed by
someone else, say nothing about the snapshot.
"""
from __future__ import annotations

import time

from restartkit.contracts import Facts, Outcome, Plan
from restartkit.strategies.base import BaseStrategy, adapter_available, model_loadable
from restartkit.strategies.criu_checks import PREREQUISITES, SNAPSHOT_PREREQUISITES, model_is_local


class CriuStrategy(BaseStrategy):
    name = "criu"
    prerequisites = [adapter_available, model_loadable, *PREREQUISITES]

    def gather(self, service, facts: Facts) -> dict:
        """The current snapshot and whether it fits this host (the host's identity, computed
        once and handed to the restore); what the live engine holds."""
        out: dict = {"model_local": model_is_local(service.policy.service["model"])}
        if service.adapter is None or facts.service.model_problem:
            return out
        from restartkit.process.procfs import fd_targets
        from restartkit.snapshot.ops import arena_holders, identity, mismatches, store_for
        from restartkit.snapshot.seal import seal_problem
        from restartkit.process.procfs import tree_pids
        out["weightless_ok"] = service.adapter.weightless_snapshots
        if facts.service.pid:
            pids = tree_pids(facts.service.pid)
            fds = {p: fd_targets(p) for p in pids}
            out["io_uring_pids"] = [p for p, t in fds.items() if any("io_uring" in x for x in t)]
            load = facts.service.stats.get("load") or {}
            # the memfd arena on the CPU; a CUDA IPC mapping shows only in what the engine says of itself
            out["ipc_attached"] = bool(arena_holders(pids)) or (load.get("source") == "ipc"
                                                                 and load.get("mode") == "zero_copy")
            # copied from the cache by an engine that can load them from there again after a restore (vLLM's
            # load format): no shared memory to keep out of the image, but a weights-less snapshot is possible
            out["reattachable"] = load.get("source") == "ipc" and bool(load.get("reattachable"))
        out["identity"] = identity(service, facts)
        store = store_for(service)
        if problem := store.trust_problem():
            out["store_problem"] = problem
        snap = store.current()
        if snap is not None and snap.damaged:
            out.update(current=snap.id, damaged=snap.damaged, images_dir=str(snap.path))
        elif snap is not None:
            tested = snap.manifest.get("tested") or {}
            out.update(current=snap.id, suspect=snap.suspect, age_s=round(snap.age_s), tested=tested.get("ok"),
                       tested_phases=tested.get("phases") if tested.get("ok") else None, images_dir=str(snap.path),
                       dump_phases=snap.manifest.get("phases"), kind=snap.manifest.get("kind") or "full",
                       weight_cache=snap.manifest.get("weight_cache"),
                       on_held_socket=bool((snap.manifest.get("listener") or {}).get("held")),
                       image_bytes=snap.manifest.get("image_bytes"), freeze_s=snap.manifest.get("freeze_s"),
                       mismatches=mismatches(snap.manifest["identity"], out["identity"]),
                       seal_problem=seal_problem(snap.manifest, snap.path))
        return out

    @staticmethod
    def snapshot_problems(facts: Facts, policy) -> list[str]:
        """Why a snapshot cannot be taken of this service here (empty: it can)."""
        return [r for r in (p(facts, policy) for p in SNAPSHOT_PREREQUISITES) if r]

    def execute(self, service, facts: Facts, plan: Plan) -> Outcome:
        from restartkit.snapshot.ops import store_for
        from restartkit.snapshot.restore import restore
        store = store_for(service)
        snap = store.current()
        if snap is None or snap.damaged:
            return Outcome(self.name, ok=False, old_still_serving=True,
                           error="no usable snapshot: " + (snap.damaged if snap else "none"))
        phases: dict[str, float] = {}
        t0 = time.monotonic()
        service.engine.stop()
        phases["stop"] = round(time.monotonic() - t0, 4)
        try:
            proc, restore_phases, load = restore(service, facts, snap)
        except Exception as e:
            suspect = bool(getattr(e, "snapshot_fault", False))
            if suspect:
                self._mark(service, snap, str(e)[:300])
            tail = getattr(e, "log_tail", "")
            return Outcome(self.name, ok=False, phases=phases, error=f"restore of snapshot {snap.id} failed: {e}",
                           pids=list(snap.manifest.get("tree_pids") or []),
                           detail={"criu_log_tail": tail, "snapshot": snap.id, "snapshot_kept": True,
                                   "snapshot_marked_suspect": suspect})
        phases.update(restore_phases)
        phases["start_to_ready"] = round(time.monotonic() - t0 - phases["stop"], 4)
        out = Outcome(self.name, ok=True, phases=phases, pids=[proc.pid],
                      proof={"path": f"CRIU restore of snapshot {snap.id}", "restored_pid": proc.pid,
                             "snapshot": snap.id, "image_bytes": snap.manifest.get("image_bytes"),
                             "snapshot_canary_matches": None})
        self.prove(out, load)
        return out

    def prove(self, out: Outcome, load: dict) -> None:
        """What besides the restore and the canary proves the path (criu: nothing more)."""

    def on_canary_failure(self, service, outcome: Outcome) -> None:
        from restartkit.snapshot.ops import store_for
        store = store_for(service)
        snap = store.get(outcome.proof.get("snapshot") or "")
        if snap is not None:
            self._mark(service, snap, outcome.error or "the restored engine answered a different canary")
            outcome.detail["snapshot_marked_suspect"] = True

    @staticmethod
    def _mark(service, snap, reason: str) -> None:
        from restartkit.snapshot.ops import snapshot_metrics, store_for
        try:
            store_for(service).mark_suspect(snap, reason)
        except OSError as e:
            print(f"restartkit: could not mark snapshot {snap.id} suspect ({e})", flush=True)
        snapshot_metrics(service)
