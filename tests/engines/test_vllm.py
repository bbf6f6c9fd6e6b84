"""The vLLM adapter against a real vLLM (the CPU build, installed by
scripts/setup): cold and criu restarts with an identical canary, the reasons
plan gives on a CPU vLLM, and io_uring.  The ipc and sleep paths need a GPU
vLLM: they are tested against vLLM's own log lines and HTTP answers."""
import json
import os
import time

import pytest

from restartkit.engines.vllm import VLLMAdapter, parse_ipc_log
from restartkit.facts import criu_facts
from tests.helpers import HAVE_VLLM, io_uring, needs_vllm, run_cli, shm_left, vllm_policy_for

@pytest.fixture
def vllm_policy(make_policy, vllm_model, service_cleanup):
    return vllm_policy_for(make_policy, vllm_model, service_cleanup)


def restart(policy, *flags):
    r = run_cli("restart", "--policy", policy, "--json", *flags, timeout=900)
    return r.returncode, json.loads(r.stdout)


def strategy(plan, name):
    return next(s for s in plan["strategies"] if s["strategy"] == name)


@pytest.mark.slow
@pytest.mark.root
@needs_vllm
@pytest.mark.skipif(os.getuid() != 0 or not criu_facts().check_ok, reason="needs root and a working CRIU")
def test_vllm_cold_and_criu_restarts(vllm_policy):
    shm_before = set(os.listdir("/dev/shm"))
    # io_uring on: vLLM opens one, so criu is not eligible, and a forced criu restart recovers cold
    with io_uring(0):
        assert run_cli("start", "--policy", vllm_policy, timeout=600).returncode == 0
        plan = json.loads(run_cli("plan", "--policy", vllm_policy, "--json").stdout)
        # restartkit's weight cache serves a CPU vLLM (its plugin's load format): not preloaded here
        assert "restartkit preload" in strategy(plan, "ipc")["reasons"][0], strategy(plan, "ipc")
        assert "on the CPU has no sleep mode" in strategy(plan, "sleep")["reasons"][0]
        assert any("io_uring" in r for r in strategy(plan, "criu")["reasons"]), plan
        r = run_cli("restart", "--policy", vllm_policy, "--strategy", "criu", "--strict", timeout=600)
        assert r.returncode == 2 and "io_uring" in r.stderr, r.stdout + r.stderr  # refused: nothing touched
    # io_uring off before the server starts: a cold restart, a snapshot, a criu restart
    with io_uring(2):
        code, cold = restart(vllm_policy, "--strategy", "cold")
        assert code == 0 and cold["proof"]["canary_identical"] is True
        r = run_cli("snapshot", "create", "--policy", vllm_policy, "--json", timeout=600)
        assert r.returncode == 0, r.stderr
        snap = json.loads(r.stdout)
        assert len(snap["tree_pids"]) >= 2  # API server and engine core (and helpers)
        # a copy restored beside the serving server (its own namespaces) answers the same canary
        r = run_cli("snapshot", "test", "--policy", vllm_policy, "--json", timeout=600)
        assert r.returncode == 0 and json.loads(r.stdout)["canary_identical"], r.stdout + r.stderr
        code, rec = restart(vllm_policy, "--strategy", "criu", "--strict")
        assert code == 0, rec
        assert rec["served_by"] == "criu" and rec["proof"]["canary_identical"] is True
        assert rec["time_to_ready_s"] < cold["time_to_ready_s"] / 2, (rec["time_to_ready_s"], cold["time_to_ready_s"])
    # four engines replaced each other (a recovery, a cold restart, a dump, a restore), then a clean stop: each
    # one's message queues in /dev/shm went with it (vLLM leaves about 420 MB each)
    assert run_cli("stop", "--policy", vllm_policy).returncode == 0
    left = shm_left(shm_before)
    # what stays: vLLM's named multiprocessing semaphores (32 bytes each), which its processes close without
    # unlinking while it starts, so no engine holds them when restartkit records its files (README)
    assert all(os.path.basename(f).startswith("sem.mp-") and os.path.getsize(f) <= 64 for f in left), left


