"""history.jsonl read back: every line that is not a record restartkit writes is skipped and
counted, reads are bounded, only a regular file is read, and nothing built on it (evidence, plan,
status, history) fails because of one bad line."""
import json
import math
import os
import threading

import pytest

from restartkit.contracts import Facts, ServiceFacts
from restartkit.evidence import context, gather
from restartkit.policy import parse_policy
from restartkit.record import load_history, record_problem
from tests.helpers import host, run_cli

GOOD = {"id": "a1", "service": "s", "requested": "auto", "reason": "restart", "started_at": 1000.0,
        "finished_at": 1002.0, "attempts": [{"strategy": "cold", "role": "primary", "ok": True, "proof": {}}],
        "final_state": "serving", "served_by": "cold", "via_recovery": False, "time_to_ready_s": 2.0,
        "context": {}, "downtime": None}
BAD_LINES = [
    "5", "[]", '"a string"', "null",
    json.dumps({**GOOD, "started_at": "yesterday"}),
    json.dumps({**GOOD, "started_at": True}),
    json.dumps({**GOOD, "time_to_ready_s": "fast"}),
    json.dumps({**GOOD, "time_to_ready_s": -1}),
    json.dumps({**GOOD, "attempts": "cold"}),
    json.dumps({**GOOD, "attempts": [5]}),
    json.dumps({**GOOD, "attempts": [{"strategy": "cold", "proof": "yes"}]}),
    json.dumps({**GOOD, "context": "here"}),
    json.dumps({**GOOD, "downtime": {"downtime_s": "none"}}),
    json.dumps({**GOOD, "final_state": 1}),
    '{"started_at": NaN, "attempts": [], "final_state": "serving"}',
    '{"started_at": Infinity, "attempts": [], "final_state": "serving"}',
    '{"torn": ',
    "[" * 100000,  # deeper than the parser recurses
]


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))


def test_every_malformed_line_is_skipped_and_counted(tmp_path):
    write(tmp_path / "history.jsonl", [json.dumps(GOOD), *BAD_LINES, json.dumps({**GOOD, "id": "a2"})])
    h = load_history(tmp_path)
    assert [r["id"] for r in h.records] == ["a1", "a2"]
    assert h.skipped == len(BAD_LINES) and h.problem is None
    assert h.note() == f"history.jsonl: {len(BAD_LINES)} malformed record(s) skipped"
    assert [r["id"] for r in load_history(tmp_path, last=1).records] == ["a2"]


def test_each_check_names_the_field():
    assert record_problem(GOOD) is None
    assert record_problem(5) == "a int, not an object"
    assert record_problem({**GOOD, "started_at": math.nan}) == "started_at is not a time"
    assert record_problem({**GOOD, "attempts": [{"strategy": 3}]}) == "an attempt is not an object naming its strategy"


def test_a_fifo_is_not_read_and_does_not_block(tmp_path):
    os.mkfifo(tmp_path / "history.jsonl")
    done = []
    t = threading.Thread(target=lambda: done.append(load_history(tmp_path)), daemon=True)
    t.start()
    t.join(5)
    assert done, "reading a FIFO history blocked"
    assert done[0].records == [] and done[0].problem == "it is not a regular file"


def test_a_link_is_not_followed(tmp_path):
    (tmp_path / "history.jsonl").symlink_to("/dev/zero")
    h = load_history(tmp_path)
    assert h.records == [] and h.problem == "it is a symbolic link"
    assert h.note() == "history.jsonl not read: it is a symbolic link"


def test_reads_are_bounded_to_the_end_of_the_file(tmp_path):
    line = json.dumps(GOOD)
    write(tmp_path / "history.jsonl", [line] * 1000 + [json.dumps({**GOOD, "id": "last"})])
    h = load_history(tmp_path, max_bytes=10 * len(line))
    assert 8 <= len(h.records) <= 10 and h.records[-1]["id"] == "last" and h.skipped == 0  # the cut line is not counted


class _Svc:
    def __init__(self, state_dir):
        self.state_dir = state_dir
        self.policy = parse_policy({"service": {"name": "s", "model": "/m"}})


def test_evidence_passes_over_bad_records_and_says_so(tmp_path):
    svc = _Svc(tmp_path)
    f = Facts(host=host(), service=ServiceFacts(engine="reference"))
    ctx = context(f, svc.policy)
    write(tmp_path / "history.jsonl", [*BAD_LINES, json.dumps({**GOOD, "context": ctx, "started_at": 1e12})])
    ev = gather(svc, f, ["sleep", "cold"], now=1e12 + 10)
    assert ev["cold"].source == "measured" and ev["cold"].time_s == 2.0
    assert f.notes == [f"history.jsonl: {len(BAD_LINES)} malformed record(s) skipped"]


@pytest.mark.slow
def test_plan_history_and_status_survive_a_planted_history(make_policy):
    """The commands themselves, against the bad lines (no engine needed to plan)."""
    policy = make_policy()
    state = policy.parent / "state" / "svc"
    state.mkdir(parents=True)
    write(state / "history.jsonl", [json.dumps(GOOD), *BAD_LINES])
    r = run_cli("plan", "--policy", policy)
    assert "Traceback" not in r.stderr and r.returncode in (0, 1), r.stderr
    assert f"history.jsonl: {len(BAD_LINES)} malformed record(s) skipped" in r.stdout, r.stdout
    r = run_cli("history", "--policy", policy, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [x["id"] for x in out["records"]] == ["a1"] and out["skipped"] == len(BAD_LINES)
    r = run_cli("status", "--policy", policy, "--json")
    assert "Traceback" not in r.stderr and json.loads(r.stdout)["running"] is False
    (state / "history.jsonl").unlink()
    os.mkfifo(state / "history.jsonl")
    r = run_cli("plan", "--policy", policy, timeout=60)
    assert "history.jsonl not read: it is not a regular file" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_status_names_no_strategy_for_a_restart_that_served_none(make_policy):
    """A failed restart served by nothing: `status` says failed, never "by None"."""
    policy = make_policy()
    state = policy.parent / "state" / "svc"
    state.mkdir(parents=True)
    write(state / "history.jsonl", [json.dumps({**GOOD, "final_state": "failed", "served_by": None})])
    r = run_cli("status", "--policy", policy)
    assert "last restart: failed" in r.stdout and "None" not in r.stdout, r.stdout + r.stderr
