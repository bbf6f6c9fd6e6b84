"""The scheduler's token budget (--max-num-batched-tokens): running sequences decode and joining prompts prefill
in the same forward pass, chunked to the budget.  Greedy tokens do not depend on it: a prompt's answer is the same
alone, in a batch, and with its prompt cut at any boundary (the KV cache written chunk by chunk, beside other
sequences' decode rows); and a running stream waits one step, not a long prompt's whole prefill, while that prompt
joins."""
import statistics
import time

import pytest
import torch

from restartkit.reference.model.checkpoint import write_checkpoint
from restartkit.reference.sched.engine import Engine, EngineOptions
from restartkit.reference.sched.scheduler import Scheduler, run_together
from restartkit.reference.sched.sequence import Sampling, Sequence


def answers(engine, prompts, max_tokens, budget) -> list[list[int]]:
    seqs = [Sequence(list(p), Sampling(max_tokens, ignore_eos=True)) for p in prompts]
    run_together(engine, seqs, budget)
    return [s.tokens for s in seqs]


@pytest.fixture(scope="module")
def tiny_engine(tiny_model):
    eng = Engine(EngineOptions(model=str(tiny_model), max_model_len=512, max_num_seqs=8))
    eng.start()
    return eng


def prompts(n, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 380, (length,), generator=g).tolist() for length in lengths[:n]]


LENGTHS = [5, 37, 200, 1, 64, 129, 300, 17]


def test_greedy_tokens_are_the_same_alone_in_a_batch_and_chunked_at_any_boundary(tiny_engine):
    ps = prompts(8, LENGTHS)
    alone = [answers(tiny_engine, [p], 24, 4096)[0] for p in ps]
    for budget in (8, 13, 64, 512):  # 8: one prompt token a step beside 7 decode rows; 13 and 64 cut anywhere
        together = answers(tiny_engine, ps, 24, budget)
        assert together == alone, budget
    assert len({tuple(a) for a in alone}) == len(alone)  # distinct answers: the comparison can fail


def test_a_step_mixes_decode_rows_and_chunks_of_several_prompts(tiny_engine):
    sched = Scheduler(tiny_engine, 4, 4, 64)
    seqs = [Sequence(p, Sampling(8, ignore_eos=True)) for p in prompts(4, [100, 10, 10, 8], seed=1)]
    for seq in seqs:
        seq.slot = sched.free_slots.pop(0)
        sched.running.append(seq)
    with tiny_engine.lock:
        sched.step()  # the 100-token prompt's first 64 tokens
        assert [s.prefilled for s in seqs] == [64, 0, 0, 0]
        sched.step()  # its last 36 and the three short prompts, in one forward pass
        assert [s.prefilled for s in seqs] == [100, 10, 10, 8] and all(len(s.tokens) == 1 for s in seqs)
        sched.step()
    assert sched.counts["mixed"] == 1 and sched.counts["prefill_tokens"] == 128 and sched.counts["decode_rows"] == 4


@pytest.mark.slow
def test_a_running_stream_waits_one_step_not_a_long_prompts_prefill(tmp_path):
    """A 2,000-token prompt joins while a stream decodes: the stream's longest gap between tokens is at most a
    quarter of that prompt's prefill alone (one forward pass over the whole prompt), at a budget of 128 tokens."""
    path = tmp_path / "small"
    write_checkpoint(path, "small")
    torch.set_num_threads(1)  # steady step times on a shared CPU
    eng = Engine(EngineOptions(model=str(path), max_model_len=2304, max_num_seqs=2))
    eng.start()
    long_prompt = prompts(1, [2000], seed=2)[0]
    alone = []
    for _ in range(3):
        seq = Sequence(long_prompt, Sampling(1, ignore_eos=True))
        t0 = time.perf_counter()
        run_together(eng, [seq], 4096)
        alone.append(time.perf_counter() - t0)
    sched = Scheduler(eng, 2, 4, 128)
    eng.scheduler = sched
    sched.start()
    try:
        stream = Sequence([1, 2, 3], Sampling(2100, ignore_eos=True))
        sched.submit([stream])
        times = []
        while len(times) < 20:  # the stream is running
            times.append(stream.events.get().at)
        joining = Sequence(long_prompt, Sampling(1, ignore_eos=True))
        sched.submit([joining])
        while True:
            ev = joining.events.get()
            if ev.kind == "done":
                break
        joined = ev.at
        while True:
            ev = stream.events.get()
            times.append(ev.at)
            if ev.at > joined:
                break
        stream.cancel()
    finally:
        sched.stop()
    gaps = [b - a for a, b in zip(times, times[1:])]
    prefill = statistics.median(alone)
    assert sched.counts["mixed"] >= 2000 // 128
    assert max(gaps) <= prefill / 4, (max(gaps), prefill, sorted(gaps)[-5:])


