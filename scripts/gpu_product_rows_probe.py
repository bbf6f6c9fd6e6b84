#!/usr/bin/env python3
"""Whether a bf16 matrix product's rows depend on how many rows it has, on this machine's GPU, at Llama-3-8B's
shapes (q/k/v, o_proj, gate/up, down_proj, lm_head):

    python3 scripts/gpu_product_rows_probe.py [--device cuda]

A decode row's token comes from a step of a few rows (a decode graph) or of many (a mixed step with prompt chunks):
where cuBLAS picks another kernel for another row count, the row rounds differently and a near tie in a greedy
argmax can go the other way (docs/BENCHMARKS.md). For each shape: the row counts whose first rows are not
bit-identical to the same rows at 1 row, and at 136 rows; and F.linear's time at 1 to 256 rows.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import print_verdicts  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down_proj": (4096, 14336),
          "lm_head": (128256, 4096)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    print("device:", torch.cuda.get_device_name(a.device))

    def timed(f, n: int = 50) -> float:
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    verdicts = []
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f, device=a.device, dtype=torch.bfloat16) / in_f ** 0.5
        x = torch.randn(2304, in_f, device=a.device, dtype=torch.bfloat16)
        one = F.linear(x[:1], w)
        small = [m for m in (2, 4, 8, 16, 32, 64, 68, 128) if not torch.equal(F.linear(x[:m], w)[:1], one)]
        at136 = F.linear(x[:136], w)[:8]
        large = [m for m in range(136, 2305, 8) if not torch.equal(F.linear(x[:m], w)[:8], at136)]
        same136 = torch.equal(at136[:1], one)
        us = {m: round(timed(lambda m=m: F.linear(x[:m], w))) for m in (1, 8, 64, 128, 256)}
        print(f"{name} {out_f}x{in_f}: differ from 1 row at {small or 'none'}; of 272 counts 136..2304, "
              f"{len(large)} differ from 136 rows; 136 rows = 1 row: {same136}; us by rows {us}", flush=True)
        verdicts.append((f"{name}: every row count gives 1 row's bits", not small and not large and same136))
    return print_verdicts(verdicts)


if __name__ == "__main__":
    sys.exit(main())
