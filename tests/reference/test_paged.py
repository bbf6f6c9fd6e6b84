"""The KV cache in blocks (restartkit.reference.model.paged): with a budget smaller than every sequence at once,
sequences take blocks as they grow, the newest is preempted when none is free, and every one completes with the
answer it has alone (its prompt and tokens prefilled again: recompute)."""
import random

import pytest
import torch

from restartkit.reference.model.paged import BLOCK
from restartkit.reference.sched.engine import Engine, EngineOptions
from restartkit.reference.sched.scheduler import run_together
from restartkit.reference.sched.sequence import Sampling, Sequence


def block_bytes(eng: Engine) -> int:
    c = eng.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * BLOCK * c.head_dim * eng.dtype.itemsize


@pytest.fixture(scope="module")
def alone(tiny_model):
    eng = Engine(EngineOptions(model=str(tiny_model), max_model_len=256, max_num_seqs=1))
    eng.start()
    return eng


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[256] + [rng.randrange(1, 250) for _ in range(rng.randint(20, 150))] for _ in range(n)]


COLS = 5  # a row of the cache at max_model_len 256: 4 blocks of 64 positions and one more


@pytest.mark.parametrize("rows, budget, ahead, pieces", [(1, 512, False, False), (2, 24, False, False),
                                                         (2, 64, False, False), (3, 512, True, False),
                                                         (2, 64, False, True), (3, 512, True, True)])
def test_a_full_kv_cache_preempts_and_every_sequence_gets_its_answer_alone(tiny_model, alone, rows, budget, ahead,
                                                                           pieces):
    """`ahead`: greedy steps launched before the last one's tokens are read (what CUDA graphs do), each taking
    the block it writes into first.  `pieces`: mixed steps as a GPU runs them, in pieces between the chunks'
    attention (restartkit.reference.runtime.piecewise), here without graphs, the chunks' keys gathered by block."""
    ps, answer = prompts(8, seed=rows + budget), 100
    want = [alone.generate(p, answer).tokens for p in ps]
    probe = Engine(EngineOptions(model=str(tiny_model), max_model_len=256, max_num_seqs=8))
    probe.prepare()
    eng = Engine(EngineOptions(model=str(tiny_model), max_model_len=256, max_num_seqs=8,
                               kv_cache_memory=rows * COLS * block_bytes(probe)))
    eng.start()
    eng.run_ahead = ahead
    if pieces:
        from restartkit.reference.runtime.piecewise import MixedGraphs
        eng._pieces = MixedGraphs(eng.model, eng.device, capture=False)
    usable = rows * COLS - 1  # the scratch block is no one's
    assert eng.kv_blocks == rows * COLS and eng.free_blocks() == usable
    seqs = [Sequence(list(p), Sampling(answer, 0.0)) for p in ps]
    with eng.lock:
        sched_counts = run_together(eng, seqs, budget)
    assert [s.tokens for s in seqs] == want
    assert sched_counts["preempted"] >= 1, sched_counts
    assert (sched_counts["ahead"] > 0) == ahead, sched_counts
    assert eng.free_blocks() == usable  # every block back
    if pieces:
        assert eng._pieces.counts["eager"] == sched_counts["mixed"] > 0, (eng._pieces.counts, sched_counts)


def test_a_kv_cache_dropped_and_restored_has_its_budget_again(tiny_model, alone):
    """What sleep and a criu+ipc snapshot do (the runner's drop and restore): the same blocks, all free, and the
    same answers under preemption after."""
    probe = Engine(EngineOptions(model=str(tiny_model), max_model_len=256))
    probe.prepare()
    eng = Engine(EngineOptions(model=str(tiny_model), max_model_len=256, max_num_seqs=8,
                               kv_cache_memory=2 * COLS * block_bytes(probe)))
    eng.start()
    ps = prompts(6, seed=11)
    want = [alone.generate(p, 80).tokens for p in ps]
    for _ in range(2):
        seqs = [Sequence(list(p), Sampling(80, 0.0)) for p in ps]
        with eng.lock:
            counts = run_together(eng, seqs, 512)
        assert [s.tokens for s in seqs] == want and counts["preempted"] >= 1
        freed = eng.drop_kv_cache()
        assert freed == 2 * COLS * block_bytes(probe) and eng.free_blocks() is None
        eng.restore_kv_cache()
        assert eng.kv_blocks == 2 * COLS and eng.free_blocks() == 2 * COLS - 1


