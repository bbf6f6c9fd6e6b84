"""vLLM's fast paths on a GPU, through restartkit (its launcher, its `restartkit_cache` load format over CUDA IPC,
its worker extension): cold, ipc, criu+ipc (a weights-less snapshot, the driver's checkpoint API, the weights
re-attached from the cache), a planned standby restart, a SIGKILLed vLLM under supervise with a standby and 4
clients, and vLLM's own sleep mode at levels 1 and 2; each proven by its record and an identical canary.  The
model is a Llama-architecture checkpoint written by transformers (random weights, bfloat16), with restartkit's
reference tokenizer.  Ends with a table and a verdict table; everything measured goes to $OUT/vllm-paths-*.json.

On the lent H200 with vLLM 0.26.0 staged by scripts/stage_vllm_gpu.py (its `install` prints the exports):
    source scripts/device-setup.sh; eval "$(python3 scripts/stage_vllm_gpu.py install)"
    python3 scripts/gpu_vllm_paths.py --shape small [--steps cold,ipc,criu+ipc,standby,crash,sleep]
criu+ipc runs vLLM with --enforce-eager: a weights-less dump frees the weights, and CUDA graphs captured on their
old addresses would read garbage after the re-attach (the worker extension refuses without it).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, RK, print_verdicts  # noqa: E402

SHAPES = {  # Llama shapes (transformers' LlamaConfig)
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=8, vocab_size=32000),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
}
STEPS = ("cold", "ipc", "criu+ipc", "standby", "crash", "sleep")
T0 = time.monotonic()
POLICY = """[service]
name = "{name}"
engine = "vllm"
model = "{model}"
port = {port}
device = "cuda"
max_model_len = 2048
engine_args = ["--enforce-eager", "--gpu-memory-utilization", "{util}"]
state_dir = "{work}/state"
env = {{ VLLM_USE_FLASHINFER_SAMPLER = "0", HF_HUB_OFFLINE = "1" }}
[restart]
start_timeout_s = 900
stop_timeout_s = 60
{extra}
[supervise]
health_interval_s = 0.5
health_timeout_s = 2.0
health_misses = 3
completion_interval_s = 10
completion_timeout_s = 30
"""


def rk(*args, timeout: int = 1800, quiet: bool = False, as_json: bool = True) -> tuple[int, dict]:
    t0 = time.monotonic()
    r = subprocess.run([*RK, *map(str, args), *(["--json"] if as_json else [])], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    try:
        out = json.loads(r.stdout)
    except ValueError:
        out = {"error": (r.stderr or r.stdout)[-3000:]}
    if not quiet:
        print(f"[{time.monotonic() - T0:6.1f} s] restartkit {' '.join(map(str, args[:2]))}: exit {r.returncode} in "
              f"{time.monotonic() - t0:.1f} s" + (f"\n{out['error']}" if r.returncode not in (0, 3) and "error" in out
                                                  else ""), flush=True)
    return r.returncode, out


def log_tail(work: Path, lines: int = 60) -> str:
    """The end of each engine log under `work` (what vLLM said before it exited)."""
    out = []
    for log in sorted((work / "state").glob("*/engine.log")):
        out.append(f"---- {log}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(out)


def make_model(path: Path, shape: str) -> float:
    """A checkpoint transformers writes (random weights, bf16, made on the GPU); the tokenizer is restartkit's."""
    if (path / "config.json").exists():
        return 0.0
    import torch
    import transformers
    t0 = time.monotonic()
    tok = path.parent / "tokenizer-src"
    if not (tok / "config.json").exists():
        subprocess.run([*RK, "model", "create", "--preset", "tiny", "--out", str(tok)], check=True, cwd=ROOT)
    ref = json.loads((tok / "config.json").read_text())
    cfg = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, rms_norm_eps=1e-5,
                                   bos_token_id=ref.get("bos_token_id"), eos_token_id=ref.get("eos_token_id"),
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    for f in tok.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return round(time.monotonic() - t0, 1)


def io_uring(value: int) -> str | None:
    """kernel.io_uring_disabled set to `value` (the old value; None where it cannot be set)."""
    path = Path("/proc/sys/kernel/io_uring_disabled")
    try:
        old = path.read_text().strip()
        path.write_text(f"{value}\n")
        return old
    except OSError:
        return None


def save(results: dict) -> None:
    out = Path(os.environ.get("OUT", "/tmp"))
    (out / f"vllm-paths-{results['shape']}.json").write_text(json.dumps(results, indent=1, default=str))


def row(name: str, code: int, rec: dict) -> dict:
    a = (rec.get("attempts") or [{}])[-1]
    proof = a.get("proof") or {}
    return {"path": name, "exit": code, "served_by": rec.get("served_by"), "time_to_ready_s": rec.get("time_to_ready_s"),
            "canary_identical": (rec.get("proof") or {}).get("canary_identical"), "ipc": proof.get("ipc"),
            "ranks": proof.get("ranks"), "load": proof.get("load"), "phases": a.get("phases"),
            "recovery_reason": rec.get("recovery_reason"), "error": rec.get("error") or a.get("error")}


