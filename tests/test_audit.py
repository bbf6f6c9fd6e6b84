"""`restartkit audit` on a deploy-repository fixture: exactly the expected
findings, and none of the near misses (a deliberate fp8_per_tensor, a
commented-out flag, a TOML that is not a policy, longer variable names)."""
import json

from restartkit.audit import audit
from tests.helpers import ROOT, run_cli

FIXTURE = ROOT / "tests" / "fixtures" / "deploy"

EXPECTED = {
    ("app/client.py", 3, "request-mm-kwargs"),
    ("k8s/deployment.yaml", 9, "env-prefix-cache-retention-interval"),
    ("k8s/deployment.yaml", 11, "env-ple-cpu-offload"),
    ("k8s/deployment.yaml", 13, "quantization-fp8-redirect"),
    ("policy.toml", 3, "upgrade-makes-restarts-cold"),
    ("scripts/serve.sh", 3, "env-mm-hasher-algorithm"),
    ("scripts/serve.sh", 4, "admission-knobs"),
    ("scripts/serve.sh", 4, "api-server-module"),
    ("scripts/serve.sh", 4, "tokenizer-mode-slow"),
    ("scripts/serve.sh", 5, "collect-detailed-traces-comma"),
    ("scripts/serve.sh", 5, "quantization-fp8-redirect"),
    ("systemd/vllm.service", 5, "env-scale-out-endpoints"),
    ("systemd/vllm.service", 6, "model-runner-v1"),
    ("systemd/vllm.service", 6, "model-runner-v1-refused"),
    ("systemd/vllm.service", 7, "admission-knobs"),
    ("systemd/vllm.service", 7, "mamba-fine-grained-prefix-cache"),
}


def test_fixture_gives_exactly_the_expected_findings():
    result = audit(FIXTURE)
    got = {(f["path"], f["line"], f["rule"]) for f in result["findings"]}
    assert got == EXPECTED
    # the near misses stay quiet
    assert not any(f["path"] in ("scripts/serve-ok.sh", "pyproject.toml") for f in result["findings"])
    assert result["needs_action"] == sum(1 for f in result["findings"] if f["severity"] == "action") == 13


def test_trusting_the_server_silences_the_request_kwargs_rule(tmp_path):
    (tmp_path / "client.py").write_text('body = {"media_io_kwargs": {"video": {"fps": 2}}}\n')
    assert [f["rule"] for f in audit(tmp_path)["findings"]] == ["request-mm-kwargs"]
    (tmp_path / "serve.sh").write_text("vllm serve m --trust-request-mm-kwargs --max-num-queued-reqs 64\n")
    assert audit(tmp_path)["findings"] == []


def test_version_window():
    assert {f["rule"] for f in audit(FIXTURE, since="0.31", until="0.32")["findings"]} == {"upgrade-makes-restarts-cold"}
    only_031 = {f["rule"] for f in audit(FIXTURE, since="0.30", until="0.31")["findings"]}
    assert {"model-runner-v1", "tokenizer-mode-slow"} <= only_031


def test_cli_exit_codes_and_json(tmp_path):
    r = run_cli("audit", FIXTURE, "--json")
    assert r.returncode == 1 and len(json.loads(r.stdout)["findings"]) == len(EXPECTED)
    (tmp_path / "ok.sh").write_text("vllm serve m --quantization fp8_per_tensor --max-num-queued-reqs 8\n")
    assert run_cli("audit", tmp_path).returncode == 0
    r = run_cli("audit", tmp_path, "--engine", "tgi")
    assert r.returncode == 2 and "no audit rules for engine 'tgi'" in r.stderr
    assert run_cli("audit", tmp_path, "--from", "zero").returncode == 2
