"""Carry out a plan: baseline canary, the chosen strategy, proof, and on any
failure the recovery path (a cold start).  Every restart leaves one record.

The flow, data one way: gather_facts (I/O, once) -> make_plan (pure) ->
_restart (acts, appends each attempt to the record) -> write_record."""
from __future__ import annotations

import time
from typing import Callable

from restartkit import evidence
from restartkit import facts as host_facts
from restartkit.contracts import Facts, Outcome, Plan
from restartkit.errors import RestartkitError
from restartkit.planner import make_plan
from restartkit.record import Record, write_record
from restartkit.service import Service
from restartkit.strategies import all_strategies
from restartkit.guard.deferred import cut_short
from restartkit.process.seam import Cut


def gather_facts(service: Service, reason: str, run_criu_check: bool = True) -> Facts:
    """Everything the planner and the strategies need, asked once: the host, the service and
    its live engine, then each strategy's own facts (a strategy that cannot ask says why)."""
    host = host_facts.gather(service.state_dir, service.policy.criu["criu_path"], run_criu_check=run_criu_check)
    facts = Facts(host=host, service=service.service_facts(), reason=reason)
    sf = facts.service
    if reason == "restart" and sf.loaded_digest and sf.model_digest and sf.loaded_digest != sf.model_digest:
        # the running engine serves other weights than those on disk: whatever restarts it serves new weights
        facts.reason = "weights"
        facts.notes.append("the weights on disk changed since the running engine loaded them: restarting for new "
                           "weights (strategies that bring back the old ones are not eligible, the canary is not "
                           "compared); say --reason weights for such restarts")
    for name, strategy in all_strategies().items():
        try:
            facts.strategy[name] = strategy.gather(service, facts)
        except Exception as e:
            facts.strategy[name] = {"error": f"{type(e).__name__}: {e}"}
    facts.evidence = evidence.gather(service, facts, list(facts.strategy))
    return facts


def snapshot_problems(facts: Facts, policy) -> list[str]:
    """Why a snapshot cannot be taken of this service on this host (empty: it can)."""
    return all_strategies()["criu"].snapshot_problems(facts, policy)


def plan_for(service: Service, requested: str, reason: str, overlap: bool | None = None) -> tuple[Plan, Facts]:
    facts = gather_facts(service, reason)
    return make_plan(facts, service.policy, requested, all_strategies(), overlap), facts


def restart(service: Service, requested: str = "auto", reason: str = "restart", strict: bool = False,
            say: Callable[[str], None] = lambda _m: None, overlap: bool | None = None,
            measure_downtime: bool = False, trigger: dict | None = None, refuse_ineligible: bool = False) -> Record:
    """`trigger`: who asked and when they noticed (supervise); the record gets the time from
    then to serving again.  `refuse_ineligible` (an operator's `restart --strategy X`, `--overlap`): what was
    asked for by name and cannot run is refused before anything is touched (UsageError, exit 2), instead of
    going straight to the recovery path."""
    plan, facts = plan_for(service, requested, reason, overlap)
    if refuse_ineligible:
        _refuse_what_cannot_run(service, plan, requested, overlap)
    if plan.overlap_dropped:
        say(plan.overlap_dropped)
    probe = None
    if plan.overlap or measure_downtime:
        from restartkit.downtime import DowntimeProbe
        probe = DowntimeProbe(service)
    rec = Record(service=service.policy.name, policy=service.policy.path, requested=requested,
                 reason=reason, plan=plan.to_dict(), context=evidence.context(facts, service.policy))
    try:
        # a termination signal (deferred by the command, or supervise's) cuts the restart at its next wait
        with cut_short(service) as since_ticks:  # a listener on the port created from then on is this restart's
            _restart(service, plan, facts, rec, since_ticks, say, probe)
    except Cut as cut:
        if probe is not None:
            probe.stop()
        _record_cut(service, rec, cut, say)
        raise
    if probe is not None:
        probe.stop()
        rec.downtime = probe.summary()
    if trigger is not None:
        rec.trigger = dict(trigger)
        if trigger.get("noticed_at"):  # where the time after a crash went: before the restart began, and in all
            rec.trigger["noticed_to_start_s"] = round(rec.started_at - trigger["noticed_at"], 3)
        if rec.final_state == "serving" and trigger.get("noticed_at"):
            rec.trigger["noticed_to_serving_s"] = round(time.time() - trigger["noticed_at"], 3)
    return _close(service, rec, strict)