@pytest.mark.slow
@needs_vllm
def test_sleep_cycle_speaks_vllms_http_interface(make_policy, vllm_model, service_cleanup):
    """The whole cycle against a real vLLM server: sleep with an explicit level, /is_sleeping, wake
    by tags, reload after level 2.  The CPU build serves these endpoints (VLLM_SERVER_DEV_MODE=1)
    but its workers ignore sleep, so memory is never released: the check must catch that."""
    from restartkit.service import Service
    from restartkit.engines.sleepcycle import Cycle, SleepCycleError
    policy = vllm_policy_for(make_policy, vllm_model, service_cleanup, env=', VLLM_SERVER_DEV_MODE = "1"')
    assert run_cli("start", "--policy", policy, timeout=600).returncode == 0
    svc = Service.from_policy_file(policy)
    pid = svc.current().pid
    before = svc.canary()
    state = svc.adapter.sleep_state(svc.policy, pid)
    assert not state["enabled"] and "--enable-sleep-mode" in state["why"]
    # level 1: vLLM says sleeping, but nothing was freed -> a failed sleep, named as such
    cycle = Cycle(svc, pid, 1)
    with pytest.raises(SleepCycleError) as e:
        cycle.sleep()
    assert "memory was not released" in e.value.message
    assert cycle.proof["sleep_answer"] == {"status": "sleeping", "level": 1}
    assert svc.adapter.sleep_is_confirmed(svc.policy) is True
    cycle.wake(footprint=0)
    first, second = cycle.proof["wake_answers"]
    assert first == {"status": "sleeping", "tags": ["weights"]}  # partial: the KV cache still sleeps
    assert second == {"status": "awake", "tags": ["kv_cache"]}
    assert svc.canary() == before
    # level 2 (memory check off: the CPU frees nothing): weights, reload through /collective_rpc, KV cache
    cycle = Cycle(svc, pid, 2)
    assert cycle.sleep(verify_memory=False) == {"status": "sleeping", "level": 2}
    cycle.wake(footprint=0)
    assert "reload" in cycle.phases and svc.canary() == before
    assert svc.adapter.sleep_is_confirmed(svc.policy) is False
    # SIGKILLed, its whole tree: the next command that stops the service removes what it left in /dev/shm
    recorded = json.loads((svc.state_dir / "engine.json").read_text())["shm"]
    assert recorded and all(os.path.exists(f["path"]) for f in recorded), recorded
    from restartkit.process.procfs import kill_tree
    kill_tree(pid)
    time.sleep(1.0)
    assert all(os.path.exists(f["path"]) for f in recorded)  # vLLM does not remove them itself
    assert run_cli("stop", "--policy", policy).returncode == 0
    assert not any(os.path.exists(f["path"]) for f in recorded), recorded


# ---- ipc and sleep, against vLLM's own words ---------------------------------------

# Lines as vLLM 0.33 prints them (vllm/model_executor/model_loader/weight_cache/ipc_loader.py),
# with the process prefixes its multiprocess executor adds.
HIT_TP2 = """\
(Worker_TP0 pid=4101) INFO 11-30 09:12:01 [ipc_loader.py:322] Mapped 291 tensors from the weight cache daemon (zero_copy mode)
(Worker_TP1 pid=4102) INFO 11-30 09:12:01 [ipc_loader.py:322] Mapped 291 tensors from the weight cache daemon (zero_copy mode)
"""
FALLBACK_TP2 = """\
(Worker_TP0 pid=4101) WARNING 11-30 09:12:01 [ipc_loader.py:253] Weight cache unusable (Weight cache fingerprint mismatch: dtype); falling back to disk loading
(Worker_TP1 pid=4102) WARNING 11-30 09:12:01 [ipc_loader.py:253] Weight cache unusable (Weight cache fingerprint mismatch: dtype); falling back to disk loading
"""
MIXED_TP2 = """\
(Worker_TP0 pid=4101) INFO 11-30 09:12:01 [ipc_loader.py:322] Mapped 291 tensors from the weight cache daemon (copy mode)
(Worker_TP1 pid=4102) WARNING 11-30 09:12:02 [ipc_loader.py:253] Weight cache unusable (no daemon socket for GPU-1); falling back to disk loading
"""


