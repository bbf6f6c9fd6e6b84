"""`restartkit supervise` for real: a tiny reference engine under the supervisor, crashed
(SIGKILL), hung (SIGSTOP), broken for good (the restart limit), stopped (SIGTERM), reloaded
(SIGHUP); systemd's notify socket listened to by the test."""
import json
import os
import signal
import socket
import subprocess
import time

import pytest

from restartkit.systemd.notify import Notifier
from tests.helpers import engines_on, gone, ipc_policy, run_cli, start_preload, wait_for

pytestmark = pytest.mark.slow

def test_a_killed_engine_comes_back_through_ipc_recorded_as_a_crash(supervised, make_policy, sockdir, preloads):  # noqa: F811
    policy = ipc_policy(make_policy, sockdir)
    start_preload(policy, preloads)
    s = supervised(policy)
    first = s.status()
    assert first["serving"] and first["supervisor"]["pid"] == s.proc.pid
    os.kill(first["pid"], signal.SIGKILL)
    rec = s.wait_record(1)
    assert rec["reason"] == "crash" and rec["served_by"] == "ipc" and not rec["via_recovery"], rec
    assert rec["proof"]["canary_identical"] is True
    assert rec["trigger"]["by"] == "supervise" and "exited" in rec["trigger"]["what"]
    assert 0 < rec["trigger"]["noticed_to_serving_s"] < 60
    assert 0 <= rec["trigger"]["noticed_to_start_s"] <= rec["trigger"]["noticed_to_serving_s"]
    st = s.status()
    assert st["serving"] and st["pid"] != first["pid"] and st["supervisor"]["restarts"][-1]["served_by"] == "ipc"
    s.wait_note("last restart (crash): ipc")


def test_a_hung_engine_is_noticed_and_restarted(supervised):
    s = supervised()
    pid = s.status()["pid"]
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    rec = s.wait_record(1)
    assert rec["reason"] == "crash" and rec["final_state"] == "serving" and "missed 3 health checks" in rec["trigger"]["what"]
    assert time.monotonic() - t0 < 60
    assert gone(pid)
    assert s.status()["serving"]


def test_an_engine_that_cannot_start_again_trips_the_limit(supervised, make_policy, tiny_model, tmp_path):
    import shutil
    model = tmp_path / "own-model"
    shutil.copytree(tiny_model, model)
    s = supervised(make_policy(model=str(model)), burst=2)
    model.rename(tmp_path / "own-model-gone")  # every start from now on fails
    os.kill(s.status()["pid"], signal.SIGKILL)
    out, _ = s.proc.communicate(timeout=120)
    assert s.proc.returncode == 1, out
    assert "giving up on svc: 3 failures within 600 s" in out and "the engine is left stopped" in out
    assert not s.status()["running"] and s.status()["supervisor"] is None


