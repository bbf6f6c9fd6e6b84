#!/usr/bin/env python3
"""The one-launch attention of a step's prompt chunks (kernels.attend_chunks, a Triton kernel) against float64
attention over the same keys, on a paged KV cache whose blocks are shuffled among the slots:

    python3 scripts/attend_chunks_check.py [--device cuda] [--dtype float32,bfloat16]
    TRITON_INTERPRET=1 python3 scripts/attend_chunks_check.py --device cpu    # Triton's interpreter, no GPU

Each case: several chunks (of 1 to 200 rows, starting anywhere in a prompt of up to 700 tokens) in one call, with
Llama-3-8B's head layout (32 query heads over 8 KV heads, 128 wide) and the tiny preset's (4 over 2, 16 wide).
Checks: every listed row within tolerance (float32 1e-4, bfloat16 2e-2 absolute, values of about 1), rows no tile
lists left untouched, a row's result bitwise the same when its chunk runs alone in a call of its own, and spare
tiles of 0 rows doing nothing.  Prints a verdict table; exit 1 on any failure.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import torch

from benchlib import verdict_table


def reference(q, ck, cv, table, slot: int, pos: int) -> torch.Tensor:
    """Row q [heads, hd] at `pos` of `slot`, in float64 over keys 0..pos: [heads, hd]."""
    n_heads, hd = q.shape
    n_kv, block = ck.shape[1], 64
    cols = table.shape[1]
    keys, values = [], []
    for c in range(pos // block + 1):
        b = int(table[slot, c])
        keys.append(ck[b // cols, :, (b % cols) * block:(b % cols + 1) * block])
        values.append(cv[b // cols, :, (b % cols) * block:(b % cols + 1) * block])
    k = torch.cat(keys, dim=1)[:, :pos + 1].double().repeat_interleave(n_heads // n_kv, 0)
    v = torch.cat(values, dim=1)[:, :pos + 1].double().repeat_interleave(n_heads // n_kv, 0)
    probs = (torch.einsum("hd,hjd->hj", q.double(), k) * hd ** -0.5).softmax(-1)
    return torch.einsum("hj,hjd->hd", probs, v)


def case(dev, dtype, n_heads: int, n_kv: int, hd: int, seed: int) -> list[tuple[str, bool]]:
    from restartkit.reference.model import kernels
    rng = random.Random(seed)
    torch.manual_seed(seed)
    slots, cols, block = 6, 12, 64  # 12 blocks a slot: positions up to 767
    blocks = list(range(slots * cols))
    rng.shuffle(blocks)
    table = torch.tensor(blocks, dtype=torch.int32).view(slots, cols)
    ck = torch.randn(slots, n_kv, cols * block, hd, dtype=dtype)
    cv = torch.randn(slots, n_kv, cols * block, hd, dtype=dtype)
    chunks, positions, rows, r = [], [], [], 0
    for slot in rng.sample(range(slots), 4):
        n = rng.choice([1, 2, 15, 16, 17, 63, 64, 65, 130, 200])
        p0 = rng.randrange(0, 700 - n)
        chunks.append((r, n, slot, p0))
        positions += range(p0, p0 + n)
        rows += [slot] * n
        r += n
    spare = 5  # rows no tile lists
    T = r + spare
    positions += [0] * spare
    rows += [0] * spare
    q = torch.randn(T, n_heads, hd, dtype=dtype)
    tiles = kernels.chunk_tiles([(r0, n) for r0, n, _, _ in chunks]) + [(0, 0)] * 3  # 3 spare tiles
    to = dict(device=dev)
    args = (ck.to(**to), cv.to(**to), torch.tensor(positions, **to), torch.tensor(rows, **to), table.to(**to))
    out = torch.full_like(q, 7.0).to(**to)
    ran = kernels.attend_chunks(q.to(**to), *args, torch.tensor(tiles, dtype=torch.long, **to), out)
    if not ran:
        return [("the kernel ran (Triton there, on a GPU or under TRITON_INTERPRET=1)", False)]
    out = out.cpu()
    worst = max(float((out[r0 + i].double() - reference(q[r0 + i], ck, cv, table, slot, p0 + i)).abs().max())
                for r0, n, slot, p0 in chunks for i in range(n))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    untouched = bool((out[r:] == 7.0).all())
    alone = True
    for r0, n, slot, p0 in chunks:  # each chunk in a call of its own, its rows first
        one = torch.full((n, n_heads, hd), 7.0, dtype=dtype, device=dev)
        sub = (args[0], args[1], torch.arange(p0, p0 + n, **to), torch.full((n,), slot, **to), args[4])
        kernels.attend_chunks(q[r0:r0 + n].contiguous().to(**to), *sub,
                              torch.tensor(kernels.chunk_tiles([(0, n)]), dtype=torch.long, **to), one)
        alone = alone and torch.equal(one.cpu(), out[r0:r0 + n])
    name = f"{str(dtype)[6:]}, {n_heads} heads over {n_kv}, {hd} wide"
    return [(f"{name}: every row within {tol} of float64 (worst {worst:.2e})", worst <= tol),
            (f"{name}: rows no tile lists untouched", untouched),
            (f"{name}: each chunk alone bitwise equal to it among others", alone)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: float32,bfloat16 on a GPU; float32 on the CPU (Triton "
                   "3.6's interpreter misreads bfloat16: a product of two comes out about 1e10)")
    a = p.parse_args()
    if a.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("on the CPU the kernel runs only under Triton's interpreter: set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    if a.device == "cpu":  # kernels.fused() asks for a GPU tensor; the interpreter runs on CPU tensors
        from restartkit.reference.model import kernels
        kernels.fused = lambda x: kernels._triton() is not None
    verdicts = []
    dtypes = a.dtype or ("float32" if a.device == "cpu" else "float32,bfloat16")
    for dtype in (getattr(torch, d) for d in dtypes.split(",")):
        for heads, kv, hd in ((32, 8, 128), (4, 2, 16)):
            verdicts += case(torch.device(a.device), dtype, heads, kv, hd, seed=len(verdicts))
    return verdict_table(verdicts)


if __name__ == "__main__":
    sys.exit(main())
