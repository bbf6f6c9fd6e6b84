"""A client hammering the service through a restart, whatever the strategy:
`restart --measure-downtime` and overlapped restarts report what it saw."""
from __future__ import annotations

import statistics
import threading
import time

from restartkit import http


class DowntimeProbe:
    """A client hammering the service through a restart: the longest gap
    between two answered requests is the downtime as users see it."""

    def __init__(self, service, interval_s: float = 0.02, timeout_s: float = 2.0):
        self.service, self.interval, self.timeout = service, interval_s, timeout_s
        self.events: list[tuple[float, bool, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.started_at = time.monotonic()  # the service answered just before: the baseline canary
        self._thread.start()

    def stop(self) -> None:
        """Idempotent; waits for a short tail of answers after the restart."""
        if self._stop.is_set() or not self._thread.is_alive():
            self._stop.set()
            return
        time.sleep(0.3)
        self._stop.set()
        self._thread.join(5)

    def _run(self):
        url = self.service.adapter.base_url(self.service.policy) + "/v1/completions"
        body = {"model": self.service.adapter.served_name(self.service.policy), "prompt": "ping", "max_tokens": 1,
                "temperature": 0.0}
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                http.post(url, body, timeout=self.timeout)
                self.events.append((t, True, ""))
            except http.HTTPFailure as e:
                self.events.append((t, False, str(e.status or "connection")))
            except Exception as e:  # a connection cut mid-answer (IncompleteRead...): still a failed request
                self.events.append((t, False, type(e).__name__))
            time.sleep(self.interval)

    def summary(self) -> dict:
        ok = [getattr(self, "started_at", None)] + [t for t, good, _ in self.events if good]
        ok = [t for t in ok if t is not None]
        gaps = [b - a for a, b in zip(ok, ok[1:])]
        worst = max(range(len(gaps)), key=gaps.__getitem__) if gaps else None
        errors: dict[str, int] = {}
        for _, good, kind in self.events:
            if not good:
                errors[kind] = errors.get(kind, 0) + 1
        base = getattr(self, "started_at", 0.0)
        cycles = [t2 - t1 for (t1, good1, _), (t2, good2, _) in zip(self.events, self.events[1:]) if good1 and good2]
        return {"requests": len(self.events), "answered": len(ok) - 1, "failed": errors,
                "downtime_s": round(gaps[worst], 4) if gaps else None,
                "gap_from_s": round(ok[worst] - base, 4) if gaps else None,
                # the probe's own cycle while served (one answer's latency plus the interval, between two answers
                # with no failure between them): a downtime this long is none
                "median_gap_s": round(statistics.median(cycles), 4) if cycles else None}


