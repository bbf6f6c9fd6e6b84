"""What the reference engine offers beside completions, as vLLM's server does: an API key (401 without it,
/health open; restartkit's probes and canary carry it from [service] api_key_file, and it is written to no
record or log), /tokenize and /detokenize, /version, and /metrics that promtool accepts, counting
requests and tokens as they are answered."""
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.helpers import ROOT, prom_sample, promtool_check, run_cli, serve_reference

pytestmark = pytest.mark.slow
KEY = "rk-test-7d0c1f2e9b"


def call(port, path, body=None, key=None):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode() if body is not None
                                 else None, headers)
    with urllib.request.urlopen(req, timeout=30) as r:
        raw = r.read()
    return json.loads(raw) if path != "/metrics" else raw.decode()


def status(port, path, body=None, key=None) -> int:
    try:
        call(port, path, body, key)
        return 200
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    from restartkit.reference.model.checkpoint import write_checkpoint
    path = tmp_path_factory.mktemp("models") / "tiny"
    write_checkpoint(path, "tiny")
    os.environ["RESTARTKIT_API_KEY"] = KEY  # how restartkit gives it: the environment, not the command line
    try:
        proc, port = serve_reference(path, "--served-model-name", "m")
    finally:
        del os.environ["RESTARTKIT_API_KEY"]
    yield port
    proc.terminate()
    proc.wait(30)


def test_the_api_key_guards_the_openai_routes_and_not_health(keyed):
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    assert status(keyed, "/v1/completions", body) == 401
    assert status(keyed, "/v1/completions", body, key="wrong") == 401
    assert status(keyed, "/v1/models") == 401 and status(keyed, "/tokenize", {"prompt": "hi"}) == 401
    assert status(keyed, "/v1/completions", body, key=KEY) == 200
    assert status(keyed, "/health") == 200 and status(keyed, "/version") == 200 and status(keyed, "/metrics") == 200
    cmdline = open(f"/proc/{_pid_on(keyed)}/cmdline", "rb").read()
    assert KEY.encode() not in cmdline


def _pid_on(port) -> int:
    return call(port, "/admin/stats")["pid"]


def test_tokenize_detokenize_and_version(keyed):
    out = call(keyed, "/tokenize", {"prompt": "The quick brown fox"}, KEY)
    assert out["count"] == len(out["tokens"]) > 4 and out["max_model_len"] == 256
    back = call(keyed, "/detokenize", {"tokens": out["tokens"]}, KEY)["prompt"]
    assert back.endswith("The quick brown fox")
    assert status(keyed, "/detokenize", {"tokens": [-1]}, KEY) == 400
    assert status(keyed, "/tokenize", {"prompt": "x", "model": "other"}, KEY) == 404
    messages = [{"role": "user", "content": "hi"}]
    assert status(keyed, "/tokenize", {"prompt": "x", "messages": messages}, KEY) == 400  # never one ignored
    assert status(keyed, "/tokenize", {"messages": messages, "chat_template": "{{ 1 }}"}, KEY) == 400
    assert call(keyed, "/version")["version"]


def settled_metrics(port) -> str:
    """/metrics once it holds every request answered so far: a request is counted just after its last byte
    went out, so a client can read its answer a moment before the count moves."""
    text = call(port, "/metrics")
    for _ in range(100):
        time.sleep(0.02)
        again = call(port, "/metrics")
        if again == text:
            return text
        text = again
    return text


def test_metrics_pass_promtool_and_count_what_was_answered(keyed, tmp_path):
    before = settled_metrics(keyed)
    call(keyed, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0}, KEY)
    status(keyed, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": -1}, KEY)
    after = settled_metrics(keyed)
    # promtool's linter refuses ':' in a name (reserved for recording rules), vLLM's own /metrics included
    (tmp_path / "m.prom").write_text("".join(ln for ln in after.splitlines(True) if "vllm:" not in ln))
    promtool_check(tmp_path / "m.prom")

    def grew(name, **labels):
        return (prom_sample(after, name, **labels) or 0) - (prom_sample(before, name, **labels) or 0)
    assert grew("restartkit_engine_requests_total", route="/v1/completions", status="200") == 1
    assert grew("restartkit_engine_requests_total", route="/v1/completions", status="400") == 1
    assert grew("restartkit_engine_generation_tokens_total") == 5
    assert grew("restartkit_engine_prompt_tokens_total") == 3
    assert grew("restartkit_engine_time_to_first_token_seconds_count") == 1
    assert prom_sample(after, "restartkit_engine_sequences_running") == 0
    # the families vLLM also has, under its names and its model_name label: dashboards made for vLLM read them
    model = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{keyed}/v1/models", headers={"Authorization": f"Bearer {KEY}"}), timeout=10).read())
    name = model["data"][0]["id"]
    assert grew("vllm:generation_tokens_total", model_name=name) == 5
    assert grew("vllm:prompt_tokens_total", model_name=name) == 3
    assert grew("vllm:time_to_first_token_seconds_count", model_name=name) == 1
    assert prom_sample(after, "vllm:num_requests_running", model_name=name) == 0
    assert prom_sample(after, "vllm:num_requests_waiting", model_name=name) == 0


def test_restartkit_carries_the_key_and_writes_it_nowhere(make_policy, service_cleanup, tmp_path):
    key_file = tmp_path / "api.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    policy = make_policy(service_extra=f'api_key_file = "{key_file}"\n')
    service_cleanup(policy)
    assert run_cli("start", "--policy", policy).returncode == 0
    out = run_cli("restart", "--policy", policy, "--strategy", "cold", "--json")
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout)
    assert rec["served_by"] == "cold" and rec["proof"]["canary_identical"] is True
    port = int(next(line.split("=")[1] for line in policy.read_text().splitlines() if line.startswith("port")))
    assert status(port, "/v1/models") == 401 and status(port, "/v1/models", key=KEY) == 200
    written = subprocess.run(["grep", "-rl", KEY, str(tmp_path / "state")], capture_output=True, text=True)
    assert written.stdout == "", f"the key is written in {written.stdout}"
    key_file.write_text("")
    out = run_cli("restart", "--policy", policy, "--strategy", "cold")
    assert out.returncode != 0 and f"api_key_file {key_file}: it must hold one key" in out.stdout + out.stderr
    assert status(port, "/v1/models", key=KEY) == 200  # a bad key file never costs the serving engine


def test_the_engine_takes_the_key_from_its_flag_too(tmp_path):
    from restartkit.reference.serving.args import parse_args
    assert parse_args(["--model", "m", "--api-key", "k"]).api_key == "k"
    env = {**os.environ, "RESTARTKIT_API_KEY": "from-env"}
    code = "from restartkit.reference.serving.args import parse_args; print(parse_args(['--model', 'm']).api_key)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "from-env"
