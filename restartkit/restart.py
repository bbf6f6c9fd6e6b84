"""Carry out a plan: baseline canary, the chosen strategy, proof, and on any
failure the recovery path (a cold start).  Every restart leaves one record."""
from __future__ import annotations

import json
import sys
import time
from typing import Callable

from restartkit import facts as host_facts
from restartkit.errors import RestartkitError
from restartkit.guard import now_ticks
from restartkit.planner import Plan, make_plan
from restartkit.record import Record, append_history, update_metrics
from restartkit.service import Service
from restartkit.strategies import all_strategies
from restartkit.strategies.base import Facts, Outcome

REASONS = ("restart", "crash", "config", "code", "weights")


def gather_facts(service: Service, reason: str, run_criu_check: bool = True) -> Facts:
    host = host_facts.gather(service.state_dir, service.policy.criu["criu_path"], run_criu_check=run_criu_check)
    facts = Facts(host=host, service=service.service_facts(), reason=reason)
    facts.service.extra["criu"] = snapshot_facts(service, facts)
    return facts


def snapshot_facts(service: Service, facts: Facts) -> dict:
    """The current snapshot and whether it fits this host; what the live engine holds."""
    if service.adapter is None or facts.service.model_problem:
        return {}
    try:
        from restartkit.snapshot.cudackpt import fd_targets
        from restartkit.snapshot.ops import identity, mismatches, store_for
        from restartkit.supervise import tree_pids
        out: dict = {}
        if facts.service.pid:
            pids = tree_pids(facts.service.pid)
            fds = {p: fd_targets(p) for p in pids}
            out["io_uring_pids"] = [p for p, t in fds.items() if any("io_uring" in x for x in t)]
            out["ipc_attached"] = any("memfd:restartkit-arena" in x for t in fds.values() for x in t)
        snap = store_for(service).current()
        if snap is not None:
            out.update(current=snap.id, suspect=snap.suspect, age_s=round(snap.age_s),
                       tested=(snap.manifest.get("tested") or {}).get("ok"),
                       image_bytes=snap.manifest.get("image_bytes"),
                       mismatches=mismatches(snap.manifest["identity"], identity(service, facts)))
        return out
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


OVERLAP_SUPPORT = {
    "reference": None,
    "vllm": "vLLM's own interfaces have no prepare/activate split (its engine takes the device and the port as it starts)",
    "sglang": "SGLang's interfaces have no prepare/activate split",
}


def overlap_problem(policy) -> str | None:
    """Why an overlapped (or prestarted) ipc restart cannot apply to this service, or None."""
    why_not = OVERLAP_SUPPORT.get(policy.service["engine"], "not supported by this engine adapter")
    if why_not is None and policy.service["tensor_parallel_size"] > 1:
        why_not = "an engine prepared beside the old one runs one rank only (tensor_parallel_size 1)"
    return why_not


def plan_for(service: Service, requested: str, reason: str) -> tuple[Plan, Facts]:
    facts = gather_facts(service, reason)
    plan = make_plan(facts, service.policy, requested, all_strategies())
    if service.adapter is not None:
        plan.notes.extend(service.adapter.plan_notes(service.policy))
    host = service.policy.service["host"]
    if host not in ("127.0.0.1", "::1", "localhost") and not host.startswith("127."):
        plan.notes.append(f"[service] host binds {host}: other hosts reach the completions; the admin and sleep "
                          "endpoints of the reference engine answer loopback only")
    if service.policy.restart["overlap"]:
        why_not = overlap_problem(service.policy)
        plan.notes.append("overlap: ipc restarts prepare the new engine beside the old one" if why_not is None
                          else f"overlap is on but does not apply: {why_not}")
    return plan, facts


def restart(service: Service, requested: str = "auto", reason: str = "restart", strict: bool = False,
            say: Callable[[str], None] = lambda _m: None, overlap: bool | None = None,
            measure_downtime: bool = False) -> Record:
    plan, facts = plan_for(service, requested, reason)
    facts.overlap = service.policy.restart["overlap"] if overlap is None else overlap
    if facts.overlap and plan.attempt != "ipc":
        say(f"--overlap applies to ipc restarts only; this restart runs {plan.attempt} without it")
        facts.overlap = False
    if facts.overlap and (why_not := overlap_problem(service.policy)):
        say(f"--overlap does not apply ({why_not}); this restart runs without it")
        facts.overlap = False
    probe = None
    if facts.overlap or measure_downtime:
        from restartkit.overlap import DowntimeProbe
        probe = DowntimeProbe(service)
    rec = _restart(service, plan, facts, requested, reason, say, probe)
    if probe is not None:
        probe.stop()
        rec.downtime = probe.summary()
    return _close(service, rec, strict)


