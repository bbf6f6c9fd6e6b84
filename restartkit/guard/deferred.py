"""SIGTERM, SIGHUP and SIGINT during a command's work only enqueue: the work runs to its next
safe point (every phase has a deadline), then the command exits.  The handler does nothing else;
a small thread says what was received, so that no print can run inside a handler (a signal that
lands while the main thread writes to stderr would make that write re-entrant)."""
from __future__ import annotations

import contextlib
import queue
import signal
import threading
from typing import Callable, Iterator

from restartkit.errors import RestartkitError
from restartkit.process.procfs import now_ticks
from restartkit.process.seam import Cut, cuttable

DEFERRED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_DONE = 0  # no signal has number 0: the announcer's sign to finish


class Interrupted(RestartkitError):
    """A deferred signal stopped work that can be rolled back (a snapshot not yet dumped)."""

    def __init__(self, signum: int, what: str):
        super().__init__(f"interrupted by {signal.Signals(signum).name}: {what}")
        self.exit_code = 128 + signum


def check_interrupted(service, what: str) -> None:
    """At a point where the work can still be undone: stop if a termination signal came."""
    got = getattr(service, "interrupts", None)
    if got:
        raise Interrupted(got[0], what)


@contextlib.contextmanager
def deferred_signals(say: Callable[[str], None], what: str) -> Iterator[list[int]]:
    """Termination signals during the block are noted, not acted on: the block
    finishes (each of its phases has a deadline) and the caller exits after.
    Yields the list of the signals received, in order."""
    got: list[int] = []
    pending: queue.SimpleQueue[int] = queue.SimpleQueue()  # put() is safe from a handler

    def note(signum, _frame):
        """Signal handler - nothing but queue the signal."""
        got.append(signum)
        pending.put(signum)

    def announce():
        signum = pending.get()
        if signum != _DONE:
            say(f"restartkit: {signal.Signals(signum).name} received: ending {what} at its next safe point "
                "(every phase has a deadline), then exiting")
    teller = threading.Thread(target=announce, name="restartkit-signals", daemon=True)
    teller.start()
    old = {s: signal.signal(s, note) for s in DEFERRED_SIGNALS}
    try:
        yield got
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        pending.put(_DONE)
        teller.join(timeout=1.0)


@contextlib.contextmanager
def cut_short(service) -> Iterator[int]:
    """Work that a termination signal may end before it is done (a restart, a start): the block
    ends at its next wait once `service.interrupts` holds a signal (Cut), and what it started or
    restored meanwhile is killed and reaped (`cut.killed`); an engine that ran before is left
    alone, and the intent stays, marked, for the next command.  Yields the start, in clock ticks."""
    since = now_ticks()
    try:
        with cuttable(lambda: next(iter(service.interrupts), None)):
            yield since
    except Cut as cut:
        cut.killed = service.engine.kill_started(service.intent.data.get("pids") or [], since)
        service.intent.update(cut=cut.name)
        raise
