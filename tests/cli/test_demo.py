"""The README's first command and `restartkit bench`, run for real: the demo end to end on the
reference model (CPU), and a bench of two strategies whose numbers come from real restarts."""
from __future__ import annotations

import json

import pytest

from tests.helpers import free_port, run_cli


@pytest.mark.slow
def test_bench_compares_strategies_from_real_restarts(make_policy, service_cleanup, tmp_path):
    policy = make_policy(extra="\n[sleep]\nenabled = true\nlevel = 1\n")
    service_cleanup(policy)
    r = run_cli("bench", "--policy", policy, "--strategies", "sleep,cold", "--repeat", "2", "--out", tmp_path / "b",
                "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    rows = {row["strategy"]: row for row in result["rows"]}
    for name in ("sleep", "cold"):
        row = rows[name]
        assert row["clean_runs"] == 2 and row["canary_identical"], row
        assert all(run["served_by"] == name for run in row["runs"])
        assert 0 < row["time_to_ready_s"]["min"] <= row["time_to_ready_s"]["median"] <= row["time_to_ready_s"]["max"]
    assert rows["sleep"]["time_to_ready_s"]["median"] < rows["cold"]["time_to_ready_s"]["median"]  # no new process
    assert json.loads((tmp_path / "b" / "bench.json").read_text())["rows"][0]["strategy"] == "sleep"
    # every bench run is a restart record like any other
    hist = json.loads(run_cli("history", "--policy", policy, "--json").stdout)["records"]
    assert {rec["id"] for rec in hist} >= {run["record"] for row in result["rows"] for run in row["runs"]}
    bad = run_cli("bench", "--policy", policy, "--strategies", "cold,warp")
    assert bad.returncode == 2 and "warp" in bad.stderr


@pytest.mark.slow
def test_the_demo_runs_end_to_end(tmp_path):
    """What a newcomer runs first: it must serve through auto with an identical canary, bench what
    this host can run, and leave nothing running."""
    r = run_cli("demo", "--workdir", tmp_path / "demo", "--repeat", "1", "--port", free_port(),
                env={"RESTARTKIT_STATE_DIR": str(tmp_path / "s")},
                timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    for step in ("== starting the reference engine", "== restartkit plan --strategy auto",
                 "== restartkit restart --strategy auto", "== restartkit bench"):
        assert step in out, step
    assert "canary: identical" in out
    assert "the demo engine and its weight cache were stopped" in out
    # its last act: a SIGKILL under supervise, served by the standby on the held socket, nothing refused
    crash = next(line for line in out.splitlines() if line.startswith("answering again"))
    assert "served by standby" in crash and " 0 connections refused, 0 HTTP 5xx, 0 lost" in crash, crash  # the front
    # the state went where the caller said (--state-dir / RESTARTKIT_STATE_DIR), not into the workdir
    assert (tmp_path / "s" / "demo" / "history.jsonl").exists() and not (tmp_path / "demo" / "state").exists()
    assert (tmp_path / "s" / "demo" / "snapshot.prom").exists()  # written whether or not a snapshot could be taken
    status = json.loads(run_cli("status", "--policy", tmp_path / "demo" / "demo.toml", "--json",
                                env={"RESTARTKIT_STATE_DIR": str(tmp_path / "s")}).stdout)
    assert not status["serving"]
