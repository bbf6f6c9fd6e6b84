#!/usr/bin/env python3
"""Where a step of the token budget goes on a GPU (no HTTP, no scheduler):

    python3 scripts/gpu_mixed_probe.py --model DIR [--device cuda] [--rows 64] [--context 600]
                                       [--chunks 448,1984]

An engine of --rows slots (max_model_len 4096) whose first rows - 1 slots each hold a sequence of --context
tokens.  Times (median of 10, synchronized): the decode step of those sequences (the decode graph, as
serving runs it), and each mixed step of their decode rows plus a prompt chunk of the given length in the last
slot (what a step of the budget runs while prompts wait), and that chunk's prefill alone: eagerly (one forward
pass) and as serving runs them on a GPU, CUDA graphs between the chunk's attention
(restartkit.reference.runtime.piecewise).  Then the step's device time in kernels (torch.profiler) against its
wall time: a step whose wall time is far above its kernels' waits on the host."""
from __future__ import annotations

import argparse
import random
import sys

from benchlib import timed  # median of n synchronized calls, in ms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--chunks", default="448,1984")
    a = p.parse_args()
    import torch

    from restartkit.reference.sched.engine import Engine, EngineOptions
    eng = Engine(EngineOptions(model=a.model, device=a.device, max_model_len=4096, max_num_seqs=a.rows))
    eng.start()
    rng = random.Random(0)
    vocab = min(eng.config.vocab_size, 32000)
    n = a.rows - 1
    slots = list(range(n))
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    with eng.lock:
        for s in slots:
            assert eng.reserve(s, a.context + 2)
            eng.prefill(s, [rng.randrange(1, vocab) for _ in range(a.context)], 0)
        tokens, positions = [rng.randrange(1, vocab) for _ in slots], [a.context] * n
        rows = []
        decode_ms = timed(lambda: eng.decode(slots, tokens, positions), sync, 10)
        rows.append((f"decode, {n} rows", decode_ms, n, 0))
        for chunk in (int(c) for c in a.chunks.split(",")):
            assert eng.reserve(n, chunk + 1)
            prompt = [rng.randrange(1, vocab) for _ in range(chunk)]
            segs = [(s, a.context, [t]) for s, t in zip(slots, tokens)] + [(n, 0, prompt)]
            pieces, eng._pieces = eng._pieces, None  # eagerly, one forward pass
            mixed_ms = timed(lambda: eng.mixed(segs), sync, 10)
            alone_ms = timed(lambda: eng.mixed([(n, 0, prompt)]), sync, 10)
            eng._pieces = pieces
            rows.append((f"mixed, {n} decode rows + a {chunk}-token chunk, eager", mixed_ms, n, chunk))
            rows.append((f"the {chunk}-token chunk alone, eager", alone_ms, 0, chunk))
            if pieces is not None:  # graphs between the chunk's attention: the first step captures them
                eng.mixed(segs)
                eng.mixed([(n, 0, prompt)])
                rows.append((f"mixed, {n} decode rows + a {chunk}-token chunk, in graphs",
                             timed(lambda: eng.mixed(segs), sync, 10), n, chunk))
                rows.append((f"the {chunk}-token chunk alone, in graphs",
                             timed(lambda: eng.mixed([(n, 0, prompt)]), sync, 10), 0, chunk))
                print(f"  pieces: {pieces.counts}", flush=True)
            if a.device.startswith("cuda"):
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    eng.mixed(segs)
                    torch.cuda.synchronize()
                cuda_us = sum(e.self_device_time_total for e in prof.key_averages())
                print(f"  mixed step with a {chunk}-token chunk: kernels {cuda_us / 1e3:.2f} ms of device time")
                print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))
    print("| step | ms | decode rows | prompt tokens | tokens/s |\n| --- | --- | --- | --- | --- |")
    for what, ms, d, c in rows:
        print(f"| {what} | {ms:.2f} | {d} | {c} | {(d + c) / ms * 1e3:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
