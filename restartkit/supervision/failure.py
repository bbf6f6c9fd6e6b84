"""A crash or a hang, as supervise notices it: what it cost (requests in flight, files left in /dev/shm), and
whether another engine serves by the time supervise holds the service's lock."""
from __future__ import annotations

import time
from typing import Callable


def noticed(service, say: Callable[[str], None], what: str, engine: int | None) -> dict:
    """Said, the requests in flight on the engine counted, its /dev/shm swept: the restart's trigger."""
    from restartkit.process.inflight import at_death
    at = time.time()
    front = service.policy.public is not None  # the front continues the requests in flight on the next engine
    if held := at_death(service.state_dir, engine) if engine is not None else None:
        say(f"{service.policy.name}: {held} request(s) in flight on it " +
            ("(the front continues them on the next engine)" if front else "are lost"))
    if swept := service.engine.sweep_gone():  # before the next engine makes its own
        say(f"{service.policy.name}: removed {len(swept)} file(s) it left in /dev/shm")
    say(f"{service.policy.name}: {what}")
    # in flight: the engine's own count of the requests it held; lost, without a front, or continued by it (what
    # it could not continue is counted by the front: restartkit_front_requests_lost_total)
    return {"by": "supervise", "what": what, "noticed_at": at, "in_flight": held, "behind_front": front,
            "lost_in_flight": None if front else held}


def replaced(service, guard, say: Callable[[str], None], pid: int | None, ticks: int | None) -> bool:
    """Once the lock is ours (another restartkit command may be restarting the engine), another engine serves:
    another PID, the same PID started anew (a CRIU restore: `ticks` differ), or the same engine taken back by
    the reconcile of a command killed halfway (a dump).  `guard(command)`: supervise's guard."""
    with guard("supervise"):
        proc = service.current()
        other = proc is not None and (proc.pid != pid or ticks is not None and proc.start_ticks != ticks)
        fixed = proc is not None and (service.reconciled or {}).get("adopted") == proc.pid
        if (other or fixed) and service.is_ready():
            say(f"{service.policy.name}: PID {proc.pid} serves now (restarted by another command); adopted")
            return True
    return False
