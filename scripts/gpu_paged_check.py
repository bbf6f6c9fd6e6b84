#!/usr/bin/env python3
"""The paged KV cache and the token budget on this machine's GPU (what tests/reference/test_paged.py and
test_token_budget.py check on the CPU in CI), in process:

    python3 scripts/gpu_paged_check.py [--device cuda] [--presets tiny,8b-shape:float32,8b-shape]
                                       [--work /tmp/rk-serving]

Each preset: 8 greedy sequences (prompts of 20-400 tokens, 100-token answers), each alone on an engine of one
slot, then all together on an engine of 8 slots whose KV cache holds two rows of blocks (so the newest is
preempted and recomputed), at budgets of 24, 64 and 512 tokens a step (prompts chunked at those boundaries, decode
rows and chunks in one forward pass), CUDA graphs and run-ahead as serving uses them; then on an engine with a row
per slot (the default).  Verdict: every answer equal to its answer alone, every block free after.  A preset
may name a dtype (8b-shape:float32): in bfloat16 a matrix product's rounding depends on its row count (cuBLAS
picks its kernel by shape), so a sequence's greedy tokens can differ between a batch and alone at a near tie;
in float32 they are the check of the paging itself.  Where an answer differs, the first token where it does.
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import time

from benchlib import reference_model, verdict_table


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(20, 400))] for _ in range(n)]


def check(model, device: str, answer: int, dtype: str | None) -> list[tuple[str, bool]]:
    import torch

    from restartkit.reference.model.paged import BLOCK
    from restartkit.reference.sched.engine import Engine, EngineOptions
    from restartkit.reference.sched.scheduler import run_together
    from restartkit.reference.sched.sequence import Sampling, Sequence

    def engine(**kw) -> Engine:
        eng = Engine(EngineOptions(model=str(model), device=device, max_model_len=1024, dtype=dtype, **kw))
        eng.start()
        return eng

    alone = engine(max_num_seqs=1)
    c = alone.config
    ps = prompts(8, min(c.vocab_size, 32000), seed=7)
    t0 = time.perf_counter()
    want = [alone.generate(p, answer).tokens for p in ps]
    print(f"  alone: {len(ps)} answers in {time.perf_counter() - t0:.1f} s", flush=True)
    block = 2 * c.num_hidden_layers * c.num_key_value_heads * BLOCK * c.head_dim * alone.dtype.itemsize
    cols = alone.kv_blocks  # one slot: one row of blocks
    del alone
    verdicts = []
    for name, kw, budgets in (("2 rows of blocks", {"kv_cache_memory": 2 * cols * block}, (24, 64, 512)),
                              ("a row per slot", {}, (512,))):
        eng = engine(max_num_seqs=8, **kw)
        free = eng.free_blocks()
        for budget in budgets:
            seqs = [Sequence(list(p), Sampling(answer, 0.0)) for p in ps]
            t0 = time.perf_counter()
            with eng.lock:
                counts = run_together(eng, seqs, budget)
            got = [s.tokens for s in seqs]
            same = sum(g == w for g, w in zip(got, want))
            first = [next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), min(len(g), len(w)))
                     for g, w in zip(got, want) if g != w]
            pieces = dict(eng._pieces.counts) if eng._pieces is not None else None
            print(f"  {name}, budget {budget}: {same}/{len(ps)} equal alone (others differ from token {first}), "
                  f"{time.perf_counter() - t0:.1f} s, counts {counts}, mixed steps in graphs {pieces}", flush=True)
            if pieces is not None and counts["mixed"]:
                verdicts.append((f"{name}, budget {budget}: mixed steps through graph pieces (each size captured at "
                                 "its first step, replayed after)",
                                 pieces["graphed"] + pieces["captured"] > 0 and not pieces["capture_failed"]))
            verdicts.append((f"{name}, budget {budget}: every answer = alone "
                             f"({counts.get('preempted', 0)} preempted)", same == len(ps)))
            verdicts.append((f"{name}, budget {budget}: every block free after", eng.free_blocks() == free))
        del eng
        gc.collect()
        torch.cuda.empty_cache() if device.startswith("cuda") else None
    return verdicts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--presets", default="tiny,8b-shape:float32,8b-shape", help="preset[:dtype], comma-separated")
    p.add_argument("--answer", type=int, default=100)
    p.add_argument("--work", default="/tmp/rk-serving")
    a = p.parse_args()
    verdicts = []
    for item in a.presets.split(","):
        preset, _, dtype = item.partition(":")
        model, _ = reference_model(a.work, a.device, preset)
        print(f"{item}:", flush=True)
        verdicts += [(f"{item}: {text}", ok) for text, ok in check(model, a.device, a.answer, dtype or None)]
    return verdict_table(verdicts)


if __name__ == "__main__":
    sys.exit(main())
