"""supervise's starts beside the restart flow: the first start adopting the engine that serves already, and a
plain cold start (as `restartkit start` does) when the restart flow itself fails before it ran a strategy (a
file it could not read, a bug): a crash must still end serving, recorded as a recovery with the reason."""
from __future__ import annotations

import time
from typing import Callable


def adopt_serving(service, guard, say: Callable[[str], None]) -> bool:
    """The engine that serves already, adopted once its canary passed (True); one that runs and does not answer
    is stopped (what replaces it starts on a free port).  `guard(command)`: supervise's guard."""
    with guard("supervise"):
        proc = service.current()
        if proc is not None and service.is_ready():
            service.canary()
            say(f"{service.policy.name}: adopted the serving engine (PID {proc.pid})" + (
                "; it listens on a socket of its own: until it is replaced, a crash refuses connections"
                if service.engine.hold and service.engine.held is None else ""))
            return True
        if proc is not None:
            service.engine.stop()
    return False


def cold_anyway(service, guard, reason: str, trigger: dict, why: str, say: Callable[[str], None]):
    """`guard(command)`: supervise's guard (restartkit.supervision.guard.degradable).  Returns the record."""
    from restartkit.record import Record, write_record
    rec = Record(service=service.policy.name, policy=service.policy.path, requested="auto", reason=reason, plan={},
                 trigger=dict(trigger))
    rec.via_recovery, rec.recovery_reason = True, f"the restart flow failed ({why}); a plain cold start"
    try:
        with guard(f"supervise restart ({reason})"):
            if service.current() is None:
                started = service.engine.start("cold")
                service.canary()
                rec.time_to_ready_s = round(started.ready_s, 3)
            rec.attempts.append({"strategy": "cold", "role": "recovery", "ok": True})
            rec.final_state, rec.served_by = "serving", "cold"
    except Exception as e:
        say(f"{service.policy.name}: a plain cold start failed too: {getattr(e, 'message', None) or e}")
        rec.attempts.append({"strategy": "cold", "role": "recovery", "ok": False, "error": str(e)})
    if trigger.get("noticed_at") and rec.final_state == "serving":
        rec.trigger["noticed_to_serving_s"] = round(time.time() - trigger["noticed_at"], 3)
    write_record(service, rec.finish(strict=False))
    return rec
