"""The planner: facts + policy + why-restart -> ordered candidates with reasons,
and every other decision of the restart (overlap included).

Pure: no I/O, no clock.  Facts are gathered before (restartkit.restart.gather_facts);
`restartkit plan` prints what it returns; `restart` carries it out.
"""
from __future__ import annotations

from restartkit.contracts import RECOVERY, Evidence, Facts, Plan
from restartkit.errors import UsageError

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def make_plan(facts: Facts, policy, requested: str, strategies: dict, overlap: bool | None = None) -> Plan:
    """`strategies`: name -> strategy, fastest first (the built-in order).  `overlap`: asked for
    on the command line (None: the policy's [restart] overlap)."""
    # long: one decision read top to bottom (order, verdicts, ranking, overlap, notes); split, its steps would
    # pass half the plan between them
    builtin = list(strategies)
    preferred = policy.strategies
    order = list(builtin) if preferred == ["auto"] else [s for s in preferred]
    # Every strategy is shown, eligible or not; the policy's order first.
    order += [s for s in strategies if s not in order]
    verdicts = {name: strategies[name].check(facts, policy) for name in order}
    notes: list[str] = []
    cold_ok = verdicts[RECOVERY].eligible

    ranked_by, expected = "order", {}
    if requested == "auto":
        allowed = list(builtin) if preferred == ["auto"] else preferred
        ranking = preferred == ["auto"] and policy.restart["rank"] == "measured" and bool(facts.evidence)
        if ranking:
            ranked_by = "downtime" if policy.restart["overlap"] and facts.service.overlap_problem is None \
                else "time_to_ready"
            allowed, expected = rank(allowed, facts.evidence, ranked_by)
            order = allowed + [s for s in order if s not in allowed]
            if not any(expected[s]["seconds"] is not None for s in allowed if s in expected and verdicts[s].eligible):
                ranked_by = "order"  # nothing eligible was measured or estimated: the built-in order stands
        eligible = [s for s in allowed if verdicts[s].eligible]
        attempt = eligible[0] if eligible else (RECOVERY if cold_ok else None)
        if attempt == RECOVERY and RECOVERY not in allowed:
            notes.append(f"no strategy the policy allows ({', '.join(allowed)}) is eligible; recovery: a cold start")
        elif attempt and ranked_by != "order":
            notes.append(_why_ranked(attempt, eligible, facts.evidence, expected, ranked_by))
        elif attempt and attempt != RECOVERY:
            notes.append(f"auto chose {attempt}: the first eligible in {' > '.join(allowed)}")
        if ranking:
            notes.extend(_evidence_notes(eligible, facts.evidence, policy))
    else:
        if requested not in verdicts:
            raise UsageError(f"strategy {requested!r} is not supported", hint=f"choose one of: auto, {', '.join(builtin)}")
        if verdicts[requested].eligible:
            attempt = requested
        elif verdicts[requested].forceable:
            attempt = requested
            notes.append(f"{requested} was asked for by name although it is not eligible; every reason is one it "
                         "may get past (ipc: the engine falls back to loading from disk and says why, recorded as a "
                         "fallback; criu+ipc on a GPU: not verified there), and a failure recovers cold")
        else:
            attempt = RECOVERY if cold_ok else None
            notes.append(f"{requested} was asked for but is not eligible; the restart goes straight to its recovery path (cold)")
    if attempt is None:
        notes.append("nothing can run: even a cold start is not possible (" + "; ".join(verdicts[RECOVERY].reasons) + ")")
    snap = facts.of("criu")
    if snap.get("current") and snap.get("freeze_s") is not None and attempt in ("criu", "criu+ipc"):
        notes.append(f"taking snapshot {snap['current']} ({snap.get('kind')}) froze the engine for "
                     f"{snap['freeze_s']:.2f} s: each refresh does so again (clients get errors meanwhile)")
    if attempt == "criu" and snap.get("current") and snap.get("tested") is None:
        notes.append(f"snapshot {snap['current']} has never been test-restored "
                     f"(`restartkit snapshot test --policy {policy.path}` restores a copy beside the engine)")
    plan = Plan(requested=requested, reason=facts.reason, order=order, verdicts=verdicts, attempt=attempt, notes=notes,
                ranked_by=ranked_by, expected=expected)
    notes.extend(facts.service.engine_notes)
    notes.extend(facts.notes)
    host = policy.service["host"]
    if host not in LOOPBACK and not host.startswith("127."):
        notes.append(f"[service] host binds {host}: other hosts reach the completions; the admin and sleep "
                     "endpoints of the reference engine answer loopback only")
    why_not = facts.service.overlap_problem
    if policy.restart["overlap"]:
        notes.append("overlap: ipc restarts prepare the new engine beside the old one" if why_not is None
                     else f"overlap is on but does not apply: {why_not}")
    if policy.restart["overlap"] if overlap is None else overlap:
        if attempt not in ("ipc", "standby"):
            plan.overlap_dropped = (f"--overlap applies to ipc and standby restarts only; this restart runs {attempt} "
                                    "without it")
        elif why_not:
            plan.overlap_dropped = f"--overlap does not apply ({why_not}); this restart runs without it"
        else:
            plan.overlap = True
    return plan


