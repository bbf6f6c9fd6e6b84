"""`restartkit rollout`: the weight cache started first, then an ipc restart with fallback off
(a silent disk load cannot pass for a working cache), then the policy's own setting; and
`vllm preload` built from the policy, failing at once where vLLM has none."""
import json

import pytest

from restartkit.engines.vllm import VLLMAdapter
from tests.helpers import ipc_policy, needs_vllm, run_cli, vllm_policy_for


def test_rollout_starts_the_cache_and_proves_it(make_policy, sockdir, service_cleanup):
    policy = ipc_policy(make_policy, sockdir)  # the policy itself allows fallback
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    try:
        r = run_cli("rollout", "--policy", policy, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        recs = json.loads(r.stdout)["records"]
        assert [rec["served_by"] for rec in recs] == ["ipc", "ipc"]
        assert all(rec["attempts"][0]["proof"]["ipc"] == "hit" and rec["proof"]["canary_identical"] for rec in recs)
        assert "started the weight cache" in r.stderr
    finally:
        run_cli("weightcache", "release", "--policy", policy, "--stop", "--force")


def test_rollout_builds_vllm_preload_with_the_policy_layout():
    from restartkit.policy import parse_policy
    from restartkit.commands.rollout import vllm_preload_argv
    p = parse_policy({"service": {"name": "v", "engine": "vllm", "model": "org/m", "device": "cuda", "dtype": "bfloat16",
                                  "tensor_parallel_size": 4, "revision": "ab" * 20, "port": 8123,
                                  "engine_args": ["--quantization", "fp8"]},
                      "ipc": {"health_port": 8099, "socket_dir": "/run/wc"}})
    argv = vllm_preload_argv(p)
    assert argv[1:5] == ["-m", "vllm.entrypoints.cli.main", "preload", "--model"]
    i = argv.index("--weight-cache-health-host")
    assert argv[i + 1] == "127.0.0.1" and argv[argv.index("--weight-cache-health-port") + 1] == "8099"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4" and "--revision" in argv
    # the engine's own arguments (so the fingerprint matches), not the server's
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv[argv.index("--quantization") + 1] == "fp8"
    assert "--port" not in argv and "--host" not in argv and "8123" not in argv
    assert argv[argv.index("--weight-cache-socket-dir") + 1] == "/run/wc"
    cfg = json.loads(VLLMAdapter().ipc_args(p)[-1])
    assert cfg["socket_dir"] == "/run/wc" and set(cfg) == {"mode", "fallback", "connect_timeout_s", "state_timeout_s", "socket_dir"}


@pytest.mark.slow
@needs_vllm
def test_rollout_says_at_once_when_vllm_preload_cannot_start(make_policy, vllm_model, service_cleanup):
    """The installed vLLM (the CPU build) has no `preload`: rollout must say so within seconds,
    with vLLM's own words, not wait out the cache's start-up timeout."""
    import time
    policy = vllm_policy_for(make_policy, vllm_model, service_cleanup)
    policy.write_text(policy.read_text() + "\n[ipc]\nhealth_port = 18099\nstartup_timeout_s = 600\n")
    t0 = time.monotonic()
    r = run_cli("rollout", "--policy", policy, timeout=300)
    assert r.returncode != 0 and time.monotonic() - t0 < 120
    assert "vllm preload exited with code" in r.stderr and "preload" in r.stderr, r.stderr
