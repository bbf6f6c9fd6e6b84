"""The reference engine trusts nothing it reads.  config.json: every value the model reads is checked
before anything is allocated, each refusal naming the file, the key and the value (NaN, inf, negative,
zero, absurd sizes, rope factors, ids outside the vocabulary, dtypes).  HTTP: every malformed request
gets a 4xx with an OpenAI-shaped error and the engine answers the next client; a chat template that
loops or recurses costs its request a 400, not a thread; a wrong model is a 404."""
import json
import math
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from restartkit.reference.model.config import InvalidConfig, ModelConfig
from restartkit.reference.model.layout import model_dir_ok
from tests.helpers import ROOT, serve_reference

TINY = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "torch_dtype": "float32", "bos_token_id": 256, "eos_token_id": 257,
        "model_type": "llama"}
BAD = [
    ("rms_norm_eps", math.nan), ("rms_norm_eps", 0.0), ("rms_norm_eps", -1e-5), ("rope_theta", math.nan),
    ("rope_theta", math.inf), ("rope_theta", 0), ("num_hidden_layers", 10**9), ("num_hidden_layers", 0),
    ("hidden_size", -64), ("hidden_size", 64.5), ("vocab_size", "384"), ("intermediate_size", -1),
    ("num_key_value_heads", 3), ("num_attention_heads", 0), ("head_dim", 33), ("max_position_embeddings", 10**12),
    ("eos_token_id", 384), ("eos_token_id", -1), ("bos_token_id", 10**6), ("eos_token_id", [257, 999]),
    ("torch_dtype", "int4"), ("tie_word_embeddings", "yes"),
    ("rope_scaling", {"rope_type": "yarn", "factor": -4.0, "original_max_position_embeddings": 1024}),
    ("rope_scaling", {"rope_type": "linear", "factor": math.nan}),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                      "original_max_position_embeddings": 1024}),
]


@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v!r}"[:40] for k, v in BAD])
def test_a_bad_config_value_is_refused_naming_key_and_value(key, value):
    with pytest.raises(InvalidConfig) as e:
        ModelConfig.from_hf({**TINY, key: value})
    message = str(e.value)
    assert message.startswith("config.json ") and key.split(".")[0] in message
    assert "Traceback" not in message and len(message) < 400


def test_good_configs_pass_and_the_memory_estimate_is_the_model_size():
    import torch

    from restartkit.reference.model.checkpoint import PRESETS
    from restartkit.reference.model.llama import Parallel
    from restartkit.reference.model.weights import build_model
    for preset in PRESETS.values():
        ModelConfig.from_hf(json.loads(json.dumps(preset.config.to_hf())))
    for cfg in (ModelConfig.from_hf(TINY), PRESETS["tiny-moe"].config):
        model = build_model(cfg, Parallel(), torch.float32, "none")
        assert cfg.estimate_bytes(4, 1, 16)[0] == sum(p.numel() * 4 for p in model.parameters())


def test_the_cli_check_names_generation_config_eos_outside_the_vocabulary(tiny_model, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 4000]}))
    with pytest.raises(InvalidConfig, match="generation_config.json eos_token_id = 4000"):
        ModelConfig.load(model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": math.nan}))
    assert "config.json rms_norm_eps = nan" in model_dir_ok(str(model))


@pytest.mark.slow
@pytest.mark.parametrize("key,value,says", [
    ("rms_norm_eps", math.nan, "config.json rms_norm_eps = nan"),
    ("num_hidden_layers", 9000, "GiB"),  # in range, but no host has the memory: refused before allocating
])
def test_an_engine_given_a_bad_config_exits_at_once_and_says_why(tiny_model, tmp_path, key, value, says):
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, key: value, "intermediate_size": 10**6}
                                                  if key == "num_hidden_layers" else {**cfg, key: value}))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "restartkit.reference.serving.server", "--model", str(model),
                          "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and says in out.stderr + out.stdout
    assert "Traceback" not in out.stderr
    assert time.monotonic() - t0 < 60


# ---- HTTP ----------------------------------------------------------------------------------
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
RECURSES = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from restartkit.reference.model.checkpoint import write_checkpoint
    path = tmp_path_factory.mktemp("models") / "tiny"
    write_checkpoint(path, "tiny")
    proc, port = serve_reference(path, "--served-model-name", "m")
    yield {"port": port, "path": path}
    proc.terminate()
    proc.wait(30)


