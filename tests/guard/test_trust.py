"""Directories another user made first are not trusted: a state dir or a snapshot root owned by
someone else, writable by others, or a link, is refused with the path and the fix, and nothing
planted there (an intent naming a PID, a snapshot) is acted on.  Real commands, real uids."""
import json
import os
import subprocess

import pytest

from restartkit.guard.trust import trust_problem
from restartkit.process.procfs import proc_start_ticks
from tests.helpers import run_cli

pytestmark = pytest.mark.slow
root_only = pytest.mark.skipif(os.getuid() != 0, reason="needs root (another uid's directories)")
NOBODY = 65534


def state_of(policy):
    return policy.parent / "state" / "svc"


def plant_intent(policy, victim_pid: int, start_ticks: int):
    """An intent.json of a dead `restartkit restart` naming `victim_pid`; returns the state dir."""
    state = state_of(policy)
    state.mkdir(parents=True, mode=0o700, exist_ok=True)
    (state / "intent.json").write_text(json.dumps({
        "command": "restart", "pid": 999999, "start_ticks": start_ticks, "pids": [victim_pid], "was_serving": False}))
    return state


def test_the_rules_name_each_problem(tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    assert trust_problem(d, "state dir") is None
    assert trust_problem(tmp_path / "missing", "state dir") is None  # made by restartkit when needed
    os.chmod(d, 0o777)
    assert "is writable by others (mode 777)" in trust_problem(d, "state dir")
    os.chmod(d, 0o700)
    (tmp_path / "link").symlink_to(d)
    assert "is a symbolic link" in trust_problem(tmp_path / "link", "state dir")
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    os.chmod(open_parent, 0o777)
    (open_parent / "svc").mkdir(mode=0o700)
    assert "could be swapped" in trust_problem(open_parent / "svc", "state dir")
    os.chmod(open_parent, 0o1777)  # sticky, like /tmp: entries cannot be renamed by others
    assert trust_problem(open_parent / "svc", "state dir") is None


@root_only
def test_a_state_dir_of_another_user_is_refused_and_not_written(make_policy):
    policy = make_policy()
    state = state_of(policy)
    state.mkdir(parents=True, mode=0o700)
    os.chown(state, NOBODY, NOBODY)
    r = run_cli("start", "--policy", policy)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"the state dir {state} belongs to uid {NOBODY}" in r.stderr and "chmod 700" in r.stderr, r.stderr
    assert os.listdir(state) == []


def test_a_state_dir_that_is_a_link_is_refused(make_policy, tmp_path):
    policy = make_policy()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    state = state_of(policy)
    state.parent.mkdir(parents=True)
    state.symlink_to(elsewhere)
    r = run_cli("start", "--policy", policy)
    assert r.returncode == 2 and "is a symbolic link" in r.stderr, r.stderr
    assert os.listdir(elsewhere) == []


@root_only
def test_an_intent_planted_by_another_user_kills_nothing(make_policy):
    """Once, a planted intent.json made even `status` SIGKILL the PID it named."""
    policy = make_policy()
    victim = subprocess.Popen(["sleep", "300"])
    try:
        state = plant_intent(policy, victim.pid, 0)
        os.chown(state, NOBODY, NOBODY)
        os.chown(state / "intent.json", NOBODY, NOBODY)
        for args in (["status"], ["stop"], ["plan"]):
            r = run_cli(*args, "--policy", policy)
            assert "Traceback" not in r.stderr, r.stderr
            assert victim.poll() is None, f"`restartkit {args[0]}` killed the PID a planted intent named"
        assert (state / "intent.json").exists()
    finally:
        victim.kill()


def test_an_intent_never_kills_a_pid_restartkit_did_not_start(make_policy):
    """Even in our own state dir (written by a buggy or older command): a PID the intent names that
    is older than the intent, or not under a keeper of ours, is left alone."""
    policy = make_policy()
    victim = subprocess.Popen(["sleep", "300"])
    try:
        state = plant_intent(policy, victim.pid, proc_start_ticks(victim.pid))
        # status only reports the interrupted restart, and names the command that finishes it
        r = run_cli("status", "--policy", policy, "--json")
        st = json.loads(r.stdout)
        assert r.returncode == 1 and st["interrupted"]["command"] == "restart", r.stdout + r.stderr
        assert st["interrupted"]["engines_left"] == [] and st["next"].startswith("restartkit start --policy")
        assert (state / "intent.json").exists() and victim.poll() is None  # status touched nothing
        r = run_cli("stop", "--policy", policy)  # a command that may act reconciles
        assert "Traceback" not in r.stderr, r.stderr
        assert victim.poll() is None, "reconcile killed a process restartkit did not start"
        assert not (state / "intent.json").exists()  # reconciled: nothing of ours was left
    finally:
        victim.kill()


@root_only
def test_a_snapshot_root_of_another_user_chooses_nothing(make_policy, tmp_path):
    images = tmp_path / "images"
    images.mkdir(mode=0o700)
    os.chown(images, NOBODY, NOBODY)
    policy = make_policy(extra=f'\n[criu]\nimages_dir = "{images}"\n')
    r = run_cli("plan", "--policy", policy, "--json")
    reasons = {s["strategy"]: s["reasons"] for s in json.loads(r.stdout)["strategies"]}
    assert any(f"the snapshot images dir {images} belongs to uid {NOBODY}" in x for x in reasons["criu"]), reasons
    r = run_cli("snapshot", "create", "--policy", policy)
    assert r.returncode == 2 and f"{images} belongs to uid {NOBODY}" in r.stderr, r.stderr


@pytest.mark.parametrize("make_it", ["directory", "immutable"])
def test_a_lock_file_that_cannot_be_opened_is_named_not_a_traceback(make_policy, make_it):
    policy = make_policy()
    state = state_of(policy)
    state.mkdir(parents=True, mode=0o700)
    lock = state / "lock"
    if make_it == "directory":
        lock.mkdir()
    else:
        lock.write_text("")
        if subprocess.run(["chattr", "+i", str(lock)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not possible here")
    try:
        r = run_cli("start", "--policy", policy)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"the lock file {lock} cannot be opened" in r.stderr and "remove it" in r.stderr, r.stderr
        assert not (state / "engine.json").exists()
    finally:
        subprocess.run(["chattr", "-i", str(lock)], capture_output=True)


def test_plan_does_not_run_a_criu_binary_others_can_change(make_policy, tmp_path):
    """A policy names the binary; as root, `plan` (a dry run) would execute it.  One that others
    may write to, or in a directory they may write to, is not run, and plan says why."""
    ran = tmp_path / "ran"
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    fake = open_dir / "criu"
    fake.write_text(f"#!/bin/sh\ntouch {ran}\necho Version: 4.2\n")
    fake.chmod(0o755)
    policy = make_policy(extra=f'\n[criu]\ncriu_path = "{fake}"\n')
    r = run_cli("plan", "--policy", policy, "--json")
    reasons = {s["strategy"]: s["reasons"] for s in json.loads(r.stdout)["strategies"]}
    assert any(f"{open_dir} is writable by others (mode 777)" in x for x in reasons["criu"]), reasons
    assert not ran.exists(), "plan ran a binary that others can change"


def test_criu_facts_are_kept_for_a_while_and_asked_again_when_the_binary_changes(tmp_path):
    """supervise's crash restarts must not run `criu --version` and `criu check` each time, but a
    CRIU replaced meanwhile is asked again."""
    import os
    from restartkit.facts import criu_facts
    calls = tmp_path / "calls"
    fake = tmp_path / "criu"
    fake.write_text(f'#!/bin/sh\necho "$1" >> {calls}\necho "Version: 9.9"\n')
    fake.chmod(0o755)
    first = criu_facts(str(fake))
    again = criu_facts(str(fake))
    assert first.version == again.version == "9.9" and first.check_ok and again is not first
    assert calls.read_text().split() == ["--version", "check"]  # once
    fake.write_text(f'#!/bin/sh\necho "$1" >> {calls}\necho "Version: 10.0"\nexit 1\n')
    os.utime(fake, ns=(1, 1))
    changed = criu_facts(str(fake))
    assert changed.version == "10.0" and not changed.check_ok
    assert calls.read_text().split() == ["--version", "check", "--version", "check"]
