"""Clients of the front that keep asking while engines are killed under them (tests/test_front.py and the vLLM
one in tests/engines/test_vllm_fast_paths.py): greedy requests through the openai client with no retries, each
answer's token ids kept, and the time each token arrived."""
from __future__ import annotations

import json
import os
import random
import signal
import statistics
import threading
import time
import urllib.error
import urllib.request

from tests.helpers import wait_for


def http(url: str, method: str = "GET", body: dict | None = None, timeout: float = 30):
    """(status, body) of one request, None when nothing answered."""
    req = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return None


def client(port: int, timeout: float = 120):
    import openai
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=timeout)


ARRIVALS: list[float] = []  # when each streamed token reached a client, any client


def ask(c, req: dict, model: str = "tiny") -> tuple[list[int], str, str]:
    """(token ids, text, finish reason) of one request, streamed or not, chat or not."""
    extra = {"ignore_eos": True, "return_token_ids": True}
    common = dict(model=model, max_tokens=req["max_tokens"], temperature=0, stream=req["stream"], extra_body=extra)
    if req.get("stop"):
        common["stop"] = req["stop"]
    if req["chat"]:
        out = c.chat.completions.create(messages=[{"role": "user", "content": req["prompt"]}], **common)
    else:
        out = c.completions.create(prompt=req["prompt"], **common)
    if not req["stream"]:
        ch = out.choices[0]
        text = ch.message.content if req["chat"] else ch.text
        return list(ch.model_extra["token_ids"]), text, ch.finish_reason
    ids, text, finish = [], "", None
    for chunk in out:
        for ch in chunk.choices:
            ids += (ch.model_extra or {}).get("token_ids") or []
            piece = (ch.delta.content if req["chat"] else ch.text) or ""
            text += piece
            finish = ch.finish_reason or finish
            if piece or ch.finish_reason:
                ARRIVALS.append(time.monotonic())
    return ids, text, finish


# a stop string no answer of the test models holds: an engine holds back the text that may start it (vLLM: its last
# len - 1 characters at every moment), which a kill must not lose (restartkit.front.journal)
NEVER = "<<a stop string that never comes>>"


def mixed_requests(n: int, seed: int = 7, low: int = 100, high: int = 300, stop: str | None = None) -> list[dict]:
    """Half streamed, half not; every other one chat; answers of low..high tokens; `stop`: in every third one."""
    rng = random.Random(seed)
    return [{"prompt": f"request {i}: {'tell me more ' * rng.randint(1, 6)}", "max_tokens": rng.randint(low, high),
             "stream": i < n // 2, "chat": i % 2 == 1, **({"stop": [stop]} if stop and i % 3 == 0 else {})}
            for i in range(n)]


class ClientsThroughKills:
    """One client thread per request, each asking it again and again through the front at `port` until `finish`;
    `kill` SIGKILLs the serving engine mid-generation and returns the time to the next token any client got."""

    def __init__(self, port: int, reqs: list[dict], model: str = "tiny"):
        self.port, self.reqs, self.model = port, reqs, model
        self.failures: list[tuple] = []
        self.answers: list[tuple[int, tuple]] = []
        self.gaps: list[float] = []
        self._done = threading.Event()
        self._threads: list[threading.Thread] = []

    def undisturbed(self) -> list[tuple]:
        c = client(self.port)
        return [ask(c, r, self.model) for r in self.reqs]  # one at a time

    def start(self) -> "ClientsThroughKills":
        c = client(self.port)
        self._threads = [threading.Thread(target=self._run, args=(c, i), daemon=True) for i in range(len(self.reqs))]
        for t in self._threads:
            t.start()
        return self

    def _run(self, c, i: int) -> None:
        while not self._done.is_set():
            try:
                self.answers.append((i, ask(c, self.reqs[i], self.model)))
            except Exception as e:  # any failure a client sees
                self.failures.append((i, repr(e), repr(e.__cause__), repr(getattr(e.__cause__, "__context__", None))))

    def kill(self, pid: int, group: bool = False, why=lambda: "") -> float:
        killed_at = time.monotonic()
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
        try:
            wait_for(lambda: any(t > killed_at for t in list(ARRIVALS)), 120)
        except AssertionError:
            raise AssertionError(f"no token after kill {len(self.gaps) + 1}: {why()}") from None
        self.gaps.append(min(t for t in list(ARRIVALS) if t > killed_at) - killed_at)
        return self.gaps[-1]

    def finish(self, timeout: float = 180) -> None:
        self._done.set()
        for t in self._threads:
            t.join(timeout)

    def summary(self) -> str:
        return (f"kill -> next token: median {statistics.median(self.gaps):.3f} s, max {max(self.gaps):.3f} s; "
                f"{len(self.answers)} answers, {len(self.failures)} failed")
