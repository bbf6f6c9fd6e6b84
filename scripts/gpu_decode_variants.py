#!/usr/bin/env python3
"""Where one decode step of the reference engine goes, and what fusing more would buy, on a GPU:

    python3 scripts/gpu_decode_variants.py [--preset 8b-shape] [--work DIR]

Builds the engine in this process (no HTTP) at 8 slots, then times (median of 50, synchronized):
  - the replay of each of the engine's decode graphs (B = 1, 2, 4, 8 rows) and Engine.decode end to end;
  - the capture of the graphs (what a start and a KV-cache restore pay);
  - one stream's time per token without HTTP: generate in this thread, and through a running scheduler, each
    with the next step run ahead (before the last one's token is read) and one by one (the tokens compared);
  - eight sequences at once, ending at different steps, run ahead and one by one (the tokens compared);
  - the weights' read floor (a clone of their size, halved).
Checks (greedy token equal, largest logit gap): the one-row graph against the eight-row one, the fused
kernels against their torch form (restartkit.reference.model.kernels), eager against the graph.  On a CPU
only the checks that need no GPU run."""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from benchlib import timed  # noqa: E402  (median of n synchronized calls)


def check(got, want) -> str:
    same = bool((got.argmax(-1) == want.argmax(-1)).all())
    return f"greedy {'same' if same else 'DIFFERENT'}, max logit gap {float((got - want).abs().max()):.3g}"


def inputs(B: int, position: int, dev):
    """B rows of token 5 at `position`."""
    import torch
    return (torch.full((B,), 5, dtype=torch.long, device=dev), torch.full((B,), position, dtype=torch.long, device=dev))


def same_as(same: bool) -> str:
    return "same as one by one" if same else "DIFFERENT from one by one"


def batch_tokens(eng, ahead: bool) -> list[list[int]]:
    """Eight greedy sequences submitted at once to a running scheduler, ending at different steps (max_tokens
    20, 27, ..., or EOS), with or without the next step launched before the last one's tokens are read."""
    from restartkit.reference.sched.scheduler import Scheduler
    from restartkit.reference.sched.sequence import Sampling, Sequence
    eng.run_ahead, eng.scheduler = ahead, Scheduler(eng, 8, 64)
    eng.scheduler.start()
    try:
        seqs = [Sequence([1, 300 + i, 301 + i], Sampling(20 + 7 * i), quiet=True) for i in range(8)]
        eng.scheduler.submit(seqs)
        out = []
        for seq in seqs:
            tokens = []
            while (ev := seq.events.get(timeout=120)).kind == "token":
                tokens.append(ev.token)
            out.append(tokens)
        return out
    finally:
        eng.scheduler.stop()
        eng.run_ahead, eng.scheduler = None, None


def clients_in_process(eng, n: int, seconds: float, ahead: bool) -> float:
    """Tokens/s of n threads each asking a 128-token greedy completion (ignore_eos) in a loop from a running
    scheduler, as n HTTP clients would without HTTP; with or without the next step run ahead."""
    import threading

    from restartkit.reference.sched.scheduler import Scheduler
    from restartkit.reference.sched.sequence import Sampling, Sequence
    eng.run_ahead, eng.scheduler = ahead, Scheduler(eng, 8, 64)
    eng.scheduler.start()
    done, stop = [0] * n, time.perf_counter() + seconds

    def client(i):
        while time.perf_counter() < stop:
            seq = Sequence([1, 300 + i, 301 + i], Sampling(128, ignore_eos=True), quiet=True)
            eng.scheduler.submit([seq])
            while seq.events.get(timeout=120).kind == "token":
                pass
            done[i] += 128
    try:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(done) / (time.perf_counter() - t0)
    finally:
        eng.scheduler.stop()
        eng.run_ahead, eng.scheduler = None, None


