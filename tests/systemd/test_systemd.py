"""supervise as systemd runs it, against a real notify socket: the watchdog fed whatever supervise
is doing (another command's lock, a crash restart, a 20 s start), SIGTERM in the middle of a start
or a restart honoured within stop_timeout_s and a few seconds, SIGHUP announced as a reload, and
`restartkit restart` by hand cut the same way."""
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import RESTARTKIT, ROOT, engines_on, run_cli

pytestmark = pytest.mark.slow

WATCHDOG_S = 4.0  # WatchdogSec=4: a WATCHDOG=1 at least every 2 s is what the unit needs
STOP_TIMEOUT_S = 10  # the test policies' [restart] stop_timeout_s


def slow_policy(make_policy, tmp_path):
    """engine = "command": the reference server behind a shell that sleeps 20 s first while the
    file `slow` exists (a start as long as a big model's, when the test wants one)."""
    flag = tmp_path / "slow"
    server = [sys.executable, "-m", "restartkit.reference.serving.server", "--model", "{model}", "--host", "{host}",
              "--port", "{port}", "--max-model-len", "{max_model_len}", "--served-model-name", "{served_model_name}",
              "--threads", "1"]
    argv = ["sh", "-c", f'if [ -e "{flag}" ]; then sleep 20; fi; exec "$@"', "slow-start", *server]
    policy = make_policy(service_extra=f"command = {json.dumps(argv)}\n")
    policy.write_text(policy.read_text().replace('engine = "reference"', 'engine = "command"')
                      .replace('engine_args = ["--threads", "1"]', "engine_args = []"))
    return policy, flag


def left_running(flag) -> list[int]:
    """Processes of the slow engine (its shell, sleeping) still alive."""
    out = []
    for d in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read()
            state = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            continue
        if str(flag).encode() in cmd and state != "Z" and int(d) != os.getpid():
            out.append(int(d))
    return out


def sigterm_stops_in_time(s) -> None:
    """SIGTERM to supervise: STOPPING=1 within 2 s, exit 0 within stop_timeout_s + 5 s."""
    t0 = time.monotonic()
    os.killpg(s.proc.pid, signal.SIGTERM)
    s.wait_note("STOPPING=1", timeout=2)
    assert time.monotonic() - t0 <= 2
    assert s.proc.wait(STOP_TIMEOUT_S + 5) == 0


