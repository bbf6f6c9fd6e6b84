"""Where an engine's start goes after the process-start floor, on one GPU.

Each measurement runs in a fresh process (first-use costs are per process):
- the floor: a bare process that imports torch and makes the CUDA context,
  from spawn, with the context made after the import or in a thread during it;
- kernels warmed in 1, 4 and 16 threads on scratch tensors before the first
  forward pass (how much of the first-use module loading runs in parallel);
- the first call of every operation of the first prefill, timed one by one;
- the reference engine's activation steps, the 8b-shape model built straight
  on the GPU with random weights: KV cache, first prefill, first decode, graph
  capture, and a second prefill as the steady state.
Prints what it measured; --json for the numbers.

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
    "CUDA context in a thread during import": {"mode": "ctx_thread"},
}
FLOOR_VARIANTS = {
    "floor: import torch + CUDA context": {"mode": "floor"},
    "floor, context in a thread": {"mode": "floor_ctx_thread"},
}


def context_early(ordinal: int = 0):
    """The engine's own early context (restartkit.reference.serving.assemble; it imports no torch)."""
    from restartkit.reference.serving.assemble import start_cuda_context
    return start_cuda_context(ordinal)


def floor_child(ctx_thread: bool) -> dict:
    """A bare process: import torch, create the CUDA context; seconds since spawn."""
    spawned = float(os.environ["PROBE_SPAWN"])
    th = context_early(0) if ctx_thread else None
    import torch
    t_import = time.time() - spawned
    if th is not None:
        th.join()
    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    return {"since_spawn_import": round(t_import, 4), "floor": round(time.time() - spawned, 4)}


def ops_child(preset: str, sdpa: str) -> dict:
    """First call of every aten op of the first prefill, timed on its own (synchronised)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    torch.cuda.set_device(0)
    from restartkit.reference.model.checkpoint import PRESETS
    from restartkit.reference.model.llama import SINGLE
    from restartkit.reference.model.weights import build_model
    cfg = PRESETS[preset].config
    out = {}
    s = time.perf_counter()
    torch.cuda.current_blas_handle()
    torch.cuda.synchronize()
    out["blas_handle"] = round(time.perf_counter() - s, 4)
    model = build_model(cfg, SINGLE, torch.bfloat16, "none").to_empty(device="cuda")
    model.allocate_kv_cache(1024)
    torch.cuda.synchronize()
    first: dict[str, float] = {}

    class Timer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = func(*args, **(kwargs or {}))
            torch.cuda.synchronize()
            name = str(func.overloadpacket.__name__)
            if name not in first:
                first[name] = round(time.perf_counter() - t0, 4)
            return r

    dev = torch.device("cuda", 0)
    ctxs = []
    if sdpa != "default":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        ctxs.append(sdpa_kernel(getattr(SDPBackend, sdpa.upper())))
    import contextlib
    with contextlib.ExitStack() as st, torch.inference_mode():
        for c in ctxs:
            st.enter_context(c)
        prompt = torch.tensor([1, 2, 3, 4], device=dev)
        s = time.perf_counter()
        with Timer():
            model(prompt, torch.arange(4, device=dev))[-1].float().cpu()
        out["first_prefill_timed"] = round(time.perf_counter() - s, 4)
        s = time.perf_counter()
        model(prompt, torch.arange(4, device=dev))[-1].float().cpu()
        out["second_prefill"] = round(time.perf_counter() - s, 4)
        s = time.perf_counter()
        model(torch.tensor([5], device=dev), torch.tensor([4], device=dev))[0].cpu()
        out["first_decode"] = round(time.perf_counter() - s, 4)
    out["ops"] = dict(sorted(first.items(), key=lambda kv: -kv[1]))
    out["ops_sum"] = round(sum(first.values()), 4)
    return out


def warm_thunks(cfg, dev, max_len: int = 1024) -> list:
    """Every kind of kernel the first prefill and decode launch, at the model's shapes, on scratch tensors."""
    import torch
    import torch.nn.functional as F
    bf, f32 = torch.bfloat16, torch.float32
    H, I, V, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    e = lambda *s, dt=bf: torch.empty(*s, dtype=dt, device=dev)  # noqa: E731
    thunks = []
    for out_f, in_f in ((nh * hd, H), (nkv * hd, H), (H, nh * hd), (I, H), (H, I), (V, H)):
        w = e(out_f, in_f)
        for m in (4, 1):
            thunks.append(lambda w=w, m=m, in_f=in_f: F.linear(e(m, in_f), w))
    for t in (4, 1):
        thunks.append(lambda t=t: F.scaled_dot_product_attention(
            e(nh, t, hd), e(nkv, max_len, hd), e(nkv, max_len, hd),
            attn_mask=torch.ones(t, max_len, dtype=torch.bool, device=dev), enable_gqa=True))
    x = torch.ones(4, H, dtype=bf, device=dev)
    pos = torch.arange(4, device=dev)
    thunks += [
        lambda: torch.arange(max_len, device=dev) <= pos.unsqueeze(1),
        lambda: torch.ones(8, 16, device=dev).index_select(0, pos),
        lambda: F.embedding(pos, e(16, H)),
        lambda: x.float().pow(2).mean(-1, keepdim=True).add(1e-5).rsqrt(),
        lambda: (x.float() * 2.0).to(bf) * x,
        lambda: torch.cat((-x[..., 2:], x[..., :2]), dim=-1) + x,
        lambda: e(max_len, nkv, hd).index_copy_(0, pos, e(4, nkv, hd)),
        lambda: F.silu(x) * x,
        lambda: x.float().cpu(),
        lambda: torch.zeros(2, 8, device=dev, dtype=bf).fill_(1),
        lambda: torch.outer(torch.arange(8, dtype=f32, device=dev),
                            1.0 / (500000.0 ** torch.arange(0, 8, 2, dtype=f32, device=dev))).cos().sin(),
    ]
    return thunks


