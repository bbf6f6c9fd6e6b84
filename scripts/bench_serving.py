#!/usr/bin/env python3
"""Users' traffic against an OpenAI-compatible engine: prompts of log-uniform length, streamed answers, 1 to 64
clients, each asking again as soon as its answer ends (a closed loop):

    python3 scripts/bench_serving.py --url http://127.0.0.1:8000 [--model NAME] [--clients 1,8,32,64]
        [--seconds 60] [--prompt-min 64] [--prompt-max 2048] [--answer-min 32] [--answer-max 256] [--seed 0]

Prompts are token-id lists (random ids of the vocabulary's lower half, so that any engine takes them as they
are); answers are greedy with `ignore_eos`, so each has exactly the length drawn.  For each client count it
reports output and prompt tokens/s, time to first token and time per output token (p50 and p99, from the client's
clock: TPOT is (last token - first token) / (tokens - 1)), and errors; then a table, and JSON with --json.
It runs against the reference engine and `vllm serve` alike (both stream `token_ids` with `return_token_ids`;
without them a chunk counts as one token).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time


def draw(rng: random.Random, low: int, high: int) -> int:
    """Log-uniform in [low, high]."""
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one(session, url: str, model: str | None, prompt: list[int], answer: int, out: dict) -> None:
    body = {"prompt": prompt, "max_tokens": answer, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, **({"model": model} if model else {})}
    t0 = time.perf_counter()
    first = last = None
    n = 0
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                out["errors"].append(f"HTTP {r.status}: {(await r.text())[:200]}")
                return
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                for ch in json.loads(line[6:]).get("choices") or ():
                    got = len(ch.get("token_ids") or ()) or (1 if ch.get("text") else 0)
                    if got:
                        last = time.perf_counter()
                        first = first or last
                        n += got
    except Exception as e:  # any failure a client sees
        out["errors"].append(repr(e))
        return
    if first is None:
        out["errors"].append("no token")
        return
    out["ttft"].append(first - t0)
    if n > 1:
        out["tpot"].append((last - first) / (n - 1))
    out["done"].append((time.perf_counter(), len(prompt), n))


async def run(url: str, model: str | None, clients: int, seconds: float, a, rng: random.Random) -> dict:
    import aiohttp
    out = {"ttft": [], "tpot": [], "done": [], "errors": []}
    stop = time.perf_counter() + seconds

    async def client(session, seed: int):
        r = random.Random(seed)
        while time.perf_counter() < stop:
            prompt = [r.randrange(3, a.vocab // 2) for _ in range(draw(r, a.prompt_min, a.prompt_max))]
            await one(session, url, model, prompt, draw(r, a.answer_min, a.answer_max), out)

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session, rng.randrange(1 << 30)) for _ in range(clients)))
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": len(out["done"]), "errors": len(out["errors"]),
            "first_errors": out["errors"][:3], "seconds": round(wall, 1),
            "output_tok_s": round(sum(n for _, _, n in out["done"]) / wall, 1),
            "prompt_tok_s": round(sum(p for _, p, _ in out["done"]) / wall, 1),
            "ttft_p50_s": _r(pct(out["ttft"], 0.5)), "ttft_p99_s": _r(pct(out["ttft"], 0.99)),
            "tpot_p50_ms": _r(pct(out["tpot"], 0.5), 1000), "tpot_p99_ms": _r(pct(out["tpot"], 0.99), 1000),
            "mean_prompt": round(statistics.mean([p for _, p, _ in out["done"]]), 1) if out["done"] else None}


def _r(v: float | None, scale: float = 1.0) -> float | None:
    return None if v is None else round(v * scale, 4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--clients", default="1,8,32,64")
    p.add_argument("--seconds", type=float, default=60.0, help="how long each client count runs (answers finish)")
    p.add_argument("--prompt-min", type=int, default=64)
    p.add_argument("--prompt-max", type=int, default=2048)
    p.add_argument("--answer-min", type=int, default=32)
    p.add_argument("--answer-max", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000, help="prompt ids are drawn below half of it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--json-out", default=None, help="also write the rows, as JSON, to this file")
    a = p.parse_args()
    rng, rows = random.Random(a.seed), []
    for n in (int(c) for c in a.clients.split(",")):
        rows.append(asyncio.run(run(a.url.rstrip("/"), a.model, n, a.seconds, a, rng)))
        r = rows[-1]
        print(f"{n:3d} clients: {r['output_tok_s']:8.1f} out tok/s, {r['prompt_tok_s']:9.1f} prompt tok/s, TTFT "
              f"p50/p99 {r['ttft_p50_s']}/{r['ttft_p99_s']} s, TPOT p50/p99 {r['tpot_p50_ms']}/{r['tpot_p99_ms']} ms, "
              f"{r['requests']} requests, {r['errors']} errors", flush=True)
    if a.json:
        print(json.dumps(rows, indent=1))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    one_client = rows[0]["output_tok_s"] if rows and rows[0]["clients"] == 1 else None
    print("| clients | output tok/s | x one client | prompt tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        x = f"{r['output_tok_s'] / one_client:.1f}" if one_client else ""
        print(f"| {r['clients']} | {r['output_tok_s']:,.0f} | {x} | {r['prompt_tok_s']:,.0f} | {r['ttft_p50_s']} / "
              f"{r['ttft_p99_s']} | {r['tpot_p50_ms']} / {r['tpot_p99_ms']} | {r['errors']} |")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
