"""How supervise ends: stopped (SIGTERM, SIGINT), the engine and its standby stopped; or giving up (the start
limit), the engine left stopped and the give-up counted in the metrics."""
from __future__ import annotations

from typing import Callable


def stop_all(service, guard, say: Callable[[str], None], why: str) -> None:
    """`guard(command)`: supervise's guard (restartkit.supervision.guard.degradable)."""
    from restartkit.standby.armed import disarm
    say(f"{service.policy.name}: {why}: stopping the engine")
    with guard("supervise stop"):
        how = service.engine.stop()
        if (pid := disarm(service)) is not None:
            how += f"; its standby (PID {pid}) stopped"
    say(f"{service.policy.name}: {how}")


def give_up(service, guard, say: Callable[[str], None], why: str) -> str:
    """The engine and its standby stopped, the give-up counted; returns the line that says it (said too)."""
    from restartkit.record import count_give_up, textfile
    from restartkit.standby.armed import disarm
    try:
        with guard("supervise stop"):
            service.engine.stop()
            disarm(service)
    except Exception as e:
        say(f"{service.policy.name}: could not stop the engine: {getattr(e, 'message', None) or e}")
    try:
        count_give_up(service.state_dir, service.policy.name, textfile(service.policy, "restarts"))
    except OSError:
        pass  # the state dir turned read-only: the line below still says it
    line = f"restartkit supervise: giving up on {service.policy.name}: {why}; the engine is left stopped"
    say(line)
    return line