def expected_value(ev: Evidence | None, ranked_by: str) -> float | None:
    """The number a strategy is ranked by: its expected downtime when restarts are overlapped
    (only an overlapped ipc restart has one below its time to ready), else its time to ready."""
    if ev is None:
        return None
    if ranked_by == "downtime" and ev.downtime_s is not None:
        return ev.downtime_s
    return ev.time_s


MARGIN = 0.1  # a strategy overtakes one the built-in order puts first only when faster by more than 10 %
MARGIN_S = 0.2  # ... and by more than 0.2 s: closer than that is noise, and the built-in order stands


def _faster(a: float, b: float) -> bool:
    return a < b * (1 - MARGIN) and b - a > MARGIN_S


def rank(allowed: list[str], evidence: dict[str, Evidence], ranked_by: str) -> tuple[list[str], dict]:
    """Fastest first by evidence.  A strategy without a number keeps its place in the built-in
    order; those with numbers are sorted among the places they hold, one overtaking another only
    when clearly faster (MARGIN, MARGIN_S).  A strategy that failed recently (still cooling
    down) goes last."""
    value = {s: expected_value(evidence.get(s), ranked_by) for s in allowed}
    numbered = [s for s in allowed if value[s] is not None]
    ordered = list(numbered)
    for _ in range(len(ordered)):  # a bubble sort with a margin: few strategies, a stable result
        for i in range(len(ordered) - 1):
            if _faster(value[ordered[i + 1]], value[ordered[i]]):
                ordered[i], ordered[i + 1] = ordered[i + 1], ordered[i]
    slots = iter(ordered)
    ranked = [next(slots) if s in numbered else s for s in allowed]
    cooling = [s for s in ranked if s in evidence and evidence[s].failures]
    ranked = [s for s in ranked if s not in cooling] + cooling
    expected = {s: {"seconds": value[s], "metric": ranked_by, **evidence[s].to_dict()} for s in allowed if s in evidence}
    return ranked, expected


def _describe(ev: Evidence, ranked_by: str) -> str:
    v = expected_value(ev, ranked_by)
    if v is None:
        return "no measurement or estimate"
    what = "downtime" if ranked_by == "downtime" and ev.downtime_s is not None else "ready"
    return f"{what} in {v:.2f} s ({ev.source}: {ev.detail})"


def _why_ranked(attempt: str, eligible: list[str], evidence: dict[str, Evidence], expected: dict,
                ranked_by: str) -> str:
    metric = "client-seen downtime" if ranked_by == "downtime" else "time to ready"
    rest = [f"{s} {expected[s]['seconds']:.2f} s" for s in eligible if s != attempt and s in expected
            and expected[s]["seconds"] is not None]
    ev = evidence.get(attempt)
    if ev is None or expected_value(ev, ranked_by) is None:
        return (f"auto chose {attempt}: not measured here yet, so it keeps its place in the built-in order; "
                f"the others are ranked by {metric}" + (f": {', '.join(rest)}" if rest else ""))
    mine = expected_value(ev, ranked_by)
    tie = any(expected[s]["seconds"] is not None and expected[s]["seconds"] < mine
              for s in eligible if s != attempt and s in expected)
    return (f"auto chose {attempt}: {_describe(ev, ranked_by)}; ranked by {metric}"
            + (f" against {', '.join(rest)}" if rest else "")
            + (f" (within {MARGIN:.0%} or {MARGIN_S} s counts as a tie, and a tie keeps the built-in order)" if tie else ""))


def _evidence_notes(eligible: list[str], evidence: dict[str, Evidence], policy) -> list[str]:
    notes = []
    unmeasured = [s for s in eligible if s in evidence and evidence[s].source != "measured"]
    if unmeasured:
        names = ",".join(dict.fromkeys([*unmeasured, RECOVERY]))
        how = ", ".join(f"{s} ({'estimated' if evidence[s].source == 'estimated' else 'built-in order'})"
                        for s in unmeasured)
        notes.append(f"no measurement here yet for {how}; measure with "
                     f"`restartkit bench --policy {policy.path} --strategies {names} --repeat 3`")
    for s, ev in evidence.items():
        if ev.failures:
            notes.append(f"{s} is ranked last: its last {ev.failures} restart(s) ended in recovery; it is tried "
                         f"first again in {ev.retry_in_s / 60:.0f} min ([restart] rank_cooldown_s)")
    return notes


def render_plan(plan: Plan) -> str:
    lines = [f"restart reason: {plan.reason}; requested: {plan.requested}"]
    for name in plan.order:
        v = plan.verdicts[name]
        mark = "eligible" if v.eligible else ("not built" if not v.built else "not eligible")
        arrow = "->" if name == plan.attempt else "  "
        exp = plan.expected.get(name)
        when = ""
        if exp is not None:
            when = (f"  expected {exp['seconds']:.2f} s ({exp['source']})" if exp["seconds"] is not None
                    else "  expected: unknown (built-in order)")
            if exp.get("failures"):
                when += f"; {exp['failures']} recent failure(s)"
        lines.append(f" {arrow} {name:<8} {mark}{when}")
        for r in v.reasons:
            lines.append(f"             - {r}")
    for n in plan.notes:
        lines.append(f"note: {n}")
    if plan.attempt:
        lines.append(f"would run: {plan.attempt}" + (f" (recovery: {plan.recovery})" if plan.attempt != plan.recovery else ""))
    return "\n".join(lines)
