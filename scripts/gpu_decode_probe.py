#!/usr/bin/env python3
"""Where one decode step of the reference engine goes, in this process (no HTTP), on a GPU:

    python3 scripts/gpu_decode_probe.py --model DIR [--device cuda] [--max-num-seqs 8]

Times (median of 50, synchronized): the decode graph's replay alone; Engine.decode end to end (host
inputs, replay, the rows picked) with 1 and 8 rows; the eager decode with 1 and 8 rows; one token
through the single-sequence path (a prefill of one token).  Then the eager step's ten most expensive
CUDA kernels (torch.profiler) and the weights' read floor at the device's measured copy bandwidth."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import timed  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    import torch

    from restartkit.reference.sched.engine import Engine, EngineOptions
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-num-seqs", type=int, default=8)
    a = p.parse_args()
    eng = Engine(EngineOptions(model=a.model, device=a.device, max_model_len=1024, max_num_seqs=a.max_num_seqs))
    eng.start()
    sync = torch.cuda.synchronize
    m, dev = eng.model, eng.device
    rows = {}
    rows["graph replay (one row)"] = timed(lambda: eng._graphs.graphs[1].replay(), sync)
    rows["graph replay (every slot)"] = timed(lambda: eng._graphs.graphs[max(eng._graphs.sizes)].replay(), sync)
    for b in (1, 8):
        slots = list(range(b))
        rows[f"Engine.decode, {b} rows"] = timed(lambda: eng.decode(slots, [5] * b, [100] * b), sync)
        tok, pos, sl = (torch.tensor(x, device=dev) for x in ([5] * b, [100] * b, slots))
        with torch.inference_mode():
            rows[f"eager decode, {b} rows, span 101"] = timed(lambda: m.decode(tok, pos, sl, span=101), sync)
            rows[f"eager decode, {b} rows, every position"] = timed(lambda: m.decode(tok, pos, sl), sync)
    with torch.inference_mode():
        one, at = torch.tensor([5], device=dev), torch.tensor([100], device=dev)
        rows["one token, single-sequence path"] = timed(lambda: m(one, at, 0), sync)
        weights = eng.weight_bytes()
        buf = torch.empty(weights // 2, dtype=torch.bfloat16, device=dev)
        copy_ms = timed(lambda: buf.clone(), sync, n=10)
        rows["weights read floor (clone: read + write)"] = copy_ms / 2
    for what, ms in rows.items():
        print(f"{what:<45} {ms:8.3f} ms")
    tok, pos, sl = (torch.tensor(x, device=dev) for x in ([5] * 8, [100] * 8, list(range(8))))
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            m.decode(tok, pos, sl)
        sync()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
