"""The strategy protocol.

A strategy answers two questions: can it serve this restart (`check`, pure:
facts and policy in, a verdict with every reason out) and how does it do it
(`execute`, which acts on the service and returns an outcome with its phases
and its proof).  Its prerequisites are small named predicates, each returning
None when satisfied and otherwise a reason a person can act on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from restartkit.facts import HostFacts
    from restartkit.policy import Policy
    from restartkit.service import Service


@dataclass
class ServiceFacts:
    """What is known about the service right now (gathered, not decided)."""
    engine: str
    engine_running: bool = False
    engine_ready: bool = False
    pid: int | None = None
    model_problem: str | None = None  # why the model cannot be loaded, if known
    engine_version: str | None = None
    adapter_problem: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class Facts:
    host: "HostFacts"
    service: ServiceFacts
    reason: str = "restart"  # why restart: restart | crash | config | code | weights
    overlap: bool = False  # prepare the new engine while the old one serves (ipc)


Predicate = Callable[[Facts, "Policy"], "str | None"]


@dataclass
class Verdict:
    strategy: str
    eligible: bool
    reasons: list[str]
    built: bool = True
    # not eligible, but every reason is one the engine handles itself when the strategy is asked for
    # by name (ipc with fallback on: the engine loads from disk and says why); auto never picks it
    forceable: bool = False

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "eligible": self.eligible, "built": self.built, "reasons": self.reasons,
                "forceable": self.forceable}


@dataclass
class Outcome:
    strategy: str
    ok: bool
    phases: dict[str, float] = field(default_factory=dict)
    proof: dict[str, Any] = field(default_factory=dict)
    engine_phases: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    fallback: str | None = None  # served, but not by the fast path (e.g. "fallback(dtype)")
    old_still_serving: bool = False  # failed before the old engine was stopped: nothing to recover
    ready_at: float | None = None  # time.monotonic() when the new engine first answered (None: unknown)
    pids: list[int] = field(default_factory=list)  # processes this attempt started or restored (killed before recovery)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("ready_at", "pids")}


class Strategy(Protocol):
    name: str
    built: bool
    prerequisites: list[Predicate]

    def check(self, facts: Facts, policy: "Policy") -> Verdict: ...

    def execute(self, service: "Service", facts: Facts) -> Outcome: ...


class BaseStrategy:
    """Holds the flow once: check runs every predicate and keeps every reason."""

    name = "base"
    built = True
    prerequisites: list[Predicate] = []

    def check(self, facts: Facts, policy: "Policy") -> Verdict:
        failed = [(p, r) for p, r in ((p, p(facts, policy)) for p in self.prerequisites) if r]
        reasons = [r for _, r in failed]
        if not self.built:
            reasons.insert(0, f"the {self.name} strategy is not built yet in restartkit {_version()}")
        forceable = bool(failed) and self.built and all(getattr(p, "forceable", lambda _p: False)(policy) for p, _ in failed)
        return Verdict(self.name, eligible=not reasons, reasons=reasons, built=self.built, forceable=forceable)

    def execute(self, service: "Service", facts: Facts) -> Outcome:
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
