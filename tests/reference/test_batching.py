"""Continuous batching on the reference engine, against real engine processes: many clients share
the decode steps (throughput grows with clients, a short request does not wait behind long ones),
restartkit's canary runs in a batch of its own (its greedy tokens are those of an idle engine),
a client that leaves has its sequences cancelled within a step or two, and a request too big or
a queue too full is refused with the limit named, the engine answering the next client normally."""
import contextlib
import json
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request

import pytest

from restartkit.clients import ClientLoad
from restartkit.contracts import CANARY_HEADER
from tests.helpers import serve_reference

pytestmark = pytest.mark.slow
PROMPT = [1, 5, 9, 13]


def post(port, body, headers=None, timeout=120):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def refused(port, body) -> tuple[int, dict, dict]:
    with pytest.raises(urllib.error.HTTPError) as e:
        post(port, body)
    return e.value.code, dict(e.value.headers), json.loads(e.value.read())


def stats(port, token: str | None = None) -> dict:
    from restartkit.guard.admin import ADMIN_HEADER
    req = urllib.request.Request(f"http://127.0.0.1:{port}/admin/stats", headers={ADMIN_HEADER: token} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["scheduler"]


def greedy(port, max_tokens, prompt=PROMPT, headers=None) -> list[int]:
    out = post(port, {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, headers)
    return out["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from restartkit.reference.model.checkpoint import write_checkpoint
    path = tmp_path_factory.mktemp("models") / "tiny"
    write_checkpoint(path, "tiny")
    proc, port = serve_reference(path, "--served-model-name", "m", "--max-num-seqs", "8", "--max-queued-seqs", "32",
                                 "--threads", "1", max_model_len=1024)
    yield port
    proc.terminate()
    proc.wait(30)


@contextlib.contextmanager
def load(port, clients, max_tokens):
    """`clients` clients (restartkit.clients.ClientLoad) asking greedy completions in a loop; every one answered."""
    clients = ClientLoad("127.0.0.1", port, "m", clients=clients, max_tokens=max_tokens, prompt="Once upon a time")
    clients.start()
    try:
        yield clients
    finally:
        clients.stop()
    assert {r.outcome for r in clients.snapshot()} == {"ok"}


def tokens(clients) -> int:
    return sum(len(a) for a in list(clients.answers))


def tokens_per_s(port, clients, seconds=4.0) -> float:
    with load(port, clients, 64) as running:
        time.sleep(0.5)  # every client has a request running
        start, t0 = tokens(running), time.perf_counter()
        time.sleep(seconds)
        return (tokens(running) - start) / (time.perf_counter() - t0)


def one_token_p50(port, n=15) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        greedy(port, 1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def test_eight_clients_share_the_decode_steps(engine):
    one = tokens_per_s(engine, 1)
    eight = tokens_per_s(engine, 8)
    print(f"tokens/s: 1 client {one:.0f}, 8 clients {eight:.0f} ({eight / one:.1f}x)")
    assert eight >= 2.5 * one


def test_a_short_request_does_not_wait_behind_long_ones(engine):
    idle = one_token_p50(engine)
    with load(engine, 4, 256):
        time.sleep(0.5)
        busy = one_token_p50(engine)
    print(f"1-token request p50: idle {idle * 1000:.1f} ms, under 4 clients {busy * 1000:.1f} ms")
    assert busy <= max(3 * idle, idle + 0.05)


def test_the_canary_runs_alone_and_matches_an_idle_engine(engine):
    alone = [greedy(engine, 32, [1, k, 7]) for k in (3, 4)]
    before = stats(engine)["isolated"]
    with load(engine, 4, 128):
        time.sleep(0.3)
        busy = [greedy(engine, 32, [1, k, 7], {CANARY_HEADER: "1"}) for k in (3, 4)]
    assert busy == alone
    after = stats(engine)
    assert after["isolated"] == before + 2 and after["shared_isolated"] == 0  # each ran with nothing beside it


def test_a_client_that_leaves_has_its_sequences_cancelled(engine):
    for stream in (False, True):
        body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "n": 4,
                           "stream": stream}).encode()
        before = stats(engine)["cancelled"]
        s = socket.create_connection(("127.0.0.1", engine))
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        end = time.monotonic() + 30
        while stats(engine)["running"] < 4:
            assert time.monotonic() < end, "the request never ran"
            time.sleep(0.01)
        s.close()
        while stats(engine)["running"] or stats(engine)["cancelled"] < before + 4:
            assert time.monotonic() < end, f"still running 30 s after its client left: {stats(engine)}"
            time.sleep(0.02)
        steps = stats(engine)["decode_rows"]
        time.sleep(0.3)
        assert stats(engine)["decode_rows"] == steps  # the engine stopped computing for it
    assert greedy(engine, 8) == greedy(engine, 8, headers={CANARY_HEADER: "1"})


def test_a_request_over_the_work_limit_is_a_400_naming_it(engine):
    t0 = time.perf_counter()
    code, _, err = refused(engine, {"model": "m", "prompt": [PROMPT] * 400, "n": 16, "max_tokens": 16})
    assert code == 400 and "max_num_seqs x max_model_len = 8192" in err["error"]["message"]
    assert err["error"]["param"] == "max_tokens"
    assert time.perf_counter() - t0 < 10  # refused before any work
    assert len(greedy(engine, 4)) == 4


def test_a_full_queue_is_a_503_with_retry_after(engine):
    results = []

    def ask():
        try:
            post(engine, {"model": "m", "prompt": PROMPT, "max_tokens": 200, "n": 16, "temperature": 0})
            results.append(200)
        except urllib.error.HTTPError as e:
            results.append((e.code, e.headers.get("Retry-After"), json.loads(e.read())["error"]["message"]))

    threads = [threading.Thread(target=ask) for _ in range(4)]  # 64 sequences for 8 slots and 32 places
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    busy = [r for r in results if r != 200]
    assert 200 in results and busy, results
    assert all(code == 503 and after == "1" and "max 32" in msg for code, after, msg in busy)
    assert len(greedy(engine, 4)) == 4


def admin(port, path) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/admin/{path}", b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_requests_that_meet_a_kv_cache_let_go_for_a_snapshot_wait_for_it(engine):
    """Before a dump the KV cache is let go.  The requests running then finish first; the ones waiting for
    a slot, and the ones that arrive while it is gone, wait for it to come back and are answered (a 503
    for each was what a client saw under load in a `snapshot create` beside supervise)."""
    want = greedy(engine, 16)
    results = []

    def ask():
        try:
            results.append(greedy(engine, 16))
        except urllib.error.HTTPError as e:
            results.append(f"HTTP {e.code}: {e.read()[:200]!r}")

    threads = [threading.Thread(target=ask) for _ in range(12)]  # 8 slots: some of them wait for one
    for t in threads:
        t.start()
    admin(engine, "drop_kv_cache")
    late = threading.Thread(target=ask)  # arrives while the KV cache is gone
    late.start()
    time.sleep(0.5)
    assert len(results) <= 12, results  # the late one cannot be answered without a KV cache
    admin(engine, "restore_kv_cache")
    for t in threads + [late]:
        t.join(120)
    assert results == [want] * 13, results


def test_every_strategy_keeps_its_canary_under_four_clients(make_policy, sockdir, preloads, service_cleanup):
    """`restartkit bench --clients 4`: cold, ipc, standby and sleep restarts while four clients send greedy
    completions; each restart's canary (run in a batch of its own) is the one taken before it, and every
    client request was answered, or met the restart (refused, or a 503 from an engine loading or stopping)."""
    import json as _json

    from tests.helpers import run_cli
    from tests.helpers import ipc_policy, start_preload
    cached = ipc_policy(make_policy, sockdir)
    cached.write_text(cached.read_text() + "\n[standby]\nenabled = true\n")
    asleep = make_policy(name="sleepy", extra="\n[sleep]\nenabled = true\nlevel = 1\n")
    service_cleanup(cached)
    service_cleanup(asleep)
    start_preload(cached, preloads)
    rows = {}
    for policy, strategies in ((cached, "cold,ipc"), (cached, "standby"), (asleep, "sleep")):
        assert run_cli("start", "--policy", policy).returncode == 0
        if strategies == "standby":
            assert run_cli("standby", "arm", "--policy", policy).returncode == 0
        r = run_cli("bench", "--policy", policy, "--strategies", strategies, "--repeat", "1", "--clients", "4",
                    "--json", timeout=900)
        assert r.returncode == 0, r.stderr
        rows.update({row["strategy"]: row for row in _json.loads(r.stdout)["rows"]})
        if strategies == "standby":
            assert run_cli("stop", "--policy", policy).returncode == 0
    assert set(rows) == {"cold", "ipc", "standby", "sleep"}
    for name, row in rows.items():
        assert row["clean_runs"] == 1 and row["canary_identical"], (name, row)
        clients = row["clients"]  # refused and 503 (loading, stopping) while no engine serves; never a 500
        assert clients.get("ok", 0) > 0 and set(clients) <= {"ok", "refused", "5xx 503", "lost"}, (name, clients)


def test_a_quiet_sequence_hands_its_tokens_over_with_its_end():
    """A reader that wants the whole answer (not streamed, no stop strings) is woken once, at the end: the tokens
    come then, in order, each stamped when the scheduler emitted it (the time-to-first-token metric reads that);
    a sequence that is not quiet hands each token over at once."""
    from restartkit.reference.sched.sequence import Event, Sampling, Sequence
    quiet, loud = Sequence([1, 2], Sampling(3), quiet=True), Sequence([1, 2], Sampling(3))
    for seq in (quiet, loud):
        for t in (7, 8):
            seq.emit(Event(0, "token", t))
    assert quiet.events.empty() and loud.events.qsize() == 2
    time.sleep(0.01)
    quiet.emit(Event(0, "done", finish="length"))
    got = [quiet.events.get_nowait() for _ in range(3)]
    assert [(e.kind, e.token) for e in got] == [("token", 7), ("token", 8), ("done", -1)]
    assert got[0].at <= got[1].at < got[2].at - 0.005 and quiet.events.empty()




def test_the_canary_goes_first_past_a_full_queue(tiny_model):
    """A backlog of clients never 503s restartkit's canary (its header and the service's admin token): it goes
    ahead of the queue and past its limits.  The header alone, or anyone else's request, meets them (here a
    request of 2 sequences against a queue of 1: refused whatever else runs)."""
    from restartkit.guard.admin import ADMIN_HEADER, ADMIN_TOKEN_ENV
    token = "c" * 64
    proc, port = serve_reference(tiny_model, "--max-num-seqs", "2", "--max-queued-seqs", "1", "--threads", "1",
                                 env={ADMIN_TOKEN_ENV: token})
    try:
        def ask(headers):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(
                {"prompt": "hi", "max_tokens": 2, "temperature": 0, "n": 2}).encode(),
                {"Content-Type": "application/json", **headers})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code
        assert ask({}) == 400 and ask({CANARY_HEADER: "1"}) == 400 and ask({ADMIN_HEADER: token}) == 400
        assert ask({CANARY_HEADER: "1", ADMIN_HEADER: token}) == 200
    finally:
        proc.terminate()
        proc.wait(30)