def _refuse_what_cannot_run(service: Service, plan: Plan, requested: str, overlap: bool | None) -> None:
    """A strategy named on the command line that is not eligible (and cannot be forced), or an --overlap that
    does not apply: refused, naming every reason, before the engine is touched."""
    from restartkit.errors import UsageError
    path = service.policy.path
    if plan.goes_straight_to_recovery:
        reasons = "; ".join(plan.verdicts[requested].reasons)
        raise UsageError(f"{requested} cannot run now: {reasons}; nothing was touched",
                         hint=f"each reason says what would make it eligible (`restartkit plan --policy {path} "
                              f"--strategy {requested}` shows them); `restartkit restart --policy {path}` (auto) runs "
                              "the fastest strategy that can")
    if overlap and plan.overlap_dropped:
        raise UsageError(f"{plan.overlap_dropped.replace(' this restart runs', ' so this restart would run')}; "
                         "nothing was touched", hint="drop --overlap, or restart with ipc or standby")


def _record_cut(service: Service, rec: Record, cut: Cut, say) -> None:
    """The restart was cut at a safe point (restartkit.guard.deferred.cut_short): the record says so."""
    intent = service.intent.data
    rec.attempts.append({"strategy": intent.get("strategy") or rec.requested, "role": intent.get("role", "primary"),
                         "ok": False, "interrupted": cut.name, "killed": cut.killed,
                         "error": f"interrupted by {cut.name} at a safe point"})
    rec.via_recovery = True
    rec.recovery_reason = (f"interrupted by {cut.name}: " + (f"killed {', '.join(map(str, cut.killed))}, which it had "
                           "started" if cut.killed else "nothing it had started was running")
                           + "; the next restartkit command reconciles")
    if service.current() is not None and service.is_ready():
        rec.final_state, rec.served_by = "serving", "old engine"
    write_record(service, rec.finish(strict=False))
    service.intent.update(record=rec.id)
    say(f"{service.policy.name}: {rec.recovery_reason}")
    cut.record = rec


def _restart(service: Service, plan: Plan, facts: Facts, rec: Record, since_ticks: int, say, probe=None) -> Record:
    # long: baseline, attempt, proof and recovery in one place, so that every path ends in one record
    requested = rec.requested
    for note in plan.notes:
        say(note)
    if plan.attempt is None:
        rec.recovery_reason = "; ".join(plan.notes)
        return rec

    baseline, source = _baseline(service, facts, rec.reason, say)
    rec.proof = {"baseline_source": source, "before": baseline}

    t0 = time.monotonic()
    strategies = all_strategies()
    primary = plan.attempt
    say(f"running {primary}" + (f" (recovery: {plan.recovery})" if primary != plan.recovery else ""))
    if probe is not None:
        probe.start()  # after the baseline canary: the client measures the restart, not our own requests
    if plan.goes_straight_to_recovery:
        rec.attempts.append({"strategy": requested, "role": "primary", "ok": False, "skipped": True,
                             "error": f"{requested} is not eligible: " + "; ".join(plan.verdicts[requested].reasons)})
    role = "recovery" if plan.goes_straight_to_recovery else "primary"
    outcome, entry = _attempt(strategies[primary], service, facts, plan, baseline, role=role,
                              after_execute=probe.stop if probe is not None else None)
    if not outcome.ok and outcome.old_still_serving:
        rec.attempts.append(entry)
        rec.via_recovery = True
        rec.recovery_reason = f"{primary} failed before the old engine was stopped: {outcome.error}"
        say(rec.recovery_reason + "; the old engine keeps serving")
        if service.is_ready():
            rec.final_state, rec.served_by = "serving", "old engine"
        return rec
    if plan.goes_straight_to_recovery:
        rec.via_recovery = True
        rec.recovery_reason = rec.attempts[0]["error"]
    if not outcome.ok and primary != plan.recovery:
        rec.via_recovery = True
        rec.recovery_reason = f"{primary} failed: {outcome.error}"
        say(f"{primary} failed ({outcome.error}); recovering with a cold start")
        cleared = service.engine.clear_for_recovery([(facts.service.pid, facts.service.start_ticks)],
                                                    [*outcome.pids, *service.intent.data.get("pids", [])], since_ticks)
        if cleared:
            entry["killed_before_recovery"] = cleared
        rec.attempts.append(entry)
        service.intent.update(strategy=plan.recovery, role="recovery")
        outcome, entry = _attempt(strategies[plan.recovery], service, facts, plan, baseline, role="recovery")
    rec.attempts.append(entry)
    if outcome.ok and outcome.fallback:
        rec.via_recovery = True
        rec.recovery_reason = f"{outcome.strategy} served through its fallback: {outcome.fallback}"
        say(rec.recovery_reason)
    if outcome.ok:
        rec.final_state = "serving"
        rec.served_by = outcome.strategy
        # until the engine answered its readiness probe (not the proof read after it, nor the canary)
        ready_at = outcome.ready_at or time.monotonic() - outcome.detail.get("verify_s", 0.0)
        rec.time_to_ready_s = round(ready_at - t0, 4)
        rec.first_completion_s = outcome.detail.get("first_completion_s")
        rec.proof.update(outcome.proof.get("canary", {}))
    return rec


