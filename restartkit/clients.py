"""Clients as the ones that do not retry: each request on a new connection, no retry, every outcome kept.
What a crash or a restart costs them: connections refused, HTTP 5xx, requests lost in flight (the engine
died holding them), how long each waited, and the time from a kill to the next answer.  Used by the
tests, the demo and the benches (`restartkit.commands.demo`, scripts/gpu_held_socket_bench.py)."""
from __future__ import annotations

import errno
import http.client
import json
import statistics
import threading
import time
from dataclasses import dataclass

REFUSED, FIVE_XX, LOST, TIMEOUT, OK, OTHER = "refused", "5xx", "lost", "timeout", "ok", "other"


@dataclass
class Request:
    started: float  # time.monotonic()
    ended: float
    outcome: str  # ok | refused | 5xx | lost | timeout | other (a 4xx, say)
    detail: str = ""
    connected: float | None = None  # when the TCP handshake completed (the kernel queues it; no engine needed)

    @property
    def waited_s(self) -> float:
        return self.ended - self.started


class ClientLoad:
    """`clients` threads, each sending one completion at a time on a new connection, until stopped."""

    def __init__(self, host: str, port: int, model: str | None, clients: int = 4, max_tokens: int = 4,
                 timeout_s: float = 30.0, prompt: str = "hello", headers: dict | None = None):
        self.host, self.port, self.timeout_s, self.headers = host, port, timeout_s, headers or {}
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "return_token_ids": True}  # vLLM's name for them
        self.body = json.dumps({"model": model, **body} if model else body).encode()  # None: the served one
        self.requests: list[Request] = []
        self.answers: list[list[int]] = []  # the token ids of every answer (all the same, greedy)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def start(self) -> "ClientLoad":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 5)

    def _run(self) -> None:
        while not self._stop.is_set():
            req, tokens = self.one()
            with self._lock:
                self.requests.append(req)
                if tokens is not None:
                    self.answers.append(tokens)
            if req.outcome == REFUSED:
                time.sleep(0.01)  # a client that does not retry sends its next request anyway; not in a hot loop

    def one(self) -> tuple[Request, list[int] | None]:
        t0 = time.monotonic()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        connected = None
        try:
            conn.connect()
            connected = time.monotonic()
            conn.request("POST", "/v1/completions", body=self.body,
                         headers={"Content-Type": "application/json", "Connection": "close", **self.headers})
            resp = conn.getresponse()
            data = resp.read()
            if resp.status >= 500:
                return Request(t0, time.monotonic(), FIVE_XX, str(resp.status)), None
            if resp.status != 200:
                return Request(t0, time.monotonic(), OTHER, str(resp.status)), None
            tokens = json.loads(data)["choices"][0].get("token_ids")
            return Request(t0, time.monotonic(), OK, connected=connected), tokens
        except ConnectionRefusedError:
            return Request(t0, time.monotonic(), REFUSED), None
        except TimeoutError:
            return Request(t0, time.monotonic(), TIMEOUT), None
        except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected,
                http.client.IncompleteRead) as e:
            return Request(t0, time.monotonic(), LOST, type(e).__name__), None
        except OSError as e:
            kind = REFUSED if e.errno == errno.ECONNREFUSED else OTHER
            return Request(t0, time.monotonic(), kind, type(e).__name__), None
        finally:
            conn.close()

    def snapshot(self) -> list[Request]:
        with self._lock:
            return list(self.requests)


def summarize(requests: list[Request], kills: list[float], clients: int) -> dict:
    """What the clients saw around the kills (time.monotonic() of each): counts by outcome, requests lost
    and whether each was in flight at a kill, the longest wait, kill -> first answer, latency percentiles
    before the first kill and after the last one's first answer."""
    counts: dict[str, int] = {}
    for r in requests:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    lost = [r for r in requests if r.outcome == LOST]
    # in flight at a kill: sent before it, cut after it (one per client at most)
    in_flight = [r for r in lost if any(r.started <= k <= r.ended for k in kills)]
    first_answer = []
    for k in kills:
        after = [r.ended for r in requests if r.outcome == OK and r.ended > k]
        first_answer.append(round(min(after) - k, 3) if after else None)
    ok = sorted(r.waited_s for r in requests if r.outcome == OK)
    before = sorted(r.waited_s for r in requests if r.outcome == OK and kills and r.ended < kills[0])
    settled = (kills[-1] + (first_answer[-1] or 0)) if kills else 0.0
    after = sorted(r.waited_s for r in requests if r.outcome == OK and r.started > settled + 1.0)
    answered = [s for s in first_answer if s is not None]
    return {
        "requests": len(requests), "clients": clients, "kills": len(kills), "counts": counts,
        "refused": counts.get(REFUSED, 0), "http_5xx": counts.get(FIVE_XX, 0), "timeouts": counts.get(TIMEOUT, 0),
        "lost": len(lost), "lost_in_flight": len(in_flight), "lost_max": clients * len(kills),
        "longest_wait_s": round(max((r.waited_s for r in requests), default=0.0), 3),
        "kill_to_answer_s": first_answer,
        "kill_to_answer_median_s": round(statistics.median(answered), 3) if answered else None,
        "p50_s": _pct(ok, 50), "p99_s": _pct(ok, 99), "p99_before_s": _pct(before, 99), "p99_after_s": _pct(after, 99),
    }


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(len(values) * q / 100))], 4)