def kernels_per_step(fn, args) -> int:
    import torch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="8b-shape")
    p.add_argument("--device", default="cuda")
    p.add_argument("--work", default="/tmp/decode-variants")
    a = p.parse_args()
    import torch

    from restartkit.reference.sched.engine import Engine, EngineOptions
    model_dir = Path(a.work) / a.preset
    if not (model_dir / "config.json").exists():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "restartkit.cli", "model", "create", "--preset", a.preset, "--out",
                        str(model_dir), "--device", a.device], check=True)
        print(f"model written in {time.perf_counter() - t0:.0f} s", flush=True)
    eng = Engine(EngineOptions(model=str(model_dir), device=a.device, max_model_len=1024, max_num_seqs=8))
    eng.start()
    m, dev = eng.model, eng.device
    gpu = dev.type == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    rows: list[tuple[str, float, str]] = []
    from restartkit.reference.model import kernels
    with torch.inference_mode():
        prompt = [1, 2, 3, 4, 5, 6, 7, 8]
        for slot in range(8):  # every slot holds the same prompt; the probe decodes at position 8
            m(torch.tensor(prompt, device=dev), torch.arange(8, device=dev), slot)
        ref = eng.decode(list(range(8)), [5] * 8, [8] * 8).float().clone()
        d = m.cache_k.shape[2]
        if gpu:
            g = eng._graphs
            for b in g.sizes:
                rows.append((f"engine graph replay, B={b}", timed(g.graphs[b].replay, sync), ""))
            rows.append(("Engine.decode, 1 row (slot 0)", timed(lambda: eng.decode([0], [5], [8]), sync), ""))
            rows.append(("Engine.decode, 1 row (slot 5)", timed(lambda: eng.decode([5], [5], [8]), sync), ""))
            rows.append(("Engine.decode, 8 rows", timed(lambda: eng.decode(list(range(8)), [5] * 8, [8] * 8), sync), ""))
            rows.append(("Engine.decode_greedy, 1 row", timed(lambda: eng.decode_greedy([0], [5], [8]), sync), ""))
            t0 = time.perf_counter()
            eng.capture_decode_graph()
            sync()
            rows.append((f"capture of the {len(g.sizes) + len(g.prompt_sizes)} graphs", (time.perf_counter() - t0) * 1000, ""))
            one = eng.decode([0], [5], [8]).float()
            rows.append(("B=1 graph against B=8 graph, row 0", 0.0, check(one, ref[:1])))
        for B in (1, 8):
            args = inputs(B, 8, dev)
            fast = m.decode(args[0], args[1], None).float()
            if gpu:
                n = kernels_per_step(lambda *a: m.decode(a[0], a[1], None), args)
                os.environ[kernels.NO_TRITON_ENV] = "1"
                kernels._triton.cache_clear()
                plain = m.decode(args[0], args[1], None).float()
                n_plain = kernels_per_step(lambda *a: m.decode(a[0], a[1], None), args)
                del os.environ[kernels.NO_TRITON_ENV]
                kernels._triton.cache_clear()
                rows.append((f"eager B={B}: {n} kernels fused, {n_plain} in torch form", 0.0, check(fast, plain)))
                if B == 1:  # a prefill (the single-sequence path) too, in a slot of its own
                    def prefill():
                        return m(torch.tensor(prompt, device=dev), torch.arange(8, device=dev), 7)[-1:].float()
                    fused_row = prefill()
                    os.environ[kernels.NO_TRITON_ENV] = "1"
                    kernels._triton.cache_clear()
                    plain_row = prefill()
                    del os.environ[kernels.NO_TRITON_ENV]
                    kernels._triton.cache_clear()
                    rows.append(("prefill of 8 tokens: fused against torch form", 0.0, check(fused_row, plain_row)))
            rows.append((f"eager B={B} against the graph", 0.0, check(fast, ref[:B])))
        if gpu:
            def per_token(scheduled: bool, ahead: bool) -> tuple[float, list[int]]:
                """A 257-token greedy completion minus a 1-token one, over 256: in this thread, or through a
                running scheduler (its thread steps, this one reads the events, as an HTTP handler does); with
                or without the next step launched before the last one's tokens are read.  And its tokens."""
                from restartkit.reference.sched.scheduler import Scheduler
                eng.run_ahead = ahead
                if scheduled:
                    eng.scheduler = Scheduler(eng, 8, 64)
                    eng.scheduler.start()
                try:
                    def run(n):
                        t0 = time.perf_counter()
                        eng.generate([1, 5, 6], n, ignore_eos=True)
                        return time.perf_counter() - t0
                    ms = statistics.median((run(257) - run(1)) / 256 for _ in range(3)) * 1000
                    return ms, eng.generate([1, 5, 6], 257, ignore_eos=True).tokens
                finally:
                    eng.run_ahead = None
                    if scheduled:
                        eng.scheduler.stop()
                        eng.scheduler = None
            got = {}
            for scheduled, ahead in ((False, False), (False, True), (True, False), (True, True)):
                ms, got[scheduled, ahead] = per_token(scheduled, ahead)
                where = "through the scheduler" if scheduled else "generate in this thread"
                same = "" if not ahead else f"tokens {same_as(got[scheduled, True] == got[scheduled, False])}"
                rows.append((f"one stream per token, {where}, {'run ahead' if ahead else 'one by one'}", ms, same))
            for n in (1, 8):
                for ahead in (False, True):
                    rate = clients_in_process(eng, n, 6.0, ahead)
                    rows.append((f"{n} in-process clients, {'run ahead' if ahead else 'one by one'}: tok/s (not ms)", rate, ""))
            rows.append(("prefill of 3 tokens, eager", timed(lambda: m(torch.tensor([1, 5, 6], device=dev),
                                                                       torch.arange(3, device=dev), 7), sync), ""))
            batches = [batch_tokens(eng, ahead) for ahead in (False, True)]
            rows.append(("8 sequences ending at different steps, run ahead", 0.0, f"tokens {same_as(batches[0] == batches[1])}"))
            buf = torch.empty(eng.weight_bytes() // 2, dtype=torch.bfloat16, device=dev)
            rows.append(("weights read floor (clone / 2)", timed(buf.clone, sync, n=10) / 2, ""))
    print(f"{d} KV heads; slots {m.cache_k.shape[1]}, positions {m.cache_k.shape[3]}")
    for what, ms, verdict in rows:
        print(f"{what:<58} {ms:8.3f} ms  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