def par_warm_child(preset: str, threads: int) -> dict:
    import threading

    th = context_early(0)
    import torch
    th.join()
    torch.cuda.set_device(0)
    from restartkit.reference.model.checkpoint import PRESETS
    from restartkit.reference.model.llama import SINGLE
    from restartkit.reference.model.weights import build_model
    cfg = PRESETS[preset].config
    dev = torch.device("cuda", 0)
    out = {}
    s = time.perf_counter()
    with torch.inference_mode():
        thunks = warm_thunks(cfg, dev)
        out["scratch"] = round(time.perf_counter() - s, 4)
        s = time.perf_counter()
        if threads <= 1:
            for t in thunks:
                t()
        else:
            def work(part):
                with torch.inference_mode():
                    for t in part:
                        t()
                torch.cuda.synchronize()
            ws = [threading.Thread(target=work, args=(thunks[i::threads],)) for i in range(threads)]
            for w in ws:
                w.start()
            for w in ws:
                w.join()
        torch.cuda.synchronize()
    out["warm"] = round(time.perf_counter() - s, 4)
    del thunks
    model = build_model(cfg, SINGLE, torch.bfloat16, "none").to_empty(device="cuda")
    torch.cuda.synchronize()
    s = time.perf_counter()
    model.allocate_kv_cache(1024)
    torch.cuda.synchronize()
    out["kv_cache_alloc"] = round(time.perf_counter() - s, 4)
    from restartkit.reference.runtime.graphs import DecodeGraphs
    with torch.inference_mode():
        prompt = torch.tensor([1, 2, 3, 4], device=dev)
        for k in ("first_prefill", "second_prefill"):
            s = time.perf_counter()
            model(prompt, torch.arange(4, device=dev))[-1].float().cpu()
            out[k] = round(time.perf_counter() - s, 4)
        s = time.perf_counter()
        DecodeGraphs(model, dev)
        torch.cuda.synchronize()
        out["graph_capture"] = round(time.perf_counter() - s, 4)
    return out


def child(preset: str, mode: str = "") -> dict:
    t = {}
    th = None
    if mode == "ctx_thread":
            th = context_early(0)
    t0 = time.perf_counter()
    import torch
    if th is not None:
        th.join()
    t["import_torch"] = time.perf_counter() - t0

    def timed(name, fn):
        s = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        t[name] = time.perf_counter() - s
        return out

    timed("cuda_init", lambda: torch.cuda.set_device(0))
    from restartkit.reference.model.checkpoint import PRESETS
    from restartkit.reference.runtime.graphs import DecodeGraphs
    from restartkit.reference.model.llama import SINGLE
    from restartkit.reference.model.weights import build_model
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
        timed("graph_capture", lambda: DecodeGraphs(model, dev))
        timed("second_prefill", lambda: model(prompt, torch.arange(4, device=dev))[-1].float().cpu())
    return {k: round(v, 4) for k, v in t.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="8b-shape")
    ap.add_argument("--json")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--mode", default="")
    ap.add_argument("--sdpa", default="default", help="default, or an SDPBackend name for the op-by-op run (math, ...)")
    a = ap.parse_args()
    if a.child:
        if a.mode.startswith("floor"):
            print(json.dumps(floor_child(a.mode == "floor_ctx_thread")))
        elif a.mode.startswith("par"):
            print(json.dumps(par_warm_child(a.preset, int(a.mode[3:]))))
        elif a.mode == "ops":
            print(json.dumps(ops_child(a.preset, a.sdpa)))
        else:
            print(json.dumps(child(a.preset, a.mode)))
        return 0

    def run(v, extra=()):
        argv = [sys.executable, __file__, "--child", "--preset", a.preset, "--mode", v.get("mode", ""), *extra]
        env = {**os.environ, **v.get("env", {}), "PROBE_SPAWN": repr(time.time())}
        out = subprocess.run(argv, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            print(out.stderr[-2000:])
            raise SystemExit(1)
        return json.loads(out.stdout.strip().splitlines()[-1])

    results = {}
    for name, v in FLOOR_VARIANTS.items():
        results[name] = [run(v) for _ in range(a.repeat)]
        print(name, results[name], flush=True)
    for n in (1, 4, 16):
        results[f"warm in {n} threads"] = [run({"mode": f"par{n}"}) for _ in range(a.repeat)]
        print(f"warm in {n} threads", results[f"warm in {n} threads"], flush=True)
    r = run({"mode": "ops"}, ("--sdpa", a.sdpa))
    results[f"ops sdpa={a.sdpa}"] = [r]
    print(f"first call of each op (sdpa backend {a.sdpa}): blas handle {r['blas_handle']} s, first prefill op by op "
          f"{r['first_prefill_timed']} s, sum of first calls {r['ops_sum']} s, second prefill {r['second_prefill']} s, "
          f"first decode {r['first_decode']} s")
    for op, dt in list(r["ops"].items())[:14]:
        print(f"    {op:<44}{dt:>9.4f}")
    for name, v in VARIANTS.items():
        results[name] = [run(v) for _ in range(a.repeat)]
    keys = ["import_torch", "cuda_init", "kv_cache_alloc", "first_prefill", "first_decode", "graph_capture", "second_prefill"]
    print(f"{'variant':<36}" + "".join(f"{k:>15}" for k in keys) + f"{'after floor':>13}")
    for name in VARIANTS:
        for r in results[name]:
            after = sum(r.get(k, 0) for k in keys[2:6])
            print(f"{name:<36}" + "".join(f"{r.get(k, 0):>15.4f}" for k in keys) + f"{after:>13.4f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
