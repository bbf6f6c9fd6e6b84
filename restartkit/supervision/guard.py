"""guarded() as every command runs it, for supervise: when the state dir cannot be written any more (it turned
read-only under a serving engine), the work still runs, degraded: no lock or intent (no other command can take
them either), the engine's log on supervise's stderr, records on stderr, until it can be written again."""
from __future__ import annotations

import contextlib
from typing import Callable

from restartkit.errors import UsageError
from restartkit.guard.preflight import preflight_writable


@contextlib.contextmanager
def degradable(service, guarded, command: str, wait_s: float, say: Callable[[str], None]):
    """`guarded`: every command's guard (restartkit.commands.reconcile.guarded)."""
    try:
        preflight_writable(service.state_dir)
    except UsageError as e:
        if not service.engine.degraded:
            say(f"restartkit supervise: {e.message}; supervising without a lock or records on disk "
                "until it can be written (the engine's log and the records go to stderr)")
        service.engine.degraded = True
        yield []
        return
    if service.engine.degraded:
        service.engine.degraded = False
        say(f"restartkit supervise: the state dir {service.state_dir} can be written again")
        last = service.engine.last
        if last is not None and last.alive():
            service.engine.mark_ready(last, "cold")  # the engine started meanwhile gets its engine.json
    with guarded(service, command, wait_s, say, defer_signals=False) as got:
        yield got
