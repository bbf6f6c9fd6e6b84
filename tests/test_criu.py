"""The criu strategy for real: CRIU 4 (installed by scripts/install-criu)
dumps and restores the reference engine; every fault ends serving through a
cold start, with the reason in the record and the snapshot kept."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from restartkit.facts import criu_facts
from tests.conftest import ROOT, run_cli

CRIU = criu_facts()
pytestmark = [
    pytest.mark.slow, pytest.mark.root,
    pytest.mark.skipif(os.getuid() != 0, reason="CRIU needs root"),
    pytest.mark.skipif(not CRIU.check_ok, reason=f"no working CRIU here ({CRIU.source}): scripts/install-criu"),
]


@pytest.fixture
def served(make_policy, service_cleanup):
    def make(extra='pid_wait_s = 5.0\n'):
        policy = make_policy(extra='\n[criu]\n' + extra)
        service_cleanup(policy)
        assert run_cli("start", "--policy", policy).returncode == 0
        return policy
    return make


def snapshots_dir(policy):
    return policy.parent / "state" / "svc" / "snapshots"


def create(policy, *flags):
    r = run_cli("snapshot", "create", "--policy", policy, "--json", *flags)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def restart(policy, *flags):
    r = run_cli("restart", "--policy", policy, "--json", *flags)
    return r.returncode, json.loads(r.stdout)


def assert_recovered(code, rec, words):
    assert code == 3, rec
    assert rec["final_state"] == "serving" and rec["served_by"] == "cold" and rec["via_recovery"]
    assert words in rec["recovery_reason"], rec["recovery_reason"]
    assert rec["proof"]["canary_identical"] is True


def test_snapshot_and_restore_give_the_same_canary(served):
    policy = served()
    snap = create(policy)
    assert snap["left_running"] and snap["image_bytes"] > 0 and snap["kv_cache_freed_bytes"] > 0
    assert json.loads(run_cli("status", "--policy", policy, "--json").stdout)["serving"]  # still serving
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    assert next(s for s in plan["strategies"] if s["strategy"] == "criu")["eligible"], plan
    code, rec = restart(policy, "--strategy", "criu", "--strict")
    assert code == 0, rec
    assert rec["served_by"] == "criu" and rec["proof"]["canary_identical"] is True
    attempt = rec["attempts"][0]
    assert attempt["proof"]["restored_pid"] == snap["pid"]  # CRIU brings the process back under its PID
    assert {"wait_pids", "criu_restore", "kv_cache_restore"} <= set(attempt["phases"])
    # and the restored engine restarts again like any other
    code, rec = restart(policy, "--strategy", "cold")
    assert code == 0 and rec["proof"]["canary_identical"] is True


@pytest.mark.parametrize("fault", ["truncated", "missing"])
def test_a_broken_image_recovers_and_keeps_the_snapshot(served, fault):
    policy = served()
    snap = create(policy)
    images = snapshots_dir(policy) / snap["path"].rsplit("/", 1)[1]
    if fault == "truncated":
        pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
        with open(pages, "r+b") as f:
            f.truncate(pages.stat().st_size // 3)
    else:
        (images / "pstree.img").unlink()
    code, rec = restart(policy, "--strategy", "criu", "--strict")
    assert_recovered(code, rec, "damaged")
    assert ("pstree.img is missing" if fault == "missing" else "written as") in rec["recovery_reason"]
    assert rec["attempts"][0]["detail"]["snapshot_kept"] and images.exists()
    listing = json.loads(run_cli("snapshot", "list", "--policy", policy, "--json").stdout)["snapshots"]
    assert listing[-1]["suspect"], listing  # marked, not deleted
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    assert any("suspect" in r for r in next(s for s in plan["strategies"] if s["strategy"] == "criu")["reasons"])


def test_a_pid_held_past_the_deadline_recovers(served):
    policy = served('pid_wait_s = 1.0\n')
    snap = create(policy, "--stop")  # the engine dies with the dump; its PID is free
    holder = take_pid(snap["pid"])
    try:
        code, rec = restart(policy, "--strategy", "criu", "--strict")
        assert_recovered(code, rec, "PIDs are taken")
        assert str(snap["pid"]) in rec["recovery_reason"]
    finally:
        holder.kill()


def test_identity_mismatch_is_named_and_recovers(served):
    policy = served()
    snap = create(policy)
    manifest_path = snapshots_dir(policy) / snap["path"].rsplit("/", 1)[1] / "manifest.json"
    m = json.loads(manifest_path.read_text())
    m["identity"]["kernel"] = "5.4.0-ancient"
    manifest_path.write_text(json.dumps(m))
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    reasons = next(s for s in plan["strategies"] if s["strategy"] == "criu")["reasons"]
    assert any("kernel: snapshot '5.4.0-ancient', host" in r for r in reasons), reasons
    code, rec = restart(policy, "--strategy", "criu", "--strict")
    assert_recovered(code, rec, "kernel: snapshot '5.4.0-ancient'")
    assert manifest_path.exists()


def test_missing_criu_recovers(served, tmp_path):
    policy = served()
    create(policy)
    text = policy.read_text().replace("[criu]\n", f'[criu]\ncriu_path = "{tmp_path}/no-criu"\n')
    policy.write_text(text)
    code, rec = restart(policy, "--strategy", "criu", "--strict")
    assert_recovered(code, rec, "not an executable file")


def test_two_refreshes_at_once(served):
    policy = served()
    cmd = [sys.executable, "-m", "restartkit.cli", "snapshot", "refresh", "--policy", str(policy), "--force"]
    a = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    b = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    outs = [(p.wait(120), p.stdout.read()) for p in (a, b)]
    codes = sorted(c for c, _ in outs)
    assert codes in ([0, 0], [0, 75]), outs  # the second waited its turn or said it is busy
    assert all(len(o.strip().splitlines()) == 1 for _, o in outs), outs  # one line each, for cron mail
    # fresh now: a plain refresh has nothing to do
    r = run_cli("snapshot", "refresh", "--policy", policy)
    assert r.returncode == 0 and "nothing to do" in r.stdout


def test_sigterm_during_create_keeps_the_previous_snapshot(served):
    policy = served()
    first = create(policy)
    p = subprocess.Popen([sys.executable, "-m", "restartkit.cli", "snapshot", "create", "--policy", str(policy)],
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
    for line in p.stderr:
        if line.startswith("taking the canary"):
            p.send_signal(signal.SIGTERM)
            break
    p.wait(60)
    assert p.returncode != 0
    listing = json.loads(run_cli("snapshot", "list", "--policy", policy, "--json").stdout)["snapshots"]
    current = [s for s in listing if s["current"]]
    assert [s["id"] for s in current] == [first["path"].rsplit("/", 1)[1]]
    time.sleep(0.5)
    assert json.loads(run_cli("status", "--policy", policy, "--json").stdout)["serving"]  # the engine is back


def test_install_timer_writes_units(served, tmp_path):
    policy = served()
    r = run_cli("snapshot", "refresh", "--policy", policy, "--install-timer", "--unit-dir", tmp_path)
    assert r.returncode == 0, r.stderr
    timer = (tmp_path / "restartkit-refresh-svc.timer").read_text()
    assert "Persistent=true" in timer and "RandomizedDelaySec" in timer and "OnCalendar=daily" in timer
    assert "snapshot refresh --policy" in (tmp_path / "restartkit-refresh-svc.service").read_text()
    assert "snapshot refresh --policy" in r.stdout  # the crontab line


def take_pid(pid: int) -> subprocess.Popen:
    """Start a process under `pid` (root: steer the kernel's next PID)."""
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    for _ in range(50):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(["sleep", "300"])
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    pytest.skip(f"could not start a process under PID {pid}")


def prom_value(path, name) -> float:
    line = next(x for x in path.read_text().splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def engines_on(policy) -> list[int]:
    """PIDs of reference engines serving this policy's port (in any PID namespace: as this one sees them)."""
    port = policy.read_text().split("port = ")[1].split()[0]
    out = []
    for d in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"restartkit.reference.server" in cmd and port.encode() in cmd:
            out.append(int(d))
    return out


def test_a_test_restore_runs_beside_the_serving_engine(served):
    """The copy is restored for real (its own PID, network and mount namespaces: the serving engine holds
    its PIDs and its port), answers the canary taken at dump time, and is gone afterwards."""
    policy = served()
    snap = create(policy)
    before = engines_on(policy)
    r = run_cli("snapshot", "test", "--policy", policy, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and out["canary_identical"], out
    assert {"criu_restore", "kv_cache_restore", "ready", "canary"} <= set(out["phases"])
    assert engines_on(policy) == before  # the copy died with its namespace; the engine is the same process
    status = json.loads(run_cli("status", "--policy", policy, "--json").stdout)
    assert status["serving"] and status["pid"] == snap["pid"]
    listing = json.loads(run_cli("snapshot", "list", "--policy", policy, "--json").stdout)["snapshots"]
    assert listing[-1]["tested"] is True and not listing[-1]["suspect"]
    images = snapshots_dir(policy) / snap["id"]
    assert (images / "test-restore.log").exists() and (images / "test-restore-engine.log").exists()
    # no unshare here: the test cannot run, which says nothing about the snapshot (not marked)
    r = run_cli("snapshot", "test", "--policy", policy, env={"PATH": str(images)})
    assert r.returncode != 0 and "unshare" in r.stderr, r.stderr
    listing = json.loads(run_cli("snapshot", "list", "--policy", policy, "--json").stdout)["snapshots"]
    assert not listing[-1]["suspect"] and listing[-1]["tested"] is True


def test_refresh_with_test_restore_switches_only_after_a_pass(served, tmp_path):
    policy = served('pid_wait_s = 5.0\ntest_restore = true\n')
    first = create(policy)
    r = run_cli("snapshot", "refresh", "--policy", policy, "--force")
    assert r.returncode == 0 and "test-restored" in r.stdout, r.stdout + r.stderr
    listing = json.loads(run_cli("snapshot", "list", "--policy", policy, "--json").stdout)["snapshots"]
    second = next(s for s in listing if s["current"])
    assert second["id"] != first["id"] and second["tested"] is True
    prom = policy.parent / "state" / "svc" / "snapshot.prom"
    assert prom_value(prom, "restartkit_snapshot_refresh_ok") == 1
    assert prom_value(prom, "restartkit_snapshot_current_test_passed") == 1
    assert prom_value(prom, "restartkit_snapshot_suspect") == 0
    # a CRIU that dumps but cannot restore (injected): the new snapshot fails its test and never becomes current
    wrapper = tmp_path / "criu"
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = restore ]; then echo "injected: no restore" >&2; exit 1; fi\n'
                       f'exec {CRIU.path} "$@"\n')
    wrapper.chmod(0o755)
    policy.write_text(policy.read_text().replace("[criu]\n", f'[criu]\ncriu_path = "{wrapper}"\n'))
    r = run_cli("snapshot", "refresh", "--policy", policy, "--force")
    assert r.returncode == 1 and "not made current" in r.stdout and "previous snapshot stays current" in r.stdout, r.stdout
    listing = json.loads(run_cli("snapshot", "list", "--policy", policy, "--json").stdout)["snapshots"]
    assert next(s for s in listing if s["current"])["id"] == second["id"]
    assert listing[-1]["id"] != second["id"] and listing[-1]["suspect"] and listing[-1]["tested"] is False
    # for the fleet's alerts: the refresh failed, one snapshot is suspect, the current one still passed its test
    assert prom_value(prom, "restartkit_snapshot_refresh_ok") == 0
    assert prom_value(prom, "restartkit_snapshot_suspect") == 1
    assert prom_value(prom, "restartkit_snapshot_current_test_passed") == 1
    assert json.loads(run_cli("status", "--policy", policy, "--json").stdout)["serving"]