def ok(r: dict, strategy: str) -> bool:
    return r["exit"] == 0 and r["served_by"] == strategy and r["canary_identical"] is True


def crash_under_supervise(P: list, port: int, model: str) -> dict:
    """supervise with a standby; 4 clients; the serving vLLM's process group SIGKILLed."""
    from restartkit.clients import ClientLoad, summarize
    sup = subprocess.Popen([*RK, "supervise", *P], cwd=ROOT, stdout=open(os.environ.get("OUT", "/tmp") + "/supervise.log", "w"),
                           stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.monotonic() + 300
        while time.monotonic() < end:
            st = rk("status", *P, quiet=True)[1]
            if st.get("serving") and (st.get("standby") or {}).get("state") == "prepared":
                break
            time.sleep(1)
        else:
            return {"error": "no standby was prepared under supervise within 300 s"}
        engine = st["pid"]
        time.sleep(8)  # served past min_uptime_s: a crash, not a failed start
        # 4 clients of short answers (kill -> answering, refused) and 4 of long ones (in flight at the kill)
        load = ClientLoad("127.0.0.1", port, model, clients=4, max_tokens=8, timeout_s=60).start()
        long = ClientLoad("127.0.0.1", port, model, clients=4, max_tokens=64, timeout_s=60).start()
        try:
            time.sleep(3)
            killed = time.monotonic()
            os.killpg(engine, signal.SIGKILL)
            end = time.monotonic() + 300
            while time.monotonic() < end and rk("status", *P, quiet=True)[1].get("pid") in (engine, None):
                time.sleep(0.2)
            time.sleep(5)
        finally:
            load.stop()
            long.stop()
        got = summarize(load.snapshot(), [killed], clients=4)
        got_long = summarize(long.snapshot(), [killed], clients=4)
        got["lost"] += got_long["lost"]
        got["refused"] += got_long["refused"]
        got["requests"] += got_long["requests"]
        recs = rk("history", *P, "--last", "1")[1].get("records") or [{}]
        return {"front": front_counts(port), "in_flight": (recs[-1].get("trigger") or {}).get("in_flight"),
                "served_by": recs[-1].get("served_by"), "canary_identical": (recs[-1].get("proof") or {}).get(
            "canary_identical"), **{k: got.get(k) for k in ("requests", "refused", "http_5xx", "lost", "lost_in_flight",
                                                            "kill_to_answer_s", "p50_s", "p99_s")}}
    finally:
        os.killpg(sup.pid, signal.SIGTERM)
        sup.wait(120)


def front_counts(port: int) -> dict:
    """The front's counters (supervise keeps it on the service's port by default), from its /metrics."""
    import urllib.request
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError as e:
        return {"error": str(e)}
    return {line.split()[0].removeprefix("restartkit_front_requests_").removesuffix("_total"): float(line.split()[1])
            for line in text.splitlines() if line.startswith("restartkit_front_requests_")}


def run(a, work: Path, model: Path, results: dict) -> list[tuple[str, bool]]:
    pol = work / "vllm.toml"
    pol.write_text(POLICY.format(name=f"vllm-{a.shape}", model=model, port=a.port, work=work, util=a.util,
                                 extra=f'[ipc]\nsocket_dir = "{work}/wc"\nfallback = false\nstartup_timeout_s = 900\n'
                                       "[standby]\nenabled = true\n"))
    P, verdicts, steps = ["--policy", pol], [], set(a.steps.split(","))
    rows = results.setdefault("rows", [])  # written to $OUT after each step (a run cut short keeps what it had)
    deadline = time.monotonic() + a.budget_s
    results["io_uring_disabled"] = io_uring(2)  # CRIU cannot dump an io_uring: none may be made (as root)
    subprocess.run([*RK, "preload", *P, "--detach"], check=True, cwd=ROOT)
    try:
        code, st = rk("start", *P)
        results["start"] = st
        if code != 0:
            print(log_tail(work), flush=True)
            verdicts.append(("the engine starts (cold)", False))
            return verdicts
        for name, args, wanted in (("cold", ["--strategy", "cold"], "cold"), ("ipc", ["--strategy", "ipc"], "ipc")):
            if name in steps and time.monotonic() < deadline:
                rows.append(row(name, *rk("restart", *P, *args, "--strict")))
                save(results)
                verdicts.append((f"{name}: served by {wanted}, canary identical", ok(rows[-1], wanted)))
        if "ipc" in steps and rows and rows[-1]["path"] == "ipc":
            verdicts.append(("ipc: a hit on every rank", rows[-1]["ipc"] == "hit"))
        if "criu+ipc" in steps and time.monotonic() < deadline:
            code, snap = rk("snapshot", "create", *P)
            results["snapshot"] = {k: snap.get(k) for k in ("kind", "image_bytes", "freeze_s", "phases", "error")}
            verdicts.append(("snapshot create: weights-less", code == 0 and snap.get("kind") == "weightless"))
            rows.append(row("criu+ipc", *rk("restart", *P, "--strategy", "criu+ipc", "--strict")))
            save(results)
            verdicts.append(("criu+ipc: served by criu+ipc, canary identical", ok(rows[-1], "criu+ipc")))
        if "standby" in steps and time.monotonic() < deadline:
            results["standby_arm"] = rk("standby", "arm", *P)[1]
            rows.append(row("standby", *rk("restart", *P, "--strategy", "standby", "--strict")))
            save(results)
            verdicts.append(("standby (planned): served by standby, canary identical", ok(rows[-1], "standby")))
        cold = next((r["time_to_ready_s"] for r in rows if r["path"] == "cold" and r["time_to_ready_s"]), None)
        fast = next((r["time_to_ready_s"] for r in rows if r["path"] == "criu+ipc" and ok(r, "criu+ipc")), None)
        if cold and fast:
            verdicts.append((f"criu+ipc ({fast:.1f} s) faster than cold ({cold:.1f} s)", fast < cold))
        if "crash" in steps and time.monotonic() < deadline:
            rk("stop", *P)
            results["crash"] = c = crash_under_supervise(P, a.port, str(model))
            save(results)
            k2a = (c.get("kill_to_answer_s") or [None])[0]
            verdicts.append((f"supervise + standby: SIGKILL -> answering {k2a} s (<= 1 s), {c.get('refused')} refused",
                             k2a is not None and k2a <= 1.0 and c.get("refused") == 0 and c.get("served_by") == "standby"))
            verdicts.append((f"the front: {c.get('lost')} of the clients' requests lost, {c.get('in_flight')} in flight "
                             f"at the kill, front {c.get('front')}", c.get("lost") == 0))
    finally:
        rk("standby", "disarm", *P, as_json=False)
        rk("stop", *P)
        rk("weightcache", "release", *P, "--stop", "--force")
        if results.get("io_uring_disabled") is not None:
            io_uring(int(results["io_uring_disabled"]))
    if "sleep" in steps and time.monotonic() < deadline:
        rows += sleep_levels(a, work, model, verdicts)
    return verdicts


def sleep_levels(a, work: Path, model: Path, verdicts: list) -> list[dict]:
    out = []
    for level in (1, 2):
        pol = work / f"sleep{level}.toml"
        pol.write_text(POLICY.format(name=f"vllm-{a.shape}-sleep{level}", model=model, port=a.port + level, work=work,
                                     util=a.util, extra=f"[sleep]\nenabled = true\nlevel = {level}\n"))
        P = ["--policy", pol]
        try:
            rk("start", *P)
            out.append(row(f"sleep {level}", *rk("restart", *P, "--strategy", "sleep", "--strict")))
            verdicts.append((f"sleep level {level}: served by sleep, canary identical", ok(out[-1], "sleep")))
        finally:
            rk("stop", *P)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--work", default="/tmp/rk-gpu-vllm")
    p.add_argument("--port", type=int, default=8790)
    p.add_argument("--util", default="0.3", help="--gpu-memory-utilization of each vLLM (a standby runs beside)")
    p.add_argument("--steps", default=",".join(STEPS))
    p.add_argument("--budget-s", type=float, default=480, help="no new step starts after this many seconds")
    a = p.parse_args()
    work = Path(a.work) / a.shape
    work.mkdir(parents=True, exist_ok=True)
    model = Path(a.work) / "models" / a.shape
    results: dict = {"shape": a.shape, "model_write_s": make_model(model, a.shape)}
    try:
        from restartkit.engines.vllm_seams import installed_version
        results["vllm"] = installed_version()
        verdicts = run(a, work, model, results)
    finally:
        save(results)
    print(f"vLLM {results.get('vllm')}, {a.shape} ({results['model_write_s']} s to write the model)")
    print(f"{'path':10s} {'served_by':10s} {'ready_s':>8s} canary  ipc")
    for r in results.get("rows", []):
        print(f"  {r['path']:8s} {str(r['served_by']):10s} {str(r['time_to_ready_s']):>8s} {str(r['canary_identical']):6s}"
              f"  {r['ipc']}" + (f"  ({r['recovery_reason'] or r['error']})" if r["exit"] not in (0,) else ""))
    if c := results.get("crash"):
        print(f"  crash under supervise: {json.dumps(c)}")
    return print_verdicts(verdicts)


if __name__ == "__main__":
    sys.exit(main())