def _baseline(service: Service, facts: Facts, reason: str, say) -> tuple[list | None, str]:
    if facts.service.engine_ready:
        try:
            return service.canary(), "live engine before the restart"
        except Exception as e:  # a sick engine is a reason to restart, not to stop
            say(f"could not take a canary from the running engine: {e}")
    tokens, source = service.stored_canary()
    return tokens, source


def _attempt(strategy, service: Service, facts: Facts, plan: Plan, baseline, role: str,
             after_execute=None) -> tuple[Outcome, dict]:
    """Execute one strategy and verify its canary; returns the outcome and its record entry."""
    service.intent.update(strategy=strategy.name, role=role, reason=facts.reason)
    try:
        outcome = strategy.execute(service, facts, plan)
    except RestartkitError as e:
        outcome = Outcome(strategy.name, ok=False, error=e.message,
                          detail={"hint": e.hint, "log_tail": getattr(e, "log_tail", "")})
    except Exception as e:  # recorded, then the recovery path runs
        outcome = Outcome(strategy.name, ok=False, error=f"{type(e).__name__}: {e}")
    if after_execute is not None:
        after_execute()
    if outcome.ok:
        _verify(service, outcome, baseline, facts.reason)
        if not outcome.ok:
            strategy.on_canary_failure(service, outcome)
    entry = outcome.to_dict()
    entry["role"] = role
    return outcome, entry


def _verify(service: Service, outcome: Outcome, baseline, reason: str) -> None:
    """The restart counts only if the canary answers, and answers the same."""
    t0 = time.monotonic()
    try:
        t1 = time.monotonic()
        ahead = outcome.detail.pop("canary_after", None)  # answered by the new process before it served
        after = service.remember_canary(ahead) if ahead is not None else service.canary()
        if ahead is None:
            outcome.detail["first_completion_s"] = round((time.monotonic() - t1) / max(1, len(after)), 4)
    except Exception as e:
        outcome.ok, outcome.error = False, f"the canary failed after {outcome.strategy}: {e}"
        return
    finally:
        outcome.detail["verify_s"] = round(time.monotonic() - t0, 4)
    from restartkit.engines.base import canary_kind
    canary = {"after": after, "compared_by": canary_kind(after)}
    if baseline is None:
        canary["canary_identical"] = None
        canary["note"] = "no baseline to compare with; this canary is the baseline from now on"
    elif reason == "weights":
        canary["canary_identical"] = None
        canary["note"] = "not compared: the restart was for new weights"
    else:
        same = baseline == after
        canary["canary_identical"] = same
        if not same:
            outcome.ok = False
            diff = next(i for i, (a, b) in enumerate(zip(baseline, after)) if a != b) if len(baseline) == len(after) else 0
            outcome.error = f"canary differs after {outcome.strategy} (prompt {diff}): the restart is not trusted"
    outcome.proof["canary"] = canary


def _close(service: Service, rec: Record, strict: bool) -> Record:
    rec.finish(strict)
    write_record(service, rec)
    return rec
