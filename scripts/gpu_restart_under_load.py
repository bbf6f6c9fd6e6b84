#!/usr/bin/env python3
"""Every strategy's restart while 4 clients ask greedy completions: the canary identical, what clients saw.

    python3 scripts/gpu_restart_under_load.py [--device cuda] [--preset 8b-shape] [--repeat 2] [--clients 4]
                                              [--work DIR] [--port 8311]

Two services on one model (a strategy's prerequisites decide which): the weights mapped from the weight
cache (zero_copy) with a standby armed: `restartkit bench --strategies standby,criu+ipc,ipc,cold` (criu+ipc
after a weights-less snapshot); then the weights owned by the engine (copy) with sleep mode on:
`--strategies sleep`.  Each through `restartkit bench --clients N` (restartkit.clients.ClientLoad: no
retries, a new connection a request).  Prints each strategy's clean runs, median time to ready, whether
every canary was identical, and the clients' outcomes, with a verdict table.  Works on the CPU too
(`--device cpu --preset tiny`; criu+ipc needs CRIU)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ask, print_verdicts  # noqa: E402

POLICY = """\
[service]
name = "{name}"
engine = "reference"
model = "{model}"
host = "127.0.0.1"
port = {port}
device = "{device}"
max_model_len = 1024

[restart]
start_timeout_s = 180
stop_timeout_s = 20
canary_prompts = ["The quick brown fox", "Restarting an inference server"]
canary_max_tokens = 16

[ipc]
mode = "{mode}"
fallback = true

[criu]
keep = 1

{extra}"""


def bench(policy: Path, strategies: str, repeat: int, clients: int) -> dict:
    r = ask("bench", "--policy", policy, "--strategies", strategies, "--repeat", repeat, "--clients", clients,
            "--json", check=True)
    return json.loads(r.stdout)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default=None, help="default: 8b-shape on cuda, tiny on the CPU")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--work", default="/tmp/rk-under-load")
    p.add_argument("--port", type=int, default=8311)
    a = p.parse_args()
    preset = a.preset or ("8b-shape" if a.device.startswith("cuda") else "tiny")
    work = Path(a.work)
    model = work / preset
    if not (model / "config.json").exists():
        ask("model", "create", "--preset", preset, "--out", model, "--device", a.device, check=True)
    rows, verdicts = [], []
    zero = work / "zero_copy.toml"
    zero.write_text(POLICY.format(name="under-load", model=model, port=a.port, device=a.device, mode="zero_copy",
                                  extra="[standby]\nenabled = true\n"))
    copy = work / "copy.toml"
    copy.write_text(POLICY.format(name="under-load-sleep", model=model, port=a.port, device=a.device, mode="copy",
                                  extra="[sleep]\nenabled = true\nlevel = 1\n"))
    try:
        t0 = time.monotonic()
        ask("preload", "--policy", zero, "--detach", check=True)
        ask("start", "--policy", zero, check=True)
        ask("restart", "--policy", zero, "--strategy", "ipc", check=True)  # a weights-less snapshot needs it
        ask("snapshot", "create", "--policy", zero, check=True)
        ask("standby", "arm", "--policy", zero, check=True)
        print(f"cache, engine and weights-less snapshot in {time.monotonic() - t0:.0f} s", flush=True)
        rows += bench(zero, "standby,criu+ipc,ipc,cold", a.repeat, a.clients)["rows"]
        ask("standby", "disarm", "--policy", zero)
        ask("stop", "--policy", zero)
        ask("start", "--policy", copy, check=True)
        rows += bench(copy, "sleep", a.repeat, a.clients)["rows"]
    finally:
        ask("standby", "disarm", "--policy", zero)
        for pol in (copy, zero):
            ask("stop", "--policy", pol)
        ask("weightcache", "release", "--policy", zero, "--stop", "--force")
    print(f"{'strategy':<10} {'clean':>5} {'ready (median s)':>17}  canary     clients")
    for row in rows:
        ready = row["time_to_ready_s"].get("median") if row["time_to_ready_s"] else None
        print(f"{row['strategy']:<10} {row['clean_runs']:>5} {ready if ready is not None else '-':>17}  "
              f"{'identical' if row['canary_identical'] else 'DIFFERENT':<10} {json.dumps(row.get('clients', {}))}"
              f"  served by {[r['served_by'] for r in row['runs']]}")
        verdicts.append((f"{row['strategy']}: {row['clean_runs']}/{a.repeat} clean, canary identical under "
                         f"{a.clients} clients", row["canary_identical"] and row["clean_runs"] == a.repeat))
    return print_verdicts(verdicts)


if __name__ == "__main__":
    sys.exit(main())
