"""`auto` ranks by what was measured, for real: a snapshot, `restartkit bench` of criu and cold on a
CRIU made slower, and the plan and the restart that follow (the pure half: test_ranking.py)."""
import json
import os

import pytest

from tests.helpers import CRIU, run_cli


def slow_criu(tmp_path, seconds: float):
    """The real CRIU, `seconds` slower at every restore (a slow disk, say) once `tmp_path/slow` exists:
    the snapshot's own test restore runs at full speed, so the estimate made from it puts criu first."""
    w, flag = tmp_path / "slow-criu", tmp_path / "slow"
    w.write_text(f'#!/bin/sh\n[ "$1" = restore ] && [ -e {flag} ] && sleep {seconds}\nexec {CRIU.path} "$@"\n')
    w.chmod(0o755)
    return w, flag


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(os.getuid() != 0 or not CRIU.check_ok, reason="needs root and a working CRIU")
def test_auto_picks_cold_once_criu_was_measured_slower(make_policy, service_cleanup, tmp_path):
    criu, slow = slow_criu(tmp_path, 9)  # far above a cold start of the tiny model (4.5 s on a loaded 2-core VM)
    policy = make_policy(extra=f'\n[criu]\ncriu_path = "{criu}"\npid_wait_s = 5.0\n')
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    r = run_cli("snapshot", "create", "--policy", policy)
    assert r.returncode == 0, r.stderr
    before = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    # no history: criu and cold are ranked by estimates (the snapshot's dump, the engine's own cold start),
    # which on a tiny model may go either way; only a measurement knows of the slow restores to come
    est = {s["strategy"]: s["expected"] for s in before["strategies"]}
    assert est["criu"]["source"] == est["cold"]["source"] == "estimated", est
    slow.touch()  # from now on every restore is 9 s slower, and only a measurement can know it
    r = run_cli("bench", "--policy", policy, "--strategies", "criu,cold", "--repeat", "2", "--json", timeout=900)
    assert r.returncode == 0, r.stderr
    rows = {row["strategy"]: row for row in json.loads(r.stdout)["rows"]}
    criu_s, cold_s = rows["criu"]["time_to_ready_s"]["median"], rows["cold"]["time_to_ready_s"]["median"]
    assert rows["criu"]["clean_runs"] == 2 and criu_s > cold_s, rows
    after = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    assert after["attempt"] == "cold" and after["ranked_by"] == "time_to_ready", after
    exp = {s["strategy"]: s["expected"] for s in after["strategies"]}
    assert exp["criu"]["source"] == exp["cold"]["source"] == "measured"
    assert abs(exp["criu"]["seconds"] - criu_s) < 0.002 and abs(exp["cold"]["seconds"] - cold_s) < 0.002
    assert after["order"].index("cold") < after["order"].index("criu")
    text = run_cli("plan", "--policy", policy).stdout
    assert f"auto chose cold: ready in {exp['cold']['seconds']:.2f} s (measured" in text, text
    assert f"criu {exp['criu']['seconds']:.2f} s" in text, text
    rec = json.loads(run_cli("restart", "--policy", policy, "--json").stdout)
    assert rec["served_by"] == "cold" and not rec["via_recovery"] and rec["proof"]["canary_identical"] is True
    assert rec["plan"]["ranked_by"] == "time_to_ready" and rec["context"]["engine"] == "reference"
    # the operator's fixed order is kept
    policy.write_text(policy.read_text().replace("[restart]\n", '[restart]\nrank = "order"\n'))
    assert json.loads(run_cli("plan", "--policy", policy, "--json").stdout)["attempt"] == "criu"
