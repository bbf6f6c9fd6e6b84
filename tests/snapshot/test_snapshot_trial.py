"""`restartkit snapshot test`: a copy of the snapshot restored in its own namespaces beside the
serving engine, answering the canary, then gone; the engine never touched."""
import json

from tests.helpers import CRIU_MARKS, create, engines_on, run_cli, snapshots_dir

pytestmark = CRIU_MARKS


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