def test_vllm_log_says_hit_fallback_or_mixed():
    hit = parse_ipc_log(HIT_TP2, world_size=2)
    assert hit["ipc"] == "hit" and set(hit["ranks"]) == {"Worker_TP0", "Worker_TP1"}
    fb = parse_ipc_log(FALLBACK_TP2, world_size=2)
    assert fb["ipc"] == "fallback" and fb["summary"] == "fallback(Weight cache fingerprint mismatch: dtype)"
    mixed = parse_ipc_log(MIXED_TP2, world_size=2)
    assert mixed["ipc"] == "mixed" and "no daemon socket" in mixed["summary"]
    # one rank's hit is not a hit of the whole engine
    assert parse_ipc_log(HIT_TP2.splitlines()[0], world_size=2)["ipc"] == "mixed"
    assert parse_ipc_log("INFO starting", world_size=1)["ipc"] == "unknown"
    # data parallel: the same TP rank in two engines is two ranks (vLLM names them Worker_DP<d>_TP<t>)
    dp = "\n".join(f"(Worker_DP{d}_TP{t} pid={4100 + 2 * d + t}) INFO 11-30 09:12:01 [ipc_loader.py:322] Mapped 291 "
                   "tensors from the weight cache daemon (zero_copy mode)" for d in (0, 1) for t in (0, 1))
    assert parse_ipc_log(dp, world_size=4)["ipc"] == "hit"
    lost = dp.replace("(Worker_DP1_TP0 pid=4102) INFO 11-30 09:12:01 [ipc_loader.py:322] Mapped 291 tensors from the weight "
                      "cache daemon (zero_copy mode)", "(Worker_DP1_TP0 pid=4102) WARNING 11-30 09:12:01 [ipc_loader.py:253] "
                      "Weight cache unusable (no daemon socket for GPU-2); falling back to disk loading")
    assert parse_ipc_log(lost, world_size=4)["summary"] == "mixed(no daemon socket for GPU-2)"


def test_vllm_launch_and_features():
    from restartkit.engines.vllm_ext import ENV, EXTENSION, LOAD_FORMAT
    from restartkit.policy import parse_policy
    # vLLM's own weight cache (`vllm preload`, [ipc] health_port): its ipc_cache load format
    gpu = parse_policy({"service": {"name": "v", "engine": "vllm", "model": "org/m", "device": "cuda",
                                    "tensor_parallel_size": 4}, "sleep": {"enabled": True},
                        "ipc": {"fallback": False, "health_port": 18090}})
    a = VLLMAdapter()
    spec = a.launch(gpu, a.ipc_args(gpu))
    assert spec.argv[1:3] == ["-m", "restartkit.engines.vllm_serve"]  # restartkit's launcher, vLLM's flags
    assert spec.argv[spec.argv.index("--worker-extension-cls") + 1] == EXTENSION and spec.env[ENV] == "1"
    assert "--enable-sleep-mode" in spec.argv and spec.env["VLLM_SERVER_DEV_MODE"] == "1"
    i = spec.argv.index("--model-loader-extra-config")
    assert spec.argv[i - 1] == "ipc_cache" and json.loads(spec.argv[i + 1])["fallback"] is False
    assert a.weight_cache_of(gpu) == "engine" and "health_port = 0" in a.standby_problem(gpu)
    # a weights-less snapshot of a GPU vLLM: CUDA graphs off, or the snapshot is refused before the engine is touched
    assert "--enforce-eager" in a.weightless_problem(gpu)
    eager = parse_policy({"service": {"name": "v", "engine": "vllm", "model": "org/m", "device": "cuda",
                                      "engine_args": ["--enforce-eager"]}})
    assert a.weightless_problem(eager) is None
    # restartkit's weight cache (the default): its plugin's load format, the cache's keys and the identity
    cpu = parse_policy({"service": {"name": "v", "engine": "vllm", "model": "/m"}, "ipc": {"fallback": False}})
    args = a.ipc_args(cpu)
    assert args[:2] == ["--load-format", LOAD_FORMAT] and a.weight_cache_of(cpu) == "restartkit"
    cfg = json.loads(args[3])
    assert cfg["cache"]["fallback"] is False and cfg["identity"] == {"quantization": "none", "revision": ""}
    if HAVE_VLLM:
        problems = a.feature_problems(cpu)
        assert problems["ipc"] is None and "CPU" in problems["sleep"]
        assert "CPU" in a.feature_problems(parse_policy({"service": {"name": "v", "engine": "vllm", "model": "/m"},
                                                          "ipc": {"health_port": 18090}}))["ipc"]


