#!/usr/bin/env python3
"""One decode step of the reference engine on the CPU, in process, for a few batch shapes; optionally the same for
another checkout of restartkit (an older commit, say) in the same run, alternated:

    python3 scripts/cpu_decode_step_probe.py [--preset small] [--trees .,/tmp/old] [--rounds 2]

The shapes: 10 rows in slots 0-9 (read in place), 10 rows in 10 of slots 0-15 shuffled (as a busy scheduler has
them), 32 rows shuffled, 4 rows, 1 row; each row at a position of 250-350.  Each figure is the best of 5 rounds of
20 steps, in ms.  Each tree runs in a process of its own (`--tree`), 2 threads.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def step_times(tree: Path, preset: str, work: str) -> str:
    sys.path[:0] = [str(tree / "scripts"), str(tree)]
    import torch
    from benchlib import reference_model

    from restartkit.reference.sched.engine import Engine, EngineOptions
    torch.set_num_threads(2)
    model, _ = reference_model(work, "cpu", preset)
    eng = Engine(EngineOptions(model=str(model), device="cpu", max_model_len=1024, max_num_seqs=32))
    eng.start()
    rng = random.Random(1)
    cases = [("10 rows, slots 0-9", list(range(10))), ("10 of slots 0-15, shuffled", rng.sample(range(16), 10)),
             ("32 rows, shuffled", rng.sample(range(32), 32)), ("4 rows", list(range(4))), ("1 row", [0])]
    got = []
    with eng.lock:
        for name, slots in cases:
            toks, poss = [5] * len(slots), [rng.randrange(250, 350) for _ in slots]
            for _ in range(5):
                eng.decode(slots, toks, poss)
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(20):
                    eng.decode(slots, toks, poss)
                best = min(best, (time.perf_counter() - t) / 20 * 1e3)
            got.append(f"{name} {best:.2f}")
    return " | ".join(got)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--trees", default=str(HERE.parent), help="restartkit checkouts, comma-separated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--work", default="/tmp/rk-step-probe")
    p.add_argument("--tree", help=argparse.SUPPRESS)  # one tree, in this process (what each run of --trees starts)
    a = p.parse_args()
    if a.tree:
        print(f"{a.tree}: {step_times(Path(a.tree).resolve(), a.preset, a.work)} (ms a step)", flush=True)
        return 0
    for _ in range(a.rounds):
        for tree in a.trees.split(","):
            subprocess.run([sys.executable, __file__, "--tree", tree, "--preset", a.preset, "--work", a.work],
                           check=True, env={**os.environ, "GOMP_SPINCOUNT": "10000"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
