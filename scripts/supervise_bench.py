#!/usr/bin/env python3
"""`restartkit supervise` against crashes: SIGKILL the engine N times, time kill -> serving again.

    python3 scripts/supervise_bench.py [--preset small] [--kills 5] [--device cpu|cuda] [--work DIR]

With the weight cache running (auto brings a crash back through ipc), without it (a cold
restart: what systemd's Restart= alone would give), and (--modes snapshot) with the cache and a
weights-less snapshot of the engine on it (auto ranks criu+ipc first: a crash comes back through a
CRIU restore with the weights re-attached; needs root and CRIU).  Each crash is timed from the
kill to a completion answered again (the client's view), and the record's own numbers are
reported (noticed -> serving, strategy, canary).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RK = [sys.executable, "-m", "restartkit.cli"]


def cli(*args, check=False) -> subprocess.CompletedProcess:
    r = subprocess.run([*RK, *map(str, args)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    if check and r.returncode != 0:
        raise RuntimeError(f"restartkit {' '.join(map(str, args))} -> {r.returncode}\n{r.stderr[-2000:]}")
    return r


def answers(port: int) -> bool:
    body = json.dumps({"model": "m", "prompt": "ping", "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def run(pol: Path, port: int, kills: int, with_cache: bool, snapshot: bool = False) -> list[dict]:
    cli("weightcache", "release", "--policy", pol, "--stop", "--force")
    cli("stop", "--policy", pol)
    if with_cache:
        cli("preload", "--policy", pol, "--detach", check=True)
    sup = subprocess.Popen([*RK, "supervise", "--policy", str(pol)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           cwd=ROOT, start_new_session=True)
    out = []
    try:
        while not answers(port):
            time.sleep(0.2)
        if with_cache:  # onto the cache first, as rollout would
            cli("restart", "--policy", pol, "--strategy", "ipc", "--wait", "120", check=True)
        if snapshot:  # taken while supervise watches: it holds the service's lock meanwhile
            cli("snapshot", "create", "--policy", pol, "--wait", "120", check=True)
        for _ in range(kills):
            last = (json.loads(cli("history", "--policy", pol, "--last", "1", "--json").stdout)["records"] or [{}])[-1].get("id")
            pid = json.loads(cli("status", "--policy", pol, "--json").stdout)["pid"]
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            while answers(port) and time.monotonic() - t0 < 5:  # the old one may answer an instant longer
                time.sleep(0.01)
            while not answers(port):
                time.sleep(0.02)
            seen = time.monotonic() - t0
            while (rec := (json.loads(cli("history", "--policy", pol, "--last", "1", "--json").stdout)["records"]
                           or [{}])[-1]).get("id") == last:
                time.sleep(0.2)
            out.append({"kill_to_answer_s": round(seen, 3), "served_by": rec["served_by"],
                        "noticed_to_serving_s": (rec.get("trigger") or {}).get("noticed_to_serving_s"),
                        "noticed_to_start_s": (rec.get("trigger") or {}).get("noticed_to_start_s"),
                        "time_to_ready_s": rec.get("time_to_ready_s"),
                        "canary_identical": rec["proof"].get("canary_identical"), "reason": rec["reason"]})
            time.sleep(1)
    finally:
        os.killpg(sup.pid, signal.SIGTERM)
        sup.wait(120)
        cli("weightcache", "release", "--policy", pol, "--stop", "--force")
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--work", default="/tmp/rk-supervise")
    p.add_argument("--port", type=int, default=8760)
    p.add_argument("--modes", default="cache,cold", help="cache, cold, snapshot (comma-separated)")
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / a.preset
    if not (model / "config.json").exists():
        cli("model", "create", "--preset", a.preset, "--out", model, "--device", a.device, check=True)
    pol = work / "supervised.toml"
    pol.write_text(f"""[service]
name = "supervised"
engine = "reference"
model = "{model}"
port = {a.port}
device = "{a.device}"
max_model_len = 512
state_dir = "{work / 'state'}"
[restart]
start_timeout_s = 600
stop_timeout_s = 15
[ipc]
socket_dir = "{work / 'sockets'}"
[supervise]
health_interval_s = 1
backoff_s = 0.01       # each kill is its own crash here: no backoff between them
backoff_max_s = 0.01
""")
    modes = {"cache": ("with weight cache", True, False), "cold": ("cold only", False, False),
             "snapshot": ("cache + snapshot", True, True)}
    results = {modes[m][0]: run(pol, a.port, a.kills, modes[m][1], modes[m][2]) for m in a.modes.split(",")}
    print(f"\nsupervise: {a.kills} x SIGKILL of the engine ({a.preset}, {a.device}, {time.strftime('%Y-%m-%d %H:%M %Z')})")
    for name, runs in results.items():
        ks = [r["kill_to_answer_s"] for r in runs]
        ns = [r["noticed_to_serving_s"] for r in runs if r["noticed_to_serving_s"] is not None]
        print(f"{name:<18} served by {sorted({r['served_by'] for r in runs})}  kill -> answering: median "
              f"{statistics.median(ks):.2f} s (min {min(ks):.2f}, max {max(ks):.2f}); noticed -> serving median "
              f"{statistics.median(ns) if ns else 0:.2f} s; canary identical {all(r['canary_identical'] for r in runs)}; "
              f"reasons {sorted({r['reason'] for r in runs})}")
        for r in runs:  # each crash: noticed -> the restart's start (lock, reaping, facts, plan), its time to ready
            print(f"    kill -> answering {r['kill_to_answer_s']:.2f} s: noticed -> restart start "
                  f"{r['noticed_to_start_s']} s, time to ready {r['time_to_ready_s']} s, noticed -> serving "
                  f"{r['noticed_to_serving_s']} s ({r['served_by']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