def test_vllm_sleep_needs_dev_mode_on_loopback_and_says_what_it_costs():
    from restartkit.engines.vllm import gpu_sleep_problem
    from restartkit.policy import parse_policy

    def pol(host, enabled=True):
        return parse_policy({"service": {"name": "v", "engine": "vllm", "model": "org/m", "device": "cuda", "host": host},
                             "sleep": {"enabled": enabled, "level": 2}})
    assert gpu_sleep_problem(pol("127.0.0.1")) is None
    assert "/collective_rpc" in gpu_sleep_problem(pol("0.0.0.0")) and "127.0.0.1" in gpu_sleep_problem(pol("0.0.0.0"))
    assert "enabled = true" in gpu_sleep_problem(pol("127.0.0.1", enabled=False))
    assert any("/collective_rpc" in n for n in VLLMAdapter().plan_notes(pol("127.0.0.1")))
    a = VLLMAdapter()
    assert a.sleep_needs_reload and a.can_confirm_sleep


def test_vllm_level_1_needs_host_memory_for_the_checkpoint(tmp_path):
    """vLLM does not report its weights' size: level 1 is judged by the checkpoint's."""
    from restartkit.facts import CriuFacts, HostFacts
    from restartkit.policy import parse_policy
    from restartkit.contracts import Facts, ServiceFacts
    from restartkit.service import Service
    from restartkit.strategies.sleep import SleepStrategy, host_memory_for_level_1
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 4096)
    p = parse_policy({"service": {"name": "v", "engine": "vllm", "model": str(tmp_path), "device": "cuda"},
                      "sleep": {"enabled": True, "level": 1}})
    host = HostFacts(arch="x86_64", kernel="6.1", uid=0, user="root", passwordless_sudo=True, machine_id="m",
                     python="3.11", cpu_count=2, mem_total_bytes=1 << 30, mem_available_bytes=1000,
                     io_uring_disabled=2, criu=CriuFacts(path=None, source="", version=None, check_ok=False))
    f = Facts(host=host, service=ServiceFacts(engine="vllm"))
    f.strategy["sleep"] = SleepStrategy().gather(Service(p), f)  # the checkpoint's size, asked once
    assert "parks 0.0 GB" in host_memory_for_level_1(f, p) and "level = 2" in host_memory_for_level_1(f, p)
    f.host.mem_available_bytes = 1 << 20
    assert host_memory_for_level_1(f, p) is None




@needs_vllm
@pytest.mark.slow
def test_vllm_serve_from_the_projects_venv_answers_a_chat_on_a_fresh_preset(vllm_model):
    """`vllm serve` as a user runs it from the project's venv (its engine core is spawned, importing the command
    again), on a preset restartkit wrote: it starts, and answers a completion and a chat (the preset's template)."""
    import subprocess
    import sys
    import urllib.request
    from tests.helpers import free_port
    port = free_port()
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    proc = subprocess.Popen([vllm, "serve", str(vllm_model), "--port", str(port), "--dtype", "float32",
                             "--max-model-len", "256", "--served-model-name", "small"],
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                time.sleep(1)
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 4})):
            req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps({"model": "small", **body})
                                         .encode(), {"Content-Type": "application/json"})
            out = json.loads(urllib.request.urlopen(req, timeout=120).read())
            assert out["usage"]["completion_tokens"] >= 1, out
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(30)


@needs_vllm
def test_the_vllm_command_runs_from_the_projects_venv():
    """scripts/setup's `vllm` (the distribution is vllm-cpu, whose stock command looked up "vllm" and died):
    its version and `vllm bench serve`, which docs/BENCHMARKS.md runs against both engines."""
    import subprocess
    import sys
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    r = subprocess.run([vllm, "--version"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().startswith("0."), r.stdout + r.stderr
    r = subprocess.run([vllm, "bench", "serve", "--help=num-prompts"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "num-prompts" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
