"""The scheduler's run-ahead (restartkit.reference.sched.scheduler): a greedy step launched before the last
one's tokens are read takes each sequence's token on the device.  Where decode graphs run (a GPU) it is on by
itself; here the real tiny model on the CPU runs it (Engine.run_ahead), driven step by step so that what joins,
leaves or is cancelled happens at the same step every run: each sequence gets the tokens it gets from steps run
one by one, a sequence that meets its EOS ends there (the step run ahead for it is dropped, and its slot serves
the next sequence as if it were new), and a batch joined or cut mid-run keeps every other sequence's tokens.
A server started with `--run-ahead on` serves clients, cancels, and keeps its canary, through HTTP."""
import dataclasses
import json
import socket
import threading
import time
import urllib.request

import pytest

from restartkit.reference.sched.engine import Engine, EngineOptions
from restartkit.reference.sched.scheduler import Scheduler
from restartkit.reference.sched.sequence import Sampling, Sequence
from tests.helpers import serve_reference


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = Engine(EngineOptions(model=str(tiny_model), max_model_len=128, max_num_seqs=4))
    eng.start()
    return eng


def seq(prompt, max_tokens) -> Sequence:
    return Sequence(list(prompt), Sampling(max_tokens))


def drive(engine, ahead: bool, joins: dict, cancels: dict | None = None) -> tuple[dict, dict]:
    """Run the scheduler in this thread: joins {step: [sequences]} are submitted before that step, cancels
    {step: sequence} cancelled before it.  Returns each sequence's (tokens, finish) and the scheduler's counts."""
    engine.run_ahead = ahead
    sched, cancels = Scheduler(engine, engine.slots, 64), cancels or {}
    everyone = [s for group in joins.values() for s in group]
    step = 0
    while step <= max(joins) or sched.running or sched.waiting:
        if step in joins:
            sched.submit(joins[step])
        if step in cancels:
            cancels[step].cancel()
        with sched.cond:
            sched._admit()
        with engine.lock:
            sched.step()
        step += 1
        assert step < 500
    assert sched._ahead is None  # nothing left running: the step run ahead was waited for
    got = {}
    for s in everyone:
        events = []
        while not s.events.empty():
            events.append(s.events.get())
        got[id(s)] = ([e.token for e in events if e.kind == "token"], next((e.finish for e in events if e.kind == "done"),
                                                                         "cancelled"))
    return got, sched.counts


def workload():
    """Three sequences at once (ending by max_tokens at different steps), a fourth joining mid-run, one cancelled."""
    a, b, c = seq([256, 1, 2, 3], 12), seq([256, 7, 8], 20), seq([256, 40, 41, 42, 43], 7)
    d = seq([256, 99, 98], 10)
    return [a, b, c, d], {0: [a, b, c], 6: [d]}, {11: b}


def test_a_batch_run_ahead_gets_the_tokens_of_steps_run_one_by_one(engine):
    seqs, joins, cancels = workload()
    plain, plain_counts = drive(engine, False, joins, cancels)
    plain = [plain[id(s)] for s in seqs]
    seqs, joins, cancels = workload()
    ahead, counts = drive(engine, True, joins, cancels)
    ahead = [ahead[id(s)] for s in seqs]
    assert plain_counts["ahead"] == 0 and counts["ahead"] >= 10
    for i in (0, 2, 3):  # ended by max_tokens
        assert ahead[i] == plain[i] and ahead[i][1] == "length" and len(ahead[i][0]) == seqs[i].sampling.max_tokens
    (cut_ahead, why_ahead), (cut_plain, why_plain) = ahead[1], plain[1]
    assert why_ahead == why_plain == "cancelled" and 4 <= len(cut_ahead) < 20
    shorter, longer = sorted([cut_ahead, cut_plain], key=len)  # cancelled at the same step, not after as many tokens
    assert longer[:len(shorter)] == shorter
    for s, (tokens, _) in zip(seqs, ahead):  # and each is the sequence's own greedy completion, alone
        if s is not seqs[1]:
            assert engine.generate(s.prompt, s.sampling.max_tokens).tokens == tokens