def test_a_crash_after_serving_starts_the_count_of_failed_starts_over(supervised):
    """start_limit_burst 1: an engine killed as soon as it serves is a failed start (one of one); one that served
    past min_uptime_s (5 s) and crashed is recovered at once and starts the count over, so the next failed start
    is the first again and supervise keeps going (without the reset it would be the second, and it would give up)."""
    s = supervised(burst=1)

    def kill_and_wait_for_the_next():
        pid = s.status()["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: (st := s.status())["serving"] and st["pid"] != pid, 90)

    for served_first in (True, True):
        if served_first:
            time.sleep(6.0)  # past min_uptime_s: a crash while serving
        kill_and_wait_for_the_next()
        kill_and_wait_for_the_next()  # killed before min_uptime_s: a failed start
    assert s.proc.poll() is None, s.proc.communicate(timeout=5)[0]
    assert s.status()["serving"]


def test_sigterm_stops_everything_and_sighup_restarts(supervised):
    s = supervised()
    os.killpg(s.proc.pid, signal.SIGHUP)
    rec = s.wait_record(1)
    assert rec["reason"] == "restart" and rec["final_state"] == "serving" and rec["trigger"]["what"] == "SIGHUP"
    assert rec["proof"]["canary_identical"] is True
    engine = s.status()["pid"]
    os.killpg(s.proc.pid, signal.SIGTERM)
    assert s.proc.wait(60) == 0
    assert "STOPPING=1" in s.notes()
    st = s.status()
    assert not st["running"] and st["supervisor"] is None
    assert not os.path.exists(f"/proc/{engine}")
    assert not (s.policy.parent / "state" / "svc" / "supervisor.json").exists()


def test_the_notifier_speaks_to_the_socket_and_keeps_quiet_without_one(tmp_path):
    path = str(tmp_path / "n.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(path)
        n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
        assert n.watchdog_s == 2.0
        n.send("READY=1", "STATUS=ok")
        assert srv.recv(100) == b"READY=1\nSTATUS=ok"
    Notifier({}).send("READY=1")  # no socket: nothing, no error
    assert Notifier({"WATCHDOG_USEC": "5", "WATCHDOG_PID": "1"}).watchdog_s is None  # another process's watchdog


def test_install_unit_writes_a_notify_unit(make_policy, tmp_path):
    policy = make_policy()
    r = run_cli("supervise", "--policy", policy, "--install-unit", "--unit-dir", tmp_path, "--watchdog-sec", "60")
    assert r.returncode == 0, r.stderr
    unit = (tmp_path / "restartkit-svc.service").read_text()
    for line in ("Type=notify", "WatchdogSec=60", "Restart=on-failure"):
        assert line in unit
    assert f"reload --policy {policy} --pid $MAINPID" in unit  # returns when the planned restart is done
    assert f"supervise --policy {policy}" in unit


def test_a_restart_by_another_command_is_adopted_not_taken_for_a_crash(supervised):
    """Two commands at once: an operator's `restartkit restart` while supervise watches.  The
    engine it starts is adopted; no crash restart follows (supervise_bench found one once)."""
    s = supervised()
    r = run_cli("restart", "--policy", s.policy, "--strategy", "cold", "--wait", "60", "--json")
    assert r.returncode == 0, r.stderr
    new = json.loads(r.stdout)
    time.sleep(6)  # longer than health_misses x health_interval: a mistaken hang would have been acted on
    recs = s.records()
    assert [x["id"] for x in recs] == [new["id"]] and recs[-1]["reason"] == "restart", recs
    st = s.status()
    assert st["serving"] and st["supervisor"]["pid"] == s.proc.pid and st["supervisor"]["failures_in_interval"] == 0


def test_a_planted_history_never_keeps_a_crash_down(supervised):
    """One malformed line in history.jsonl once broke every plan: under supervise, a crash that was
    never restarted.  Evidence is advice: the crash comes back, and the bad lines are said."""
    s = supervised()
    hist = s.policy.parent / "state" / "svc" / "history.jsonl"
    with open(hist, "a") as f:
        f.write('5\n{"started_at": NaN, "attempts": [], "final_state": "serving"}\n'
                '{"started_at": "yesterday", "attempts": {}, "final_state": "serving"}\n')
    os.kill(s.status()["pid"], signal.SIGKILL)
    rec = s.wait_record(1)
    assert rec["reason"] == "crash" and rec["final_state"] == "serving", rec
    assert "history.jsonl: 3 malformed record(s) skipped" in rec["plan"]["notes"], rec["plan"]["notes"]
    assert s.status()["serving"]


def test_when_the_restart_flow_itself_fails_a_crash_still_ends_serving(make_policy, service_cleanup):
    """The restart flow raising (a bug, a file it cannot read) must not leave a crashed service
    down: supervise starts it cold, for real, and records why."""
    from restartkit.commands.supervise import Supervisor
    from restartkit.service import Service
    policy = make_policy()
    service_cleanup(policy)
    said = []
    sup = Supervisor(Service.from_policy_file(policy), say=said.append, notifier=Notifier({}))

    def broken(*_a, **_kw):
        raise RuntimeError("the flow broke")
    sup.restart = broken
    try:
        rec = sup._restart("crash", {"by": "supervise", "what": "test", "noticed_at": time.time()})
    finally:
        sup.path.unlink(missing_ok=True)  # it wrote supervisor.json as this test process: not a supervisor
    assert rec is not None and rec.final_state == "serving" and rec.served_by == "cold" and rec.via_recovery
    assert "the restart flow failed (RuntimeError: the flow broke)" in rec.recovery_reason
    assert json.loads(run_cli("status", "--policy", policy, "--json").stdout)["serving"]
    recs = json.loads(run_cli("history", "--policy", policy, "--json").stdout)["records"]
    assert recs[-1]["id"] == rec.id and recs[-1]["trigger"]["noticed_to_serving_s"] > 0


def test_one_supervisor_per_service(supervised):
    s = supervised()
    r = run_cli("supervise", "--policy", s.policy, timeout=60)
    assert r.returncode == 75, r.stdout + r.stderr
    assert f"is supervised already (PID {s.proc.pid}" in r.stderr, r.stderr
    assert s.proc.poll() is None and s.status()["serving"]


def test_restartkit_stop_under_supervise_stops_through_the_supervisor(supervised):
    """Once, `restartkit stop` under supervise became a crash restart: the engine came back."""
    s = supervised()
    engine = s.status()["pid"]
    r = run_cli("stop", "--policy", s.policy, "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["supervisor"] == s.proc.pid
    assert s.proc.wait(60) == 0  # its own stop: exit 0, so its unit does not restart it
    time.sleep(2)
    st = s.status()
    assert not st["running"] and st["supervisor"] is None and not os.path.exists(f"/proc/{engine}")
    assert s.records() == []  # no crash restart


def test_restartkit_sleep_under_supervise_is_no_hang(supervised, make_policy):
    s = supervised(make_policy(extra="\n[sleep]\nenabled = true\nlevel = 1\n"))
    engine = s.status()["pid"]
    r = run_cli("sleep", "--policy", s.policy, "--wait", "30", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    time.sleep(8)  # longer than health_misses x health_interval and completion_interval_s: a hang would be acted on
    assert s.records() == [] and s.status()["pid"] == engine
    r = run_cli("wake", "--policy", s.policy, "--wait", "30", "--json", timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout)["served_by"] == "sleep", r.stdout + r.stderr
    assert s.status()["serving"] and s.status()["pid"] == engine


def test_a_state_dir_that_turns_read_only_never_stops_crash_recovery(supervised):
    """Once serving, the state dir turns read-only (here: immutable).  A crash still comes back: the
    engine's log and the record go to supervise's stderr until the dir can be written again."""
    s = supervised()
    state = s.policy.parent / "state" / "svc"
    engine = s.status()["pid"]
    if subprocess.run(["chattr", "+i", str(state)], capture_output=True).returncode != 0:
        pytest.skip("no immutable flag here")
    try:
        os.kill(engine, signal.SIGKILL)
        port = int(s.policy.read_text().split("port = ")[1].split()[0])
        deadline = time.monotonic() + 120
        back = []
        while time.monotonic() < deadline and not back:
            back = [p for p in engines_on(s.policy) if p != engine]
            time.sleep(0.2)
        assert back, "the crash was not restarted while the state dir was read-only"
        from restartkit.http import post
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                out = post(f"http://127.0.0.1:{port}/v1/completions", {"prompt": "hi", "max_tokens": 2}, timeout=5)
                break
            except Exception:
                time.sleep(0.2)
        assert out["choices"], out
        assert s.proc.poll() is None
    finally:
        subprocess.run(["chattr", "-i", str(state)], capture_output=True)
    os.killpg(s.proc.pid, signal.SIGTERM)
    assert s.proc.wait(60) == 0
    out = s.proc.stdout.read()
    assert "supervising without a lock or records on disk" in out and "can be written again" in out, out
    # the crash's record: on stderr when history.jsonl could not be written, else in it (an existing file stays
    # writable in an immutable directory)
    hist = state / "history.jsonl"
    recorded = hist.exists() and any('"reason": "crash"' in line for line in hist.read_text().splitlines())
    assert recorded or ("could not write the record" in out and '"reason": "crash"' in out), out
    assert engines_on(s.policy) == []  # the engine started meanwhile was found and stopped


def test_units_quote_a_policy_path_by_systemds_rules_and_refuse_a_newline(make_policy, tmp_path):
    import shutil
    spaced = tmp_path / "with space" / "100% svc.toml"
    spaced.parent.mkdir()
    shutil.copy(make_policy(), spaced)
    units = tmp_path / "units"
    units.mkdir()
    r = run_cli("supervise", "--policy", spaced, "--install-unit", "--unit-dir", units, "--state-dir", tmp_path / "st ate")
    assert r.returncode == 0, r.stderr
    unit = (units / "restartkit-svc.service").read_text()
    assert f'supervise --policy "{str(spaced).replace("%", "%%")}"' in unit, unit
    # the unit runs the service the command line named: the same state root (lock, history, metrics)
    assert f'Environment="RESTARTKIT_STATE_DIR={tmp_path / "st ate"}"' in unit, unit
    assert "Wants=network-online.target" in unit and "After=network-online.target" in unit
    if shutil.which("systemd-analyze"):
        v = subprocess.run(["systemd-analyze", "verify", str(units / "restartkit-svc.service")], capture_output=True,
                           text=True)
        assert v.returncode == 0, v.stderr
    r = run_cli("snapshot", "refresh", "--policy", spaced, "--install-timer", "--unit-dir", units)
    assert r.returncode == 0 and "\\%" in r.stdout, r.stdout + r.stderr  # the crontab line escapes cron's %
    newline = tmp_path / "a\nb.toml"
    shutil.copy(make_policy(), newline)
    r = run_cli("supervise", "--policy", newline, "--install-unit", "--unit-dir", units)
    assert r.returncode == 2 and "cannot carry it" in r.stderr, r.stderr


def test_the_first_start_attaches_from_a_warm_cache_and_is_recorded(make_policy, sockdir, preloads, supervised):
    """supervise's first start once was always cold, whatever the weight cache held (on the H200: a second
    copy of the weights on the device for a while, 9.7 s instead of about 3.7 s), and left no record.  It
    now runs the restart flow: the weight cache's ipc start path, proven (an IPC hit), recorded."""
    policy = ipc_policy(make_policy, sockdir)
    start_preload(policy, preloads)
    s = supervised(policy)
    rec = s.first_start()
    assert rec is not None and rec["final_state"] == "serving" and rec["served_by"] == "ipc", rec
    assert rec["attempts"][-1]["proof"]["ipc"] == "hit" and not rec["via_recovery"], rec["attempts"][-1]
    st = s.status()
    assert st["serving"] and st["supervisor"]["restarts"] == [] and s.records() == [], st


def test_every_state_of_supervise_has_a_step_and_every_step_names_a_state():
    """The loop's states (supervisor's states.py shape): each but ENDED has its step, each step returns a Phase."""
    import inspect
    from restartkit.commands.supervise import Phase, Supervisor
    assert set(Supervisor.STEPS) == set(Phase) - {Phase.ENDED}
    for phase, step in Supervisor.STEPS.items():
        assert inspect.signature(step).return_annotation in ("Phase", Phase), (phase, step)


def test_supervise_leaves_no_zombie_child(supervised):
    """The keepers of engines that died (a crash, a restart) are collected: supervise holds no zombie child."""
    from restartkit.process.procfs import proc_state
    s = supervised()
    engine = s.status()["pid"]
    os.kill(engine, signal.SIGKILL)
    s.wait_record(1)
    assert run_cli("restart", "--policy", s.policy, "--strategy", "cold").returncode == 0

    def zombies():
        kids = [int(p) for p in open(f"/proc/{s.proc.pid}/task/{s.proc.pid}/children").read().split()]
        return [p for p in kids if proc_state(p) == "Z"]
    # a turn of its watch loop (a second at most here) collects a keeper whose engine ended
    end = time.monotonic() + 10
    while zombies() and time.monotonic() < end:
        time.sleep(0.2)
    assert not zombies(), [(p, open(f"/proc/{p}/cmdline").read()) for p in zombies()]
