"""The one door for side effects: spawning, signalling, the clock and sleeping.  The logic tests
pass their own; everything else gets the real one."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from restartkit.process.procfs import exited, proc_start_ticks, reap, tree_pids


class Cut(BaseException):
    """A termination signal reached a safe point of a cuttable block (see `cuttable`).  A
    BaseException, as KeyboardInterrupt: no `except Exception` of a strategy takes it for a
    failure to recover from."""
    record = None  # the restart's record, when a restart was cut
    killed: tuple[int, ...] | list[int] = ()  # what the cut work had started, killed when it was cut

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


_blocks: list[dict] = []  # the cuttable blocks we are in, innermost last: their question, and whether they were cut


@contextlib.contextmanager
def cuttable(pending: Callable[[], int | None]) -> Iterator[None]:
    """Within the block every wait of restartkit's (`Seam.wait_until`, `safe_point`) is a safe point:
    once `pending()` names a signal, the next one raises Cut in the main thread, once (the
    clean-up's own waits after it run to their end).  Outside such a block nothing is cut."""
    block = {"pending": pending, "cut": False}
    _blocks.append(block)
    try:
        yield
    finally:
        _blocks.remove(block)


def safe_point() -> None:
    """Raise Cut here when a cuttable block was asked to end (see `cuttable`)."""
    if not _blocks or _blocks[-1]["cut"] or threading.current_thread() is not threading.main_thread():
        return
    signum = _blocks[-1]["pending"]()
    if signum:
        _blocks[-1]["cut"] = True  # once: what cleans up after the cut waits undisturbed
        raise Cut(signum)


@dataclass
class Seam:
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    kill: Callable[[int, int], None] = os.kill
    popen: Callable[..., subprocess.Popen] = subprocess.Popen

    def wait_until(self, done: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
        """Ask `done` until it says yes (True) or `timeout_s` passed (False; it is asked once
        more at the deadline).  The one poll loop: every wait of restartkit's own goes through it."""
        deadline = self.clock() + max(0.0, timeout_s)
        while True:
            safe_point()
            if done():
                return True
            now = self.clock()
            if now >= deadline:
                return False
            self.sleep(min(interval_s, deadline - now))  # never past the deadline: a short wait stays short

    def reap_until_gone(self, pids: list[int], timeout_s: float, also: Callable[[], bool] = lambda: True) -> bool:
        """Reap `pids` (our children, or orphans we adopted) until none of their trees is left
        and `also` holds, or the timeout passed."""
        def gone() -> bool:
            for p in pids:
                reap(p)
            return not any(tree_pids(p) for p in pids) and also()
        return self.wait_until(gone, timeout_s)

    def alive(self, pid: int, create_time: float | None = None, start_ticks: int | None = None) -> bool:
        """Is this process (not another one under a reused PID) alive?  Named by its start
        time in clock ticks since boot when known (no clock step changes it), else by its
        wall-clock create time (records written before start ticks were kept)."""
        if start_ticks is not None:
            return proc_start_ticks(pid) == start_ticks and not exited(pid)
        try:
            import psutil
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                return False
            return create_time is None or abs(p.create_time() - create_time) < 0.5
        except Exception:  # NoSuchProcess, AccessDenied on a foreign PID
            return False
