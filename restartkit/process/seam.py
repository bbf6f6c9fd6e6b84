"""The one door for side effects: spawning, signalling, the clock and sleeping.  The logic tests
pass their own; everything else gets the real one."""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

from restartkit.process.procfs import exited, proc_start_ticks, reap, tree_pids


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
            if done():
                return True
            if self.clock() >= deadline:
                return False
            self.sleep(interval_s)

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
