"""cold: a normal start from the checkpoint on disk.  Always available, and
the recovery path of every other strategy."""
from __future__ import annotations

import time

from restartkit.strategies.base import BaseStrategy, Facts, Outcome, adapter_available, model_loadable


class ColdStrategy(BaseStrategy):
    name = "cold"
    prerequisites = [adapter_available, model_loadable]

    def execute(self, service, facts: Facts) -> Outcome:
        phases: dict[str, float] = {}
        t0 = time.monotonic()
        service.stop()
        phases["stop"] = round(time.monotonic() - t0, 4)
        t1 = time.monotonic()
        started = service.start_engine(strategy=self.name)
        phases["start_to_ready"] = round(time.monotonic() - t1, 4)
        return Outcome(self.name, ok=True, phases=phases, engine_phases=started.engine_phases,
                       proof={"path": "cold start from disk", "weight_source": started.weight_source})
