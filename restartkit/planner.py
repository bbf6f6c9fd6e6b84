"""The planner: facts + policy + why-restart -> ordered candidates with reasons,
and every other decision of the restart (overlap included).

Pure: no I/O, no clock.  Facts are gathered before (restartkit.restart.gather_facts);
`restartkit plan` prints what it returns; `restart` carries it out.
"""
from __future__ import annotations

from restartkit.contracts import RECOVERY, Facts, Plan
from restartkit.errors import UsageError

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def make_plan(facts: Facts, policy, requested: str, strategies: dict, overlap: bool | None = None) -> Plan:
    """`strategies`: name -> strategy, fastest first (the built-in order).  `overlap`: asked for
    on the command line (None: the policy's [restart] overlap)."""
    builtin = list(strategies)
    preferred = policy.strategies
    order = list(builtin) if preferred == ["auto"] else [s for s in preferred]
    # Every strategy is shown, eligible or not; the policy's order first.
    order += [s for s in strategies if s not in order]
    verdicts = {name: strategies[name].check(facts, policy) for name in order}
    notes: list[str] = []
    cold_ok = verdicts[RECOVERY].eligible

    if requested == "auto":
        allowed = list(builtin) if preferred == ["auto"] else preferred
        eligible = [s for s in allowed if verdicts[s].eligible]
        attempt = eligible[0] if eligible else (RECOVERY if cold_ok else None)
        if attempt == RECOVERY and RECOVERY not in allowed:
            notes.append(f"no strategy the policy allows ({', '.join(allowed)}) is eligible; recovery: a cold start")
        elif attempt and attempt != RECOVERY:
            notes.append(f"auto chose {attempt}: the first eligible in {' > '.join(allowed)}")
    else:
        if requested not in verdicts:
            raise UsageError(f"strategy {requested!r} is not supported", hint=f"choose one of: auto, {', '.join(builtin)}")
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
    snap = facts.of("criu")
    if attempt == "criu" and snap.get("current") and snap.get("tested") is None:
        notes.append(f"snapshot {snap['current']} has never been test-restored "
                     f"(`restartkit snapshot test --policy {policy.path}` restores a copy beside the engine)")
    plan = Plan(requested=requested, reason=facts.reason, order=order, verdicts=verdicts, attempt=attempt, notes=notes)
    notes.extend(facts.service.engine_notes)
    host = policy.service["host"]
    if host not in LOOPBACK and not host.startswith("127."):
        notes.append(f"[service] host binds {host}: other hosts reach the completions; the admin and sleep "
                     "endpoints of the reference engine answer loopback only")
    why_not = facts.service.overlap_problem
    if policy.restart["overlap"]:
        notes.append("overlap: ipc restarts prepare the new engine beside the old one" if why_not is None
                     else f"overlap is on but does not apply: {why_not}")
    if policy.restart["overlap"] if overlap is None else overlap:
        if attempt != "ipc":
            plan.overlap_dropped = f"--overlap applies to ipc restarts only; this restart runs {attempt} without it"
        elif why_not:
            plan.overlap_dropped = f"--overlap does not apply ({why_not}); this restart runs without it"
        else:
            plan.overlap = True
    return plan


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
