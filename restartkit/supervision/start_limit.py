"""supervise's start limit, as systemd's StartLimitIntervalSec/StartLimitBurst: the failures noticed within
[supervise] start_limit_interval_s; past start_limit_burst supervise gives up.  Failed starts back off,
doubling from backoff_s up to backoff_max_s (tenacity's wait_exponential); a crash after serving does not
count, and clears the count."""
from __future__ import annotations

import collections
import types

from tenacity import wait_exponential


class StartLimit:
    def __init__(self, cfg: dict):
        self.window = cfg["start_limit_interval_s"]
        self.burst = cfg["start_limit_burst"]
        self.wait = wait_exponential(multiplier=cfg["backoff_s"], max=cfg["backoff_max_s"])
        self.failures: collections.deque[float] = collections.deque()  # when each failure was noticed

    def clear(self) -> None:
        self.failures.clear()

    def note(self, noticed: float) -> None:
        """A failure noticed at `noticed` (time.time()); those older than the window are forgotten."""
        self.failures.append(noticed)
        while self.failures and self.failures[0] < noticed - self.window:
            self.failures.popleft()

    def exceeded(self) -> bool:
        return len(self.failures) > self.burst

    def backoff_s(self) -> float:
        """How long to wait before the next start: 0 after one failure, then backoff_s, doubling."""
        recent = len(self.failures)
        return 0.0 if recent <= 1 else float(self.wait(types.SimpleNamespace(attempt_number=recent - 1)))

    def within(self, now: float) -> int:
        """The failures within the window before `now`."""
        return len([t for t in self.failures if t >= now - self.window])

    def __len__(self) -> int:
        return len(self.failures)
