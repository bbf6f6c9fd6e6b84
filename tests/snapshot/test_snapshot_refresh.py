"""`restartkit snapshot refresh` (cron or the systemd timer it installs): one refresh at a time,
a new snapshot current only after its test restore passed, the timer's units."""
import json
import subprocess
import sys

from tests.helpers import CRIU, CRIU_MARKS, ROOT, create, prom_value, run_cli

pytestmark = CRIU_MARKS


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


def test_install_timer_writes_units(served, tmp_path):
    policy = served()
    r = run_cli("snapshot", "refresh", "--policy", policy, "--install-timer", "--unit-dir", tmp_path)
    assert r.returncode == 0, r.stderr
    timer = (tmp_path / "restartkit-refresh-svc.timer").read_text()
    assert "Persistent=true" in timer and "RandomizedDelaySec" in timer and "OnCalendar=daily" in timer
    assert "snapshot refresh --policy" in (tmp_path / "restartkit-refresh-svc.service").read_text()
    assert "snapshot refresh --policy" in r.stdout  # the crontab line


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
    succeeded = prom_value(prom, "restartkit_snapshot_refresh_last_success_timestamp_seconds")
    assert abs(succeeded - prom_value(prom, "restartkit_snapshot_refresh_timestamp_seconds")) < 1e-6
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
    assert prom_value(prom, "restartkit_snapshot_refresh_last_success_timestamp_seconds") == succeeded  # the ok one
    assert prom_value(prom, "restartkit_snapshot_refresh_timestamp_seconds") > succeeded
    assert prom_value(prom, "restartkit_snapshot_current_test_passed") == 1
    assert json.loads(run_cli("status", "--policy", policy, "--json").stdout)["serving"]


def test_a_refresh_says_records_and_exports_how_long_it_froze_the_engine(served):
    import re
    policy = served()
    r = run_cli("snapshot", "refresh", "--policy", policy, "--force")
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"the engine served nothing for ([0-9.]+) s", r.stdout)
    assert m and float(m[1]) > 0, r.stdout
    listing = json.loads(run_cli("snapshot", "list", "--policy", policy, "--json").stdout)["snapshots"]
    snap = next(s for s in listing if s["current"])
    manifest = json.loads((policy.parent / "state" / "svc" / "snapshots" / snap["id"] / "manifest.json").read_text())
    assert abs(manifest["freeze_s"] - float(m[1])) < 0.01
    prom = policy.parent / "state" / "svc" / "snapshot.prom"
    assert abs(prom_value(prom, "restartkit_snapshot_current_freeze_seconds") - manifest["freeze_s"]) < 1e-6
    assert prom_value(prom, "restartkit_snapshot_current_bytes") == manifest["image_bytes"] > 0
    plan = json.loads(run_cli("plan", "--policy", policy, "--strategy", "criu", "--json").stdout)
    assert any("froze the engine for" in n for n in plan["notes"]), plan["notes"]