def test_decode_rows_in_any_order_read_their_slots_in_place_with_the_gathered_answer(tiny_model, monkeypatch):
    """Decode rows whose slots lie close together (shuffled, as a busy scheduler has them) attend over those slots
    read in place (paged.covering) rather than over a copy of their keys: the same logits as the copy, and rows
    spread thin are still copied."""
    from restartkit.reference.model import paged
    eng = Engine(EngineOptions(model=str(tiny_model), max_model_len=256, max_num_seqs=8))
    eng.start()
    rng = random.Random(3)
    lengths = [rng.randint(30, 90) for _ in range(8)]
    with eng.lock:
        for pos in range(max(lengths)):  # each slot's keys up to its length, written by decode steps
            live = [s for s in range(8) if pos < lengths[s]]
            eng.decode(live, [rng.randrange(1, 250) for _ in live], [pos] * len(live))
    seen, real = [], paged.covering

    def counted(table, rows):
        seen.append(real(table, rows))
        return seen[-1]
    monkeypatch.setattr(paged, "covering", counted)
    for slots in ([5, 2, 7, 3, 6, 4], [1, 0, 3, 2], [7, 0]):
        toks = [rng.randrange(1, 250) for _ in slots]
        positions = [lengths[s] for s in slots]
        seen.clear()
        with eng.lock:
            got = eng.decode(slots, toks, positions)
            in_place = seen[0] is not None
            monkeypatch.setattr(paged, "covering", lambda table, rows: None)
            copied = eng.decode(slots, toks, positions)
            monkeypatch.setattr(paged, "covering", counted)
        assert in_place == (slots != [7, 0]), (slots, seen)
        assert torch.allclose(got, copied, atol=1e-5, rtol=0), (slots, (got - copied).abs().max())
        assert got.argmax(-1).tolist() == copied.argmax(-1).tolist()


def test_a_budget_that_cannot_hold_one_sequence_is_refused_naming_the_flag(tiny_model):
    eng = Engine(EngineOptions(model=str(tiny_model), max_model_len=256, max_num_seqs=8, kv_cache_memory=1000))
    with pytest.raises(ValueError, match="kv-cache-memory 1000 holds 0 blocks.*lower --max-model-len"):
        eng.start()


def at_once(port: int, ask, n: int) -> tuple[dict[int, list[int]], dict]:
    """ask(i) for i < n, each in a thread of its own, all at once: ({i: its answer}, the engine's scheduler stats)."""
    import json
    import threading
    import urllib.request
    got: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, ask(i))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/stats", timeout=10) as r:
        return got, json.loads(r.read())["scheduler"]


@pytest.mark.slow
def test_clients_of_an_engine_whose_kv_cache_holds_few_of_them_all_get_their_answers(tiny_model, alone):
    """`restartkit engine serve --kv-cache-memory`: 12 streaming clients at once, max-num-seqs defaulting to 64, a
    cache of 2 rows of 5 blocks: the engine preempts (its stats say how often) and every client gets its answer alone."""
    import json
    import urllib.request

    from tests.helpers import serve_reference
    probe = Engine(EngineOptions(model=str(tiny_model), max_model_len=256))
    probe.prepare()
    ps, answer = prompts(12, seed=3), 90
    want = [alone.generate(p, answer).tokens for p in ps]
    proc, port = serve_reference(tiny_model, "--served-model-name", "m", "--threads", "1", "--kv-cache-memory",
                                 str(2 * COLS * block_bytes(probe)))

    def ask(i: int) -> list[int]:
        body = {"model": "m", "prompt": ps[i], "max_tokens": answer, "temperature": 0, "stream": True,
                "return_token_ids": True}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        ids = []
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                line = line.strip()
                if line.startswith(b"data: {"):
                    for ch in json.loads(line[6:])["choices"]:
                        ids += ch.get("token_ids") or []
        return ids

    try:
        got, s = at_once(port, ask, len(ps))
        assert [got.get(i) for i in range(len(ps))] == want
        assert s["max_num_seqs"] == 64 and s["kv_cache_blocks"] == 2 * COLS and s["kv_blocks_free"] == 2 * COLS - 1, s
        assert s["preempted"] >= 1 and s["finished"] >= len(ps), s
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow
def test_tensor_parallel_ranks_follow_rank_0s_block_table(tiny_model):
    """Two ranks (gloo), a cache of 5 blocks: rank 0 preempts and hands out blocks, and tells the other rank each
    change; answers under preemption are each request's answer alone on the same engine."""
    import json
    import urllib.request

    from tests.helpers import free_port, serve_reference
    probe = Engine(EngineOptions(model=str(tiny_model), max_model_len=256))
    probe.prepare()
    per_rank = block_bytes(probe) // 2  # each rank holds half the KV heads
    proc, port = serve_reference(tiny_model, "--served-model-name", "m", "--threads", "1", "--tensor-parallel-size",
                                 "2", "--dist-port", str(free_port()), "--kv-cache-memory", str(COLS * per_rank))
    ps = prompts(6, seed=5)

    def ask(p) -> list[int]:
        body = {"model": "m", "prompt": p, "max_tokens": 80, "temperature": 0}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["choices"][0]["token_ids"]

    try:
        want = [ask(p) for p in ps]  # one at a time: no preemption
        got, s = at_once(port, lambda i: ask(ps[i]), len(ps))
        assert [got.get(i) for i in range(len(ps))] == want
        assert s["preempted"] >= 1 and s["kv_cache_blocks"] == COLS, s
    finally:
        proc.terminate()
        proc.wait(30)