def test_a_sequence_that_meets_its_eos_ends_there_and_its_slot_serves_the_next(engine):
    """It ends at its EOS though the step after was already launched for it; the sequence beside it keeps its
    tokens (that step was its next one), and a sequence joining later takes the freed slot as a new one."""
    prompt, beside, later = [256, 3, 1, 4, 1, 5], [256, 7, 8], [256, 9, 2, 6]
    tokens = engine.generate(prompt, 16).tokens
    alone = {tuple(p): engine.generate(p, 16).tokens for p in (beside, later)}
    end = next(t for t in tokens[4:] if all(t not in a for a in alone.values()))
    i = tokens.index(end)  # the first time the model says it
    config = engine.config
    engine.config = dataclasses.replace(config, extra_eos_token_ids=(end,))
    try:
        first, second, then = seq(prompt, 16), seq(beside, 16), seq(later, 16)
        got, counts = drive(engine, True, {0: [first, second], 14: [then]})
    finally:
        engine.config = config
    assert first.slot == then.slot == 0
    assert got[id(first)] == (tokens[: i + 1], "stop")
    assert got[id(second)] == (alone[tuple(beside)], "length")
    assert got[id(then)] == (alone[tuple(later)], "length")  # after a step that wrote past the first one's end
    assert counts["ahead"] >= 14


def test_a_steps_tokens_reach_their_readers_once_the_next_step_is_launched(engine):
    """Where steps run ahead, a step's tokens wait for the next step's launch (their readers' threads then wake while
    the device computes): while the batch runs, each reader has the tokens of every step but the last; the step
    that empties the batch hands over the rest; without run-ahead each step's tokens are handed over at its end."""
    for ahead in (True, False):
        engine.run_ahead = ahead
        sched = Scheduler(engine, engine.slots, 64)
        a, b = seq([256, 5, 6, 7], 9), seq([256, 11, 12], 9)
        sched.submit([a, b])
        lag, lags = {id(a): 0, id(b): 0}, set()
        while sched.running or sched.waiting:
            with sched.cond:
                sched._admit()
            with engine.lock:
                sched.step()
            for s in (a, b):
                while not s.events.empty():
                    if s.events.get().kind == "token":
                        lag[id(s)] += 1
                if sched.running:
                    lags.add(len(s.tokens) - lag[id(s)])
        assert lag == {id(a): 9, id(b): 9}  # every token reached its reader in the end
        assert lags == ({1} if ahead else {0}), lags


def post(port: int, body: dict, headers: dict | None = None) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def counts(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/stats", timeout=10) as r:
        return json.loads(r.read())["scheduler"]


@pytest.mark.slow
def test_a_server_told_to_run_ahead_serves_clients_cancels_and_canaries(tiny_model):
    """`--run-ahead on` on the CPU, through HTTP: 4 clients asking greedy completions (one ending at a stop token)
    all get whole answers while steps run ahead; the canary under that load equals the canary idle; a client that
    leaves mid-answer has its sequences cancelled and the engine stops computing for it; the next client is served."""
    proc, port = serve_reference(tiny_model, "--run-ahead", "on", "--max-num-seqs", "4", "--threads", "1",
                                 max_model_len=512)
    try:
        def ask(prompt, n, **extra):
            return post(port, {"prompt": prompt, "max_tokens": n, "temperature": 0, **extra})["choices"][0]

        canary = {"X-Restartkit-Canary": "1"}
        idle = post(port, {"prompt": [1, 3, 7], "max_tokens": 32, "temperature": 0}, canary)["choices"][0]
        stop_at = ask([1, 8, 9], 40, ignore_eos=True)["token_ids"][10]
        answers, errors = {}, []

        def client(i):
            try:
                for _ in range(3):
                    extra = {"ignore_eos": True, **({"stop_token_ids": [stop_at]} if i == 0 else {})}
                    answers.setdefault(i, []).append(ask([1, 8, 9] if i == 0 else [1, 20 + i, 5], 40, **extra))
            except Exception as e:  # noqa: BLE001 (the assertion below names it)
                errors.append(e)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        busy = post(port, {"prompt": [1, 3, 7], "max_tokens": 32, "temperature": 0}, canary)["choices"][0]
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert busy["token_ids"] == idle["token_ids"]
        for i, got in answers.items():
            assert len(got) == 3
            for a in got:
                if i == 0:
                    assert a["finish_reason"] == "stop" and a["token_ids"][-1] == stop_at, a
                else:
                    assert a["finish_reason"] == "length" and len(a["token_ids"]) == 40, a
        assert counts(port)["ahead"] > 20  # steps launched ahead: it ran

        before = counts(port)["cancelled"]
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 400, "temperature": 0, "n": 2, "ignore_eos": True,
                           "stream": True}).encode()
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        assert s.recv(4096)  # it has started answering
        s.close()
        end = time.monotonic() + 30
        while counts(port)["running"] or counts(port)["cancelled"] < before + 2:
            assert time.monotonic() < end, f"still running 30 s after its client left: {counts(port)}"
            time.sleep(0.02)
        rows = counts(port)["decode_rows"]
        time.sleep(0.3)
        assert counts(port)["decode_rows"] == rows
        assert ask([1, 3, 7], 32)["token_ids"] == idle["token_ids"]
    finally:
        proc.terminate()
        proc.wait(30)
