"""The front (restartkit.front) for real: a reference engine behind it, clients through it.  It forwards the
OpenAI routes and refuses the admin ones by name; under supervise with a standby, the serving engine SIGKILLed
again and again mid-generation, every client's answer comes whole and token-identical to an undisturbed one."""
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.helpers import ROOT, free_port, ipc_policy, prom_sample, serve_reference, start_preload, wait_for

pytestmark = pytest.mark.slow


def start_front(upstream: int, *extra, log=None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    out = open(log or os.devnull, "w")  # noqa: SIM115 (the child holds it)
    proc = subprocess.Popen([sys.executable, "-m", "restartkit.front", "--listen", f"127.0.0.1:{port}", "--upstream",
                             f"http://127.0.0.1:{upstream}", *extra], cwd=ROOT, stderr=out)
    wait_for(lambda: proc.poll() is not None or _status(f"http://127.0.0.1:{port}/front/status", timeout=1), 20)
    assert proc.poll() is None, f"the front exited: see {log}"
    return proc, port


def _status(url: str, method: str = "GET", body: dict | None = None, timeout: float = 30):
    req = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return None


def client(port: int):
    import openai
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)


def ask(c, req: dict) -> tuple[list[int], str, str]:
    """(token ids, text, finish reason) of one request, streamed or not, chat or not."""
    extra = {"ignore_eos": True, "return_token_ids": True}
    common = dict(model="tiny", max_tokens=req["max_tokens"], temperature=0, stream=req["stream"], extra_body=extra)
    if req["chat"]:
        out = c.chat.completions.create(messages=[{"role": "user", "content": req["prompt"]}], **common)
    else:
        out = c.completions.create(prompt=req["prompt"], **common)
    if not req["stream"]:
        ch = out.choices[0]
        text = ch.message.content if req["chat"] else ch.text
        return list(ch.model_extra["token_ids"]), text, ch.finish_reason
    ids, text, finish = [], "", None
    for chunk in out:
        for ch in chunk.choices:
            ids += (ch.model_extra or {}).get("token_ids") or []
            piece = (ch.delta.content if req["chat"] else ch.text) or ""
            text += piece
            finish = ch.finish_reason or finish
            if piece or ch.finish_reason:
                ARRIVALS.append(time.monotonic())
    return ids, text, finish


ARRIVALS: list[float] = []


def test_the_front_forwards_the_openai_routes_and_refuses_admin_ones(tiny_model):
    engine, eport = serve_reference(tiny_model, "--threads", "1")
    front = None
    try:
        front, port = start_front(eport)
        c, direct = client(port), client(eport)
        for stream in (False, True):
            for chat in (False, True):
                req = {"prompt": "restart me", "max_tokens": 24, "stream": stream, "chat": chat}
                assert ask(c, req) == ask(direct, req), req
        assert _status(f"http://127.0.0.1:{port}/v1/models")[0] == 200
        status, body = _status(f"http://127.0.0.1:{port}/admin/drop_kv_cache", "POST", {})
        assert status == 403 and b"admin route" in body
        assert _status(f"http://127.0.0.1:{port}/admin/stats")[0] == 403
        status, body = _status(f"http://127.0.0.1:{port}/v1/embeddings", "POST", {"input": "x"})
        assert status == 404 and b"not a route the front forwards" in body
        metrics = _status(f"http://127.0.0.1:{port}/metrics")[1].decode()
        assert prom_sample(metrics, "restartkit_front_requests_journalled_total") == 4
        assert prom_sample(metrics, "restartkit_front_requests_lost_total") == 0
        assert "vllm:generation_tokens_total" in metrics  # the engine's own, forwarded
    finally:
        engine.kill()
        engine.wait(10)
        if front is not None:
            front.terminate()
            front.wait(10)


def test_a_request_waits_for_an_engine_then_gets_503_with_retry_after():
    dead = free_port()  # nothing listens there
    front, port = start_front(dead, "--wait-s", "1.5")
    try:
        t0 = time.monotonic()
        status, body = _status(f"http://127.0.0.1:{port}/v1/completions", "POST",
                               {"model": "tiny", "prompt": "x", "max_tokens": 4})
        assert status == 503 and b"no engine answered within 1.5 s" in body
        assert 1.4 < time.monotonic() - t0 < 15
    finally:
        front.terminate()
        front.wait(10)


