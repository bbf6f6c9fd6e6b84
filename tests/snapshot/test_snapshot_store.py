"""The snapshot store against damaged manifests: named as damaged, kept for inspection, never
restored and never pruned silently; a snapshot that is a link is shown, not hidden; a creation
time in the future is suspect with its reason (the next refresh takes it again), the others listed as they are."""
import json
import math
import os
import time

import pytest

from restartkit.snapshot.store import MANIFEST, SnapshotStore, manifest_problem
from tests.helpers import run_cli

GOOD = {"created_at": 1000.0, "pid": 4242, "tree_pids": [4242, 4243], "identity": {"arch": "x86_64"},
        "canary": {"prompts": ["a"], "tokens": [[1, 2]]}, "kind": "full", "files": {}, "image_bytes": 10}


def snapshot(root, sid, manifest, raw=None):
    d = root / sid
    d.mkdir(parents=True, mode=0o700)
    (d / MANIFEST).write_text(raw if raw is not None else json.dumps(manifest))
    return d


@pytest.mark.parametrize("bad, words", [
    ([], "is a list"),
    ({**GOOD, "identity": "x86_64"}, "identity is missing or not a dict"),
    ({**GOOD, "tree_pids": [1]}, "tree_pids are not process ids"),
    ({**GOOD, "tree_pids": ["4242"]}, "tree_pids are not process ids"),
    ({**GOOD, "pid": True}, "pid is missing"),
    ({**GOOD, "created_at": math.inf}, "created_at is not a time"),
    ({**GOOD, "kind": "partial"}, "kind 'partial'"),
    ({**GOOD, "suspect": "yes"}, "suspect is not a dict"),
])
def test_each_manifest_problem_is_named(bad, words):
    assert manifest_problem(GOOD) is None
    assert words in manifest_problem(bad)


def test_damaged_snapshots_are_listed_kept_and_never_current_for_a_restore(tmp_path):
    store = SnapshotStore(tmp_path / "snaps")
    snapshot(store.root, "20260101-000000-1", GOOD)
    snapshot(store.root, "20260101-000001-2", None, raw="{not json")
    snapshot(store.root, "20260101-000002-3", {**GOOD, "identity": []})
    os.chmod(store.root, 0o700)
    (store.root / "elsewhere").mkdir()
    real = snapshot(tmp_path, "real", GOOD)
    (store.root / "20260101-000003-4").symlink_to(real)
    listed = {s.id: s.damaged for s in store.list()}
    assert listed["20260101-000000-1"] is None
    assert "cannot be read" in listed["20260101-000001-2"]
    assert "identity" in listed["20260101-000002-3"]
    assert "is a symbolic link" in listed["20260101-000003-4"]
    store.make_current(store.get("20260101-000001-2"))
    assert store.current().damaged
    removed = store.prune(keep=1)
    assert set(removed) == {"elsewhere"}  # a directory without a manifest goes; damaged ones stay
    assert {s.id for s in store.list()} == set(listed)


def test_a_creation_time_in_the_future_is_suspect_with_its_reason():
    from restartkit.snapshot.store import Snapshot
    ahead = Snapshot(None, {**GOOD, "created_at": time.time() + 86400})
    assert "dated 86400 s in the future" in ahead.suspect["reason"] and ahead.age_s == 0
    assert Snapshot(None, {**GOOD, "created_at": time.time() + 60}).suspect is None  # within the clock's skew
    assert 0 <= Snapshot(None, {**GOOD, "created_at": time.time() - 5}).age_s < 60


@pytest.mark.slow
def test_a_snapshot_dated_in_the_future_leaves_the_store_readable(make_policy):
    """A clock stepped back: plan names the snapshot suspect with why (no OverflowError), list shows every
    snapshot, and an older one is still listed as it was."""
    policy = make_policy()
    policy.write_text(policy.read_text().replace("[restart]\n", '[restart]\nstrategies = ["criu", "cold"]\n'))
    root = policy.parent / "state" / "svc" / "snapshots"
    root.mkdir(parents=True, mode=0o700)
    snapshot(root, "20260101-000000-1", {**GOOD, "created_at": time.time() - 3600})
    ahead = snapshot(root, "20990101-000000-1", {**GOOD, "created_at": time.time() + 86400 * 30})
    SnapshotStore(root).make_current(SnapshotStore(root).get(ahead.name))
    r = run_cli("plan", "--policy", policy, "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    (criu,) = [v for v in json.loads(r.stdout)["strategies"] if v["strategy"] == "criu"]
    assert "in the future" in " ".join(criu["reasons"]), criu
    listed = json.loads(run_cli("snapshot", "list", "--policy", policy, "--json").stdout)
    rows = {s["id"]: s for s in listed["snapshots"]}
    assert rows["20260101-000000-1"]["age_h"] == 1.0 and rows["20990101-000000-1"]["suspect"], rows


@pytest.mark.slow
def test_plan_and_list_name_a_damaged_current_snapshot(make_policy):
    policy = make_policy()
    root = policy.parent / "state" / "svc" / "snapshots"
    root.mkdir(parents=True, mode=0o700)
    d = snapshot(root, "20260101-000000-1", None, raw='{"identity": 5}')
    SnapshotStore(root).make_current(SnapshotStore(root).get(d.name))
    r = run_cli("plan", "--policy", policy, "--json")
    assert "Traceback" not in r.stderr, r.stderr
    reasons = {s["strategy"]: s["reasons"] for s in json.loads(r.stdout)["strategies"]}
    assert any("snapshot 20260101-000000-1 is damaged" in x and "kept for inspection" in x for x in reasons["criu"])
    r = run_cli("snapshot", "list", "--policy", policy)
    assert r.returncode == 0 and "DAMAGED (kept for inspection)" in r.stdout, r.stdout + r.stderr
    r = run_cli("snapshot", "inspect", "--policy", policy)
    assert r.returncode == 2 and "is damaged" in r.stderr, r.stderr
    assert (d / MANIFEST).read_text() == '{"identity": 5}'  # untouched
