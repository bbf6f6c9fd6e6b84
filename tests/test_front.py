"""The front (restartkit.front) for real: a reference engine behind it, clients through it.  It forwards the
OpenAI routes and refuses the admin ones by name; under supervise with a standby, the serving engine SIGKILLed
again and again mid-generation, every client's answer comes whole and token-identical to an undisturbed one."""
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers import ROOT, free_port, ipc_policy, prom_sample, run_cli, serve_reference, start_preload, wait_for
from tests.streams import ClientsThroughKills, ask, client, http, mixed_requests

pytestmark = pytest.mark.slow


def start_front(upstream: int, *extra, log=None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    out = open(log or os.devnull, "w")  # noqa: SIM115 (the child holds it)
    proc = subprocess.Popen([sys.executable, "-m", "restartkit.front", "--listen", f"127.0.0.1:{port}", "--upstream",
                             f"http://127.0.0.1:{upstream}", *extra], cwd=ROOT, stderr=out)
    wait_for(lambda: proc.poll() is not None or http(f"http://127.0.0.1:{port}/front/status", timeout=1), 20)
    assert proc.poll() is None, f"the front exited: see {log}"
    return proc, port


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
                # a stop string the answer holds: the front applies it (the engine is asked for none), as the engine does
                text = ask(direct, req)[1]
                at = next(i for i in range(3, len(text) - 1) if "\ufffd" not in text[i:i + 2])
                stop = {**req, "stop": [text[at:at + 2], "<<never>>"]}
                got, want = ask(c, stop), ask(direct, stop)
                assert got[1:] == want[1:] == (text[:text.index(text[at:at + 2])], "stop"), (req, got, want)
        assert http(f"http://127.0.0.1:{port}/v1/models")[0] == 200
        status, body = http(f"http://127.0.0.1:{port}/admin/drop_kv_cache", "POST", {})
        assert status == 403 and b"admin route" in body
        assert http(f"http://127.0.0.1:{port}/admin/stats")[0] == 403
        status, body = http(f"http://127.0.0.1:{port}/v1/embeddings", "POST", {"input": "x"})
        assert status == 404 and b"not a route the front forwards" in body
        metrics = http(f"http://127.0.0.1:{port}/metrics")[1].decode()
        assert prom_sample(metrics, "restartkit_front_requests_journalled_total") == 8
        assert prom_sample(metrics, "restartkit_front_requests_lost_total") == 0
        assert "vllm:generation_tokens_total" in metrics  # the engine's own, forwarded
    finally:
        engine.kill()
        engine.wait(10)
        if front is not None:
            front.terminate()
            front.wait(10)


def test_more_streams_than_aiohttps_default_pool_all_reach_the_engine_at_once(tiny_model):
    """aiohttp's client caps a session at 100 connections by default: the front held request 101 and on in its
    own queue while the engine had room (--max-num-seqs 160).  120 streams through the front: all run at once."""
    import http.client as http_client
    import re
    engine, eport = serve_reference(tiny_model, "--threads", "1", "--max-num-seqs", "160", max_model_len=1024)
    front = None
    try:
        front, port = start_front(eport)
        body = {"model": "tiny", "prompt": [256, 5, 6], "max_tokens": 900, "ignore_eos": True, "temperature": 0,
                "stream": True}

        def stream() -> None:
            try:
                http(f"http://127.0.0.1:{port}/v1/completions", "POST", body, timeout=300)
            except (OSError, ValueError, http_client.HTTPException):
                pass  # cut when the test ends

        threads = [threading.Thread(target=stream, daemon=True) for _ in range(120)]
        for t in threads:
            t.start()
        most = 0.0
        for _ in range(120):
            metrics = http(f"http://127.0.0.1:{eport}/metrics")[1].decode()
            most = max([most, *map(float, re.findall(r"^vllm:num_requests_running(?:{[^}]*})? (\S+)", metrics, re.M))])
            if most >= 120:
                break
            time.sleep(0.25)
        assert most == 120, f"at most {most} of 120 streams ran on the engine at once"
    finally:
        engine.kill()
        engine.wait(10)
        if front is not None:
            front.kill()
            front.wait(10)


def test_a_request_waits_for_an_engine_then_gets_503_with_retry_after():
    dead = free_port()  # nothing listens there
    front, port = start_front(dead, "--wait-s", "1.5")
    try:
        t0 = time.monotonic()
        status, body = http(f"http://127.0.0.1:{port}/v1/completions", "POST",
                               {"model": "tiny", "prompt": "x", "max_tokens": 4})
        assert status == 503 and b"no engine answered within 1.5 s" in body
        assert 1.4 < time.monotonic() - t0 < 15
    finally:
        front.terminate()
        front.wait(10)


KILLS = 10  # of the serving engine (issue 55's count), each mid-generation, each served by a standby armed again
#            after the last


def test_requests_in_flight_survive_sigkills_of_the_serving_engine(supervised, make_policy, sockdir, preloads):
    """8 streaming and 8 non-streamed greedy clients, answers of 100-300 tokens, no client retries; the serving
    engine SIGKILLed 10 times mid-generation under supervise with a standby and its front (on by default): no
    request fails, every answer is token-identical to the undisturbed one and whole (no token duplicated or
    missing)."""
    policy = ipc_policy(make_policy, sockdir)
    port = service_port(policy)  # the front's: supervise holds it and keeps the front on it
    policy.write_text(policy.read_text().replace("max_model_len = 256", "max_model_len = 512").replace(
        'engine_args = ["--threads", "1"]', 'engine_args = ["--threads", "1", "--max-num-seqs", "16"]')
                      + "\n[standby]\nenabled = true\n")
    start_preload(policy, preloads)
    s = supervised(policy, burst=50)  # kills this close count as failed starts: no giving up on them
    log = policy.parent / "state" / "svc" / "front.log"
    rng = random.Random(7)
    clients = ClientsThroughKills(port, mixed_requests(16))
    try:
        want = clients.undisturbed()
        assert all(len(w[0]) == r["max_tokens"] for w, r in zip(want, clients.reqs))
        clients.start()
        for _ in range(KILLS):
            wait_for(lambda: (st := s.status()) and st.get("pid") and (st.get("standby") or {}).get("state") ==
                     "prepared", 120)
            time.sleep(rng.uniform(0.3, 1.0))  # mid-generation: 16 clients are always in flight
            pid = s.status()["pid"]
            clients.kill(pid, why=lambda: f"front {http(f'http://127.0.0.1:{port}/front/status')}; engine log "
                                          f"{(policy.parent / 'state' / 'svc' / 'engine.log').read_text()[-1500:]}")
            wait_for(lambda: s.status().get("pid") not in (None, pid), 60)
        # a planned restart through the standby, beside supervise: the old engine's streams move to the new one
        wait_for(lambda: (s.status().get("standby") or {}).get("state") == "prepared", 120)
        r = run_cli("restart", "--policy", policy, "--strategy", "standby", "--strict", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["served_by"] == "standby", r.stdout + r.stderr
        time.sleep(1.0)
        clients.finish()
        print(clients.summary())
        assert clients.failures == [], (clients.failures[:3], log.read_text()[-3000:])
        assert sorted(clients.gaps)[len(clients.gaps) // 2] <= 1.0, clients.summary()  # kill -> next token
        assert len(clients.answers) >= 16
        for i, got in clients.answers:
            assert got == want[i], (i, clients.reqs[i])
        metrics = http(f"http://127.0.0.1:{port}/metrics")[1].decode()
        assert prom_sample(metrics, "restartkit_front_requests_resumed_total") >= KILLS
        assert prom_sample(metrics, "restartkit_front_requests_lost_total") == 0
        # the front itself killed with 2 requests in flight on it (held there: the engine stopped for a moment):
        # they are lost with it, and counted; supervise starts it again on the socket it holds, nothing refused
        front = json.loads((policy.parent / "state" / "svc" / "supervisor.json").read_text())["listener"]["front"]
        engine = s.status()["pid"]
        os.kill(engine, signal.SIGSTOP)
        held = [threading.Thread(target=lambda: http(f"http://127.0.0.1:{port}/v1/completions", "POST",
                                                     {"model": "tiny", "prompt": "held", "max_tokens": 4}), daemon=True)
                for _ in range(2)]
        try:
            for t in held:
                t.start()
            time.sleep(0.7)  # the front saved its counts (every 0.25 s) with both in flight
            os.kill(front["pid"], signal.SIGKILL)
        finally:
            os.kill(engine, signal.SIGCONT)
        assert ask(client(port), clients.reqs[0]) == want[0]  # a new connection: the pool's died with the front
        assert log.read_text().count("front: answering on") == 2  # the second front answered it
        metrics = http(f"http://127.0.0.1:{port}/metrics")[1].decode()
        assert prom_sample(metrics, "restartkit_front_requests_lost_with_front_total") == 2
        assert prom_sample(metrics, "restartkit_front_requests_resumed_total") >= 10  # counted on from the first front
    finally:
        clients.finish(10)


def service_port(policy) -> int:
    return int(policy.read_text().split("\nport = ")[1].split()[0])


def test_supervise_refuses_a_front_port_it_cannot_have_by_name(make_policy, service_cleanup):
    import socket

    policy = make_policy()
    service_cleanup(policy)
    port = service_port(policy)
    engines = policy.read_text().split("engine_port = ")[1].split()[0]
    policy.write_text(policy.read_text().replace(f"engine_port = {engines}", f"engine_port = {port}"))
    r = run_cli("supervise", "--policy", policy, timeout=120)
    assert r.returncode == 2 and "front.engine_port" in r.stderr and "the front answers there" in r.stderr, r.stderr
    policy.write_text(policy.read_text().replace(f"engine_port = {port}", f"engine_port = {engines}"))
    with socket.socket() as neighbour:
        neighbour.bind(("127.0.0.1", port))
        neighbour.listen()
        r = run_cli("supervise", "--policy", policy, timeout=120)
        assert r.returncode == 2 and f"cannot bind 127.0.0.1:{port}, where the front answers" in r.stderr, r.stderr
        assert "change [service] port" in r.stderr and f"PID {os.getpid()} listens there" in r.stderr
    assert run_cli("status", "--policy", policy).returncode != 0  # nothing left serving


# an engine that refuses a field it does not know, as a strict OpenAI server does: the reference engine behind a
# relay that answers 400 to include_stop_str_in_output and passes everything else on as it is
STRICT = """
import sys, aiohttp
from aiohttp import web
UP = sys.argv[2]
async def handle(req):
    body = await req.read()
    if b"include_stop_str_in_output" in body:
        return web.json_response({"error": {"message": "unknown field 'include_stop_str_in_output'"}}, status=400)
    async with aiohttp.ClientSession() as s, s.request(req.method, UP + req.path_qs, data=body,
                                                       headers={"Content-Type": "application/json"}) as r:
        out = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers["Content-Type"]})
        await out.prepare(req)
        async for data in r.content.iter_any():
            await out.write(data)
        await out.write_eof()
        return out
app = web.Application()
app.router.add_route("*", "/{tail:.*}", handle)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


def test_an_engine_that_refuses_include_stop_str_in_output_is_asked_without_it(tiny_model):
    engine, eport = serve_reference(tiny_model, "--threads", "1")
    sport = free_port()
    strict = subprocess.Popen([sys.executable, "-c", STRICT, str(sport), f"http://127.0.0.1:{eport}"])
    front = None
    try:
        wait_for(lambda: http(f"http://127.0.0.1:{sport}/v1/models", timeout=1), 20)
        front, port = start_front(sport)
        direct = client(eport)
        for stream in (True, False):
            req = {"prompt": "restart me", "max_tokens": 24, "stream": stream, "chat": False}
            text = ask(direct, req)[1]
            at = next(i for i in range(3, len(text) - 1) if "\ufffd" not in text[i:i + 2])
            stop = {**req, "stop": [text[at:at + 2]]}
            assert ask(client(port), stop) == ask(direct, stop), stop  # the engine's own stop handling, as before
    finally:
        for proc in (engine, strict, front):
            if proc is not None:
                proc.kill()
                proc.wait(10)


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


def test_a_request_the_front_cannot_continue_is_sent_again_whole_or_ends_with_an_error_event(tiny_model):
    """n > 1, logprobs, echo: the front cannot continue them from their tokens.  Not streamed, an engine SIGKILLed
    mid-answer costs the client nothing: the request goes again, whole, to the next engine on the port, and the
    answer equals an undisturbed one.  Streamed, once part of it reached the client, the client gets an error event
    and [DONE], never a reset; both are counted."""
    engine, eport = serve_reference(tiny_model, "--threads", "1", max_model_len=2048)
    front = nxt = None
    try:
        front, port = start_front(eport)
        body = {"model": "tiny", "prompt": "restart me", "max_tokens": 40, "temperature": 0, "logprobs": 1}
        want = http(f"http://127.0.0.1:{eport}/v1/completions", "POST", body)
        assert want[0] == 200
        os.kill(engine.pid, signal.SIGSTOP)  # the request reaches it and waits there, mid-answer
        got = []
        asker = threading.Thread(target=lambda: got.append(http(f"http://127.0.0.1:{port}/v1/completions", "POST",
                                                                body, timeout=60)))
        asker.start()
        time.sleep(1.0)
        engine.kill()
        engine.wait(10)
        nxt, _ = serve_reference(tiny_model, "--threads", "1", max_model_len=2048, port=eport)
        asker.join(60)
        assert got and got[0][0] == 200, got
        strip = lambda b: [c["text"] for c in json.loads(b)["choices"]]  # noqa: E731
        assert strip(got[0][1]) == strip(want[1])
        assert json.loads(got[0][1])["choices"][0]["logprobs"] == json.loads(want[1])["choices"][0]["logprobs"]
        # streamed: its first chunk read, the engine SIGKILLed
        import http.client as httplib
        conn = httplib.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({**body, "max_tokens": 1500, "stream": True,
                                                            "ignore_eos": True}), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and r.readline().startswith(b"data: {")
        os.kill(nxt.pid, signal.SIGSTOP)
        nxt.kill()
        nxt.wait(10)
        rest = r.read().decode()  # whole: no reset
        events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "could not be continued" in events[-2], events[-3:]
        status = json.loads(http(f"http://127.0.0.1:{port}/front/status")[1])
        assert status["retried_whole"] >= 1 and status["lost"] == 1, status
    finally:
        for proc in (engine, nxt, front):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
