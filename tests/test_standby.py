"""The standby engine for real (reference engine on the CPU, its weights on a real weight cache):
armed, it never answers on the service's port; supervise promotes it on a SIGKILL and arms
another; a planned restart promotes it; one that is gone, or a reason it cannot serve, is not
promoted, with the reason; `stop` takes it down too."""
import json
import os
import signal
import time

import pytest

from tests.conftest import prom_sample, run_cli
from tests.helpers import gone, ipc_policy, start_preload

pytestmark = pytest.mark.slow

STANDBY = "\n[standby]\nenabled = true\n"


def policy_with_standby(make_policy, sockdir):
    policy = ipc_policy(make_policy, sockdir)
    policy.write_text(policy.read_text() + STANDBY)
    return policy


def port_of(policy) -> int:
    return int(policy.read_text().split("port = ")[1].split()[0])


def listeners(port: int) -> list[int]:
    from restartkit.process.procfs import listeners as on
    return on(port)


def standby(policy) -> dict | None:
    return json.loads(run_cli("status", "--policy", policy, "--json").stdout)["standby"]


def wait_for(what, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if got := what():
            return got
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s")


def test_supervise_promotes_its_standby_on_a_crash_and_arms_another(supervised, make_policy, sockdir, preloads):
    policy = policy_with_standby(make_policy, sockdir)
    start_preload(policy, preloads)
    s = supervised(policy)
    first = wait_for(lambda: (sb := standby(policy)) and sb["state"] == "prepared" and sb)
    engine = s.status()["pid"]
    assert listeners(port_of(policy)) == [engine]  # armed, the standby does not answer on the service's port
    assert first["pid"] != engine and first["rss_bytes"] > 0
    os.kill(engine, signal.SIGKILL)
    rec = s.wait_record(1)
    assert rec["reason"] == "crash" and rec["served_by"] == "standby" and not rec["via_recovery"], rec
    assert rec["proof"]["canary_identical"] is True and rec["attempts"][-1]["proof"]["ipc"] == "hit"
    assert s.status()["pid"] == first["pid"]  # the standby is the engine now
    second = wait_for(lambda: (sb := standby(policy)) and sb["state"] == "prepared" and sb["pid"] != first["pid"] and sb)
    assert listeners(port_of(policy)) == [first["pid"]]
    sup = wait_for(lambda: (st := s.status()["supervisor"]) and st["standby"]["rearm_s"] and st)
    assert sup["standby"]["armed"] in (first["pid"], second["pid"])
    prom = (policy.parent / "state" / "svc" / "metrics.prom").read_text()
    wait_for(lambda: prom_sample((policy.parent / "state" / "svc" / "metrics.prom").read_text(),
                                 "restartkit_standby_armed", service="svc") == 1)
    assert prom_sample(prom, "restartkit_restart_total", service="svc", strategy="standby", outcome="ok") == 1
    os.killpg(s.proc.pid, signal.SIGTERM)
    assert s.proc.wait(30) == 0
    assert gone(second["pid"])


@pytest.mark.parametrize("kv_ahead", ["never", "always"])
def test_a_planned_restart_promotes_the_standby_and_stop_takes_it_down(make_policy, sockdir, preloads, service_cleanup,
                                                                       kv_ahead):
    """kv_ahead: the standby waits prepared (its KV cache allocated at promotion), or activated (KV cache
    and graph ready, promotion is the port only)."""
    policy = policy_with_standby(make_policy, sockdir)
    policy.write_text(policy.read_text() + f'kv_ahead = "{kv_ahead}"\n')
    service_cleanup(policy)
    start_preload(policy, preloads)
    assert run_cli("start", "--policy", policy).returncode == 0
    r = run_cli("standby", "arm", "--policy", policy, "--json")
    assert r.returncode == 0, r.stderr
    armed = json.loads(r.stdout)
    assert armed["kv_ahead"] is (kv_ahead == "always") and armed["state"] == "prepared"
    assert listeners(port_of(policy)) == [json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]]
    r = run_cli("restart", "--policy", policy, "--strategy", "standby", "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["served_by"] == "standby" and rec["proof"]["canary_identical"] is True, rec
    assert rec["attempts"][-1]["proof"]["standby_pid"] == armed["pid"] == standby_gone_engine(policy)
    assert run_cli("standby", "arm", "--policy", policy).returncode == 0
    again = standby(policy)
    r = run_cli("stop", "--policy", policy, "--json")
    assert r.returncode == 0 and f"its standby (PID {again['pid']}) stopped" in json.loads(r.stdout)["how"], r.stdout
    assert standby(policy) is None and listeners(port_of(policy)) == []
    assert gone(again["pid"])


def standby_gone_engine(policy) -> int:
    """After a promotion: no standby left, and the engine's PID."""
    st = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert st["standby"] is None and st["serving"], st
    return st["pid"]


def test_a_dead_standby_or_a_reason_it_cannot_serve_is_never_promoted(make_policy, sockdir, preloads, service_cleanup):
    policy = policy_with_standby(make_policy, sockdir)
    service_cleanup(policy)
    start_preload(policy, preloads)
    assert run_cli("start", "--policy", policy).returncode == 0
    assert run_cli("standby", "arm", "--policy", policy).returncode == 0
    plan = json.loads(run_cli("plan", "--policy", policy, "--reason", "config", "--json").stdout)
    why = {v["strategy"]: " ".join(v["reasons"]) for v in plan["strategies"]}
    assert "reason 'config'" in why["standby"] and plan["attempt"] != "standby"
    pid = standby(policy)["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: standby(policy)["state"] == "dead")
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    why = {v["strategy"]: " ".join(v["reasons"]) for v in plan["strategies"]}
    assert f"the standby (PID {pid}) is gone" in why["standby"]
    r = run_cli("restart", "--policy", policy, "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["served_by"] != "standby" and rec["proof"]["canary_identical"] is True, rec
    r = run_cli("restart", "--policy", policy, "--strategy", "standby", "--json")  # asked for by name: its recovery
    rec = json.loads(r.stdout)
    assert rec["served_by"] == "cold" and rec["via_recovery"] and "is gone" in rec["recovery_reason"], rec


def test_the_weight_cache_killed_under_an_armed_standby_is_no_outage(make_policy, sockdir, preloads, service_cleanup):
    """The standby maps its weights from the cache: killed, the cache leaves the mapping in place (memfd on
    the CPU), so the promotion still serves, proven by the canary; whatever serves, the service serves."""
    policy = policy_with_standby(make_policy, sockdir)
    service_cleanup(policy)
    cache = start_preload(policy, preloads)
    assert run_cli("start", "--policy", policy).returncode == 0
    assert run_cli("restart", "--policy", policy, "--strategy", "ipc").returncode == 0  # onto the cache
    assert run_cli("standby", "arm", "--policy", policy).returncode == 0
    from restartkit.process.procfs import kill_tree
    kill_tree(cache.pid)  # the launcher and its daemons, SIGKILL
    cache.wait(10)
    wait_for(lambda: all(d.get("state") != "ready" for d in json.loads(
        run_cli("weightcache", "status", "--policy", policy, "--json").stdout)["daemons"]))
    r = run_cli("restart", "--policy", policy, "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["final_state"] == "serving" and rec["proof"]["canary_identical"] is True, rec
    assert rec["served_by"] == "standby", rec  # its weights were attached before the cache went
    assert json.loads(run_cli("status", "--policy", policy, "--json").stdout)["serving"]


def test_a_standby_ready_ahead_takes_the_port_beside_the_old_engine(make_policy, sockdir, preloads, service_cleanup):
    """[restart] overlap and a standby activated ahead: it takes the port beside the old engine (SO_REUSEPORT),
    then the old one stops; the port is never closed."""
    policy = policy_with_standby(make_policy, sockdir)
    policy.write_text(policy.read_text().replace("[restart]\n", "[restart]\noverlap = true\n")
                      + 'kv_ahead = "always"\n')
    service_cleanup(policy)
    start_preload(policy, preloads)
    assert run_cli("start", "--policy", policy).returncode == 0
    old = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    assert run_cli("standby", "arm", "--policy", policy).returncode == 0
    r = run_cli("restart", "--policy", policy, "--strategy", "standby", "--measure-downtime", "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["served_by"] == "standby" and rec["proof"]["canary_identical"] is True, rec
    att = rec["attempts"][-1]
    assert att["proof"]["overlap"] is True and "stop_old" in att["phases"] and rec["downtime"] is not None, att
    assert listeners(port_of(policy)) == [att["proof"]["standby_pid"]]
    assert gone(old)


def test_a_standby_armed_before_a_weights_change_is_never_promoted(make_policy, sockdir, preloads, service_cleanup,
                                                                    tmp_path):
    """New weights on disk: the standby holds the old ones.  plan refuses it for the reason and for itself, and
    supervise would replace it (stale)."""
    import shutil
    from restartkit.reference.checkpoint import write_checkpoint
    model = tmp_path / "own-model"
    write_checkpoint(model, "tiny", seed=1)
    import functools
    policy = policy_with_standby(functools.partial(make_policy, model=str(model)), sockdir)
    service_cleanup(policy)
    start_preload(policy, preloads)
    assert run_cli("start", "--policy", policy).returncode == 0
    assert run_cli("standby", "arm", "--policy", policy).returncode == 0
    shutil.rmtree(model)
    write_checkpoint(model, "tiny", seed=2)  # other weights, same shapes
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    why = {v["strategy"]: " ".join(v["reasons"]) for v in plan["strategies"]}
    assert plan["reason"] == "weights" and plan["attempt"] != "standby"
    assert "the weights on disk changed since it was armed" in why["standby"], why["standby"]


def test_restartkit_killed_during_a_promotion_is_reconciled_by_the_next_command(make_policy, sockdir, preloads,
                                                                                service_cleanup):
    """SIGKILL to `restartkit restart` while it promotes (the standby held stopped, so that the promotion waits):
    the next command finds the intent, stops the half-promoted standby (it never took the port) and, as the
    killed restart meant the service to serve, starts it cold."""
    import subprocess
    import sys
    from tests.conftest import ROOT
    policy = policy_with_standby(make_policy, sockdir)
    policy.write_text(policy.read_text() + 'kv_ahead = "never"\n')
    service_cleanup(policy)
    start_preload(policy, preloads)
    assert run_cli("start", "--policy", policy).returncode == 0
    assert run_cli("standby", "arm", "--policy", policy).returncode == 0
    sb = standby(policy)["pid"]
    os.kill(sb, signal.SIGSTOP)
    intent = policy.parent / "state" / "svc" / "intent.json"
    p = subprocess.Popen([sys.executable, "-m", "restartkit.cli", "restart", "--policy", str(policy), "--strategy",
                          "standby"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: intent.exists() and "standby" in intent.read_text())
        time.sleep(1.0)  # the old engine stopped; the promotion waits for the stopped standby
        p.kill()
        p.wait(10)
    finally:
        os.kill(sb, signal.SIGCONT)
    r = run_cli("status", "--policy", policy, "--json")
    st = json.loads(r.stdout)
    assert "interrupted `restartkit restart`" in r.stderr and st["serving"] and st["pid"] != sb, (r.stderr, st)
    assert st["standby"] is None and listeners(port_of(policy)) == [st["pid"]]
    wait_for(lambda: gone(sb), 15)


def test_many_re_arms_leave_nothing_behind(make_policy, sockdir, preloads, service_cleanup):
    """Five standbys armed and replaced: the weight cache lists only the engine and the last standby as
    attached (no attachment of a dead standby is kept), and no standby process is left."""
    policy = policy_with_standby(make_policy, sockdir)
    service_cleanup(policy)
    start_preload(policy, preloads)
    assert run_cli("start", "--policy", policy).returncode == 0
    assert run_cli("restart", "--policy", policy, "--strategy", "ipc").returncode == 0
    pids = []
    for _ in range(5):
        assert run_cli("standby", "arm", "--policy", policy).returncode == 0  # replaces the one before
        pids.append(standby(policy)["pid"])
    engine = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]

    def attached():
        daemons = json.loads(run_cli("weightcache", "status", "--policy", policy, "--json").stdout)["daemons"]
        return sorted(daemons[0]["attached"])
    wait_for(lambda: attached() == sorted([engine, pids[-1]]), 30)
    assert [p for p in pids[:-1] if not gone(p)] == []


def test_two_promotions_at_once_are_one_after_the_other(make_policy, sockdir, preloads, service_cleanup):
    import subprocess
    import sys
    from tests.conftest import ROOT
    policy = policy_with_standby(make_policy, sockdir)
    service_cleanup(policy)
    start_preload(policy, preloads)
    assert run_cli("start", "--policy", policy).returncode == 0
    assert run_cli("standby", "arm", "--policy", policy).returncode == 0
    cmd = [sys.executable, "-m", "restartkit.cli", "restart", "--policy", str(policy), "--strategy", "standby",
           "--wait", "60", "--json"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    recs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert sorted(r["served_by"] for r in recs) == ["cold", "standby"], recs  # the second found no standby
    assert all(r["final_state"] == "serving" and r["proof"]["canary_identical"] is True for r in recs), recs
    st = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert st["serving"] and listeners(port_of(policy)) == [st["pid"]]
