"""vLLM's fast paths on a GPU: ipc (CUDA IPC handles from restartkit's weight cache into vLLM's load format),
criu+ipc (the driver's checkpoint API on a weights-less vLLM, the weights re-attached from the cache) and a
standby vLLM, each proven by its record and an identical canary; a verdict table at the end.

WRITTEN, NOT RUN: it needs a GPU build of vLLM (0.32 or newer) beside restartkit in one Python, which the lent
H200 cannot hold (its torch is 2.11; vLLM pins 2.13/2.14).  Run it where you have one, as root with CRIU >= 4:
    python scripts/gpu_vllm_paths.py --model /path/to/hf-checkpoint [--work /tmp/rk-gpu-vllm]
criu+ipc runs vLLM with --enforce-eager: a weights-less dump frees the weights, and CUDA graphs captured on their
old addresses would read garbage after the re-attach (the worker extension refuses without it).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import print_verdicts  # noqa: E402

POLICY = """[service]
name = "gpu-vllm-paths"
engine = "vllm"
model = "{model}"
port = {port}
device = "cuda"
max_model_len = 2048
engine_args = ["--enforce-eager", "--gpu-memory-utilization", "0.45"]
state_dir = "{work}/state"
[restart]
start_timeout_s = 900
[ipc]
socket_dir = "{work}/wc"
fallback = false
[standby]
enabled = true
"""


def rk(*args: str, timeout: int = 1800) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, "-m", "restartkit.cli", *args, "--json"], capture_output=True, text=True,
                       timeout=timeout)
    try:
        return r.returncode, json.loads(r.stdout)
    except ValueError:
        return r.returncode, {"stderr": r.stderr[-2000:]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--work", default="/tmp/rk-gpu-vllm")
    p.add_argument("--port", type=int, default=8790)
    a = p.parse_args()
    Path(a.work).mkdir(parents=True, exist_ok=True)
    policy = Path(a.work) / "vllm.toml"
    policy.write_text(POLICY.format(model=a.model, port=a.port, work=a.work))
    P = ["--policy", str(policy)]
    verdicts, rows = [], []
    subprocess.run([sys.executable, "-m", "restartkit.cli", "preload", *P, "--detach"], check=True)
    try:
        rk("start", *P)
        for name, args in (("ipc", ["--strategy", "ipc", "--strict"]),):
            code, rec = rk("restart", *P, *args)
            rows.append((name, rec.get("served_by"), rec.get("time_to_ready_s")))
            verdicts.append((f"{name}: served by ipc, every rank a hit, canary identical",
                             code == 0 and rec.get("served_by") == "ipc" and rec.get("proof", {}).get("ipc") == "hit"
                             and rec.get("proof", {}).get("canary_identical") is True))
        code, snap = rk("snapshot", "create", *P)
        verdicts.append(("snapshot create: weights-less", code == 0 and snap.get("kind") == "weightless"))
        code, rec = rk("restart", *P, "--strategy", "criu+ipc", "--strict")
        rows.append(("criu+ipc", rec.get("served_by"), rec.get("time_to_ready_s")))
        verdicts.append(("criu+ipc: served by criu+ipc, canary identical",
                         code == 0 and rec.get("served_by") == "criu+ipc" and rec.get("proof", {}).get("canary_identical") is True))
        code, _ = rk("standby", "arm", *P)
        code, rec = rk("restart", *P, "--strategy", "standby", "--strict")
        rows.append(("standby", rec.get("served_by"), rec.get("time_to_ready_s")))
        verdicts.append(("standby: served by standby, canary identical",
                         code == 0 and rec.get("served_by") == "standby" and rec.get("proof", {}).get("canary_identical") is True))
    finally:
        rk("standby", "disarm", *P)
        rk("stop", *P)
        rk("weightcache", "release", *P, "--stop", "--force")
    print("strategy   served_by   time_to_ready_s")
    for name, by, t in rows:
        print(f"  {name:9s} {str(by):11s} {t}")
    return print_verdicts(verdicts)


if __name__ == "__main__":
    sys.exit(main())
