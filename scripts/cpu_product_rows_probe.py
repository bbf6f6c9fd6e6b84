#!/usr/bin/env python3
"""What bounds the CPU engine's decode products: the weights' memory traffic, or the float32 kernel for few rows.

    python3 scripts/cpu_product_rows_probe.py [--rows 10] [--out 3072] [--in 512] [--rounds 5]

One [out x in] float32 product of --rows rows in the engine's CPU form (weight @ x.T, restartkit.reference.model.
kernels.linear), on 1 and on 2 threads, median of --rounds rounds of 300: with 16 weights taken in turn (each one
read from memory, 16 of them larger than the L3 of a small host), with the same weight each time (in cache), and a
plain sum of a weight from memory (what reading it costs).  Where the product in cache is about as slow as from
memory, and several times a plain read, the kernel is what a decode step waits on, not the memory.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def median_us(f, rounds: int, n: int = 300) -> float:
    for i in range(32):
        f(i)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for i in range(n):
            f(i)
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=10)
    p.add_argument("--out", type=int, default=3072, help="the weight's rows (the small preset's gate/up: 3072)")
    p.add_argument("--in", dest="inner", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    weights = [torch.randn(a.out, a.inner) for _ in range(16)]
    x = torch.randn(a.rows, a.inner)
    flop = 2 * a.out * a.inner * a.rows
    print(f"[{a.out} x {a.inner}] float32 x {a.rows} rows, {a.out * a.inner * 4 / 1e6:.1f} MB a weight")
    print("| threads | from memory | in cache | GFLOP/s in cache | plain read of the weight |")
    print("| --- | --- | --- | --- | --- |")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        memory = median_us(lambda i: weights[i % 16] @ x.t(), a.rounds)
        cache = median_us(lambda i: weights[0] @ x.t(), a.rounds)
        read = median_us(lambda i: weights[i % 16].sum(), a.rounds)
        print(f"| {threads} | {memory:,.0f} us | {cache:,.0f} us | {flop / cache / 1e3:.1f} | {read:,.0f} us |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
