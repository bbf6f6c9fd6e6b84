#!/usr/bin/env python3
"""What the front (restartkit.front) costs a client, side by side with the same client talking to the engine
directly, on this machine's GPU or its CPU:

    python3 scripts/front_overhead.py [--device cuda] [--preset 8b-shape] [--clients 64] [--tokens 128]
                                      [--seconds 20] [--rounds 2] [--work DIR]

One reference engine (--max-num-seqs = --clients) and one front before it.  Alternating direct and through the
front, --rounds times each (so that drift of the machine falls on both):
  - a 1-token greedy completion's latency, p50 of 200, one client, a new connection each;
  - output tokens/s of --clients streaming clients (asyncio, aiohttp), each asking --tokens-token greedy
    completions in a loop, counted by the token ids the chunks carry, over --seconds;
  - the CPU time the front and the engine spent per streamed token (their /proc stat, over the same seconds).
Prints a verdict table with the issue's targets: p50 + at most 1 ms, tokens/s at most 5 % lower.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import print_verdicts, reference_model, start_server, stop_server  # noqa: E402


def one_token_p50(port: int, n: int = 200) -> float:
    import http.client
    body = json.dumps({"prompt": [1, 42, 43], "max_tokens": 1, "temperature": 0})
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        conn.close()
        assert r.status == 200, r.status
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_s(pid: int) -> float:
    """The CPU seconds (user and system) process pid has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _stream_clients(port: int, clients: int, tokens: int, seconds: float,
                          pids: tuple[int, ...] = ()) -> tuple[float, int, list[float]]:
    """(output tokens/s, client errors, the CPU microseconds each of pids spent per token) over `seconds`."""
    import aiohttp
    counted, errors, stop = [0], [0], asyncio.Event()
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}

    async def client(session):
        while not stop.is_set():
            try:
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            for ch in json.loads(line[6:])["choices"]:
                                counted[0] += len(ch.get("token_ids") or ())
            except aiohttp.ClientError:
                errors[0] += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(client(session)) for _ in range(clients)]
        await asyncio.sleep(min(3.0, seconds / 4))  # every client streaming
        first, t0, cpu0 = counted[0], time.perf_counter(), [cpu_s(pid) for pid in pids]
        await asyncio.sleep(seconds)
        got = counted[0] - first
        rate = got / (time.perf_counter() - t0)
        per_token = [(cpu_s(pid) - c) / max(got, 1) * 1e6 for pid, c in zip(pids, cpu0)]
        stop.set()
        await asyncio.gather(*tasks)
    return rate, errors[0], per_token


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default=None, help="default: 8b-shape on cuda, tiny on the CPU")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--work", default="/var/tmp/restartkit-front-overhead")
    a = p.parse_args()
    gpu = a.device.startswith("cuda")
    work = Path(a.work)
    model, preset = reference_model(a.work, a.device, a.preset)
    eport, fport = 18311, 18312
    engine = start_server([sys.executable, "-m", "restartkit.reference.serving.server", "--model", str(model), "--port",
                           str(eport), "--device", a.device, "--max-num-seqs", str(a.clients), "--max-model-len", "1024"],
                          eport, work / "engine.log", env=None if gpu else {"OMP_NUM_THREADS": "1"})
    front = start_server([sys.executable, "-m", "restartkit.front", "--listen", f"127.0.0.1:{fport}", "--upstream",
                          f"http://127.0.0.1:{eport}"], fport, work / "front.log")
    got = {n: {"p50_s": [], "tok_s": [], "errors": 0, "engine_cpu_us_per_token": [], "front_cpu_us_per_token": []}
           for n in ("direct", "front")}
    try:
        one_token_p50(eport, 20), one_token_p50(fport, 20)  # warm
        for _ in range(a.rounds):
            for name, port in (("direct", eport), ("front", fport)):
                got[name]["p50_s"].append(one_token_p50(port))
                rate, errors, (engine_us, front_us) = asyncio.run(_stream_clients(
                    port, a.clients, a.tokens, a.seconds, (engine.pid, front.pid)))
                got[name]["tok_s"].append(rate)
                got[name]["errors"] += errors
                got[name]["engine_cpu_us_per_token"].append(round(engine_us, 1))
                got[name]["front_cpu_us_per_token"].append(round(front_us, 1))
                print(f"{name}: 1-token p50 {got[name]['p50_s'][-1] * 1000:.2f} ms, {a.clients} streams "
                      f"{rate:.0f} tok/s, {errors} errors; CPU per token: engine {engine_us:.0f} us, front "
                      f"{front_us:.0f} us", flush=True)
    finally:
        for proc in (front, engine):
            stop_server(proc)
    d, f = ({k: statistics.mean(v) for k, v in got[n].items() if k in ("p50_s", "tok_s")} for n in ("direct", "front"))
    added_ms, lower = (f["p50_s"] - d["p50_s"]) * 1000, 1 - f["tok_s"] / d["tok_s"]
    print(json.dumps({"device": a.device, "preset": preset, "clients": a.clients, "tokens": a.tokens, **got,
                      "p50_added_ms": round(added_ms, 3), "tok_s_lower": round(lower, 4)}, indent=1))
    return print_verdicts([
        (f"1-token p50 {f['p50_s'] * 1000:.2f} ms through the front, {d['p50_s'] * 1000:.2f} ms direct: "
         f"+{added_ms:.2f} ms <= 1 ms", added_ms <= 1.0),
        (f"{a.clients} streams {f['tok_s']:.0f} tok/s through the front, {d['tok_s']:.0f} direct: "
         f"{lower * 100:.1f} % lower <= 5 %", lower <= 0.05),
        ("no client error", got["direct"]["errors"] + got["front"]["errors"] == 0)])


if __name__ == "__main__":
    sys.exit(main())