def test_a_budget_below_max_num_seqs_is_refused_naming_both(capsys):
    from restartkit.reference.serving.args import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", "m", "--max-num-seqs", "16", "--max-num-batched-tokens", "8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--max-num-batched-tokens (8) is less than --max-num-seqs (16)" in err and "at least 16" in err
    assert parse_args(["--model", "m"]).max_num_batched_tokens == 512


def test_short_chunks_beside_running_streams_through_prefill_graphs_give_the_same_tokens(tiny_engine, monkeypatch):
    """On a GPU, one or two prompt chunks a prefill graph takes (<= 128 tokens) join running streams as prefills
    and then a decode step, not a mixed step.  The CPU has no graphs: the runner is told it has, so that this
    scheduling runs here, with its eager prefills.  Tokens equal alone; steps with decode rows and chunks went
    that way (no mixed step where every chunk fits), and two prompts with no stream prefill with no decode step."""
    ps = prompts(8, LENGTHS)
    alone = [answers(tiny_engine, [p], 24, 4096)[0] for p in ps]
    monkeypatch.setattr(tiny_engine, "graphed_prefill", lambda tokens: tokens <= 128, raising=False)
    monkeypatch.setattr(Scheduler, "short_chunks_as_prefills", True)  # off by default (see Scheduler.step)
    for budget in (8, 64, 512):
        seqs = [Sequence(list(p), Sampling(24, ignore_eos=True)) for p in ps]
        counts = run_together(tiny_engine, seqs, budget)
        assert [s.tokens for s in seqs] == alone, budget
        assert counts["prefill_tokens"] >= sum(LENGTHS), budget
        if budget == 8:  # every chunk is short: never a mixed step
            assert counts["mixed"] == 0, counts
    two = [Sequence(list(p), Sampling(4, ignore_eos=True)) for p in prompts(2, [10, 20], seed=3)]
    counts = run_together(tiny_engine, two, 512)  # two short prompts, nothing running: two prefills, no empty decode
    assert counts["mixed"] == 0 and all(len(s.tokens) == 4 for s in two)


def test_a_mixed_step_in_pieces_between_its_chunks_attention_gives_the_same_tokens(tiny_engine, monkeypatch):
    """On a GPU a mixed step runs as CUDA graphs between its chunks' attention (restartkit.reference.runtime.piecewise:
    decode rows by slot, then the chunks' rows padded, in static buffers).  The same pieces run here without graphs:
    tokens equal alone at budgets that cut prompts anywhere, several chunks in a step; every mixed step took them."""
    from restartkit.reference.runtime.piecewise import MixedGraphs
    ps = prompts(8, LENGTHS)
    alone = [answers(tiny_engine, [p], 24, 4096)[0] for p in ps]
    pieces = MixedGraphs(tiny_engine.model, tiny_engine.device, capture=False)
    monkeypatch.setattr(tiny_engine, "_pieces", pieces)
    for budget in (8, 13, 64, 512):
        seqs = [Sequence(list(p), Sampling(24, ignore_eos=True)) for p in ps]
        counts = run_together(tiny_engine, seqs, budget)
        assert [s.tokens for s in seqs] == alone, budget
        assert pieces.counts["eager"] == counts["mixed"] > 0, (budget, pieces.counts, counts)
        pieces.counts["eager"] = 0
