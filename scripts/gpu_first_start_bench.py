#!/usr/bin/env python3
"""supervise's first start on a warm weight cache, and the clients' view of a standby being killed:

    python3 scripts/gpu_first_start_bench.py [--device cuda] [--preset 8b-shape] [--kills 3] [--clients 4]

1. the weight cache holds the weights (`restartkit preload`); then, side by side:
   - `restartkit start` (a cold start: the engine loads its own copy from disk beside the cache's);
   - `restartkit supervise`'s first start (the restart flow: the ipc start path, recorded);
   each timed from the command to the first answer, the device's memory in use sampled every 0.1 s
   (its peak, against the cache's own);
2. under supervise with a standby armed and `--clients` clients asking without pause: the longest gap
   between two answers in the 8 s before each SIGKILL of the standby, and in the 8 s after it.

Prints a verdict table: the first start served by ipc (an IPC hit) and recorded; its time below the cold
start's; its peak device memory below the cache's + 25 % (one copy of the weights, not two); the gap after a
standby kill at most 2x the steady one.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import RK, ROOT, answers, ask, print_verdicts, standby_prepared  # noqa: E402


class DeviceMemory(threading.Thread):
    """The device's memory in use (nvidia-smi), every 0.1 s; its peak in MiB (None without a GPU)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak: int | None = None
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout.split()
                used = int(out[0])
                self.peak = used if self.peak is None else max(self.peak, used)
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return
            time.sleep(0.1)

    def stop(self) -> int | None:
        self.done.set()
        self.join(15)
        return self.peak


def used_mib() -> int | None:
    """The device's memory in use now (MiB), None without a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.split()
        return int(out[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def policy(work: Path, model: Path, device: str, port: int) -> Path:
    pol = work / "first.toml"
    pol.write_text(f"""[service]
name = "first"
model = "{model}"
port = {port}
device = "{device}"
max_model_len = 512
state_dir = "{work / 'state'}"
[restart]
start_timeout_s = 600
stop_timeout_s = 15
[ipc]
socket_dir = "{work / 'sockets'}"
[standby]
enabled = true
[supervise]
min_uptime_s = 1.0
""")
    return pol


def timed_start(pol: Path, port: int, supervise: bool) -> tuple[float, int | None, subprocess.Popen | None]:
    """From the command to the first answer; the device's peak memory meanwhile."""
    mem = DeviceMemory()
    mem.start()
    t0 = time.monotonic()
    sup = None
    if supervise:
        sup = subprocess.Popen([*RK, "supervise", "--policy", str(pol)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, cwd=ROOT, start_new_session=True)
    else:
        ask("start", "--policy", pol, check=True)
    while not answers(port):
        if sup is not None and sup.poll() is not None:
            raise RuntimeError(f"supervise exited {sup.returncode}")
        time.sleep(0.02)
    took = time.monotonic() - t0
    time.sleep(1.0)  # what it allocates right after (a standby armed) is not the start's
    return took, mem.stop(), sup


def gaps(port: int, pol: Path, kills: int, clients: int) -> list[dict]:
    """The longest gap between two answers before and after each SIGKILL of the armed standby."""
    from restartkit.clients import ClientLoad
    load = ClientLoad("127.0.0.1", port, None, clients=clients, max_tokens=8).start()
    out = []
    try:
        for _ in range(kills):
            sb = standby_prepared(pol)
            time.sleep(8.0)
            killed = time.monotonic()
            os.kill(sb["pid"], signal.SIGKILL)
            time.sleep(8.0)
            done = sorted(r.started + r.waited_s for r in load.snapshot() if r.outcome == "ok")
            before = [t for t in done if killed - 8.0 <= t < killed]
            after = [t for t in done if killed <= t < killed + 8.0]
            widest = (lambda ts: round(max((b - a for a, b in zip(ts, ts[1:])), default=0.0), 3))
            out.append({"steady_gap_s": widest(before), "gap_after_kill_s": widest(after),
                        "answers_before": len(before), "answers_after": len(after),
                        "failed": sum(1 for r in load.snapshot() if r.outcome != "ok")})
    finally:
        load.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="8b-shape")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--work", default="/tmp/rk-first-start")
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / a.preset
    if not (model / "config.json").exists():
        ask("model", "create", "--preset", a.preset, "--out", model, "--device", a.device, check=True)
    pol = policy(work, model, a.device, a.port)
    result: dict = {"preset": a.preset, "device": a.device}
    sup = None
    try:
        base = result["base_mib"] = used_mib()
        ask("preload", "--policy", pol, "--detach", check=True)
        cache = used_mib()
        result["cache_mib"] = None if cache is None or base is None else cache - base
        cold_s, cold_peak, _ = timed_start(pol, a.port, supervise=False)
        result["cold_start"] = {"to_answer_s": round(cold_s, 3), "peak_mib": cold_peak}
        ask("stop", "--policy", pol, check=True)
        time.sleep(2.0)
        first_s, first_peak, sup = timed_start(pol, a.port, supervise=True)
        recs = json.loads(ask("history", "--policy", pol, "--json").stdout)["records"]
        first = next((r for r in recs if (r.get("trigger") or {}).get("what") == "the first start under supervise"), {})
        result["first_start"] = {"to_answer_s": round(first_s, 3), "peak_mib": first_peak,
                                 "served_by": first.get("served_by"), "recorded": bool(first),
                                 "ipc": ((first.get("attempts") or [{}])[-1].get("proof") or {}).get("ipc"),
                                 "time_to_ready_s": first.get("time_to_ready_s")}
        result["standby_kills"] = gaps(a.port, pol, a.kills, a.clients)
    finally:
        if sup is not None and sup.poll() is None:
            os.killpg(sup.pid, signal.SIGTERM)
            sup.wait(120)
        ask("stop", "--policy", pol)
        ask("weightcache", "release", "--policy", pol, "--stop", "--force")
    print(json.dumps(result, indent=1))
    f, c, kills = result["first_start"], result["cold_start"], result["standby_kills"]
    cache_mib = result.get("cache_mib")
    steady = statistics.median(k["steady_gap_s"] for k in kills) if kills else None
    after = max((k["gap_after_kill_s"] for k in kills), default=None)
    return print_verdicts([
        (f"first start served by {f['served_by']} (ipc {f['ipc']}), recorded: {f['recorded']}",
         f["served_by"] == "ipc" and f["ipc"] == "hit" and f["recorded"]),
        (f"first start {f['to_answer_s']} s to an answer, against a cold start's {c['to_answer_s']} s",
         f["to_answer_s"] < c["to_answer_s"]),
        (f"first start's peak device memory {f['peak_mib']} MiB (idle {result['base_mib']}), the cache's {cache_mib} "
         f"MiB (cold start: {c['peak_mib']} MiB); at most the idle + the cache's + 25 %",
         a.device == "cpu" or (f["peak_mib"] is not None and cache_mib is not None
                               and f["peak_mib"] - result["base_mib"] <= cache_mib * 1.25)),
        (f"standby killed {len(kills)}x: longest gap after {after} s, steady {steady} s (at most 2x)",
         bool(kills) and steady is not None and after <= 2 * max(steady, 0.05)),
    ])


if __name__ == "__main__":
    sys.exit(main())