def test_requests_in_flight_survive_sigkills_of_the_serving_engine(supervised, make_policy, sockdir, preloads):
    """8 streaming and 8 non-streamed greedy clients, answers of 100-300 tokens, no client retries; the serving
    engine SIGKILLed 10 times mid-generation under supervise with a standby: no request fails, every answer is
    token-identical to the undisturbed one and whole (no token duplicated or missing)."""
    policy = ipc_policy(make_policy, sockdir)
    port = free_port()  # the front's: supervise holds it and keeps the front on it
    policy.write_text(policy.read_text().replace("max_model_len = 256", "max_model_len = 512").replace(
        'engine_args = ["--threads", "1"]', 'engine_args = ["--threads", "1", "--max-num-seqs", "16"]')
                      + f"\n[standby]\nenabled = true\n\n[front]\nport = {port}\n")
    start_preload(policy, preloads)
    s = supervised(policy, burst=50)  # kills this close count as failed starts: no giving up on them
    log = policy.parent / "state" / "svc" / "front.log"
    rng, done = random.Random(7), threading.Event()
    reqs = [{"prompt": f"request {i}: {'tell me more ' * rng.randint(1, 6)}", "max_tokens": rng.randint(100, 300),
             "stream": i < 8, "chat": i % 2 == 1} for i in range(16)]
    try:
        c = client(port)
        want = [ask(c, r) for r in reqs]  # undisturbed, one at a time
        assert all(len(w[0]) == r["max_tokens"] for w, r in zip(want, reqs))
        failures, answers = [], []

        def run(i):
            while not done.is_set():
                try:
                    answers.append((i, ask(c, reqs[i])))
                except Exception as e:  # any failure a client sees
                    failures.append((i, repr(e), repr(e.__cause__), repr(getattr(e.__cause__, "__context__", None))))

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(16)]
        for t in threads:
            t.start()
        kills, gaps = 0, []
        while kills < 10:
            wait_for(lambda: (st := s.status()) and st.get("pid") and (st.get("standby") or {}).get("state") ==
                     "prepared", 120)
            time.sleep(rng.uniform(0.3, 1.0))  # mid-generation: 16 clients are always in flight
            pid = s.status()["pid"]
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            kills += 1
            try:
                wait_for(lambda: any(t > killed_at for t in list(ARRIVALS)), 60)
            except AssertionError:
                raise AssertionError(f"no token after kill {kills}: front {_status(f'http://127.0.0.1:{port}/front/status')}"
                                     f"; engine log {(policy.parent / 'state' / 'svc' / 'engine.log').read_text()[-1500:]}")
            gaps.append(min(t for t in list(ARRIVALS) if t > killed_at) - killed_at)
            wait_for(lambda: s.status().get("pid") not in (None, pid), 60)
        done.set()
        for t in threads:
            t.join(180)
        print(f"kill -> next token: median {statistics.median(gaps):.3f} s, max {max(gaps):.3f} s; "
              f"{len(answers)} answers")
        assert failures == [], (failures[:3], log.read_text()[-3000:])
        assert len(answers) >= 16
        for i, got in answers:
            assert got == want[i], (i, reqs[i])
        metrics = _status(f"http://127.0.0.1:{port}/metrics")[1].decode()
        assert prom_sample(metrics, "restartkit_front_requests_resumed_total") >= 10
        assert prom_sample(metrics, "restartkit_front_requests_lost_total") == 0
        # the front itself killed: supervise starts it again on the socket it holds; no connection is refused
        front = json.loads((policy.parent / "state" / "svc" / "supervisor.json").read_text())["listener"]["front"]
        os.kill(front["pid"], signal.SIGKILL)
        assert ask(client(port), reqs[0]) == want[0]  # a new connection: the pool's died with the front
        assert log.read_text().count("front: answering on") == 2  # the second front answered it
    finally:
        done.set()


def test_supervise_refuses_a_front_port_it_cannot_have_by_name(make_policy, service_cleanup):
    import socket

    from tests.helpers import run_cli
    policy = make_policy()
    service_cleanup(policy)
    engine_port = int(policy.read_text().split("port = ")[1].split()[0])
    policy.write_text(policy.read_text() + f"\n[front]\nport = {engine_port}\n")
    r = run_cli("supervise", "--policy", policy, timeout=120)
    assert r.returncode == 2 and f"[front] port {engine_port} is the engine's own" in r.stderr, r.stderr
    with socket.socket() as neighbour:
        neighbour.bind(("127.0.0.1", 0))
        neighbour.listen()
        taken = neighbour.getsockname()[1]
        policy.write_text(policy.read_text().replace(f"[front]\nport = {engine_port}", f"[front]\nport = {taken}"))
        r = run_cli("supervise", "--policy", policy, timeout=120)
        assert r.returncode == 2 and f"cannot bind the front's port 127.0.0.1:{taken}" in r.stderr, r.stderr
        assert "change [front] port" in r.stderr


def test_an_api_key_is_passed_on_to_the_engine_and_a_wrong_one_refused(tiny_model):
    import openai
    engine, eport = serve_reference(tiny_model, "--threads", "1", "--api-key", "sesame")
    front = None
    try:
        front, port = start_front(eport)
        keyed = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sesame", max_retries=0, timeout=60)
        for stream in (False, True):
            for chat in (False, True):
                ids, _, finish = ask(keyed, {"prompt": "key", "max_tokens": 8, "stream": stream, "chat": chat})
                assert len(ids) == 8 and finish == "length"
        with pytest.raises(openai.AuthenticationError):
            ask(client(port), {"prompt": "no key", "max_tokens": 8, "stream": False, "chat": False})
    finally:
        engine.kill()
        engine.wait(10)
        if front is not None:
            front.terminate()
            front.wait(10)
