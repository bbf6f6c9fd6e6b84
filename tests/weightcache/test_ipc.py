"""The ipc strategy for real on the CPU: daemons sharing memfd arenas over
SCM_RIGHTS, the reference engine attaching at TP1 and TP2, fingerprints,
fallbacks, cleanup and permissions."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from pathlib import Path

from restartkit.reference.model.checkpoint import write_checkpoint
from tests.helpers import ROOT, admin_stats, ipc_policy, prom_sample, run_cli, start_preload

pytestmark = pytest.mark.slow


def restart(policy, *args):
    r = run_cli("restart", "--policy", policy, *args, "--json")
    return r.returncode, json.loads(r.stdout)


@pytest.mark.parametrize("tp", [1, 2])
def test_ipc_restart_is_a_hit_with_identical_canary(make_policy, sockdir, preloads, service_cleanup, tp):
    policy = ipc_policy(make_policy, sockdir, service_extra=f"tensor_parallel_size = {tp}\n")
    start_preload(policy, preloads)
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    assert plan["attempt"] == "ipc", plan
    code, rec = restart(policy, "--strategy", "auto", "--strict")
    assert code == 0, rec
    assert rec["served_by"] == "ipc" and not rec["via_recovery"]
    proof = rec["attempts"][0]["proof"]
    assert proof["ipc"] == "hit" and proof["ranks"] == ["hit"] * tp and proof["weight_source"] == "ipc"
    assert rec["proof"]["canary_identical"] is True
    prom = (policy.parent / "state" / "svc" / "metrics.prom").read_text()
    assert prom_sample(prom, "restartkit_ipc_attach_total", service="svc", result="hit") == 1
    if tp > 1:  # an overlapped restart is built for TP1 only: asked for at TP2, it is refused, saying why
        r = run_cli("restart", "--policy", policy, "--strategy", "ipc", "--overlap", "--strict", "--json", timeout=120)
        assert r.returncode == 2 and "tensor_parallel_size 1" in r.stderr and r.stdout == "", r.stdout + r.stderr
        r = run_cli("restart", "--policy", policy, "--strategy", "ipc", "--strict", "--json", timeout=120)
        again = json.loads(r.stdout)  # --json: said in the record, stderr stays for errors
        assert r.returncode == 0 and again["attempts"][0]["proof"]["ranks"] == ["hit", "hit"], again
    status = json.loads(run_cli("weightcache", "status", "--policy", policy, "--json").stdout)
    engine_pid = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    assert engine_pid in status["daemons"][0]["attached"]
    # a zero_copy engine holds the weights: release is refused, then allowed with --force
    r = run_cli("weightcache", "release", "--policy", policy)
    assert r.returncode == 1 and "stop them first" in r.stdout


def test_fingerprint_mismatch_falls_back_per_field(make_policy, sockdir, preloads, service_cleanup, tmp_path, tiny_model):
    # the daemon holds the tiny model as float32, unquantized, no revision
    daemon_policy = ipc_policy(make_policy, sockdir, name="daemon")
    start_preload(daemon_policy, preloads)
    finetune = write_checkpoint(tmp_path / "finetune", "tiny", seed=1)  # same layout, other weights
    cases = {
        "checkpoint": dict(model=str(finetune)),
        "dtype": dict(service_extra='dtype = "bfloat16"\n'),
        "quantization": dict(service_extra='quantization = "int8"\n'),
        "revision": dict(service_extra='revision = "' + "ab" * 20 + '"\n'),
    }
    for field, kw in cases.items():
        policy = make_policy(name=f"fb-{field}", model=kw.get("model"), service_extra=kw.get("service_extra", ""),
                             extra=f'\n[ipc]\nsocket_dir = "{sockdir}"\nfallback = true\n')
        service_cleanup(policy)
        assert run_cli("start", "--policy", policy).returncode == 0
        plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
        ipc = next(s for s in plan["strategies"] if s["strategy"] == "ipc")
        assert not ipc["eligible"] and any(f"{field} differs" in r for r in ipc["reasons"]), (field, ipc)
        assert ipc["forceable"] and plan["attempt"] != "ipc"  # auto never picks it
        # asked for by name: the engine is started with ipc_cache, falls back to disk itself, and says why
        code, rec = restart(policy, "--strategy", "ipc", "--strict")
        assert code == 3 and rec["final_state"] == "serving" and rec["served_by"] == "ipc", (field, rec)
        assert rec["via_recovery"] and f"fallback({field}" in rec["recovery_reason"], (field, rec["recovery_reason"])
        proof = rec["attempts"][0]["proof"]
        assert proof["ipc"] == "fallback" and proof["weight_source"] == "disk"
        assert rec["proof"]["canary_identical"] is True
        run_cli("stop", "--policy", policy)


def test_fallback_off_fails_the_start_naming_the_field(make_policy, sockdir, preloads, service_cleanup):
    daemon_policy = ipc_policy(make_policy, sockdir, name="daemon")
    start_preload(daemon_policy, preloads)
    policy = make_policy(name="strict", service_extra='quantization = "int8"\n',
                         extra=f'\n[ipc]\nsocket_dir = "{sockdir}"\nfallback = false\nstate_timeout_s = 2.0\n')
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    r = run_cli("restart", "--policy", policy, "--strategy", "ipc", "--strict")
    # ipc is not eligible (quantization differs): refused by name, nothing touched
    assert r.returncode == 2 and "quantization differs" in r.stderr, r.stdout + r.stderr
    # and an engine started with fallback off against that daemon fails, naming the field
    from restartkit.errors import EngineStartError
    from restartkit.policy import load_policy
    from restartkit.service import Service
    svc = Service(load_policy(policy))
    svc.engine.stop()
    with pytest.raises(EngineStartError) as e:
        svc.engine.start("ipc", extra_args=svc.adapter.ipc_args(svc.policy))
    assert "quantization differs" in e.value.log_tail and "fallback is off" in e.value.log_tail


def test_ipc_named_with_no_daemon_is_refused(make_policy, sockdir, service_cleanup):
    policy = ipc_policy(make_policy, sockdir)
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    ipc = next(s for s in plan["strategies"] if s["strategy"] == "ipc")
    assert any("restartkit preload" in r for r in ipc["reasons"])
    before = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    r = run_cli("restart", "--policy", policy, "--strategy", "ipc", "--strict")  # asked for by name: refused
    assert r.returncode == 2 and "ipc cannot run now" in r.stderr and "restartkit preload" in r.stderr, r.stderr
    assert json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"] == before



def test_a_stopped_weight_cache_is_named_at_once(make_policy, sockdir, preloads, service_cleanup):
    """A daemon stopped by SIGSTOP still accepts (in the kernel) and answers nothing: plan names it from its
    process state instead of waiting out its timeout, and ipc is not eligible; continued, it serves again."""
    from restartkit.process.procfs import tree_pids
    policy = ipc_policy(make_policy, sockdir)
    service_cleanup(policy)
    daemons = tree_pids(start_preload(policy, preloads).pid)
    assert run_cli("start", "--policy", policy).returncode == 0
    for pid in daemons:
        os.kill(pid, signal.SIGSTOP)
    try:
        ipc = next(s for s in json.loads(run_cli("plan", "--policy", policy, "--json").stdout)["strategies"]
                   if s["strategy"] == "ipc")
        assert not ipc["eligible"] and any("is stopped (SIGSTOP)" in r and "kill -CONT" in r for r in ipc["reasons"]), ipc
    finally:
        for pid in daemons:
            os.kill(pid, signal.SIGCONT)
    ipc = next(s for s in json.loads(run_cli("plan", "--policy", policy, "--json").stdout)["strategies"]
               if s["strategy"] == "ipc")
    assert ipc["eligible"], ipc

def test_sigterm_leaves_nothing_behind(make_policy, sockdir, preloads):
    policy = ipc_policy(make_policy, sockdir, service_extra="tensor_parallel_size = 2\n")
    launcher = start_preload(policy, preloads)
    daemons = [p for p in _children(launcher.pid)]
    assert len(daemons) == 2 and len(list(sockdir.iterdir())) == 4  # 2 sockets + 2 locks
    memfds = [_memfds(pid) for pid in daemons]
    assert all(memfds)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(20) == 0
    assert list(sockdir.iterdir()) == []
    for pid in daemons:
        assert not os.path.exists(f"/proc/{pid}")  # the processes that held the arenas are gone


def test_second_daemon_for_a_device_fails_at_once(make_policy, sockdir, preloads):
    policy = ipc_policy(make_policy, sockdir)
    start_preload(policy, preloads)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "restartkit.cli", "preload", "--policy", str(policy)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 3 and "already serves this device" in r.stdout
    assert time.monotonic() - t0 < 20


def test_a_rank_that_fails_to_start_stops_the_launcher(make_policy, sockdir):
    # 4 attention heads do not split over 3 ranks: every rank fails while loading
    policy = ipc_policy(make_policy, sockdir, service_extra="tensor_parallel_size = 3\n")
    r = subprocess.run([sys.executable, "-m", "restartkit.cli", "preload", "--policy", str(policy)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 1 and "not divisible" in r.stdout and "stopping the others" in r.stdout
    assert list(sockdir.iterdir()) == []


def test_multi_node_port_clash_is_a_usage_error(make_policy, sockdir):
    policy = ipc_policy(make_policy, sockdir, ipc_extra="nnodes = 2\nweight_cache_master_port = 29500\nengine_master_port = 29500\n",
                        service_extra="tensor_parallel_size = 2\n")
    r = run_cli("preload", "--policy", policy)
    assert r.returncode == 2 and "needs a port of its own" in r.stderr


def _children(pid):
    import psutil
    return [c.pid for c in psutil.Process(pid).children() if "restartkit.weightcache.daemon" in " ".join(c.cmdline())]


def _memfds(pid):
    fd_dir = f"/proc/{pid}/fd"
    return [os.readlink(os.path.join(fd_dir, f)) for f in os.listdir(fd_dir)
            if "memfd:restartkit-arena" in os.readlink(os.path.join(fd_dir, f))]


def test_expert_parallel_moe_restart_is_a_hit(make_policy, sockdir, preloads, service_cleanup, tmp_path):
    moe = write_checkpoint(tmp_path / "moe", "tiny-moe")
    policy = make_policy(model=str(moe), service_extra="tensor_parallel_size = 2\nexpert_parallel = true\n",
                         extra=f'\n[ipc]\nsocket_dir = "{sockdir}"\n')
    start_preload(policy, preloads)
    wc = json.loads(run_cli("weightcache", "status", "--policy", policy, "--json").stdout)["daemons"]
    # each rank holds 2 of the 4 experts, whole: fewer tensors than the full model
    assert all(d["fingerprint"]["expert_parallel"] for d in wc)
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    code, rec = restart(policy, "--strategy", "ipc", "--strict")
    assert code == 0 and rec["attempts"][0]["proof"]["ranks"] == ["hit", "hit"]
    assert rec["proof"]["canary_identical"] is True


def test_copy_mode_detaches_after_copying(make_policy, sockdir, preloads, service_cleanup):
    policy = ipc_policy(make_policy, sockdir, ipc_extra='mode = "copy"\n')
    start_preload(policy, preloads)
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    code, rec = restart(policy, "--strategy", "ipc", "--strict")
    assert code == 0 and rec["attempts"][0]["proof"]["mode"] == "copy"
    wc = json.loads(run_cli("weightcache", "status", "--policy", policy, "--json").stdout)["daemons"]
    assert wc[0]["attached"] == []  # a copy holds nothing of the daemon's: release is allowed
    assert run_cli("weightcache", "release", "--policy", policy).returncode == 0


def test_health_reports_ready_then_degraded(make_policy, sockdir, preloads, tmp_path):
    import urllib.error
    import urllib.request
    from tests.helpers import free_port
    port = free_port()
    policy = ipc_policy(make_policy, sockdir, service_extra="tensor_parallel_size = 2\n", ipc_extra=f"health_port = {port}\n")
    launcher = start_preload(policy, preloads)
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read())
    assert health["state"] == "ready" and [r["state"] for r in health["ranks"]] == ["ready", "ready"]
    os.kill(_children(launcher.pid)[1], signal.SIGKILL)
    time.sleep(1.0)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
    assert e.value.code == 503 and json.loads(e.value.read())["state"] == "degraded"


def test_a_draft_model_restarts_through_its_own_group(make_policy, sockdir, preloads, service_cleanup, tmp_path):
    from restartkit.reference.model.checkpoint import write_checkpoint
    draft = write_checkpoint(tmp_path / "draft", "tiny", seed=7)  # other weights, same tokenizer
    policy = ipc_policy(make_policy, sockdir, service_extra=f'draft_model = "{draft}"\nnum_speculative_tokens = 2\n')
    policy.write_text(policy.read_text().replace("[restart]\n", '[restart]\noverlap = true\noverlap_mode = "prestart"\n'))
    start_preload(policy, preloads)
    names = sorted(p.name for p in sockdir.iterdir() if p.suffix == ".sock")
    assert len(names) == 2 and names[1].endswith("_draft.sock")
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    code, rec = restart(policy, "--strategy", "auto", "--no-overlap", "--strict")
    assert code == 0 and rec["served_by"] == "ipc", rec
    proof = rec["attempts"][0]["proof"]
    assert proof["ipc"] == "hit" and proof["draft"] == "hit" and rec["proof"]["canary_identical"] is True
    stats = admin_stats(policy)
    assert stats["speculative"]["tokens"] == 2 and stats["speculative"]["rounds"] > 0  # the canary ran through it
    assert stats["load"]["draft"]["ipc"] == "hit"
    daemons = json.loads(run_cli("weightcache", "status", "--policy", policy, "--json").stdout)["daemons"]
    assert [d["draft"] for d in daemons] == [False, True] and all(stats["pid"] in d["attached"] for d in daemons)
    # prepared beside the old engine, the draft too
    code, rec = restart(policy, "--strategy", "ipc", "--overlap", "--strict")
    assert code == 0 and rec["attempts"][0]["proof"]["draft"] == "hit" and rec["proof"]["canary_identical"] is True
    # the draft group's daemon gone: plan names it and does not offer ipc
    os.kill(daemons[1]["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 10
    while Path(names[1]).name in {p.name for p in sockdir.iterdir()} and time.monotonic() < deadline:
        time.sleep(0.1)
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    ipc = next(s for s in plan["strategies"] if s["strategy"] == "ipc")
    assert plan["attempt"] != "ipc" and any("(draft model)" in r for r in ipc["reasons"]), ipc


def test_a_draft_model_at_tp2_changes_no_output_and_attaches_on_every_rank(make_policy, sockdir, preloads,
                                                                           service_cleanup, tmp_path):
    draft = write_checkpoint(tmp_path / "draft", "tiny", seed=7)
    policy = ipc_policy(make_policy, sockdir, service_extra="tensor_parallel_size = 2\n")
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0  # no draft yet
    policy.write_text(policy.read_text().replace("tensor_parallel_size = 2\n",
                                                 f'tensor_parallel_size = 2\ndraft_model = "{draft}"\n'))
    # a restart that adds the draft: the canary (the model's greedy output) must not change
    code, rec = restart(policy, "--strategy", "cold", "--strict")
    assert code == 0 and rec["proof"]["canary_identical"] is True, rec
    start_preload(policy, preloads)
    code, rec = restart(policy, "--strategy", "ipc", "--strict")
    assert code == 0 and rec["served_by"] == "ipc", rec
    proof = rec["attempts"][0]["proof"]
    assert proof["ranks"] == ["hit", "hit"] and proof["draft"] == "hit" and rec["proof"]["canary_identical"] is True
    stats = admin_stats(policy)
    assert stats["speculative"]["rounds"] > 0 and stats["load"]["draft"]["ranks"] == ["hit", "hit"]


def test_two_launchers_as_two_nodes_rendezvous_and_serve_one_engine(make_policy, sockdir, preloads, service_cleanup):
    """Multi-node, on one host: two launchers given --nnodes 2 and their --node-rank each serve their half
    of the TP2 ranks, meet through the TCPStore on --weight-cache-master-port, and a TP2 engine attaches
    rank 0 from one and rank 1 from the other."""
    import urllib.request

    from tests.helpers import free_port
    policy = ipc_policy(make_policy, sockdir, service_extra="tensor_parallel_size = 2\n")
    store, health = free_port(), [free_port(), free_port()]
    procs = []
    for node in (0, 1):
        flags = ["--nnodes", "2", "--node-rank", str(node), "--weight-cache-master-port", str(store),
                 "--health-port", str(health[node])]
        procs.append(subprocess.Popen([sys.executable, "-m", "restartkit.cli", "preload", "--policy", str(policy), *flags],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT))
        preloads.append(procs[-1])
    views = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            views = [json.loads(urllib.request.urlopen(f"http://127.0.0.1:{h}/", timeout=2).read()) for h in health]
            if all(v["state"] == "ready" and v["cluster_ready"] for v in views):
                break
        except OSError:
            pass
        time.sleep(0.2)
    assert views and all(v["state"] == "ready" and v["cluster_ready"] for v in views), views
    assert [[r["rank"] for r in v["ranks"]] for v in views] == [[0], [1]]  # each node its own half
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    code, rec = restart(policy, "--strategy", "ipc", "--strict")
    assert code == 0, rec
    assert rec["served_by"] == "ipc" and rec["attempts"][0]["proof"]["ranks"] == ["hit", "hit"]
    assert rec["proof"]["canary_identical"] is True
    # node 1's launcher stops: node 0 still serves its rank, and its cluster view names the node that went
    procs[1].send_signal(signal.SIGTERM)
    procs[1].wait(15)
    v0 = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{health[0]}/", timeout=2).read())
    assert v0["state"] == "ready" and v0["cluster_ready"] is False and v0["nodes"] == {"0": "ready", "1": "gone"}, v0
