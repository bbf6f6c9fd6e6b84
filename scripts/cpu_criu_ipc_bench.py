#!/usr/bin/env python3
"""criu+ipc against criu, ipc and cold on the CPU (root, CRIU 4 from scripts/install-criu).

    python3 scripts/cpu_criu_ipc_bench.py [--preset small] [--repeat 3] [--work DIR]

The reference engine on the CPU with its weight cache running: a full snapshot of the engine
as loaded from disk, `bench --strategies criu,cold`; then the engine restarted through ipc
(mapping its weights from the cache), a snapshot without the weights, `bench --strategies
criu+ipc,ipc`.  Prints one table: median time to ready per strategy, both images' sizes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, timeout=900, check=True) -> dict | str:
    r = subprocess.run([sys.executable, "-m", "restartkit.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    if check and r.returncode not in (0, 3):
        raise RuntimeError(f"restartkit {' '.join(map(str, args))} -> {r.returncode}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout) if "--json" in args else r.stdout


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--work", default="/tmp/rk-cpu-criu-ipc")
    p.add_argument("--port", type=int, default=8750)
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / a.preset
    if not (model / "config.json").exists():
        cli("model", "create", "--preset", a.preset, "--out", model)
    pol = work / "bench.toml"
    pol.write_text(f"""[service]
name = "cpu-criu-ipc"
engine = "reference"
model = "{model}"
port = {a.port}
device = "cpu"
max_model_len = 512
engine_args = ["--threads", "1"]
state_dir = "{work / 'state'}"
[restart]
start_timeout_s = 120
stop_timeout_s = 15
[ipc]
socket_dir = "{work / 'sockets'}"
mode = "zero_copy"
[criu]
pid_wait_s = 10.0
""")
    rows, images = {}, {}
    try:
        cli("weightcache", "release", "--policy", pol, "--stop", "--force", check=False)
        cli("stop", "--policy", pol, check=False)
        cli("preload", "--policy", pol, "--detach")
        cli("start", "--policy", pol)
        snap = cli("snapshot", "create", "--policy", pol, "--json")
        images[snap["kind"]] = snap["image_bytes"]
        for r in cli("bench", "--policy", pol, "--strategies", "criu,cold", "--repeat", a.repeat, "--json")["rows"]:
            rows[r["strategy"]] = r
        cli("restart", "--policy", pol, "--strategy", "ipc", "--json")
        snap = cli("snapshot", "create", "--policy", pol, "--json")
        images[snap["kind"]] = snap["image_bytes"]
        for r in cli("bench", "--policy", pol, "--strategies", "criu+ipc,ipc", "--repeat", a.repeat, "--json")["rows"]:
            rows[r["strategy"]] = r
    finally:
        cli("stop", "--policy", pol, check=False)
        cli("weightcache", "release", "--policy", pol, "--stop", "--force", check=False)
    print(f"\ncriu+ipc on the CPU ({a.preset} preset, {a.repeat} runs each, {time.strftime('%Y-%m-%d %H:%M %Z')})")
    print(f"{'strategy':<10}{'clean':>6}{'median':>9}{'min':>8}{'max':>8}  canary  restore to ready (no stop, no PID wait)")
    for name in ("criu+ipc", "criu", "ipc", "cold"):
        r = rows.get(name)
        if r is None:
            continue
        t = r["time_to_ready_s"]
        rtr = [x["time_to_ready_s"] - (x["phases"] or {}).get("stop", 0) - (x["phases"] or {}).get("wait_pids", 0)
               for x in r["runs"] if x["served_by"] == name and not x["via_recovery"]]
        print(f"{name:<10}{r['clean_runs']:>6}{t.get('median', 0):>8.2f}s{t.get('min', 0):>7.2f}s{t.get('max', 0):>7.2f}s  "
              f"{'same' if r['canary_identical'] else 'DIFF':<6}  {statistics.median(rtr) if rtr else 0:.2f} s")
    print("images: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in images.items()))
    med = {k: (r["time_to_ready_s"].get("median") if r["clean_runs"] else None) for k, r in rows.items()}
    if med.get("criu+ipc") and med.get("criu") and med.get("cold"):
        ok = med["criu+ipc"] < 0.95 * min(med["criu"], med["cold"])  # by more than the noise
        print(f"{'met' if ok else 'MISSED'}: criu+ipc faster than criu and than cold by more than 5 % "
              f"({med['criu+ipc']:.3f} s against {med['criu']:.3f} s and {med['cold']:.3f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
