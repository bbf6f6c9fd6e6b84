"""The OpenAI API as clients use it, against a real reference engine (a checkpoint transformers
wrote, with a chat template), through the `openai` client: streaming ends in [DONE] with the same
text as without, chat renders the tokenizer's template as transformers does, stop/n/logprobs/echo
are honoured, anything else is a 400 naming the field, and a 503 says Retry-After."""
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

from tests.helpers import serve_reference as serve  # noqa: E402
from tests.hf import CHAT_TEMPLATE, checkpoint  # noqa: E402

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One engine for the module: a transformers-written Llama with a chat template, float32 on the CPU."""
    path = tmp_path_factory.mktemp("models") / "chatty"
    model = checkpoint(path, chat_template=CHAT_TEMPLATE, rope_theta=10000.0)
    proc, port = serve(path, "--enable-sleep-mode")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    yield {"client": client, "port": port, "path": path, "model": model, "name": client.models.list().data[0].id}
    proc.terminate()
    proc.wait(30)


def test_a_streamed_completion_is_the_same_text_ending_in_done(engine):
    c, name = engine["client"], engine["name"]
    plain = c.completions.create(model=name, prompt="The quick brown fox", max_tokens=20, temperature=0)
    chunks = list(c.completions.create(model=name, prompt="The quick brown fox", max_tokens=20, temperature=0,
                                       stream=True))
    assert len(chunks) > 2 and chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert "".join(ch.choices[0].text for ch in chunks) == plain.choices[0].text != ""
    # on the wire: server-sent events, the last one [DONE]
    body = json.dumps({"model": name, "prompt": "hi", "max_tokens": 3, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{engine['port']}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        events = [ln for ln in r.read().decode().split("\n\n") if ln]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_chat_renders_the_template_as_transformers_does_streamed_or_not(engine):
    c, name = engine["client"], engine["name"]
    tok = transformers.AutoTokenizer.from_pretrained(engine["path"])
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    import torch
    want = engine["model"].generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                                    pad_token_id=0)[0, len(ids):].tolist()
    out = c.chat.completions.create(model=name, messages=MESSAGES, max_tokens=10, temperature=0)
    assert out.choices[0].model_extra["token_ids"] == want
    assert out.choices[0].message.role == "assistant" and out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    chunks = list(c.chat.completions.create(model=name, messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == len(want)


def test_stop_n_logprobs_and_echo_are_honoured(engine):
    c, name = engine["client"], engine["name"]
    full = c.completions.create(model=name, prompt="Restarting", max_tokens=24, temperature=0).choices[0].text
    stop = full[5:8]
    assert len(stop) == 3 and stop in full
    cut = c.completions.create(model=name, prompt="Restarting", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=name, prompt="Restarting", max_tokens=24, temperature=0, stop=stop, stream=True))
    assert streamed == cut.choices[0].text
    two = c.completions.create(model=name, prompt="Restarting", max_tokens=6, temperature=0, n=2)
    assert [ch.index for ch in two.choices] == [0, 1] and two.choices[0].text == two.choices[1].text
    sampled = c.completions.create(model=name, prompt="Restarting", max_tokens=6, temperature=1.0, n=2, seed=3)
    again = c.completions.create(model=name, prompt="Restarting", max_tokens=6, temperature=1.0, n=2, seed=3)
    assert [ch.text for ch in sampled.choices] == [ch.text for ch in again.choices]
    lp = c.completions.create(model=name, prompt="Restarting", max_tokens=4, temperature=0, logprobs=2).choices[0]
    assert len(lp.logprobs.top_logprobs) == 4 and all(len(top) == 2 for top in lp.logprobs.top_logprobs)
    assert all(max(top.values()) == pytest.approx(chosen) for top, chosen in
               zip(lp.logprobs.top_logprobs, lp.logprobs.token_logprobs))  # greedy: the likeliest
    echo = c.completions.create(model=name, prompt="Restarting", max_tokens=4, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Restarting")
    chat = c.chat.completions.create(model=name, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
                                     top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 3 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 2


def test_streamed_logprobs_come_with_their_tokens_and_add_up_to_the_whole(engine):
    """Each streamed chunk carries the logprobs of the tokens its text completes (not all in the last one);
    put together they are the unstreamed logprobs, text offsets included, for completions and chat alike."""
    c, name = engine["client"], engine["name"]
    ask = {"model": name, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "logprobs": 2}
    whole = c.completions.create(**ask).choices[0].logprobs
    chunks = [ch.choices[0] for ch in c.completions.create(**ask, stream=True)]
    parts = [ch.logprobs for ch in chunks if ch.logprobs is not None]
    assert len(parts) >= 2 and all(len(p.tokens) >= 1 for p in parts), parts
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in getattr(p, key)] == getattr(whole, key), key
    assert "".join(ch.text for ch in chunks) == c.completions.create(**ask).choices[0].text
    chat = {"model": name, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = c.chat.completions.create(**chat).choices[0].logprobs.content
    parts = [ch.choices[0].logprobs.content for ch in c.chat.completions.create(**chat, stream=True)
             if ch.choices and ch.choices[0].logprobs is not None]
    assert len(parts) >= 2 and [e.model_dump() for p in parts for e in p] == [e.model_dump() for e in whole]


@pytest.mark.parametrize("fields,param", [({"top_p": 1.5}, "top_p"), ({"presence_penalty": 3.0}, "presence_penalty"),
                                          ({"logit_bias": {"5": 10}}, "logit_bias"),
                                          ({"extra_body": {"guided_json": {}}}, "guided_json"),
                                          ({"logprobs": 1, "echo": True}, "echo"), ({"best_of": 3}, "best_of")])
def test_a_field_that_is_not_honoured_is_a_400_naming_it(engine, fields, param):
    c, name = engine["client"], engine["name"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt="hi", max_tokens=2, **fields)
    assert e.value.body["param"] == param and param in e.value.body["message"], e.value.body


def test_chat_without_a_template_is_a_400_and_a_sleeping_engine_says_retry_after(engine, tiny_model, tmp_path):
    plain = tmp_path / "plain"  # a checkpoint without a chat template
    shutil.copytree(tiny_model, plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    proc, port = serve(plain)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="plain", messages=MESSAGES, max_tokens=2)
        assert "no chat template" in e.value.body["message"] and e.value.body["param"] == "messages"
    finally:
        proc.terminate()
        proc.wait(30)
    base = f"http://127.0.0.1:{engine['port']}"
    urllib.request.urlopen(urllib.request.Request(base + "/sleep?level=1", b"", method="POST"), timeout=60)
    try:
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(base + "/v1/completions", body,
                                                          {"Content-Type": "application/json"}), timeout=30)
        assert e.value.code == 503 and e.value.headers["Retry-After"] == "1"
    finally:
        urllib.request.urlopen(urllib.request.Request(base + "/wake_up", b"", method="POST"), timeout=60)
    assert engine["client"].completions.create(model=engine["name"], prompt="hi", max_tokens=2).choices


def test_a_client_gone_mid_stream_leaves_the_engine_serving(engine):
    import socket
    body = json.dumps({"model": engine["name"], "prompt": "hi", "max_tokens": 200, "temperature": 0,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", engine["port"]), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert s.recv(64).startswith(b"HTTP/1.1 200")
    assert engine["client"].completions.create(model=engine["name"], prompt="hi", max_tokens=2).choices
    assert os.path.isdir(engine["path"])


def test_the_openai_clients_cases_pass_on_a_fresh_preset_model(tmp_path):
    """What a user of the demo's model runs first: sync, async, streamed, chat (streamed too), n and logprobs,
    through the openai client with no retries, on a model `restartkit model create` just wrote."""
    import asyncio
    made = subprocess.run([sys.executable, "-m", "restartkit.cli", "model", "create", "--preset", "tiny",
                           "--out", str(tmp_path / "fresh")], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    proc, port = serve(tmp_path / "fresh")
    try:
        base = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        name = client.models.list().data[0].id
        one = client.completions.create(model=name, prompt="Hello", max_tokens=8, temperature=0)
        assert one.choices[0].finish_reason in ("length", "stop") and one.usage.completion_tokens >= 1
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=name, prompt="Hello", max_tokens=8, temperature=0, stream=True) if c.choices)
        assert streamed == one.choices[0].text
        chat = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=8, temperature=0)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
        chat_streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=name, messages=MESSAGES, max_tokens=8, temperature=0, stream=True) if c.choices)
        assert chat_streamed == chat.choices[0].message.content
        several = client.completions.create(model=name, prompt="Hello", max_tokens=4, n=3, temperature=1.0, seed=1)
        assert sorted(c.index for c in several.choices) == [0, 1, 2]
        logprobs = client.completions.create(model=name, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
        assert len(logprobs.choices[0].logprobs.tokens) == logprobs.usage.completion_tokens
        chat_lp = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=4, temperature=0,
                                                 logprobs=True, top_logprobs=2)
        assert all(len(t.top_logprobs) == 2 for t in chat_lp.choices[0].logprobs.content)

        async def both():
            aclient = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0)
            got = await asyncio.gather(*(aclient.completions.create(model=name, prompt="Hello", max_tokens=8,
                                                                   temperature=0) for _ in range(3)))
            await aclient.close()
            return [g.choices[0].text for g in got]
        assert asyncio.run(both()) == [one.choices[0].text] * 3
    finally:
        proc.terminate()
        proc.wait(30)
