"""The data that flows one way through a restart: policy -> facts -> plan ->
execute -> record.

Facts are gathered (I/O, once per command), the plan is decided from them
(pure), a strategy carries the plan out and returns an Outcome, the restart
flow appends it to the record.  Only data lives here: no I/O, no imports of
the modules that produce or consume it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

# Every strategy by name, fastest first: the order `auto` tries when the policy gives none.
STRATEGY_NAMES = ("sleep", "standby", "criu+ipc", "ipc", "criu", "cold")
# One line each, for the CLI's help and the docs.
STRATEGY_SUMMARIES = {
    "sleep": "park the weights in host memory (or drop them) and wake up in process",
    "standby": "promote a second engine kept armed on the cached weights",
    "criu+ipc": "restore a weights-less CRIU snapshot and re-attach the weights from the weight cache",
    "ipc": "attach the processed weights from a weight-cache daemon",
    "criu": "restore a CRIU snapshot of the whole initialized engine",
    "cold": "a normal start; the recovery path of every other strategy",
}
RECOVERY = "cold"  # always available: the recovery path of every other strategy
REASONS = ("restart", "crash", "config", "code", "weights")  # why restart
# On restartkit's canary requests: an engine that batches runs them in a batch of their own, so that a greedy
# token never depends on what else the engine was computing (the canary compares tokens across restarts).
CANARY_HEADER = "X-Restartkit-Canary"
FACT_TIMEOUT_S = 3.0  # per question asked of a running engine while facts are gathered: a hung one costs seconds


class HostView(Protocol):
    """What this machine can do, gathered once per command (the host facts): as the core sees it."""
    arch: str
    kernel: str
    uid: int
    machine_id: str

    @property
    def is_root(self) -> bool: ...


class PolicyView(Protocol):
    """One service's policy file, loaded and checked: as the core sees it (sections by name)."""
    path: str

    @property
    def name(self) -> str: ...

    @property
    def strategies(self) -> list[str]: ...


@dataclass
class ServiceFacts:
    """What is known about the service and its live engine right now (gathered, not decided)."""
    engine: str
    engine_running: bool = False
    engine_ready: bool = False
    engine_answered: bool = False  # answered at all within the fact timeout (a 503 while asleep counts)
    pid: int | None = None
    start_ticks: int | None = None  # with the PID, names the running engine (engine.json)
    model_problem: str | None = None  # why the model cannot be loaded, if known
    engine_version: str | None = None
    adapter_problem: str | None = None
    overlap_problem: str | None = None  # why this engine cannot be prepared beside the old one, if it cannot
    engine_notes: list[str] = field(default_factory=list)  # what plan says about this engine beyond the reasons
    model_digest: str | None = None  # the weights' identity (a local checkpoint's digest), for evidence
    loaded_digest: str | None = None  # the digest of the weights the running engine was started with (engine.json)
    stats: dict = field(default_factory=dict)  # what the live engine reports about itself (load, phases, sleep)
    held_socket: dict | None = None  # the service's socket, held by its supervisor (restartkit.process.listener)


@dataclass
class Evidence:
    """What this service measured (or can estimate) about one strategy; see restartkit.evidence."""
    strategy: str
    time_s: float | None = None  # expected time to ready
    downtime_s: float | None = None  # expected client-seen downtime of an overlapped restart (ipc)
    source: str = "none"  # measured | estimated | none
    n: int = 0  # how many restarts the measurement is the median of
    detail: str = ""
    failures: int = 0  # recent restarts that tried it first and ended in recovery (within the cool-down)
    failed_at: float | None = None
    retry_in_s: float | None = None  # when it is tried first again

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "strategy"}


@dataclass
class Facts:
    host: HostView
    service: ServiceFacts
    reason: str = "restart"  # why restart: one of REASONS
    # what each strategy gathered for itself (its `gather` step), by strategy name
    strategy: dict[str, dict] = field(default_factory=dict)
    # what this service measured about each strategy (history, estimates), by strategy name
    evidence: dict[str, Evidence] = field(default_factory=dict)
    # what gathering the facts noticed (malformed history records, weights changed on disk): plan says it
    notes: list[str] = field(default_factory=list)

    def of(self, name: str) -> dict:
        return self.strategy.get(name) or {}


Predicate = Callable[[Facts, PolicyView], "str | None"]


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
class Plan:
    """Every decision of a restart, made before anything is touched."""
    requested: str
    reason: str
    order: list[str]
    verdicts: dict[str, Verdict]
    attempt: str | None  # what runs first; None: nothing can run
    recovery: str = RECOVERY
    notes: list[str] = field(default_factory=list)
    overlap: bool = False  # prepare the new engine while the old one serves (ipc)
    overlap_dropped: str | None = None  # overlap was asked for and does not apply to this restart: why
    ranked_by: str = "order"  # how auto ordered the strategies: order | time_to_ready | downtime
    expected: dict[str, dict] = field(default_factory=dict)  # per strategy: the evidence the ranking used

    @property
    def goes_straight_to_recovery(self) -> bool:
        return self.attempt == self.recovery and self.requested not in ("auto", self.recovery)

    def to_dict(self) -> dict:
        return {
            "requested": self.requested, "reason": self.reason, "order": self.order,
            "attempt": self.attempt, "recovery": self.recovery, "notes": self.notes, "ranked_by": self.ranked_by,
            "overlap_dropped": self.overlap_dropped,
            "strategies": [{**self.verdicts[s].to_dict(), **({"expected": self.expected[s]} if s in self.expected else {})}
                           for s in self.order],
        }


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
    """gather (I/O, once per command) -> check (pure) -> execute (acts, returns an Outcome)."""
    name: str
    built: bool
    prerequisites: list[Predicate]

    def gather(self, service, facts: Facts) -> dict: ...

    def check(self, facts: Facts, policy: PolicyView) -> Verdict: ...

    def execute(self, service, facts: Facts, plan: Plan) -> Outcome: ...
