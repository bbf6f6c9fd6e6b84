#!/usr/bin/env python3
"""Whether a bf16 matrix product's rows depend on how many rows it has, on this machine's GPU, at Llama-3-8B's
shapes (q/k/v, o_proj, gate/up, down_proj, lm_head):

    python3 scripts/gpu_product_rows_probe.py [--device cuda] [--no-kernel]

A decode row's token comes from a step of a few rows (a decode graph) or of many (a mixed step with prompt chunks):
where cuBLAS picks another kernel for another row count, the row rounds differently and a near tie in a greedy
argmax can go the other way (docs/BENCHMARKS.md). For each shape: the row counts whose first rows are not
bit-identical to the same rows at 1 row, and at 136 rows; and F.linear's time at 1 to 256 rows.  Then the same
for restartkit's own kernel (triton_kernels.linear_rows, the engine's bf16 products on a GPU), and its time against
cuBLAS's at 1 to 2,048 rows for its default tiles and a few others, with what a 32-layer step's products would take
each way (the table to choose the default tiles from).
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
    p.add_argument("--no-kernel", action="store_true", help="cuBLAS only")
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
        verdicts.append((f"{name}: cuBLAS, every row count gives 1 row's bits", not small and not large and same136))
    if not a.no_kernel:
        verdicts += kernel_rows(a.device, timed)
    return print_verdicts(verdicts)


ROWS = (1, 8, 64, 256, 2048)
ALTERNATIVES = {"bn128-bk64": {"BN": 128, "BK": 64}, "bk64-s5": {"BK": 64, "num_stages": 5},
                "bn128-w8-s3": {"BN": 128, "num_warps": 8, "num_stages": 3}, "parts1": {"PARTS": 1},
                "parts-x2": {}, "bn32": {"BN": 32, "PARTS": 1}, "bn256-bk64-w8-s3": {"BN": 256, "BK": 64,
                                                                                     "num_warps": 8, "num_stages": 3}}


def kernel_rows(device: str, timed) -> list[tuple[str, bool]]:
    """linear_rows against cuBLAS at each shape: bits by row count, and time by row count and tiles."""
    import torch
    import torch.nn.functional as F
    from restartkit.reference.model import triton_kernels as T
    verdicts, step, failed = [], {}, set()  # step[config][rows]: a 32-layer step's products (lm_head once), us
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f, device=device, dtype=torch.bfloat16) / in_f ** 0.5
        x = torch.randn(2304, in_f, device=device, dtype=torch.bfloat16)
        full = T.linear_rows(x, w)
        counts = [*range(1, 129), *range(136, 2305, 8)]
        differ = [m for m in counts if not torch.equal(T.linear_rows(x[:m], w), full[:m])]
        gap = float((full.float() - F.linear(x, w).float()).abs().max())
        default = T.linear_config(in_f)
        print(f"{name}: linear_rows {default}: {len(differ)} of {len(counts)} row counts differ from 2304 rows'"
              f" first rows {differ[:8]}; largest gap from cuBLAS {gap:.3g}", flush=True)
        verdicts.append((f"{name}: linear_rows, every row count gives the same bits", not differ))
        configs = {"cublas": None, "default": default}
        for alt, change in ALTERNATIVES.items():
            c = {**default, **change}
            if alt == "parts-x2":
                c["PARTS"] = default["PARTS"] * 2
            configs[alt] = c
        layers = 1 if name == "lm_head" else 32
        for label, c in configs.items():
            row = {}
            for m in ROWS:
                xm = x[:m].contiguous()
                f = (lambda xm=xm: F.linear(xm, w)) if c is None else (lambda xm=xm, c=c: T.linear_rows(xm, w, c))
                try:
                    row[m] = timed(f, 20)
                except Exception as e:  # a tile too large for this GPU's shared memory
                    print(f"  {label}: {type(e).__name__}: {str(e)[:100]}")
                    row = None
                    break
            if row is None:
                failed.add(label)
                continue
            print(f"  {label:18} " + " ".join(f"{m}:{row[m]:8.1f}us" for m in ROWS), flush=True)
            for m in ROWS:
                step.setdefault(label, {}).setdefault(m, 0.0)
                step[label][m] += row[m] * layers
    print("a step's products (32 layers, lm_head once), ms by rows:")
    for label, row in step.items():
        if label not in failed:
            print(f"  {label:18} " + " ".join(f"{m}:{row[m] / 1000:7.2f}" for m in ROWS))
    base = step["cublas"]
    cost = max(step["default"][m] / base[m] for m in ROWS)
    print(f"linear_rows default / cuBLAS, worst over rows: {cost:.2f}x")
    return verdicts


if __name__ == "__main__":
    sys.exit(main())
