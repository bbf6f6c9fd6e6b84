"""The engine's process, for real: its keeper (restartkit/process/keeper.py) reaps it the moment it
exits (the PID free for a CRIU restore), reads like the engine to the caller (its exit
status), ignores the stop signals meant for the engine, and in restore mode adopts what the
restoring process leaves behind; the reference engine writes its threads' stacks on SIGQUIT."""
import json
import os
import signal
import subprocess
import time

import pytest

from restartkit.process import keeper
from tests.helpers import run_cli


def parent_of(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(pid)


def cmdline(pid: int) -> str:
    return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while os.path.exists(f"/proc/{pid}"):
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_the_keeper_reads_like_the_engine():
    k, pid, _ = keeper.start(subprocess.Popen, "spawn", ["sleep", "60"])
    assert parent_of(pid) == k.pid and "keeper.py spawn" in cmdline(k.pid)
    assert os.getsid(pid) == pid  # the engine leads its own session, as CRIU wants of a dumped tree
    os.kill(k.pid, signal.SIGTERM)  # a stop is for the engine, not its keeper
    time.sleep(0.2)
    assert k.poll() is None
    os.kill(pid, signal.SIGKILL)
    assert k.wait(timeout=10) == -signal.SIGKILL  # killed by a signal: the same signal
    assert not os.path.exists(f"/proc/{pid}")  # reaped by the keeper before it exited
    k, _, _ = keeper.start(subprocess.Popen, "spawn", ["sh", "-c", "exit 7"])
    assert k.wait(timeout=10) == 7


def test_what_the_engine_leaves_behind_dies_with_it(tmp_path):
    """A helper the engine started (a multi-process engine's worker) and that a crash orphans comes
    to the keeper, which kills and collects it: nothing holds the engine's memory, port or PIDs."""
    pidfile = tmp_path / "helper.pid"
    k, pid, _ = keeper.start(subprocess.Popen, "spawn",
                             ["sh", "-c", f"sleep 300 >/dev/null 2>&1 & echo $! > {pidfile}; exec sleep 300"])
    end = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < end
        time.sleep(0.01)
    helper = int(pidfile.read_text())
    assert parent_of(helper) == pid
    os.kill(pid, signal.SIGKILL)  # the engine crashes; its helper is orphaned
    assert k.wait(timeout=10) == -signal.SIGKILL
    assert not os.path.exists(f"/proc/{helper}")  # killed and collected by the keeper before it left


def test_a_command_that_cannot_start_is_an_os_error_naming_it():
    with pytest.raises(OSError, match="/nonexistent/engine"):
        keeper.start(subprocess.Popen, "spawn", ["/nonexistent/engine"])


def test_restore_mode_adopts_what_the_restorer_leaves(tmp_path):
    """As `criu restore --restore-detached`: the child exits, its detached child lives on."""
    pidfile = tmp_path / "left.pid"
    k, _, ctl = keeper.start(subprocess.Popen, "restore",
                             ["sh", "-c", f"sleep 60 >/dev/null 2>&1 & echo $! > {pidfile}; exit 3"])
    assert ctl.read(10) == {"exit": 3}
    ctl.close()
    left = int(pidfile.read_text())
    assert parent_of(left) == k.pid  # a child subreaper: the orphan came to the keeper, not to init
    os.kill(left, signal.SIGKILL)
    assert k.wait(timeout=10) == 0  # it leaves once the last adopted process is collected ...
    assert not os.path.exists(f"/proc/{left}")  # ... by itself


def test_an_engine_started_by_restartkit_is_kept(make_policy, service_cleanup):
    policy = make_policy()
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    pid = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    kp = parent_of(pid)
    assert "keeper.py spawn" in cmdline(kp)
    assert not any(str(pid) in p or "restartkit.reference" in p for p in cmdline(kp).split()[:6])  # argv not shown
    os.kill(pid, signal.SIGKILL)
    assert gone(kp)  # the keeper exits only after it collected the engine ...
    assert not os.path.exists(f"/proc/{pid}")  # ... so the PID is free at once
    st = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert not st["serving"]


def test_sigquit_writes_the_engines_stacks_and_it_keeps_serving(make_policy, service_cleanup):
    policy = make_policy()
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    pid = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    log = policy.parent / "state" / "svc" / "engine.log"
    before = log.stat().st_size
    os.kill(pid, signal.SIGQUIT)
    end = time.monotonic() + 10
    while b"most recent call first" not in log.read_bytes()[before:] and time.monotonic() < end:
        time.sleep(0.05)
    assert b"most recent call first" in log.read_bytes()[before:]
    r = run_cli("restart", "--policy", policy, "--strategy", "cold", "--json")  # alive and well: it restarts
    assert r.returncode == 0 and json.loads(r.stdout)["proof"]["canary_identical"] is True


def test_a_killed_keeper_leaves_the_engine_serving(make_policy, service_cleanup):
    """SIGKILL cannot be ignored: the engine goes on (its parent is now init), restartkit still
    knows it by PID and start time, and restarts it."""
    policy = make_policy()
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    pid = json.loads(run_cli("status", "--policy", policy, "--json").stdout)["pid"]
    kp = parent_of(pid)
    os.kill(kp, signal.SIGKILL)
    assert gone(kp)
    st = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert st["serving"] and st["pid"] == pid
    r = run_cli("restart", "--policy", policy, "--strategy", "cold", "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["proof"]["canary_identical"] is True
    assert gone(pid)  # the old engine stopped, even without its keeper


def _zombie_collected_after(delay_s: float | None) -> tuple[subprocess.Popen, int]:
    """A parent whose child exits at once and which collects it only after `delay_s` (None: never);
    returns the parent and the child's PID, once the child is a zombie."""
    collect = "pass" if delay_s is None else f"time.sleep({delay_s}); os.waitpid(c, 0)"
    parent = subprocess.Popen(["python3", "-c", "import os, time\nc = os.fork()\nif c == 0: os._exit(0)\n"
                               f"print(c, flush=True)\n{collect}\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    for _ in range(500):
        if open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
            return parent, child
        time.sleep(0.01)
    raise AssertionError(f"PID {child} never became a zombie")


def test_a_zombie_its_parent_collects_a_moment_later_is_waited_for():
    """An engine just stopped is a zombie until its keeper is next scheduled: a restore waits for that
    (it once gave up at once in a loaded CI run, the snapshot's PID 'taken')."""
    from restartkit.snapshot.restore import ZOMBIE_GRACE_S, wait_pids_free
    parent, child = _zombie_collected_after(0.5)
    try:
        t = time.monotonic()
        assert wait_pids_free([child], 30.0) == []
        assert time.monotonic() - t < ZOMBIE_GRACE_S + 5
    finally:
        parent.kill()
        parent.wait()


def test_a_zombie_its_parent_never_collects_is_named_after_a_grace():
    from restartkit.snapshot.restore import ZOMBIE_GRACE_S, wait_pids_free
    parent, child = _zombie_collected_after(None)
    try:
        t = time.monotonic()
        assert wait_pids_free([child], 30.0) == [child]
        assert ZOMBIE_GRACE_S <= time.monotonic() - t < 30.0  # named, not waited out
    finally:
        parent.kill()
        parent.wait()
