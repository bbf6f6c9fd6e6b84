"""The planner: facts + policy + why-restart -> ordered candidates with reasons.

Pure: no I/O, no clock.  `restartkit plan` prints what it returns; `restart`
carries it out.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from restartkit.strategies import DEFAULT_ORDER
from restartkit.strategies.base import Facts, Verdict

RECOVERY = "cold"


@dataclass
class Plan:
    requested: str
    reason: str
    order: list[str]
    verdicts: dict[str, Verdict]
    attempt: str | None  # what runs first; None: nothing can run
    recovery: str = RECOVERY
    notes: list[str] = field(default_factory=list)

    @property
    def goes_straight_to_recovery(self) -> bool:
        return self.attempt == self.recovery and self.requested not in ("auto", self.recovery)

    def to_dict(self) -> dict:
        return {
            "requested": self.requested, "reason": self.reason, "order": self.order,
            "attempt": self.attempt, "recovery": self.recovery, "notes": self.notes,
            "strategies": [self.verdicts[s].to_dict() for s in self.order],
        }


def make_plan(facts: Facts, policy, requested: str, strategies: dict) -> Plan:
    preferred = policy.strategies
    order = list(DEFAULT_ORDER) if preferred == ["auto"] else [s for s in preferred]
    # Every strategy is shown, eligible or not; the policy's order first.
    order += [s for s in strategies if s not in order]
    verdicts = {name: strategies[name].check(facts, policy) for name in order}
    notes: list[str] = []
    cold_ok = verdicts[RECOVERY].eligible

    if requested == "auto":
        allowed = list(DEFAULT_ORDER) if preferred == ["auto"] else preferred
        eligible = [s for s in allowed if verdicts[s].eligible]
        attempt = eligible[0] if eligible else (RECOVERY if cold_ok else None)
        if attempt == RECOVERY and RECOVERY not in allowed:
            notes.append(f"no strategy the policy allows ({', '.join(allowed)}) is eligible; recovery: a cold start")
        elif attempt and attempt != RECOVERY:
            notes.append(f"auto chose {attempt}: the first eligible in {' > '.join(allowed)}")
    else:
        if requested not in verdicts:
            raise KeyError(requested)
        if verdicts[requested].eligible:
            attempt = requested
        elif verdicts[requested].forceable:
            attempt = requested
            notes.append(f"{requested} was asked for by name although it is not eligible; the engine handles "
                         "that itself (it falls back to loading from disk and says why), recorded as a fallback")
        else:
            attempt = RECOVERY if cold_ok else None
            notes.append(f"{requested} was asked for but is not eligible; the restart goes straight to its recovery path (cold)")
    if attempt is None:
        notes.append("nothing can run: even a cold start is not possible (" + "; ".join(verdicts[RECOVERY].reasons) + ")")
    snap = facts.service.extra.get("criu") or {}
    if attempt == "criu" and snap.get("current") and snap.get("tested") is None:
        notes.append(f"snapshot {snap['current']} has never been test-restored "
                     f"(`restartkit snapshot test --policy {policy.path}` restores a copy beside the engine)")
    return Plan(requested=requested, reason=facts.reason, order=order, verdicts=verdicts, attempt=attempt, notes=notes)


def render_plan(plan: Plan) -> str:
    lines = [f"restart reason: {plan.reason}; requested: {plan.requested}"]
    for name in plan.order:
        v = plan.verdicts[name]
        mark = "eligible" if v.eligible else ("not built" if not v.built else "not eligible")
        arrow = "->" if name == plan.attempt else "  "
        lines.append(f" {arrow} {name:<6} {mark}")
        for r in v.reasons:
            lines.append(f"           - {r}")
    for n in plan.notes:
        lines.append(f"note: {n}")
    if plan.attempt:
        lines.append(f"would run: {plan.attempt}" + (f" (recovery: {plan.recovery})" if plan.attempt != plan.recovery else ""))
    return "\n".join(lines)