def _restart(service: Service, plan: Plan, facts: Facts, requested: str, reason: str, say, probe=None) -> Record:
    rec = Record(service=service.policy.name, policy=service.policy.path, requested=requested,
                 reason=reason, plan=plan.to_dict())
    for note in plan.notes:
        say(note)
    if plan.attempt is None:
        rec.recovery_reason = "; ".join(plan.notes)
        return rec

    baseline, source = _baseline(service, facts, reason, say)
    rec.proof = {"baseline_source": source, "before": baseline}

    t0 = time.monotonic()
    since_ticks = now_ticks()  # a listener on the port created from here on belongs to this restart
    strategies = all_strategies()
    primary = plan.attempt
    say(f"running {primary}" + (f" (recovery: {plan.recovery})" if primary != plan.recovery else ""))
    if probe is not None:
        probe.start()  # after the baseline canary: the client measures the restart, not our own requests
    outcome = _attempt(strategies[primary], service, facts, baseline, rec, role="primary",
                       after_execute=probe.stop if probe is not None else None)
    if not outcome.ok and outcome.old_still_serving:
        rec.via_recovery = True
        rec.recovery_reason = f"{primary} failed before the old engine was stopped: {outcome.error}"
        say(rec.recovery_reason + "; the old engine keeps serving")
        if service.is_ready():
            rec.final_state, rec.served_by = "serving", "old engine"
        return rec
    if plan.goes_straight_to_recovery:
        rec.via_recovery = True
        rec.recovery_reason = f"{requested} is not eligible: " + "; ".join(plan.verdicts[requested].reasons)
        rec.attempts.insert(0, {"strategy": requested, "role": "primary", "ok": False, "skipped": True,
                                "error": rec.recovery_reason})
        rec.attempts[1]["role"] = "recovery"
    if not outcome.ok and primary != plan.recovery:
        rec.via_recovery = True
        rec.recovery_reason = f"{primary} failed: {outcome.error}"
        say(f"{primary} failed ({outcome.error}); recovering with a cold start")
        cleared = service.clear_for_recovery([facts.service.pid, *outcome.pids, *service.intent.data.get("pids", [])],
                                             since_ticks)
        if cleared:
            rec.attempts[-1]["killed_before_recovery"] = cleared
        service.intent.update(strategy=plan.recovery, role="recovery")
        outcome = _attempt(strategies[plan.recovery], service, facts, baseline, rec, role="recovery")
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


def _attempt(strategy, service: Service, facts: Facts, baseline, rec: Record, role: str, after_execute=None) -> Outcome:
    service.intent.update(strategy=strategy.name, role=role, reason=facts.reason)
    try:
        outcome = strategy.execute(service, facts)
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
    rec.attempts.append(entry)
    return outcome


def _verify(service: Service, outcome: Outcome, baseline, reason: str) -> None:
    """The restart counts only if the canary answers, and answers the same."""
    t0 = time.monotonic()
    try:
        t1 = time.monotonic()
        after = service.canary()
        outcome.detail["first_completion_s"] = round((time.monotonic() - t1) / max(1, len(after)), 4)
    except Exception as e:
        outcome.ok, outcome.error = False, f"the canary failed after {outcome.strategy}: {e}"
        return
    finally:
        outcome.detail["verify_s"] = round(time.monotonic() - t0, 4)
    canary = {"after": after}
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


def write_record(service: Service, rec: Record) -> bool:
    """history.jsonl and metrics.prom.  A record that cannot be written is printed on stderr
    (never silently lost), and never turns a served restart into a failed command."""
    try:
        append_history(service.state_dir, rec)
        update_metrics(service.state_dir, rec)
        return True
    except OSError as e:
        print(f"restartkit: could not write the record of restart {rec.id} to {service.state_dir} ({e.strerror or e}); "
              f"the record follows:\n{json.dumps(rec.to_dict(), default=str)}", file=sys.stderr)
        return False
