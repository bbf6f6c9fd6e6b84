"""standby: promote the armed standby engine (restartkit.standby.armed).  Everything but its
activation was paid for ahead: the old engine stops (a planned restart; after a crash it is gone
already), then the standby allocates its KV cache, captures its graph, answers one canary prompt
on its private port and takes the service's port.  Proof: its weight-cache hit and the canary.
A standby that is gone, stale or not yet prepared is not eligible, with the reason; one that
fails during its promotion leaves the restart to its recovery (a cold start)."""
from __future__ import annotations

import os
import signal
import time

from restartkit.contracts import Facts, Outcome, Plan
from restartkit.strategies.base import BaseStrategy, adapter_available, model_loadable
from restartkit.standby.prepared import activate, canary_at, took_over, wait_state


def _sb(facts: Facts) -> dict:
    return facts.of("standby")


def enabled(facts: Facts, policy) -> str | None:
    return None if policy.standby["enabled"] else "[standby] enabled is false (no standby engine is kept armed)"


def engine_can_stand_by(facts: Facts, policy) -> str | None:
    from restartkit.standby.armed import cannot_stand_by
    return cannot_stand_by(policy)


def reason_fits(facts: Facts, policy) -> str | None:
    if facts.reason in ("restart", "crash"):
        return None
    return (f"reason {facts.reason!r}: the standby was started with the weights and flags of before; it serves "
            "restarts and crashes only")


def armed(facts: Facts, policy) -> str | None:
    sb = _sb(facts)
    if "error" in sb:
        return f"could not read the standby's state: {sb['error']}"
    rec = sb.get("standby")
    if rec is None:
        return "no standby is armed (`restartkit standby arm`, or supervise with [standby] enabled)"
    if not rec["alive"]:
        return f"the standby (PID {rec['pid']}) is gone"
    if rec["state"] != "prepared":
        return f"the standby (PID {rec['pid']}) is {rec['state']}, not prepared yet"
    return sb.get("frozen") or sb.get("stale")


class StandbyStrategy(BaseStrategy):
    name = "standby"
    prerequisites = [adapter_available, model_loadable, enabled, engine_can_stand_by, reason_fits, armed]

    def gather(self, service, facts: Facts) -> dict:
        from restartkit.standby.armed import frozen, stale, state
        rec = state(service)
        live = rec is not None and rec["alive"]
        return {"standby": rec, "stale": stale(service, rec) if live else None,
                "frozen": frozen(rec) if live and rec["state"] == "prepared" else None}

    def execute(self, service, facts: Facts, plan: Plan) -> Outcome:
        from restartkit.standby.armed import process
        rec = _sb(facts)["standby"]
        new = process(service, rec)
        status = service.state_dir / "standby-status.json"
        phases: dict[str, float] = {}
        out = Outcome(self.name, ok=False, phases=phases, proof={"standby_pid": new.pid,
                                                                "armed_s": round(time.time() - rec["armed_at"], 1)})
        old = service.current()
        if old is None and (holder := service.engine.port_holder_after_grace()):
            # someone else's listener: the standby could not take the port; it stays armed for when it is free
            out.error = (f"port {service.policy.service['port']} is already in use by {holder}; the standby "
                         f"(PID {new.pid}) stays armed")
            return out
        # killed meanwhile, restartkit leaves the next command a standby to adopt (it took the port) or to stop
        service.intent.update(standby={"pid": new.pid, "start_ticks": new.start_ticks})
        # overlapped ([restart] overlap or --overlap), beside the old engine (SO_REUSEPORT on both, the standby's
        # KV cache allocated already): the port never closes, and the old engine stops once the standby serves
        beside = (old is not None and plan.overlap and bool(facts.service.stats.get("reuse_port"))
                  and bool(rec.get("kv_ahead")))
        out.proof["overlap"] = beside
        t0 = time.monotonic()
        handover = None
        if old is not None and not beside and rec.get("kv_ahead"):
            # the standby holds its own KV cache: the port free is all it waits for; the old one exits meanwhile
            handover = service.engine.hand_over()
            phases["stop_old"] = handover.port_free_s
        elif old is not None and not beside:
            out.proof["old_stop"] = service.engine.stop()  # drained and exited: its KV cache is free
            phases["stop_old"] = round(time.monotonic() - t0, 4)
        t1 = time.monotonic()
        try:
            return self._promote(service, new, status, out, old, beside, t0, t1, rec)
        finally:
            if handover is not None:
                handover.join()
                out.proof["old_stop"] = handover.how

    def on_canary_failure(self, service, outcome: Outcome) -> None:
        """The promoted standby answered another canary: it is stopped before the recovery starts (armed before
        this restart, it is not among what the recovery's clean-up counts as this restart's)."""
        current = service.current()
        if current is not None and current.pid == outcome.proof.get("standby_pid"):
            outcome.proof["stopped_after_canary"] = service.engine.stop()

    def _promote(self, service, new, status, out: Outcome, old, beside: bool, t0: float, t1: float,
                 rec: dict) -> Outcome:
        """SIGUSR1 (activate, unless done ahead), the canary on its private port, SIGUSR2 (the public port)."""
        from restartkit.standby.armed import canary_of, consumed
        pol, phases = service.policy, out.phases
        try:
            private, stats = activate(service, new, status, out, old, pol.standby["promote_timeout_s"])
            phases["activate"] = round(time.monotonic() - t1, 4)
            # beside the old engine, the whole canary before it takes the port; else nothing serves meanwhile: one
            # token shows it computes, and the whole canary is compared once it serves (the restart's proof)
            out.proof["new_engine_canary"] = (canary_at(service, private) if beside
                                              else canary_at(service, private, first_only=True, max_tokens=1))
            os.kill(new.pid, signal.SIGUSR2)
            wait_state(status, new, "ready", pol.standby["promote_timeout_s"])
        except Exception as e:
            if beside:  # the old engine was not touched: it keeps serving
                new.stop(timeout_s=5)
                consumed(service)
                out.error, out.old_still_serving = f"the standby (PID {new.pid}) failed its promotion: {e}", True
                return out
            # the old engine is gone: the restart's recovery (cold) takes over
            if new.alive():
                new.stop(timeout_s=5)
            consumed(service)
            out.error = f"the standby (PID {new.pid}) failed its promotion: {e}"
            return out
        except BaseException:  # cut by a signal: a half-promoted standby is nobody's engine
            if new.alive():
                new.stop(timeout_s=5)
            consumed(service)
            raise
        consumed(service)
        phases["stop_to_ready"] = round(time.monotonic() - t1, 4)
        out.ready_at = time.monotonic()
        # the proof: the whole canary this process answered on its private port (beside the old engine, just
        # now; activated ahead, while it waited), compared by the restart; else the restart asks it on the port
        ahead = out.proof["new_engine_canary"] if beside else canary_of(service, rec)
        if ahead is not None:
            out.detail["canary_after"] = ahead
            out.proof["canary_from"] = ("the promoted engine on its private port, " + (
                "before it took the port" if beside else f"while it waited armed ({time.time() - rec['canary']['at']:.0f} s "
                "before its promotion)"))
        if beside:
            t2 = time.monotonic()
            out.proof["old_stop"] = service.engine.stop()  # SIGTERM: it finishes what it answers, closes its listener
            phases["stop_old"] = round(time.monotonic() - t2, 4)
        return took_over(service, new, "standby", stats, out, t0)
