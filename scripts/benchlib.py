"""What the benchmark and device scripts share: running restartkit, the arguments and policy of a single-service
GPU script, a restart's summary, readiness checks, the verdict table every device script ends with, and timing.
The scripts import it by path (sys.path holds scripts/); it imports restartkit only inside its functions."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RK = [sys.executable, "-m", "restartkit.cli"]


def cli(*args, check=True, timeout=900) -> subprocess.CompletedProcess:
    """`restartkit ARGS`, checked unless `check=False`: an exit but 0 or 3 (served through a recovery) raises."""
    r = subprocess.run([*RK, *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    if check and r.returncode not in (0, 3):
        raise RuntimeError(f"restartkit {' '.join(map(str, args))} -> {r.returncode}\n{r.stderr[-3000:]}")
    return r


def ask(*args, check=False) -> subprocess.CompletedProcess:
    """`restartkit ARGS`, not checked unless `check` (then any exit but 0 raises)."""
    r = subprocess.run([*RK, *map(str, args)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    if check and r.returncode != 0:
        raise RuntimeError(f"restartkit {' '.join(map(str, args))} -> {r.returncode}\n{r.stderr[-2000:]}")
    return r


def reference_model(work: str, device: str, preset: str | None) -> tuple[Path, str]:
    """(checkpoint, preset) of the reference engine under `work`, written once (`restartkit model create`);
    the preset defaults to 8b-shape on cuda and tiny on the CPU."""
    preset = preset or ("8b-shape" if device.startswith("cuda") else "tiny")
    model = Path(work) / preset
    model.parent.mkdir(parents=True, exist_ok=True)
    if not (model / "config.json").exists():
        t0 = time.perf_counter()
        ask("model", "create", "--preset", preset, "--out", model, "--device", device, check=True)
        print(f"model {preset} written in {time.perf_counter() - t0:.0f} s", flush=True)
    return model, preset


def start_server(argv: list[str], port: int, log: Path, env: dict | None = None, path: str = "/health",
                 wait_s: float = 900) -> subprocess.Popen:
    """A server (argv: its whole command line) started in its own session from the repository's root, its output
    in `log`, returned once GET `path` on loopback `port` answers; SystemExit if it exits or does not answer.
    stop_server ends it and what it started."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            env={**os.environ, **(env or {})}, start_new_session=True)
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"{Path(argv[0]).name} {argv[1:3]} exited: {log.read_text()[-3000:]}")
            time.sleep(0.2)
    stop_server(proc)
    raise SystemExit(f"{Path(argv[0]).name} did not answer within {wait_s:.0f} s: see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's session, SIGKILL after 60 s."""
    import signal
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def bench_setup(default_work: str, default_port: int, extra=lambda p: None):
    """The arguments every single-service GPU script takes, and its work dirs and model
    (created with `restartkit model create` unless --model names one)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--work", default=default_work)
    p.add_argument("--preset", default="8b-shape")
    p.add_argument("--model", default=None, help="reuse a checkpoint directory")
    p.add_argument("--device", default="cuda")
    p.add_argument("--port", type=int, default=default_port)
    extra(p)
    args = p.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else work / "models" / args.preset
    if not (model / "config.json").exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        cli("model", "create", "--preset", args.preset, "--out", model, "--device", args.device)
    return args, out, work, model


def write_policy(work: Path, name: str, model: Path, device: str, port: int, tp: int = 1,
                 restart: str = "", sections: str = "", service: str = "") -> Path:
    """The policy every GPU script starts from (the reference engine, 4096 tokens, state under
    `work`); `service` adds [service] keys, `restart` [restart] keys, `sections` whole sections."""
    p = work / f"{name}.toml"
    p.write_text(f"""
[service]
name = "{name}"
model = "{model}"
port = {port}
device = "{device}"
tensor_parallel_size = {tp}
max_model_len = 4096
state_dir = "{work / 'state'}"
{service}[restart]
start_timeout_s = 600
{restart}{sections}""")
    return p


def restart(pol: Path, strategy: str, *flags: str) -> dict:
    rec = json.loads(cli("restart", "--policy", pol, "--strategy", strategy, *flags, "--json").stdout)
    a = rec["attempts"][-1]
    return {"strategy": strategy, "served_by": rec["served_by"], "via_recovery": rec["via_recovery"],
            "recovery_reason": rec["recovery_reason"], "downtime": rec.get("downtime"),
            "time_to_ready_s": rec["time_to_ready_s"], "phases": a.get("phases"), "engine_phases": a.get("engine_phases"),
            "canary_identical": rec["proof"].get("canary_identical"), "ipc": (a.get("proof") or {}).get("ipc"),
            "ranks": (a.get("proof") or {}).get("ranks"), "attach_s": (a.get("proof") or {}).get("attach_s"),
            "draft": (a.get("proof") or {}).get("draft")}


def teardown(pol: Path, results: Path | None = None, res: dict | None = None) -> None:
    """The end of every single-service GPU script: the engine and its weight cache stopped, the results written."""
    cli("stop", "--policy", pol, check=False)
    cli("weightcache", "release", "--policy", pol, "--stop", "--force", check=False)
    if results is not None:
        results.write_text(json.dumps(res, indent=2))


def cpu_line() -> str:
    """This machine's CPU for a benchmark's output, e.g. "Intel(R) Xeon(R) Processor (GenuineIntel), 2 cores, torch
    2.13.0+cpu": the CPU under a VM can change between runs of one command, and CPU figures are compared only where
    this line is the same (the maker also chooses the engine's CPU products: restartkit.reference.model.kernels)."""
    import torch

    from restartkit.reference.model.kernels import cpu_maker, cpuinfo
    name, maker = cpuinfo("model name") or "an unnamed CPU", cpu_maker() or "maker not said"
    return f"{name} ({maker}), {os.cpu_count()} cores, torch {torch.__version__}"


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def engine_stats(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/stats", timeout=10) as r:
        return json.loads(r.read())


def answers(port: int) -> bool:
    body = json.dumps({"prompt": "ping", "max_tokens": 1, "temperature": 0}).encode()  # model: the one served
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def engines_on(port: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"restartkit.reference.serving.server" in cmd and str(port).encode() in cmd:
            out.append(int(d))
    return out


def gpu_mib(pid: int) -> int | None:
    """Device memory the process holds (nvidia-smi), None without a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        a, _, b = line.partition(",")
        if a.strip() == str(pid):
            return int(b.strip())
    return None


def standby_prepared(pol: Path, timeout: float = 300) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        sb = json.loads(ask("status", "--policy", pol, "--json").stdout).get("standby") or {}
        if sb.get("state") == "prepared" and (sb.get("canary") or not sb.get("kv_ahead")):
            return sb  # (activated ahead: once it answered its canary ahead too)
        time.sleep(0.2)
    raise RuntimeError("no standby was prepared in time")


def print_verdicts(verdicts: list[tuple[str, bool]]) -> int:
    """The verdict table every device script ends with; its exit code (0: every verdict ok)."""
    print("verdict")
    for what, ok in verdicts:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
    return 0 if all(ok for _, ok in verdicts) else 1


def verdict_table(verdicts: list[tuple[str, bool]]) -> int:
    """The verdicts as a markdown table (for docs/BENCHMARKS.md as they are); the exit code (0: every one yes)."""
    print("| check | verdict |\n| --- | --- |")
    for what, ok in verdicts:
        print(f"| {what} | {'yes' if ok else '**NO**'} |")
    return 0 if all(ok for _, ok in verdicts) else 1


def timed(fn, sync, n: int = 50) -> float:
    for _ in range(5):
        fn()
    sync()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000
