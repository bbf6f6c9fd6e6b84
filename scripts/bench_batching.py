#!/usr/bin/env python3
"""The reference engine under many clients (continuous batching), on this machine's GPU or its CPU:

    python3 scripts/bench_batching.py [--device cuda] [--preset 8b-shape] [--max-num-seqs 8] [--seconds 15]
                                      [--work DIR] [--remove-model]

Measures, against one engine process:
  - tokens/s with 1, 4 and 8 clients, each asking greedy completions of up to --tokens tokens in a loop (a new connection each);
  - a one-token request's median latency, idle and under 4 such clients;
  - one stream's time per token (a 257-token completion minus a 1-token one, over 256);
  - batch invariance: a prompt's greedy tokens alone and in a batch of 8 (whatever the kernels do), and as
    restartkit's canary (X-Restartkit-Canary: a batch of its own) under 8 clients.
Prints a verdict table with the targets of the issue on continuous batching: on cuda 8 clients >= 6x one, the
1-token median under 4 clients <= 3x idle, one stream <= 5 ms per token (8B shapes); on the CPU >= 2.5x and
<= 3x idle (or idle + 0.05 s); the canary identical everywhere.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import print_verdicts, reference_model, start_server, stop_server  # noqa: E402

from restartkit.clients import ClientLoad  # noqa: E402
from restartkit.engines.reference import CPU_ENV  # noqa: E402

CANARY = {"X-Restartkit-Canary": "1"}


def post(port: int, body: dict, headers: dict | None = None, timeout: float = 300) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def greedy(port: int, prompt: list[int], tokens: int, headers: dict | None = None) -> list[int]:
    out = post(port, {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}, headers)
    return out["choices"][0]["token_ids"]


class Clients:
    """`n` clients (restartkit.clients.ClientLoad: a new connection a request) asking `tokens`-token greedy
    completions in a loop; every request must be answered."""

    def __init__(self, port: int, n: int, tokens: int):
        self.load = ClientLoad("127.0.0.1", port, None, clients=n, max_tokens=tokens, timeout_s=300,
                               prompt="Once upon a time")

    @property
    def done(self) -> int:
        return sum(len(a) for a in list(self.load.answers))

    def __enter__(self):
        self.load.start()
        return self

    def __exit__(self, *exc):
        self.load.stop()
        bad = [r for r in self.load.snapshot() if r.outcome != "ok"]
        assert not bad, bad[:3]


def tokens_per_s(port: int, n: int, tokens: int, seconds: float) -> float:
    """Tokens of the answers completed between the first completion in the window and the last, over the time
    between them (answers count whole: a window's edges would otherwise cut the rate by up to an answer)."""
    with Clients(port, n, tokens) as c:
        time.sleep(min(2.0, seconds / 4))
        seen, marks, end = c.done, [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            if c.done != seen:
                seen = c.done
                marks.append((time.perf_counter(), seen))
            time.sleep(0.005)
        if len(marks) < 2:
            raise RuntimeError(f"fewer than two answers completed in {seconds} s: raise --seconds")
        (t0, d0), (t1, d1) = marks[0], marks[-1]
        return (d1 - d0) / (t1 - t0)


def one_token_p50(port: int, n: int = 21) -> float:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        greedy(port, [1, 7, 9 + i % 3], 1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def per_token_s(port: int) -> float:
    def timed(tokens):
        t0 = time.perf_counter()
        greedy(port, [1, 5, 6], tokens)
        return time.perf_counter() - t0
    return statistics.median((timed(257) - timed(1)) / 256 for _ in range(3))


def batched(port: int, prompt: list[int], n: int, tokens: int) -> list[int]:
    """`prompt`'s greedy tokens while n - 1 other prompts decode beside it (all submitted at once)."""
    out: dict[int, list[int]] = {}

    def ask(i):
        out[i] = greedy(port, prompt if i == 0 else [1, 300 + i, 301 + i], tokens)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return out[0]


def serve(model: Path, device: str, port: int, max_num_seqs: int, log: Path) -> subprocess.Popen:
    return start_server([sys.executable, "-m", "restartkit.reference.serving.server", "--model", str(model), "--device",
                         device, "--port", str(port), "--max-model-len", "1024", "--max-num-seqs", str(max_num_seqs)],
                        port, log, env=CPU_ENV)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default=None, help="default: tiny on the CPU, 8b-shape on cuda")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--port", type=int, default=8791)
    p.add_argument("--work", default="/tmp/rk-batching")
    p.add_argument("--remove-model", action="store_true")
    a = p.parse_args()
    gpu = a.device.startswith("cuda")
    work = Path(a.work)
    model, preset = reference_model(a.work, a.device, a.preset)
    proc = serve(model, a.device, a.port, a.max_num_seqs, work / "engine.log")
    try:
        got = measure(a.port, a.tokens, a.seconds)
    finally:
        stop_server(proc)
        if a.remove_model:
            shutil.rmtree(model, ignore_errors=True)
    got.update(device=a.device, preset=preset, max_num_seqs=a.max_num_seqs, tokens=a.tokens)
    print(json.dumps(got, indent=1))
    one, eight = got["tok_s"]["1"], got["tok_s"]["8"]
    idle, busy = got["one_token_p50_s"]["idle"], got["one_token_p50_s"]["4 clients"]
    verdicts = [(f"8 clients {eight:.0f} tok/s >= {6 if gpu else 2.5}x one client ({one:.0f})",
                 eight >= (6 if gpu else 2.5) * one),
                (f"1-token p50 under 4 clients {busy * 1000:.1f} ms <= 3x idle ({idle * 1000:.1f} ms)"
                 + ("" if gpu else " or idle + 50 ms"), busy <= (3 * idle if gpu else max(3 * idle, idle + 0.05))),
                ("the canary under 8 clients = alone", got["canary_under_load_identical"])]
    if gpu:
        verdicts.append((f"one stream {got['per_token_ms']:.2f} ms per token <= 5 ms", got["per_token_ms"] <= 5.0))
        verdicts.append(("greedy tokens alone = in a batch of 8 (batch-invariant decode)", got["batch_invariant"]))
    return print_verdicts(verdicts)


def measure(port: int, tokens: int, seconds: float) -> dict:
    prompt = [1, 42, 43, 44]
    alone = greedy(port, prompt, 64)
    got = {"per_token_ms": round(per_token_s(port) * 1000, 3)}
    got["tok_s"] = {str(n): round(tokens_per_s(port, n, tokens, seconds), 1) for n in (1, 4, 8)}
    got["one_token_p50_s"] = {"idle": round(one_token_p50(port), 4)}
    with Clients(port, 4, max(tokens, 256)):
        time.sleep(1.0)
        got["one_token_p50_s"]["4 clients"] = round(one_token_p50(port), 4)
    got["batch_invariant"] = all(batched(port, prompt, 8, 64) == alone for _ in range(3))
    with Clients(port, 8, tokens):
        time.sleep(1.0)
        got["canary_under_load_identical"] = all(greedy(port, prompt, 64, CANARY) == alone for _ in range(3))
    return got


if __name__ == "__main__":
    sys.exit(main())
