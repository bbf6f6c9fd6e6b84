"""engine = "command": any OpenAI-compatible server started by a command (here the
reference server, started the way a user would start their own), restarted and
proven like the others; a missing binary is named before anything stops."""
import json
import os
import sys
import time

import pytest

from restartkit.engines.command import canary_tokens
from tests.helpers import run_cli


def command_policy(make_policy, tiny_model, argv):
    policy = make_policy(service_extra=f"command = {json.dumps(argv)}\n")
    policy.write_text(policy.read_text().replace('engine = "reference"', 'engine = "command"'))
    return policy


SERVER = [sys.executable, "-m", "restartkit.reference.serving.server", "--model", "{model}", "--host", "{host}",
          "--port", "{port}", "--max-model-len", "{max_model_len}", "--served-model-name", "{served_model_name}"]


@pytest.mark.slow
def test_a_command_engine_restarts_cold_with_an_identical_canary(make_policy, tiny_model, service_cleanup):
    policy = command_policy(make_policy, tiny_model, SERVER)
    service_cleanup(policy)
    r = run_cli("start", "--policy", policy)
    assert r.returncode == 0, r.stdout + r.stderr
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    reasons = {s["strategy"]: " ".join(s["reasons"]) for s in plan["strategies"]}
    assert "generic command engine" in reasons["ipc"] and "generic command engine" in reasons["sleep"]
    assert plan["attempt"] == "cold"
    r = run_cli("restart", "--policy", policy, "--strategy", "auto", "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["served_by"] == "cold" and rec["proof"]["canary_identical"] is True, rec
    assert all(isinstance(t, int) for t in rec["proof"]["after"][0])  # this server gives token ids


@pytest.mark.slow
def test_probes_and_canary_use_the_name_the_engine_serves(make_policy, tiny_model, service_cleanup):
    """A server that serves its own name (here the reference server's default, the directory's base name,
    not the policy's model path) is probed and compared by that name, from /v1/models; with
    [service] served_model_name the policy's name is sent."""
    policy = command_policy(make_policy, tiny_model, SERVER[:-2])  # no --served-model-name: it serves "tiny"-like
    service_cleanup(policy)
    r = run_cli("start", "--policy", policy)
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli("restart", "--policy", policy, "--strategy", "cold", "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["proof"]["canary_identical"] is True, r.stdout + r.stderr
    named = command_policy(make_policy, tiny_model, SERVER[:-2] + ["--served-model-name", "mine"])
    named.write_text(named.read_text().replace("[service]\n", '[service]\nserved_model_name = "mine"\n'))
    r = run_cli("restart", "--policy", named, "--strategy", "cold", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["proof"]["canary_identical"] is True, r.stdout + r.stderr


def test_a_missing_command_is_named_before_anything_stops(make_policy, tiny_model, tmp_path):
    policy = command_policy(make_policy, tiny_model, [str(tmp_path / "no-such-server"), "--port", "{port}"])
    r = run_cli("start", "--policy", policy)
    assert r.returncode != 0 and "no-such-server" in r.stderr and "not an executable file" in r.stderr
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    assert plan["attempt"] is None
    policy = command_policy(make_policy, tiny_model, ["server-nobody-installed", "--port", "{port}"])
    assert "is not on PATH" in run_cli("start", "--policy", policy).stderr
    policy = command_policy(make_policy, tiny_model, [sys.executable, "--gpu", "{gpu}"])
    assert "placeholder" in run_cli("start", "--policy", policy).stderr


def test_canary_uses_the_most_exact_answer_the_server_gives():
    assert canary_tokens({"token_ids": [5, 6], "text": "ab"}) == [5, 6]
    assert canary_tokens({"logprobs": {"tokens": ["a", "b"]}, "text": "ab"}) == ["tok:a", "tok:b"]
    assert canary_tokens({"text": "ab"}) == ["text:ab"]


@pytest.mark.slow
@pytest.mark.root
def test_a_command_engine_is_snapshotted_and_restored_by_criu(make_policy, tiny_model, service_cleanup):
    import os

    from restartkit.facts import criu_facts
    if os.getuid() != 0 or not criu_facts().check_ok:
        pytest.skip("needs root and a working CRIU (scripts/install-criu)")
    policy = command_policy(make_policy, tiny_model, SERVER)
    policy.write_text(policy.read_text() + "\n[criu]\npid_wait_s = 5.0\n")
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    r = run_cli("snapshot", "create", "--policy", policy, "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(run_cli("plan", "--policy", policy, "--json").stdout)
    assert plan["attempt"] == "criu", plan
    r = run_cli("restart", "--policy", policy, "--strategy", "criu", "--strict", "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["served_by"] == "criu" and rec["proof"]["canary_identical"] is True, rec


def test_a_single_file_checkpoint_is_pinned_for_snapshots(tmp_path):
    """A GGUF-style single-file model is local: criu does not ask for a hub revision, and the
    snapshot's identity changes when the file does."""
    import os

    from restartkit.contracts import Facts, ServiceFacts
    from restartkit.policy import parse_policy
    from restartkit.weightcache.fingerprint import local_checkpoint_identity
    from restartkit.strategies.criu_checks import model_is_local, revision_pinned
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 100)
    pol = lambda m: parse_policy({"service": {"name": "s", "engine": "command", "model": m,  # noqa: E731
                                              "command": ["srv", "{model}"]}})
    gathered = lambda m: Facts(host=None, service=ServiceFacts(engine="command"),  # noqa: E731
                               strategy={"criu": {"model_local": model_is_local(m)}})
    assert revision_pinned(gathered(str(model)), pol(str(model))) is None
    assert "hub id" in revision_pinned(gathered("org/model"), pol("org/model"))
    before = local_checkpoint_identity(str(model))
    model.write_bytes(b"GGUF" + b"\1" * 101)
    os.utime(model, ns=(1, 1))
    assert before and local_checkpoint_identity(str(model)) != before
    assert local_checkpoint_identity("org/model") is None


def transformers_serve():
    """`transformers serve` (transformers[serving]): a third-party OpenAI-compatible server that refuses
    fields it does not know (422) and returns neither token ids nor logprobs."""
    import importlib.util
    import shutil
    exe = shutil.which("transformers", path=os.path.dirname(sys.executable))
    missing = [m for m in ("transformers", "fastapi", "uvicorn", "accelerate") if importlib.util.find_spec(m) is None]
    if exe is None or missing:
        pytest.skip(f"transformers[serving] is not installed ({', '.join(missing) or 'no transformers command'})")
    return exe


STRICT_ENV = 'env = { HF_HUB_OFFLINE = "1", HF_HUB_DISABLE_UPDATE_CHECK = "1", OMP_NUM_THREADS = "1" }\n'


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["cold", "criu"])
def test_a_strict_third_party_server_restarts_as_a_command_engine(make_policy, service_cleanup, tmp_path, strategy):
    """The readiness probe carries the standard fields only; the canary falls back from token ids and
    logprobs (refused with a 422, then ignored) to the text, and the record says so."""
    if strategy == "criu":
        from restartkit.facts import criu_facts
        if os.getuid() != 0 or not criu_facts().check_ok:
            pytest.skip("needs root and a working CRIU (scripts/install-criu)")
    from tests.hf import checkpoint
    model = tmp_path / "hf-llama"
    checkpoint(model, rope_theta=10000.0)
    argv = [transformers_serve(), "serve", "{model}", "--host", "{host}", "--port", "{port}", "--device", "cpu"]
    policy = make_policy(model=str(model), service_extra=f"command = {json.dumps(argv)}\n" + STRICT_ENV)
    policy.write_text(policy.read_text().replace('engine = "reference"', 'engine = "command"')
                      .replace('engine_args = ["--threads", "1"]\n', "") + "\n[criu]\npid_wait_s = 5.0\n")
    service_cleanup(policy)
    import contextlib
    from tests.helpers import io_uring
    with io_uring(2) if strategy == "criu" else contextlib.nullcontext():  # its uvloop makes one otherwise
        restarted(policy, strategy)


def restarted(policy, strategy):
    t0 = time.monotonic()
    r = run_cli("start", "--policy", policy)
    assert r.returncode == 0, r.stdout + r.stderr
    assert time.monotonic() - t0 < 50  # the probe was answered, not waited out
    if strategy == "criu":
        r = run_cli("snapshot", "create", "--policy", policy, "--json")
        assert r.returncode == 0, r.stderr
    r = run_cli("restart", "--policy", policy, "--strategy", strategy, "--strict", "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["served_by"] == strategy and rec["proof"]["canary_identical"] is True, rec
    assert rec["proof"]["compared_by"] == "text" and rec["proof"]["after"][0][0].startswith("text:"), rec["proof"]


@pytest.mark.slow
def test_a_4xx_to_the_readiness_probe_is_reported_at_once(make_policy, tiny_model, service_cleanup):
    """A server that answers the probe with a 400 (here one whose own max_model_len cannot hold it) is not
    waited out for start_timeout_s: the start fails with the server's message."""
    argv = [a if a != "{max_model_len}" else "6" for a in SERVER]
    policy = command_policy(make_policy, tiny_model, argv)
    policy.write_text(policy.read_text().replace("start_timeout_s = 60", "start_timeout_s = 240"))
    service_cleanup(policy)
    t0 = time.monotonic()
    r = run_cli("start", "--policy", policy)
    assert r.returncode != 0 and time.monotonic() - t0 < 60, r.stderr
    assert "refused restartkit's readiness probe: HTTP 400" in r.stderr and "exceeds max_model_len" in r.stderr, r.stderr
    assert "raise [restart] start_timeout_s" not in r.stderr
