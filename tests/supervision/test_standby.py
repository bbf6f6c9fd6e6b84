"""The standby engine for real (reference engine on the CPU, its weights on a real weight cache):
armed, it never answers on the service's port; supervise promotes it on a SIGKILL and arms
another; a planned restart promotes it; one that is gone, or a reason it cannot serve, is not
promoted, with the reason; `stop` takes it down too."""
import json
import os
import signal
import threading
import time

import pytest

import tests.helpers as helpers

from restartkit.facts import criu_facts
from tests.helpers import admin_stats, engines_on, gone, ipc_policy, prom_sample, run_cli, start_preload
from restartkit.process.procfs import exited

pytestmark = pytest.mark.slow

STANDBY = "\n[standby]\nenabled = true\n"


def policy_with_standby(make_policy, sockdir, service_extra="", kv_ahead=None):
    policy = ipc_policy(make_policy, sockdir, service_extra=service_extra)
    policy.write_text(policy.read_text() + STANDBY + (f'kv_ahead = "{kv_ahead}"\n' if kv_ahead else ""))
    return policy


def started_and_armed(policy, preloads, service_cleanup) -> dict:
    """The service started on its weight cache and a standby armed: `standby arm --json`'s record."""
    service_cleanup(policy)
    start_preload(policy, preloads)
    assert run_cli("start", "--policy", policy).returncode == 0
    r = run_cli("standby", "arm", "--policy", policy, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def port_of(policy) -> int:
    return int(policy.read_text().split("port = ")[1].split()[0])


def listeners(port: int) -> list[int]:
    from restartkit.process.procfs import listeners as on
    return on(port)


def answering(policy, n: int = 6) -> set[int]:
    """The PIDs that answer on the service's port, each asked on a new connection (under supervise the
    supervisor, the engine and the armed standby all hold the service's one socket: only the engine accepts)."""
    return {admin_stats(policy)["pid"] for _ in range(n)}


def standby(policy) -> dict | None:
    return json.loads(run_cli("status", "--policy", policy, "--json").stdout)["standby"]


def stop_when(condition, pid: int) -> threading.Thread:
    """SIGSTOP `pid` the moment `condition()` holds (checked every millisecond, in a thread)."""
    def watch():
        end = time.monotonic() + 60
        while not condition() and time.monotonic() < end:
            time.sleep(0.001)
        os.kill(pid, signal.SIGSTOP)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _frozen_mid_promotion(engine: int, sb: int, intent) -> bool:
    """SIGKILL the engine and SIGSTOP the standby the moment supervise's promotion began (intent.json names the
    standby: it found the standby alive), before it activates; False (the standby running) when the promotion
    ended first."""
    def promoting() -> bool:
        try:
            return "standby" in intent.read_text()
        except OSError:  # not begun, or cleared at the end
            return False
    seen = threading.Event()

    def watch():
        end = time.monotonic() + 30
        while time.monotonic() < end and not seen.is_set():
            if promoting():
                os.kill(sb, signal.SIGSTOP)
                seen.set()
            time.sleep(0.001)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    os.kill(engine, signal.SIGKILL)
    watcher.join(40)
    time.sleep(0.5)
    if seen.is_set() and promoting():
        return True
    if seen.is_set():
        os.kill(sb, signal.SIGCONT)
    return False


def wait_for(what, timeout=60):
    return helpers.wait_for(what, timeout, every=0.2)


def serving_and_armed(make_policy, sockdir, preloads, service_cleanup, kv_ahead: str):
    """The service serving on its weight cache, a standby armed (`[standby] kv_ahead`); returns the policy."""
    policy = policy_with_standby(make_policy, sockdir)
    policy.write_text(policy.read_text() + f'kv_ahead = "{kv_ahead}"\n')
    service_cleanup(policy)
    start_preload(policy, preloads)
    assert run_cli("start", "--policy", policy).returncode == 0
    assert run_cli("standby", "arm", "--policy", policy).returncode == 0
    return policy


def test_supervise_promotes_its_standby_on_a_crash_and_arms_another(supervised, make_policy, sockdir, preloads):
    policy = policy_with_standby(make_policy, sockdir)
    start_preload(policy, preloads)
    s = supervised(policy)
    first = wait_for(lambda: (sb := standby(policy)) and sb["state"] == "prepared" and sb)
    engine = s.status()["pid"]
    assert answering(policy) == {engine}  # armed, the standby does not answer on the service's port
    from restartkit.policy import load_policy
    engines = load_policy(policy).engine_port_behind_front()  # behind supervise's front (on by default)
    assert set(listeners(engines)) == {s.proc.pid, engine, first["pid"]}  # the one socket supervise holds
    assert first["pid"] != engine and first["rss_bytes"] > 0
    os.kill(engine, signal.SIGKILL)
    rec = s.wait_record(1)
    assert rec["reason"] == "crash" and rec["served_by"] == "standby" and not rec["via_recovery"], rec
    assert rec["proof"]["canary_identical"] is True and rec["attempts"][-1]["proof"]["ipc"] == "hit"
    assert s.status()["pid"] == first["pid"]  # the standby is the engine now
    second = wait_for(lambda: (sb := standby(policy)) and sb["state"] == "prepared" and sb["pid"] != first["pid"] and sb)
    assert answering(policy) == {first["pid"]}
    sup = wait_for(lambda: (st := s.status()["supervisor"]) and st["standby"]["rearm_s"] and st)
    assert sup["standby"]["armed"] in (first["pid"], second["pid"])
    prom = (policy.parent / "state" / "svc" / "metrics.prom").read_text()
    wait_for(lambda: prom_sample((policy.parent / "state" / "svc" / "metrics.prom").read_text(),
                                 "restartkit_standby_armed", service="svc") == 1)
    assert prom_sample(prom, "restartkit_restart_total", service="svc", strategy="standby", outcome="ok") == 1
    if os.getuid() == 0 and criu_facts().check_ok:  # a scheduled refresh after that crash: a snapshot, or the fix
        r = run_cli("snapshot", "create", "--policy", policy, "--wait", "60")
        assert "Traceback" not in r.stderr and (r.returncode == 0 or "cannot give up supervise's held socket"
                                                in r.stderr), r.stdout + r.stderr
        assert answering(policy) == {first["pid"]}  # it keeps serving either way
    os.killpg(s.proc.pid, signal.SIGTERM)
    assert s.proc.wait(30) == 0
    assert gone(second["pid"])


@pytest.mark.parametrize("kv_ahead", ["never", "always"])
def test_a_planned_restart_promotes_the_standby_and_stop_takes_it_down(make_policy, sockdir, preloads, service_cleanup,
                                                                       kv_ahead):
    """kv_ahead: the standby waits prepared (its KV cache allocated at promotion), or activated (KV cache
    and graph ready, promotion is the port only)."""
    policy = policy_with_standby(make_policy, sockdir, kv_ahead=kv_ahead)
    armed = started_and_armed(policy, preloads, service_cleanup)
    assert armed["kv_ahead"] is (kv_ahead == "always") and armed["state"] == "prepared"
    assert listeners(port_of(policy)) == [json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]]
    r = run_cli("restart", "--policy", policy, "--strategy", "standby", "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["served_by"] == "standby" and rec["proof"]["canary_identical"] is True, rec
    assert rec["attempts"][-1]["proof"]["standby_pid"] == armed["pid"] == standby_gone_engine(policy)
    # promoted, it listens where the service does and nowhere else (its private port, the whole API, is closed)
    assert listening_ports(armed["pid"]) == {port_of(policy)}, listening_ports(armed["pid"])
    # activated ahead, it answered the canary while it waited: that is the proof, compared with the old engine's
    # (no canary of restartkit's own on the public port for a client's first request to queue behind)
    came_from = rec["attempts"][-1]["proof"].get("canary_from")
    assert (armed.get("canary") is not None) is (kv_ahead == "always")
    assert (came_from is not None and "while it waited armed" in came_from) is (kv_ahead == "always"), came_from
    assert run_cli("standby", "arm", "--policy", policy).returncode == 0
    again = standby(policy)
    r = run_cli("stop", "--policy", policy, "--json")
    assert r.returncode == 0 and f"its standby (PID {again['pid']}) stopped" in json.loads(r.stdout)["how"], r.stdout
    assert standby(policy) is None and listeners(port_of(policy)) == []
    assert gone(again["pid"])


def test_a_standby_bench_arms_a_standby_for_each_run(make_policy, sockdir, preloads, service_cleanup):
    """A promotion uses the standby up: `restartkit bench --strategies standby --repeat 2` arms the next one
    before its second run, so both runs are standby restarts (without it the second fell back to cold)."""
    policy = policy_with_standby(make_policy, sockdir, kv_ahead="never")
    started_and_armed(policy, preloads, service_cleanup)
    r = run_cli("bench", "--policy", policy, "--strategies", "standby", "--repeat", "2", "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)["rows"][0]
    assert [run["served_by"] for run in row["runs"]] == ["standby", "standby"] and row["clean_runs"] == 2, row
    assert row["canary_identical"] is True
    assert run_cli("stop", "--policy", policy).returncode == 0 and standby(policy) is None


def listening_ports(pid: int) -> set[int]:
    """The TCP ports the process listens on (from /proc)."""
    from restartkit.process.procfs import fd_targets, tcp_sockets
    mine = {t[len("socket:["):-1] for t in fd_targets(pid) if t.startswith("socket:[")}
    return {int(cols[1].rsplit(":", 1)[1], 16) for cols in tcp_sockets() if cols[3] == "0A" and cols[9] in mine}


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
    before = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    r = run_cli("restart", "--policy", policy, "--strategy", "standby", "--json")  # asked for by name: refused
    assert r.returncode == 2 and "standby cannot run now" in r.stderr and "is gone" in r.stderr, r.stderr
    assert json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"] == before  # untouched


def test_a_frozen_standby_is_never_promoted(make_policy, sockdir, preloads, service_cleanup):
    """A standby alive but stopped (SIGSTOP) would hang its promotion for promote_timeout_s with the old engine
    already gone: plan calls it frozen, and a restart is served by another strategy while the old engine serves."""
    policy = policy_with_standby(make_policy, sockdir)
    policy.write_text(policy.read_text() + "promote_timeout_s = 30\n")
    service_cleanup(policy)
    start_preload(policy, preloads)
    assert run_cli("start", "--policy", policy).returncode == 0
    assert run_cli("standby", "arm", "--policy", policy).returncode == 0
    pid = standby(policy)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
        why = {v["strategy"]: " ".join(v["reasons"]) for v in plan["strategies"]}
        assert f"the standby (PID {pid}) is frozen" in why["standby"] and plan["attempt"] != "standby", why
        t0 = time.monotonic()
        r = run_cli("restart", "--policy", policy, "--json")
        took = time.monotonic() - t0
        rec = json.loads(r.stdout)
        assert r.returncode == 0 and rec["served_by"] not in ("standby", None), rec
        assert rec["proof"]["canary_identical"] is True and took < 20, (took, rec)
        assert standby(policy)["pid"] == pid  # still there, never promoted
        shown = run_cli("standby", "status", "--policy", policy, "--json")
        assert shown.returncode == 1 and "is frozen" in json.loads(shown.stdout)["why_not_promotable"]
    finally:
        os.kill(pid, signal.SIGCONT)
    shown = run_cli("standby", "status", "--policy", policy, "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["promotable"] is True


def test_supervise_replaces_a_frozen_standby(supervised, make_policy, sockdir, preloads):
    """supervise keeps a standby that can be promoted: a stopped one is killed and another armed, while the
    engine serves on."""
    policy = policy_with_standby(make_policy, sockdir)
    start_preload(policy, preloads)
    s = supervised(policy)
    sb = wait_for(lambda: (st := standby(policy)) and st["state"] == "prepared" and st)["pid"]
    engine = s.status()["pid"]
    os.kill(sb, signal.SIGSTOP)
    new = wait_for(lambda: (st := standby(policy)) and st["pid"] != sb and st["state"] == "prepared" and st)
    wait_for(lambda: gone(sb), 15)
    assert s.status()["pid"] == engine and new["pid"] != engine


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
    assert "before it took the port" in att["proof"]["canary_from"]
    assert listeners(port_of(policy)) == [att["proof"]["standby_pid"]]
    assert gone(old)


def test_a_standby_armed_before_a_weights_change_is_never_promoted(make_policy, sockdir, preloads, service_cleanup,
                                                                    tmp_path):
    """New weights on disk: the standby holds the old ones.  plan refuses it for the reason and for itself, and
    supervise would replace it (stale)."""
    import shutil
    from restartkit.reference.model.checkpoint import write_checkpoint
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
    from tests.helpers import ROOT
    policy = serving_and_armed(make_policy, sockdir, preloads, service_cleanup, "never")
    sb = standby(policy)["pid"]
    old = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    intent = policy.parent / "state" / "svc" / "intent.json"
    # stopped once the old engine is gone: after the restart found the standby alive, before it activates
    freezer = stop_when(lambda: exited(old), sb)
    p = subprocess.Popen([sys.executable, "-m", "restartkit.cli", "restart", "--policy", str(policy), "--strategy",
                          "standby"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: intent.exists() and "standby" in intent.read_text())
        freezer.join(30)
        time.sleep(1.0)  # the old engine stopped; the promotion waits for the stopped standby
        assert "standby" in intent.read_text() and p.poll() is None  # still promoting
        p.kill()
        p.wait(10)
    finally:
        os.kill(sb, signal.SIGCONT)
    assert json.loads(run_cli("status", "--policy", policy, "--json").stdout)["interrupted"]["command"] == "restart"
    r = run_cli("start", "--policy", policy, "--json")  # reconciles the killed restart
    assert "interrupted `restartkit restart`" in r.stderr, r.stderr
    st = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert st["serving"] and st["pid"] != sb, (r.stderr, st)
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
    from tests.helpers import ROOT
    policy = policy_with_standby(make_policy, sockdir)
    service_cleanup(policy)
    start_preload(policy, preloads)
    assert run_cli("start", "--policy", policy).returncode == 0
    assert run_cli("standby", "arm", "--policy", policy).returncode == 0
    cmd = [sys.executable, "-m", "restartkit.cli", "restart", "--policy", str(policy), "--strategy", "standby",
           "--wait", "60", "--json"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 2], (codes, outs)  # the second found no standby: refused, nothing touched
    rec = json.loads(outs[codes.index(0)][0])
    assert rec["served_by"] == "standby" and rec["proof"]["canary_identical"] is True, rec
    assert "standby cannot run now" in outs[codes.index(2)][1], outs
    st = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert st["serving"] and listeners(port_of(policy)) == [st["pid"]]


def test_supervise_killed_during_a_crash_promotion_is_reconciled_by_the_next_command(supervised, make_policy, sockdir,
                                                                                       preloads):
    """SIGKILL to supervise while it promotes its standby after a crash (the standby held stopped, so that the
    promotion waits): the next command stops the half-promoted standby and, as supervise meant the service to
    serve, starts it cold."""
    policy = policy_with_standby(make_policy, sockdir)
    policy.write_text(policy.read_text() + 'kv_ahead = "never"\n')
    start_preload(policy, preloads)
    s = supervised(policy)
    intent = policy.parent / "state" / "svc" / "intent.json"
    sb, engine = None, None
    for _ in range(3):  # a promotion that ends before the watcher runs (a loaded host) is tried again
        sb = wait_for(lambda: (st := standby(policy)) and st["state"] == "prepared" and st["pid"] != sb and st)["pid"]
        engine = s.status()["pid"]
        if _frozen_mid_promotion(engine, sb, intent):
            break
        wait_for(lambda: s.status().get("pid") == sb)  # it was promoted whole: it serves, and a new one is armed
    else:
        pytest.fail("three promotions ended before the standby could be stopped halfway")
    try:
        os.kill(s.proc.pid, signal.SIGKILL)  # supervise only: its engines are the next command's to sort out
        s.proc.wait(10)
    finally:
        os.kill(sb, signal.SIGCONT)
    r = run_cli("start", "--policy", policy, "--json")  # reconciles what the killed supervise left
    assert "interrupted `restartkit supervise restart (crash)`" in r.stderr, r.stderr
    st = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert st["serving"] and st["pid"] not in (sb, engine) and st["standby"] is None, (r.stderr, st)
    assert listeners(port_of(policy)) == [st["pid"]]
    wait_for(lambda: gone(sb), 15)


@pytest.mark.skipif(os.getuid() != 0, reason="mount namespaces need root")
@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_standby_arm_on_a_state_dir_that_cannot_be_written_leaves_nothing_running(make_policy, sockdir, preloads,
                                                                                    service_cleanup, fault):
    import subprocess
    from tests.helpers import RESTARTKIT, ROOT
    policy = policy_with_standby(make_policy, sockdir)
    service_cleanup(policy)
    start_preload(policy, preloads)
    assert run_cli("start", "--policy", policy).returncode == 0
    engine = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    sd = policy.parent / "state" / "svc"
    cmd = " ".join(map(str, [*RESTARTKIT, "standby", "arm", "--policy", policy]))
    if fault == "read-only":
        script = f"mount --bind {sd} {sd} && mount -o remount,bind,ro {sd} && exec {cmd}"
    else:  # a small filesystem holding the state dir's files, filled up
        script = (f"cp -a {sd} {sd}.copy && mount -t tmpfs -o size=512k tmpfs {sd} && cp -a {sd}.copy/. {sd}/ && "
                  f"rm -rf {sd}.copy && (dd if=/dev/zero of={sd}/filler bs=4k 2>/dev/null; true) && exec {cmd}")
    before = set(os.listdir("/proc"))
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"the state dir {sd} is not writable" in r.stderr and "Traceback" not in r.stderr, r.stderr
    from restartkit.process.procfs import argv
    new = [int(p) for p in set(os.listdir("/proc")) - before if p.isdigit()]
    assert [p for p in new if "--prepare-only" in argv(int(p))] == []  # no standby left running
    st = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert st["serving"] and st["pid"] == engine and st["standby"] is None


def test_a_neighbour_on_the_port_at_promotion_is_named_and_the_standby_stays_armed(make_policy, sockdir, preloads,
                                                                                 service_cleanup, tmp_path):
    """The engine crashed and someone else took its port: the promotion is refused before it starts, naming
    the neighbour, who is left alone; the standby stays armed and is promoted once the port is free."""
    import subprocess
    import sys
    policy = policy_with_standby(make_policy, sockdir)
    service_cleanup(policy)
    start_preload(policy, preloads)
    assert run_cli("start", "--policy", policy).returncode == 0
    assert run_cli("standby", "arm", "--policy", policy).returncode == 0
    sb = standby(policy)["pid"]
    engine = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    os.kill(engine, signal.SIGKILL)
    wait_for(lambda: gone(engine))
    port = port_of(policy)
    neighbour = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        wait_for(lambda: listeners(port) == [neighbour.pid])
        r = run_cli("restart", "--policy", policy, "--json")
        rec = json.loads(r.stdout)
        assert r.returncode == 1 and rec["attempts"][0]["strategy"] == "standby", rec
        assert f"port {port} is already in use by PID {neighbour.pid}" in rec["attempts"][0]["error"], rec
        assert "stays armed" in rec["attempts"][0]["error"]
        assert neighbour.poll() is None  # someone else's process is left alone
        assert standby(policy)["pid"] == sb and standby(policy)["state"] == "prepared"
    finally:
        neighbour.kill()
        neighbour.wait()
    r = run_cli("restart", "--policy", policy, "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["served_by"] == "standby" and rec["proof"]["canary_identical"] is True, rec
    assert listeners(port) == [sb]


def test_a_canary_answered_ahead_that_differs_is_not_trusted(make_policy, sockdir, preloads, service_cleanup):
    """The canary a standby answered while it waited is compared like any other: one that differs from the old
    engine's fails the promotion, and the restart recovers cold with an identical canary."""
    policy = serving_and_armed(make_policy, sockdir, preloads, service_cleanup, "always")
    path = policy.parent / "state" / "svc" / "standby.json"
    rec = json.loads(path.read_text())
    rec["canary"]["tokens"][0][-1] += 1  # as if the standby computed another last token
    path.write_text(json.dumps(rec))
    r = run_cli("restart", "--policy", policy, "--strategy", "standby", "--json")
    out = json.loads(r.stdout)
    assert out["attempts"][0]["strategy"] == "standby" and "canary differs" in out["attempts"][0]["error"], out
    assert out["served_by"] == "cold" and out["via_recovery"] and out["proof"]["canary_identical"] is True, json.dumps(out)
    st = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert st["serving"] and st["pid"] != rec["pid"] and listeners(port_of(policy)) == [st["pid"]]
    assert gone(rec["pid"])


def test_a_canary_ahead_that_cannot_be_written_leaves_the_promotion_its_own(make_policy, sockdir, preloads,
                                                                           service_cleanup):
    """The standby's record cannot be rewritten when its canary ahead is kept (an immutable standby.json: even
    root's rename over it fails): `standby arm` says so and still succeeds, the standby stays armed, and its
    promotion takes its canary on the service's port, identical."""
    import subprocess
    from tests.helpers import RESTARTKIT, ROOT
    policy = policy_with_standby(make_policy, sockdir)
    policy.write_text(policy.read_text() + 'kv_ahead = "always"\n')
    service_cleanup(policy)
    start_preload(policy, preloads)
    assert run_cli("start", "--policy", policy).returncode == 0
    path = policy.parent / "state" / "svc" / "standby.json"
    arm = subprocess.Popen([*map(str, RESTARTKIT), "standby", "arm", "--policy", str(policy)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        wait_for(path.exists, 60)  # written once by the arm; the canary ahead comes after the standby's preparation
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
            arm.kill()
            pytest.skip("this filesystem has no immutable files (chattr +i)")
        out, err = arm.communicate(timeout=120)
    finally:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    assert arm.returncode == 0, out + err
    assert "the standby's canary ahead failed" in err and "Traceback" not in err, err
    sb = standby(policy)
    assert sb["state"] == "prepared" and sb.get("canary") is None, sb
    r = run_cli("restart", "--policy", policy, "--strategy", "standby", "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["served_by"] == "standby" and rec["proof"]["canary_identical"] is True, rec
    assert rec["first_completion_s"] is not None, rec  # its canary asked on the service's port, none ahead
    assert listeners(port_of(policy)) == [sb["pid"]]


def ranks_of(pid: int) -> list[int]:
    """The standby's tensor-parallel workers (its children running --worker-rank)."""
    from restartkit.process.procfs import argv, tree_pids
    return [p for p in tree_pids(pid) if p != pid and "--worker-rank" in argv(p)]


@pytest.mark.parametrize("kv_ahead", ["never", "always"])
def test_a_tensor_parallel_standby_waits_with_every_rank_and_is_promoted(make_policy, sockdir, preloads,
                                                                        service_cleanup, kv_ahead):
    """At tensor_parallel_size 2 the standby's second rank prepares on its own weight cache and waits with rank 0
    (no collective, no KV cache before its go); promoted on a planned restart and after a crash, every rank
    attached (an ipc hit), canary identical; `stop` takes both ranks down."""
    policy = policy_with_standby(make_policy, sockdir, "tensor_parallel_size = 2\n", kv_ahead)
    armed = started_and_armed(policy, preloads, service_cleanup)
    workers = ranks_of(armed["pid"])
    assert armed["state"] == "prepared" and len(workers) == 1, armed
    engine = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    assert listeners(port_of(policy)) == [engine]  # armed, neither rank answers on the service's port
    r = run_cli("restart", "--policy", policy, "--strategy", "standby", "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["served_by"] == "standby" and rec["proof"]["canary_identical"] is True, rec
    assert rec["attempts"][-1]["proof"]["ranks"] == ["hit", "hit"], rec["attempts"][-1]["proof"]
    assert standby_gone_engine(policy) == armed["pid"] and ranks_of(armed["pid"]) == workers
    # a crash of the promoted engine: the next standby serves it
    assert run_cli("standby", "arm", "--policy", policy).returncode == 0
    nxt = standby(policy)
    os.kill(armed["pid"], signal.SIGKILL)
    wait_for(lambda: gone(armed["pid"]) and all(gone(w) for w in workers))  # its worker dies with it
    r = run_cli("restart", "--policy", policy, "--reason", "crash", "--json")
    rec = json.loads(r.stdout)
    assert rec["reason"] == "crash" and rec["served_by"] == "standby" and rec["proof"]["canary_identical"] is True, rec
    assert standby_gone_engine(policy) == nxt["pid"] and len(ranks_of(nxt["pid"])) == 1
    both = [nxt["pid"], *ranks_of(nxt["pid"])]
    assert run_cli("stop", "--policy", policy).returncode == 0
    wait_for(lambda: all(gone(p) for p in both), 15)


def test_a_tensor_parallel_standby_whose_worker_died_is_never_promoted(make_policy, sockdir, preloads,
                                                                      service_cleanup):
    """The standby's second rank killed while it waits: the standby says so and exits (rank 0 alone cannot
    serve), is not promoted, and the restart is served by ipc with an identical canary."""
    policy = policy_with_standby(make_policy, sockdir, "tensor_parallel_size = 2\n")
    sb = started_and_armed(policy, preloads, service_cleanup)
    os.kill(ranks_of(sb["pid"])[0], signal.SIGKILL)
    wait_for(lambda: gone(sb["pid"]))
    status = json.loads((policy.parent / "state" / "svc" / "standby-status.json").read_text())
    assert status["state"] == "failed" and "tensor-parallel worker PID" in status["error"], status
    r = run_cli("restart", "--policy", policy, "--json")
    rec = json.loads(r.stdout)
    why = {v["strategy"]: " ".join(v["reasons"]) for v in rec["plan"]["strategies"]}
    assert "is gone" in why["standby"] or "failed" in why["standby"], why
    assert rec["served_by"] == "ipc" and rec["proof"]["canary_identical"] is True, rec


def test_a_tensor_parallel_standby_with_one_rank_off_the_cache_is_not_promoted(make_policy, sockdir, preloads,
                                                                              service_cleanup):
    """Rank 1's weight-cache daemon gone before the standby is armed: that rank loads from disk ([ipc] fallback),
    so the standby is no weight-cache hit; its promotion is refused naming the ranks, and the restart
    recovers with an identical canary."""
    import psutil
    policy = policy_with_standby(make_policy, sockdir, "tensor_parallel_size = 2\n")
    service_cleanup(policy)
    launcher = start_preload(policy, preloads)
    assert run_cli("start", "--policy", policy).returncode == 0
    daemons = [c for c in psutil.Process(launcher.pid).children() if "restartkit.weightcache.daemon" in " ".join(c.cmdline())]
    rank1 = next(d for d in daemons if "--tp-rank 1" in " ".join(d.cmdline()))
    rank1.kill()
    rank1.wait(10)
    assert run_cli("standby", "arm", "--policy", policy).returncode == 0
    r = run_cli("restart", "--policy", policy, "--strategy", "standby", "--json")
    rec = json.loads(r.stdout)
    first = rec["attempts"][0]
    assert first["strategy"] == "standby" and "on every rank: ranks ['hit', 'fallback']" in first["error"], first
    assert rec["served_by"] != "standby" and rec["proof"]["canary_identical"] is True, rec


def test_supervise_promotes_a_tensor_parallel_standby_when_a_worker_of_the_engine_dies(supervised, make_policy,
                                                                                    sockdir, preloads):
    """TP2 under supervise: the serving engine's second rank SIGKILLed (rank 0 alone cannot serve, so it exits):
    a crash, served by the standby with every rank a hit, and another standby armed with its worker."""
    policy = policy_with_standby(make_policy, sockdir, "tensor_parallel_size = 2\n")
    start_preload(policy, preloads)
    s = supervised(policy)
    first = wait_for(lambda: (sb := standby(policy)) and sb["state"] == "prepared" and sb)
    engine = s.status()["pid"]
    worker = ranks_of(engine)[0]
    os.kill(worker, signal.SIGKILL)
    rec = s.wait_record(1)
    assert rec["reason"] == "crash" and rec["served_by"] == "standby" and not rec["via_recovery"], rec
    assert rec["proof"]["canary_identical"] is True and rec["attempts"][-1]["proof"]["ranks"] == ["hit", "hit"]
    assert s.status()["pid"] == first["pid"] and gone(engine)
    second = wait_for(lambda: (sb := standby(policy)) and sb["state"] == "prepared" and sb["pid"] != first["pid"] and sb)
    assert len(ranks_of(second["pid"])) == 1 and answering(policy) == {first["pid"]}
    os.killpg(s.proc.pid, signal.SIGTERM)
    assert s.proc.wait(30) == 0
    assert gone(second["pid"])


def test_no_standby_is_spawned_where_the_engine_cannot_hold_one(supervised, make_policy):
    """[standby] enabled, but the engine loads a copy of its weights ([ipc] mode copy): supervise says why once
    and spawns nothing (it used to start a standby every few seconds, each refused); `standby arm` exits 2 with
    the reason, before any process starts."""
    policy = make_policy(extra='\n[ipc]\nmode = "copy"\n\n[standby]\nenabled = true\n')
    s = supervised(policy)
    s.listen(7.0)  # past supervise's 5 s between two tries at arming
    assert run_cli("status", "--policy", policy, "--json").returncode == 0
    assert json.loads(run_cli("status", "--policy", policy, "--json").stdout)["standby"] is None
    assert len(engines_on(policy)) == 1, engines_on(policy)
    r = run_cli("standby", "arm", "--policy", policy)
    assert r.returncode == 2 and "[ipc] mode must be 'zero_copy'" in r.stderr, r.stderr
    assert len(engines_on(policy)) == 1
    s.close()
    said = s.proc.stdout.read()
    assert said.count("no standby is armed: a standby maps its weights") == 1, said


@pytest.mark.skipif(os.getuid() != 0, reason="starts a process as another user")
def test_disarm_never_signals_a_process_that_is_not_restartkits(make_policy, service_cleanup):
    """standby.json names another user's process (its start ticks right, as a forged or stale record could):
    `standby disarm` leaves it alone."""
    import subprocess
    from restartkit.process.procfs import proc_start_ticks
    policy = make_policy()
    service_cleanup(policy)
    other = subprocess.Popen(["sleep", "600"], user=65534, group=65534, start_new_session=True)
    try:
        time.sleep(0.2)
        state_dir = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["state_dir"]
        os.makedirs(state_dir, exist_ok=True)
        with open(os.path.join(state_dir, "standby.json"), "w") as f:
            json.dump({"pid": other.pid, "start_ticks": proc_start_ticks(other.pid), "armed_at": time.time()}, f)
        r = run_cli("standby", "disarm", "--policy", policy)
        time.sleep(0.5)
        assert other.poll() is None, (r.returncode, r.stdout, r.stderr)
    finally:
        other.kill()
        other.wait()


def test_a_busy_standby_is_promoted_on_a_crash_under_cpu_load(supervised, make_policy, sockdir, preloads):
    """Both cores busy (four spinning processes at the standby's priority): its private /health may be slow, but
    it is not frozen, and a crash is still served through it."""
    import subprocess
    import sys
    policy = policy_with_standby(make_policy, sockdir)
    start_preload(policy, preloads)
    s = supervised(policy)
    first = wait_for(lambda: (sb := standby(policy)) and sb["state"] == "prepared" and sb)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
    try:
        time.sleep(1)
        os.kill(s.status()["pid"], signal.SIGKILL)
        rec = s.wait_record(1, timeout=180)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert rec["reason"] == "crash" and rec["served_by"] == "standby", (rec["served_by"], rec["plan"])
    assert s.status()["pid"] == first["pid"]


def test_a_standby_orphaned_by_a_killed_supervise_is_stopped_before_the_next_start(supervised, make_policy, sockdir,
                                                                                  preloads, tmp_path):
    """supervise SIGKILLed, then its engine: the armed standby keeps a copy of the service's socket and never
    accepts.  The next supervise stops it (saying so) before it binds the port, and serves."""
    policy = policy_with_standby(make_policy, sockdir)
    start_preload(policy, preloads)
    s = supervised(policy)
    first = wait_for(lambda: (sb := standby(policy)) and sb["state"] == "prepared" and sb)
    engine = s.status()["pid"]
    os.kill(s.proc.pid, signal.SIGKILL)
    os.kill(engine, signal.SIGKILL)
    s.proc.wait(30)
    assert first["pid"] in listeners(port_of(policy)) or standby(policy)["alive"]  # left behind
    again = helpers.Supervised(policy, tmp_path)
    try:
        again.wait_note("READY=1")  # it bound the port and serves
        assert gone(first["pid"])
        st = again.status()
        assert st["serving"] and st["pid"] != first["pid"], st
    finally:
        again.close()


def test_an_armed_standby_answers_every_admin_route_with_no_500(make_policy, sockdir, preloads, service_cleanup):
    """Each admin route asked of an armed standby (on its private port, with restartkit's token): an answer or a
    4xx naming why not, never a 500; and it still serves when promoted."""
    from restartkit import http
    from restartkit.guard import admin
    policy = policy_with_standby(make_policy, sockdir)
    armed = started_and_armed(policy, preloads, service_cleanup)
    base = f"http://127.0.0.1:{standby(policy)['admin_port']}"
    headers = admin.headers(policy.parent / "state" / "svc")
    got = {}
    for route in ("/admin/stats", "/admin/drop_kv_cache", "/admin/restore_kv_cache", "/admin/release_weights",
                  "/admin/reattach_weights", "/admin/detach_listener", "/is_sleeping", "/sleep", "/wake_up"):
        try:
            if route in ("/admin/stats", "/is_sleeping"):
                http.get(base + route, timeout=30, headers=headers)
            else:
                http.post(base + route, body={}, timeout=30, headers=headers)
            got[route] = 200
        except http.HTTPFailure as e:
            got[route] = (e.status, e.message)
    assert not [r for r, v in got.items() if isinstance(v, tuple) and (v[0] or 500) >= 500], got
    r = run_cli("restart", "--policy", policy, "--strategy", "standby", "--strict", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["proof"]["canary_identical"], (armed, got, r.stdout, r.stderr)