def raw(port, data: bytes, timeout=10.0) -> tuple[int, dict]:
    """Send bytes as they are; the status and the JSON body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = s.recv(65536)
            assert chunk, f"connection closed without an answer (sent {data[:60]!r})"
            got += chunk
        head, _, rest = got.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += s.recv(65536)
    return int(head.split()[1]), json.loads(rest[:length])


def post(port, body: bytes, extra: str = "") -> tuple[int, dict]:
    return raw(port, (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
                      f"Content-Length: {len(body)}\r\n\r\n").encode() + body)


def answers_normally(port) -> None:
    code, out = post(port, json.dumps({"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}).encode())
    assert code == 200 and len(out["choices"][0]["token_ids"]) == 3


MALFORMED = {
    "invalid utf-8": b'{"prompt": "\xff\xfe", "max_tokens": 2}',
    "lone surrogate": b'{"prompt": "\\ud800", "max_tokens": 2}',
    "deep nesting": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "negative token id": b'{"prompt": [1, -5, 3], "max_tokens": 2}',
    "token id past the vocabulary": b'{"prompt": [1, 99999], "max_tokens": 2}',
    "not an object": b'[1, 2]',
    "not json": b'{"prompt": ',
    "negative max_tokens": b'{"prompt": "hi", "max_tokens": -1}',
    "subnormal temperature": b'{"prompt": "hi", "max_tokens": 2, "temperature": 5e-324}',
    "subnormal repetition_penalty": b'{"prompt": "hi", "max_tokens": 2, "repetition_penalty": 5e-324}',
    "seed past 2**64": b'{"prompt": "hi", "max_tokens": 2, "seed": 18446744073709551616}',
}


@pytest.mark.slow
@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_body_is_a_4xx_shaped_like_openai(engine, name):
    code, out = post(engine["port"], MALFORMED[name])
    assert 400 <= code < 500, out
    assert set(out["error"]) >= {"message", "type", "code"} and out["error"]["message"]
    answers_normally(engine["port"])


@pytest.mark.slow
@pytest.mark.parametrize("head", [
    "Content-Length: -5\r\n", "Content-Length: abc\r\n", "Transfer-Encoding: chunked\r\n",
])
def test_a_bad_content_length_is_a_4xx(engine, head):
    code, out = raw(engine["port"], f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode())
    assert 400 <= code < 500 and out["error"]["message"]
    answers_normally(engine["port"])


@pytest.mark.slow
def test_a_malformed_request_line_is_a_4xx_in_json(engine):
    code, out = raw(engine["port"], b"GARBAGE\r\n\r\n")
    assert code == 400 and out["error"]["message"]
    answers_normally(engine["port"])


@pytest.mark.slow
def test_a_wrong_model_is_a_404_and_no_model_is_the_served_one(engine):
    code, out = post(engine["port"], b'{"model": "gpt-9", "prompt": "hi", "max_tokens": 1}')
    assert code == 404 and "gpt-9" in out["error"]["message"] and out["error"]["param"] == "model"
    code, _ = post(engine["port"], b'{"model": "m", "prompt": "hi", "max_tokens": 1}')
    assert code == 200


@pytest.mark.slow
@pytest.mark.parametrize("template,says", [(LOOPS, "to render"), (RECURSES, "recursed")])
def test_a_chat_template_that_never_ends_costs_one_request(tmp_path, template, says):
    from restartkit.reference.model.checkpoint import write_checkpoint
    path = tmp_path / "tiny"
    write_checkpoint(path, "tiny")
    cfg = json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").exists() else {}
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    proc, port = serve_reference(path)
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
        t0 = time.monotonic()
        code, out = raw(port, (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               f"Content-Length: {len(body)}\r\n\r\n").encode() + body, timeout=30)
        assert code == 400 and says in out["error"]["message"]
        assert time.monotonic() - t0 < 20
        answers_normally(port)
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow
def test_a_client_that_closes_early_is_one_log_line(tmp_path):
    from restartkit.reference.model.checkpoint import write_checkpoint
    write_checkpoint(tmp_path / "tiny", "tiny")
    log = tmp_path / "engine.log"
    proc, port = serve_reference(tmp_path / "tiny", log=log)
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:  # half a body, then gone
            s.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt"')
        with socket.create_connection(("127.0.0.1", port)) as s:  # a long answer it does not wait for
            body = b'{"prompt": [1, 2], "max_tokens": 200, "stream": true}'
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            s.recv(10)
        answers_normally(port)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/nowhere", timeout=10)
        assert e.value.code == 404 and json.loads(e.value.read())["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert "Traceback" not in text
    assert len([line for line in text.splitlines() if "client 127.0.0.1:" in line]) == 2, text


@pytest.mark.parametrize("template", ["{{ 'x' * 4000000000 }}", "{{ ['a'] * 400000000 }}", "{{ 10 ** 100000000 }}",
                                      "{% set s = 'x' * 4000000 %}{{ s + s }}"])
def test_a_chat_template_is_sized_before_it_allocates(template):
    """A rendering's size is checked before a repetition, a power or a join is made (it was checked as text
    came out, after 11.7 GB had been allocated): a 400 at once, with little memory."""
    import tracemalloc
    from restartkit.reference.serving.protocol import BadRequest, render_chat
    tracemalloc.start()
    try:
        with pytest.raises(BadRequest) as e:
            render_chat(template, [{"role": "user", "content": "hi"}], {})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.param == "messages" and peak < 64 << 20, (str(e.value), peak)


@pytest.mark.slow
def test_five_thousand_idle_connections_leave_the_engine_answering(tmp_path):
    """5,000 connections that send nothing: no thread each (threads stay bounded), a real client is still answered
    in under a second, the idle ones are closed after the keep-alive time, and the memory they cost returns."""
    import resource
    from restartkit.reference.model.checkpoint import write_checkpoint
    from restartkit.reference.serving.connections import KEEPALIVE_S
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 1 << 16), hard))
    path = write_checkpoint(tmp_path / "tiny", "tiny")
    proc, port = serve_reference(path, "--threads", "1", "--max-connections", "64")
    idle = []
    try:
        answers_normally(port)
        before = _threads_and_rss(proc.pid)
        for _ in range(5000):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            idle.append(s)
        t0 = time.monotonic()
        answers_normally(port)
        assert time.monotonic() - t0 < 1.0
        during = _threads_and_rss(proc.pid)
        assert during[0] <= before[0] + 8, (before, during)  # no thread per idle connection
        time.sleep(KEEPALIVE_S + 2)
        closed = sum(1 for s in idle if s.recv(1) == b"")  # the engine closed them
        assert closed == len(idle)
        after = _threads_and_rss(proc.pid)
        assert after[1] <= before[1] + (64 << 20), (before, during, after)
        answers_normally(port)
    finally:
        for s in idle:
            s.close()
        proc.terminate()
        proc.wait(30)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _threads_and_rss(pid: int) -> tuple[int, int]:
    status = open(f"/proc/{pid}/status").read()
    field = {ln.split(":")[0]: ln.split(":")[1].split() for ln in status.splitlines()}
    return int(field["Threads"][0]), int(field["VmRSS"][0]) * 1024


@pytest.mark.slow
def test_a_slow_loris_is_cut_and_a_half_closed_client_is_answered(tmp_path):
    """A client that sends its request a byte every second is cut once REQUEST_READ_S has passed since its first
    byte, whatever its pace; one that half-closes after sending its whole request still gets its answer."""
    from restartkit.reference.model.checkpoint import write_checkpoint
    from restartkit.reference.serving.connections import REQUEST_READ_S
    path = write_checkpoint(tmp_path / "tiny", "tiny")
    proc, port = serve_reference(path, "--threads", "1")
    try:
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}).encode()
        request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        half = socket.create_connection(("127.0.0.1", port), timeout=30)
        half.sendall(request)
        half.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := half.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200") and b'"token_ids"' in answer, answer[:300]
        half.close()
        slow = socket.create_connection(("127.0.0.1", port), timeout=5)
        t0 = time.monotonic()
        cut = None
        for byte in request[:-1]:
            try:
                slow.sendall(bytes([byte]))
                time.sleep(1.0)
                slow.settimeout(0.01)
                if slow.recv(1) == b"":
                    cut = time.monotonic() - t0
                    break
            except TimeoutError:
                continue
            except OSError:
                cut = time.monotonic() - t0
                break
            finally:
                slow.settimeout(5)
            if time.monotonic() - t0 > REQUEST_READ_S + 10:
                break
        assert cut is not None and REQUEST_READ_S - 1 <= cut <= REQUEST_READ_S + 5, cut
        answers_normally(port)
    finally:
        proc.terminate()
        proc.wait(30)
