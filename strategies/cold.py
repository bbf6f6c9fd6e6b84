"""cold: a normal start from the checkpoint on disk.  Always available, and
the recovery path of every other strategy."""
from __future__ import annotations

from restartkit.contracts import Facts, Outcome, Plan
from restartkit.strategies.base import BaseStrategy, adapter_available, model_loadable


class ColdStrategy(BaseStrategy):
    name = "cold"
    prerequisites = [adapter_available, model_loadable]

    def execute(self, service, facts: Facts, plan: Plan) -> Outcome:
        phases: dict[str, float] = {}
        started = service.engine.restart(self.name, phases=phases)
        return Outcome(self.name, ok=True, phases=phases, engine_phases=started.engine_phases, ready_at=started.ready_at,
                       proof={"path": "cold start from disk", "weight_source": started.weight_source})
