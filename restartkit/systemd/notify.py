"""systemd's notify protocol as supervise speaks it: `Notifier` sends (READY=1, STATUS=, STOPPING=1,
RELOADING=1), `Heartbeat` keeps the unit's watchdog fed from a thread of its own, whatever the
main loop is doing (waiting for another command's lock, a restart, a long start), for as long as
that loop makes progress: each of its steps says how long it may take, and a step that overruns
(a wedged loop) or a stopped process lets the watchdog fire, as it should."""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable


class Notifier:
    """sd_notify over $NOTIFY_SOCKET (nothing when it is not set)."""

    def __init__(self, env: dict | None = None):
        env = os.environ if env is None else env
        self.address = env.get("NOTIFY_SOCKET") or None
        usec = env.get("WATCHDOG_USEC")
        wpid = env.get("WATCHDOG_PID")
        self.watchdog_s = int(usec) / 1e6 if usec and usec.isdigit() and (not wpid or wpid == str(os.getpid())) else None

    def send(self, *lines: str) -> None:
        """A new socket per message: safe from a signal handler (no buffer or lock is shared)."""
        if not self.address:
            return
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto("\n".join(lines).encode(), addr)
        except OSError:
            pass  # the manager went away: nothing to tell

    def reloading(self) -> None:
        """RELOADING=1 with the monotonic time systemd 253+ matches it by (older ones ignore it)."""
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")


class Heartbeat:
    """WATCHDOG=1 every quarter of WatchdogSec (so no gap reaches half of it), and while the unit is
    starting or stopping EXTEND_TIMEOUT_USEC for what is left of the step under way, so that a start
    that legitimately outlasts TimeoutStartSec (a lock held by another command, then the start) is
    not killed for it.  Both only while the main loop is inside its step's budget (`step`)."""

    STARTING, RUNNING, STOPPING = "starting", "running", "stopping"

    def __init__(self, notifier: Notifier, clock: Callable[[], float] = time.monotonic):
        self.notify, self.clock = notifier, clock
        self.period = notifier.watchdog_s / 4 if notifier.watchdog_s else 1.0
        self.deadline = clock() + 60.0
        self.phase = self.STARTING
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self, budget_s: float, phase: str | None = None) -> None:
        """The main loop starts a step that takes at most `budget_s` (and the unit is in `phase`)."""
        self.deadline = self.clock() + budget_s
        if phase is not None:
            self.phase = phase

    def alive(self) -> bool:
        return self.clock() < self.deadline

    def beat(self) -> list[str]:
        """What one tick sends (nothing once the main loop overran its step)."""
        if not self.alive():
            return []
        lines = ["WATCHDOG=1"] if self.notify.watchdog_s else []
        if self.phase in (self.STARTING, self.STOPPING):
            lines.append(f"EXTEND_TIMEOUT_USEC={int((self.deadline - self.clock()) * 1e6)}")
        return lines

    def start(self) -> None:
        if not self.notify.address or self._thread is not None:
            return

        def run():
            while True:
                if lines := self.beat():
                    self.notify.send(*lines)
                if self._done.wait(self.period):
                    return
        self._thread = threading.Thread(target=run, name="restartkit-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
