"""vLLM's weights-less snapshots against the real vLLM CPU build: an ipc restart proven by every rank's hit,
a weights-less snapshot (the worker extension releases the weights and the KV cache) against a whole-process
one, and a criu+ipc restart with the canary identical."""
import os

import pytest

from tests.helpers import (CRIU, START_S, cache_policy, cli_json, io_uring, needs_vllm, run_cli, shm_left, start_preload, strategy)

pytestmark = [pytest.mark.slow, needs_vllm]


@pytest.mark.root
@pytest.mark.skipif(os.getuid() != 0 or not CRIU.check_ok, reason="needs root and a working CRIU (scripts/install-criu)")
def test_vllm_ipc_and_criu_ipc_restarts(make_policy, vllm_model, service_cleanup, sockdir, preloads):
    """With the weight cache preloaded: an ipc restart proven by every rank's hit; a weights-less snapshot at
    most half the size of a whole-process one; a criu+ipc restart with the canary identical; /dev/shm back."""
    shm_before = set(os.listdir("/dev/shm"))
    policy = cache_policy(make_policy, vllm_model, service_cleanup, sockdir, kv_gib=2)
    with io_uring(2):
        start_preload(policy, preloads)
        assert run_cli("start", "--policy", policy, timeout=START_S).returncode == 0
        code, plan = cli_json("plan", "--policy", policy)
        assert strategy(plan, "ipc")["eligible"], strategy(plan, "ipc")
        code, rec = cli_json("restart", "--policy", policy, "--strategy", "ipc", "--strict")
        assert code == 0 and rec["served_by"] == "ipc" and not rec["via_recovery"], rec
        proof = rec["attempts"][-1]["proof"]
        assert proof["ipc"] == "hit" and proof["ranks"] == ["hit"] and proof["weight_source"] == "ipc", proof
        assert rec["proof"]["canary_identical"] is True, rec
        # the whole process (weights and KV cache in the image), then weights-less (both released first)
        full_policy = policy.with_name("full.toml")
        full_policy.write_text(policy.read_text().replace("[criu]\n", "[criu]\nweights = \"include\"\n"))
        code, full = cli_json("snapshot", "create", "--policy", full_policy)
        assert code == 0 and full["kind"] == "full", full
        code, snap = cli_json("snapshot", "create", "--policy", policy)
        assert code == 0 and snap["kind"] == "weightless", snap
        print("vLLM images: whole process", full["image_bytes"], "weights-less", snap["image_bytes"])
        assert snap["image_bytes"] <= full["image_bytes"] / 2, (snap["image_bytes"], full["image_bytes"])
        code, rec = cli_json("restart", "--policy", policy, "--strategy", "criu+ipc", "--strict")
        assert code == 0 and rec["served_by"] == "criu+ipc", rec
        assert rec["proof"]["canary_identical"] is True, rec
        print("vLLM criu+ipc restart to ready", rec["time_to_ready_s"], "s")
    assert run_cli("stop", "--policy", policy).returncode == 0
    left = shm_left(shm_before)
    assert all(os.path.basename(f).startswith("sem.mp-") and os.path.getsize(f) <= 64 for f in left), left
