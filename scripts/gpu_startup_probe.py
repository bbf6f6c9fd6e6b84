"""Where an engine's start goes after the process-start floor, on one GPU.

Each variant runs in a fresh process (first-use costs are per process):
the 8b-shape model is built straight on the GPU with random weights (no
checkpoint needed), then the steps of the reference engine's activation are
timed one by one: KV cache, first prefill, first decode, graph capture, and a
second prefill as the steady state.  Prints a verdict table; --json for the
numbers.

    python3 scripts/gpu_startup_probe.py [--preset 8b-shape] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = {
    "as the engine starts": {},
    "eager module loading": {"env": {"CUDA_MODULE_LOADING": "EAGER"}},
}


def child(preset: str) -> dict:
    t = {}
    t0 = time.perf_counter()
    import torch
    t["import_torch"] = time.perf_counter() - t0

    def timed(name, fn):
        s = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        t[name] = time.perf_counter() - s
        return out

    timed("cuda_init", lambda: torch.cuda.set_device(0))
    from restartkit.reference.checkpoint import PRESETS
    from restartkit.reference.engine import capture_decode
    from restartkit.reference.model import SINGLE
    from restartkit.reference.weights import build_model
    cfg = PRESETS[preset].config
    model = build_model(cfg, SINGLE, torch.bfloat16, "none").to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    torch.cuda.synchronize()
    timed("kv_cache_alloc", lambda: model.allocate_kv_cache(4096))
    dev = torch.device("cuda", 0)
    with torch.inference_mode():
        prompt = torch.tensor([1, 2, 3, 4], device=dev)
        timed("first_prefill", lambda: model(prompt, torch.arange(4, device=dev))[-1].float().cpu())
        timed("first_decode", lambda: model(torch.tensor([5], device=dev), torch.tensor([4], device=dev))[0].cpu())
        timed("graph_capture", lambda: capture_decode(model, dev))
        timed("second_prefill", lambda: model(prompt, torch.arange(4, device=dev))[-1].float().cpu())
    return {k: round(v, 4) for k, v in t.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="8b-shape")
    ap.add_argument("--json")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.preset)))
        return 0
    results = {}
    for name, v in VARIANTS.items():
        runs = []
        for _ in range(a.repeat):
            argv = [sys.executable, __file__, "--child", "--preset", a.preset]
            out = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **v.get("env", {})})
            if out.returncode != 0:
                print(out.stderr[-2000:])
                return 1
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        results[name] = runs
    keys = ["import_torch", "cuda_init", "kv_cache_alloc", "first_prefill", "first_decode", "graph_capture", "second_prefill"]
    print(f"{'variant':<36}" + "".join(f"{k:>15}" for k in keys) + f"{'after floor':>13}")
    for name, runs in results.items():
        for r in runs:
            after = sum(r.get(k, 0) for k in keys[2:6])
            print(f"{name:<36}" + "".join(f"{r.get(k, 0):>15.4f}" for k in keys) + f"{after:>13.4f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