def wait_for(what, timeout: float = 60, every: float = 0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if got := what():
            return got
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_the_watchdog_is_fed_through_a_held_lock_a_crash_restart_and_a_20s_start(supervised, make_policy, tmp_path):
    import fcntl
    policy, flag = slow_policy(make_policy, tmp_path)
    s = supervised(policy, env={"WATCHDOG_USEC": str(int(WATCHDOG_S * 1e6))})
    t0 = time.monotonic()
    s.listen(3)
    # another command holds the service's lock (as a long `restartkit snapshot refresh` would) ...
    fd = os.open(policy.parent / "state" / "svc" / "lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        flag.touch()  # ... and the engine crashes meanwhile; its restart will take 20 s
        os.kill(s.status()["pid"], signal.SIGKILL)
        s.listen(8)
    finally:
        os.close(fd)
    wait_for(lambda: (s.notes(), any("restarting (crash)" in m for m in s.messages))[1], 30)
    rec = s.wait_record(1, timeout=120)
    s.listen(3)
    assert rec["reason"] == "crash" and rec["final_state"] == "serving" and rec["time_to_ready_s"] > 15, rec
    gap = s.longest_gap("WATCHDOG=1", t0)
    assert gap <= WATCHDOG_S / 2, f"a {gap:.2f} s gap between WATCHDOG=1 (WatchdogSec={WATCHDOG_S:.0f})"
    assert s.proc.poll() is None and s.status()["serving"]


def test_sigterm_during_a_restarts_20s_start_stops_within_the_stop_timeout(supervised, make_policy, tmp_path):
    policy, flag = slow_policy(make_policy, tmp_path)
    s = supervised(policy)
    flag.touch()
    os.kill(s.status()["pid"], signal.SIGKILL)
    s.wait_note("STATUS=restarting (crash)")
    wait_for(lambda: left_running(flag))  # the new engine's shell is in its 20 s
    time.sleep(1)
    sigterm_stops_in_time(s)
    assert left_running(flag) == [] and engines_on(policy) == []
    out = s.proc.stdout.read()
    assert "interrupted by SIGTERM" in out, out
    recs = s.records()
    assert recs[-1]["reason"] == "crash" and recs[-1]["attempts"][-1]["interrupted"] == "SIGTERM", recs[-1]
    assert recs[-1]["final_state"] == "not serving"
    assert s.status()["supervisor"] is None


def test_sigterm_during_the_first_20s_start_stops_at_once(supervised, make_policy, tmp_path):
    policy, flag = slow_policy(make_policy, tmp_path)
    flag.touch()
    s = supervised(policy, wait_ready=False)
    wait_for(lambda: left_running(flag))
    s.listen(2)
    # a start that runs long: TimeoutStartSec extended to what the policy allows now, whatever the unit said
    extend = [int(m.split("=")[1]) for m in s.messages if m.startswith("EXTEND_TIMEOUT_USEC=")]
    assert extend and max(extend) >= 60e6, s.messages  # [restart] start_timeout_s = 60
    sigterm_stops_in_time(s)
    assert left_running(flag) == [] and engines_on(policy) == []
    assert "READY=1" not in s.messages


def test_a_sighup_is_a_reload_and_an_adopted_engine_is_named(supervised):
    s = supervised()
    first = s.status()["pid"]
    os.killpg(s.proc.pid, signal.SIGHUP)
    rec = s.wait_record(1)
    s.wait_note(f"last restart (restart): {rec['served_by']}")
    reload_at = s.messages.index("RELOADING=1")
    assert s.messages[reload_at + 1].startswith("MONOTONIC_USEC=")
    assert "READY=1" in s.messages[reload_at:], s.messages
    # another command restarts it: supervise's STATUS= names the engine it adopted
    r = run_cli("restart", "--policy", s.policy, "--strategy", "cold", "--wait", "60", "--json")
    assert r.returncode == 0, r.stderr
    pid = s.status()["pid"]
    assert pid != first
    s.wait_note(f"STATUS=serving PID {pid}", timeout=30)


def test_sigterm_to_restart_by_hand_cuts_it_and_the_next_command_reconciles(make_policy, tmp_path, service_cleanup):
    policy, flag = slow_policy(make_policy, tmp_path)
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    flag.touch()
    p = subprocess.Popen([*RESTARTKIT, "restart", "--policy", str(policy), "--strategy", "cold", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    wait_for(lambda: left_running(flag))
    t0 = time.monotonic()
    os.killpg(p.pid, signal.SIGTERM)
    out, err = p.communicate(timeout=STOP_TIMEOUT_S + 5)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert time.monotonic() - t0 < STOP_TIMEOUT_S + 5
    rec = json.loads(out)
    assert rec["final_state"] == "not serving" and rec["attempts"][-1]["interrupted"] == "SIGTERM", rec
    assert "the next restartkit command reconciles" in rec["recovery_reason"], rec
    assert left_running(flag) == [] and engines_on(policy) == []
    flag.unlink()
    r = run_cli("start", "--policy", policy, "--json")  # reconciles the cut restart: the service serves again
    assert r.returncode == 0, r.stderr
    assert "interrupted `restartkit restart`" in r.stderr and engines_on(policy)
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    assert plan["attempt"] == "cold"


def test_the_weight_cache_unit_comes_first_and_both_units_load(make_policy, tmp_path):
    policy = make_policy()
    units = tmp_path / "units"
    units.mkdir()
    r = run_cli("preload", "--policy", policy, "--install-unit", "--unit-dir", units)
    assert r.returncode == 0, r.stderr
    r = run_cli("supervise", "--policy", policy, "--install-unit", "--unit-dir", units, "--watchdog-sec", "30")
    assert r.returncode == 0, r.stderr
    cache = (units / "restartkit-wc-svc.service").read_text()
    engine = (units / "restartkit-svc.service").read_text()
    assert "Before=restartkit-svc.service" in cache and "--wait-ready" in cache.split("ExecStartPost=")[1]
    assert "Wants=network-online.target restartkit-wc-svc.service" in engine
    assert "After=network-online.target restartkit-svc.socket restartkit-wc-svc.service" in engine
    verify(units / "restartkit-svc.service", units / "restartkit-wc-svc.service")


def test_the_service_unit_takes_its_listening_socket_from_a_socket_unit(make_policy, tmp_path):
    """supervise --install-unit writes restartkit-NAME.socket beside the service: systemd holds the port (the
    policy's host:port, the backlog restartkit states) and the service requires it; both load in
    systemd-analyze verify.  An IPv6 host is written in brackets."""
    from restartkit.process.listener import BACKLOG
    units = tmp_path / "units"
    units.mkdir()
    policy = make_policy()
    port = int(policy.read_text().split("port = ")[1].split()[0])
    r = run_cli("supervise", "--policy", policy, "--install-unit", "--unit-dir", units)
    assert r.returncode == 0, r.stderr
    assert "systemctl enable --now restartkit-svc.socket restartkit-svc.service" in r.stdout, r.stdout
    sock = (units / "restartkit-svc.socket").read_text()
    engine = (units / "restartkit-svc.service").read_text()
    assert f"ListenStream=127.0.0.1:{port}\n" in sock and f"Backlog={BACKLOG}\n" in sock, sock
    assert "Requires=restartkit-svc.socket\n" in engine and "restartkit-svc.socket" in engine.split("After=")[1]
    verify(units / "restartkit-svc.socket", units / "restartkit-svc.service")
    v6 = make_policy(name="six", service_extra='host = "::1"\n')
    r = run_cli("supervise", "--policy", v6, "--install-unit", "--unit-dir", units)
    assert r.returncode == 0, r.stderr
    assert f"ListenStream=[::1]:{int(v6.read_text().split('port = ')[1].split()[0])}\n" in \
        (units / "restartkit-six.socket").read_text()
    verify(units / "restartkit-six.socket", units / "restartkit-six.service")


def unreachable_by(user: str) -> str | None:
    """The first directory on the way to this interpreter that `user` cannot traverse (None: none)."""
    r = subprocess.run(["runuser", "-u", user, "--", "test", "-x", os.path.realpath(sys.executable)])
    if r.returncode == 0:
        return None
    path = Path(os.path.realpath(sys.executable))
    return next((str(p) for p in reversed(path.parents) if not os.stat(p).st_mode & 0o001), str(path))


def test_a_unit_for_another_user_gets_a_state_directory_and_is_refused_for_criu(make_policy, tmp_path, request):
    """nobody's home is /nonexistent: a state root pinned there could never be made.  The unit keeps its
    state in StateDirectory= (systemd makes it for that user; restartkit reads $STATE_DIRECTORY), and the
    CLI prints the root an operator passes to run restartkit as that user."""
    units = tmp_path / "units"
    units.mkdir()
    policy = make_policy()
    textfiles = Path(tempfile.mkdtemp(dir="/dev/shm")) / "textfiles"  # outside /tmp: made at install
    request.addfinalizer(lambda: shutil.rmtree(textfiles.parent, ignore_errors=True))
    policy.write_text("\n".join(ln for ln in policy.read_text().splitlines() if not ln.startswith("state_dir"))
                      + f'\n[metrics]\ntextfile_dir = "{textfiles}"\n')
    criu = make_policy(name="c")
    criu.write_text(criu.read_text().replace("[restart]\n", '[restart]\nstrategies = ["criu", "cold"]\n'))
    r = run_cli("supervise", "--policy", criu, "--install-unit", "--unit-dir", units, "--user", "nobody")
    assert r.returncode == 2 and "lists criu, which needs root" in r.stderr, r.stderr
    assert not (units / "restartkit-c.service").exists()
    r = run_cli("supervise", "--policy", policy, "--install-unit", "--unit-dir", units, "--user", "nobody")
    if blocked := unreachable_by("nobody"):  # this interpreter lives under a 0700 home (203/EXEC in the unit)
        assert r.returncode == 2 and "nobody (the unit's user" in r.stderr and "no unit was written" in r.stderr, \
            r.stderr
        assert not (units / "restartkit-svc.service").exists()
        pytest.skip(f"the rest needs an interpreter nobody can reach ({blocked} is not): tests/booted runs it")
    assert r.returncode == 0, r.stderr
    made = textfiles.stat()  # ProtectSystem=strict skips a missing "-" ReadWritePaths: it is made, for nobody
    assert made.st_uid == pwd.getpwnam("nobody").pw_uid and made.st_mode & 0o777 == 0o755, oct(made.st_mode)
    assert f"ReadWritePaths=-{textfiles}\n" in (units / "restartkit-svc.service").read_text()
    engine = (units / "restartkit-svc.service").read_text()
    assert "User=nobody\nStateDirectory=restartkit\n" in engine and "RESTARTKIT_STATE_DIR" not in engine, engine
    assert "sudo -u nobody restartkit status --state-dir /var/lib/restartkit" in r.stdout, r.stdout
    verify(units / "restartkit-svc.service")
    # what the unit's supervise will read: $STATE_DIRECTORY names the root
    st = run_cli("status", "--policy", policy, "--json", env={"STATE_DIRECTORY": str(tmp_path / "sd"),
                                                               "RESTARTKIT_STATE_DIR": ""})
    assert json.loads(st.stdout)["state_dir"].startswith(str(tmp_path / "sd")), st.stdout + st.stderr
    # the weight cache's unit as another user than the engine's: refused, naming both
    r = run_cli("preload", "--policy", policy, "--install-unit", "--unit-dir", units)
    assert r.returncode == 2 and "runs as nobody, this unit would run as root" in r.stderr, r.stderr
    assert not (units / "restartkit-wc-svc.service").exists()


def test_units_without_criu_are_hardened_and_a_give_up_ends(make_policy, tmp_path):
    """systemd-analyze security scores each unit without CRIU at 5.0 or less (9.6 before); a unit with CRIU
    says why it is not hardened.  supervise's give-up (exit 1) is not restarted, and a unit that fails at
    once trips its start limit at RestartSec pace instead of looping."""
    units = tmp_path / "units"
    units.mkdir()
    for device in ("cpu", "cuda"):
        policy = make_policy(name=f"h{device}", service_extra=f'device = "{device}"\n')
        assert run_cli("preload", "--policy", policy, "--install-unit", "--unit-dir", units).returncode == 0
        assert run_cli("supervise", "--policy", policy, "--install-unit", "--unit-dir", units).returncode == 0
        for unit in (f"restartkit-wc-h{device}.service", f"restartkit-h{device}.service"):
            text = (units / unit).read_text()
            verify(units / unit)
            assert exposure(units / unit) <= 5.0, (unit, text)
            assert "StartLimitIntervalSec=300\nStartLimitBurst=5\n" in text and "RestartSec=5\n" in text
            assert ("PrivateDevices=no" in text) == (device == "cuda"), text
        assert "RestartPreventExitStatus=1\n" in (units / f"restartkit-h{device}.service").read_text()
    criu = make_policy(name="c")
    criu.write_text(criu.read_text().replace("[restart]\n", '[restart]\nstrategies = ["criu", "cold"]\n'))
    assert run_cli("supervise", "--policy", criu, "--install-unit", "--unit-dir", units).returncode == 0
    text = (units / "restartkit-c.service").read_text()
    assert "# Not hardened like a unit without CRIU" in text and "\nProtectSystem=" not in text, text
    verify(units / "restartkit-c.service")


def exposure(unit) -> float:
    v = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)], capture_output=True, text=True)
    line = [ln for ln in v.stdout.splitlines() if "Overall exposure level" in ln]
    assert line, v.stdout + v.stderr
    return float(line[0].split(":")[1].split()[0])


def verify(*units) -> None:
    import shutil
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze (scripts/install-tools installs it)")
    v = subprocess.run(["systemd-analyze", "verify", *map(str, units)], capture_output=True, text=True)
    assert v.returncode == 0, v.stderr


def test_a_stopped_supervise_lets_the_watchdog_fire(supervised):
    """The heartbeat is supervise's own: a supervise that cannot run (SIGSTOP) sends nothing."""
    s = supervised(env={"WATCHDOG_USEC": str(int(WATCHDOG_S * 1e6))})
    s.listen(2)
    os.kill(s.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        s.listen(WATCHDOG_S + 1)
        assert s.longest_gap("WATCHDOG=1", t0) > WATCHDOG_S  # systemd would have fired
    finally:
        os.kill(s.proc.pid, signal.SIGCONT)
    s.listen(2)
    assert s.longest_gap("WATCHDOG=1", time.monotonic() - 1.5) <= WATCHDOG_S / 2  # fed again


def test_the_heartbeat_stops_when_the_loop_overruns_its_step():
    from restartkit.systemd.notify import Heartbeat, Notifier
    now = [100.0]
    beat = Heartbeat(Notifier({"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "4000000"}), clock=lambda: now[0])
    assert beat.period == 1.0
    beat.step(10, Heartbeat.STARTING)
    assert beat.beat() == ["WATCHDOG=1", "EXTEND_TIMEOUT_USEC=10000000"]
    now[0] += 4
    beat.step(30, Heartbeat.RUNNING)
    assert beat.beat() == ["WATCHDOG=1"]  # running: no timeout to extend
    now[0] += 30.5
    assert beat.beat() == []  # the main loop did not come back within its step: a wedged supervise
    beat.step(5, Heartbeat.STOPPING)
    assert beat.beat() == ["WATCHDOG=1", "EXTEND_TIMEOUT_USEC=5000000"]


def test_the_cli_says_what_it_does_as_it_happens_and_is_quiet_with_json(make_policy, service_cleanup):
    policy = make_policy()
    service_cleanup(policy)
    r = run_cli("start", "--policy", policy)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert "starting the engine (cold); its log: " in lines[0] and "waiting for it to answer (up to 60 s)" in lines[1]
    r = run_cli("restart", "--policy", policy, "--strategy", "cold", "--json")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    json.loads(r.stdout)
    bad = run_cli("policy", "check", policy.parent / "nope.toml", env={"NO_COLOR": "1"})
    assert bad.returncode == 2 and "\x1b[" not in bad.stderr and bad.stderr.startswith("error: ")


def test_snapshot_restore_without_a_snapshot_exits_3(make_policy, service_cleanup):
    policy = make_policy()
    service_cleanup(policy)
    r = run_cli("snapshot", "restore", "--policy", policy, "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 3 and rec["served_by"] == "cold" and rec["via_recovery"], (r.returncode, rec)


def test_an_interpreter_under_a_private_tmp_is_refused(make_policy, monkeypatch, tmp_path):
    """A venv under /tmp, hidden by the unit's PrivateTmp=yes (203/EXEC): refused at install, naming it.
    (The policy puts the weight cache's sockets outside /tmp, so the unit's /tmp is private.)"""
    from restartkit.systemd import units
    from restartkit.service import Service
    outside = Path(tempfile.mkdtemp(dir="/dev/shm"))  # state and sockets outside /tmp: the unit's /tmp is private
    try:
        policy = make_policy(extra=f'\n[ipc]\nsocket_dir = "{outside}/sockets"\n')
        policy.write_text("\n".join(ln for ln in policy.read_text().splitlines() if not ln.startswith("state_dir")))
        svc = Service.from_policy_file(str(policy), str(outside / "state"))
    finally:
        shutil.rmtree(outside, ignore_errors=True)
    monkeypatch.setattr(units, "interpreter_paths", lambda: ["/tmp/venv/bin/python3"])
    assert "under /tmp, which the unit's PrivateTmp=yes hides" in units.reach_problem(svc, None)
    monkeypatch.setattr(units, "interpreter_paths", lambda: ["/usr/bin/python3"])
    assert units.reach_problem(svc, None) is None
