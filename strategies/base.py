"""The strategy protocol, held once.

A strategy answers three questions: what does it need to know (`gather`, the
one I/O step, run once per command before planning), can it serve this
restart (`check`, pure: facts and policy in, a verdict with every reason out)
and how does it do it (`execute`, which acts on the service and returns an
outcome with its phases and its proof).  Its prerequisites are small named
predicates over the gathered facts, each returning None when satisfied and
otherwise a reason a person can act on.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from restartkit.contracts import Facts, Outcome, Plan, Predicate, Verdict

if TYPE_CHECKING:
    from restartkit.policy import Policy
    from restartkit.service import Service


class BaseStrategy:
    """check runs every predicate and keeps every reason."""

    name = "base"
    built = True
    prerequisites: list[Predicate] = []

    def gather(self, service: "Service", facts: Facts) -> dict:
        """What this strategy's predicates and its execute need, asked once (I/O allowed here only)."""
        return {}

    def check(self, facts: Facts, policy: "Policy") -> Verdict:
        failed = [(p, r) for p, r in ((p, p(facts, policy)) for p in self.prerequisites) if r]
        reasons = [r for _, r in failed]
        if not self.built:
            reasons.insert(0, f"the {self.name} strategy is not built yet in restartkit {_version()}")
        forceable = bool(failed) and self.built and all(getattr(p, "forceable", lambda _p: False)(policy) for p, _ in failed)
        return Verdict(self.name, eligible=not reasons, reasons=reasons, built=self.built, forceable=forceable)

    def execute(self, service: "Service", facts: Facts, plan: Plan) -> Outcome:
        raise NotImplementedError(f"{self.name} cannot execute")

    def on_canary_failure(self, service: "Service", outcome: Outcome) -> None:
        """The engine this strategy brought back answered a different canary (criu: mark the snapshot)."""


def _version() -> str:
    from restartkit import __version__
    return __version__


# ---- predicates shared by several strategies ----------------------------------

def adapter_available(facts: Facts, policy: "Policy") -> str | None:
    return facts.service.adapter_problem


def model_loadable(facts: Facts, policy: "Policy") -> str | None:
    return facts.service.model_problem
