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


# ---- the model's parts, the shipped ones against the ones they replaced -------------
CANDIDATES = {
    "as shipped": "",
    "previous rotary (device tables, negation)": "old_rope",
    "previous RMSNorm (rsqrt of mean)": "old_rms",
    "previous attention (SDPA, GQA, mask)": "old_attn",
    "positions by a device arange": "pos_device",
    "previous model (all four)": "old_rope,old_rms,old_attn,pos_device",
    "warm-up prompt of 1 token": "warm1",
    "warm-up prompt of 7 tokens (the probe's)": "warm7",
}


def patch_model(cands: set) -> None:
    """Put back the parts of the reference model that the shipped ones replaced (the probe's copies)."""
    import torch
    import torch.nn.functional as F
    from restartkit.reference.model import llama as M
    if "old_rope" in cands:
        def rope_tables(head_dim, max_len, theta, dtype, device):
            inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
            emb = torch.outer(torch.arange(max_len, dtype=torch.float32, device=device), inv)
            emb = torch.cat((emb, emb), dim=-1)
            return emb.cos(), emb.sin()

        def apply_rope(x, cos, sin):
            half = x.shape[-1] // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            return x * cos.unsqueeze(1).to(x.dtype) + rotated * sin.unsqueeze(1).to(x.dtype)
        M.rope_tables, M.apply_rope = rope_tables, apply_rope
        shipped_alloc = M.LlamaForCausalLM.allocate_kv_cache

        def alloc(self, max_len):
            n = shipped_alloc(self, max_len)
            self._key_pos = torch.arange(max_len, device=self.lm_head.weight.device)
            return n
        M.LlamaForCausalLM.allocate_kv_cache = alloc
    if "old_rms" in cands:
        def rms(self, x):
            x32 = x.float()
            return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        M.RMSNorm.forward = rms
    if "old_attn" in cands:
        def attn(self, x, cos, sin, positions, cache_k, cache_v, mask):
            T = x.shape[0]
            q = M.apply_rope(self.q_proj(x).view(T, self.n_heads, self.head_dim), cos, sin)
            k = M.apply_rope(self.k_proj(x).view(T, self.n_kv, self.head_dim), cos, sin)
            cache_k.index_copy_(0, positions, k)
            cache_v.index_copy_(0, positions, self.v_proj(x).view(T, self.n_kv, self.head_dim))
            out = F.scaled_dot_product_attention(q.transpose(0, 1), cache_k.transpose(0, 1), cache_v.transpose(0, 1),
                                                 attn_mask=mask, enable_gqa=True)
            return self.par.reduce(self.o_proj(out.transpose(0, 1).reshape(T, self.n_heads * self.head_dim)))

        def forward(self, tokens, positions):
            cos, sin = self._cos.index_select(0, positions), self._sin.index_select(0, positions)
            mask = self._key_pos.unsqueeze(0) <= positions.unsqueeze(1)
            x = self.model.embed_tokens(tokens)
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, positions, self.cache_k[i], self.cache_v[i], mask)
            return self.lm_head(self.model.norm(x)).float()
        M.Attention.forward, M.LlamaForCausalLM.forward = attn, forward


def candidate_child(preset: str, spec: str, with_ops: bool) -> dict:
    cands = {c for c in spec.split(",") if c}
    t0 = time.perf_counter()
    import torch
    out = {"import_torch": round(time.perf_counter() - t0, 4)}
    cuda = os.environ.get("PROBE_DEVICE", "cuda") == "cuda"  # cpu: a dry run of the probe itself
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.set_device(0)
    patch_model(cands)
    from restartkit.reference.model.checkpoint import PRESETS
    from restartkit.reference.runtime.graphs import DecodeGraphs
    from restartkit.reference.model.llama import SINGLE
    from restartkit.reference.model.weights import build_model
    cfg = PRESETS[preset].config
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model = build_model(cfg, SINGLE, torch.bfloat16, "none")
    torch.manual_seed(0)
    for name, p in list(model.named_parameters()):  # random weights made on the device (one kernel module)
        mod_name, _, attr = name.rpartition(".")
        t = torch.empty(p.shape, dtype=torch.bfloat16, device=dev).normal_(0, 0.02)
        setattr(model.get_submodule(mod_name), attr, torch.nn.Parameter(t, requires_grad=False))
    sync()
    positions = (lambda n, start=0: torch.arange(start, start + n, device=dev)) if "pos_device" in cands \
        else (lambda n, start=0: torch.arange(start, start + n).to(dev))

    def timed(name, fn):
        s = time.perf_counter()
        r = fn()
        sync()
        out[name] = round(time.perf_counter() - s, 4)
        return r
    with torch.inference_mode():
        timed("kv_cache_alloc", lambda: model.allocate_kv_cache(4096))
        n = 1 if "warm1" in cands else 7 if "warm7" in cands else 4  # the engine's warm-up prompt: 4 tokens
        prompt = torch.tensor([256, 1, 2, 3, 4, 5, 6][:n], device=dev)
        if with_ops:
            first = {}
            from torch.utils._python_dispatch import TorchDispatchMode

            class Timer(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    sync()
                    s = time.perf_counter()
                    r = func(*args, **(kwargs or {}))
                    sync()
                    first.setdefault(str(func.overloadpacket.__name__), round(time.perf_counter() - s, 4))
                    return r
            with Timer():
                timed("first_prefill", lambda: model(prompt, positions(n))[-1].float().cpu())
            out["ops"] = dict(sorted(first.items(), key=lambda kv: -kv[1]))
        else:
            timed("first_prefill", lambda: model(prompt, positions(n))[-1].float().cpu())
        if cuda:  # as the engine: the capture runs the first decode steps eagerly
            timed("graph_capture", lambda: DecodeGraphs(model, dev))
        else:
            timed("first_decode", lambda: model(torch.tensor([5], device=dev), positions(1, n))[0].float().cpu())
        # restartkit's readiness probe: "ready?" is 7 tokens with BOS
        probe = torch.tensor([256, 114, 101, 97, 100, 121, 63], device=dev)
        logits = timed("probe_prefill", lambda: model(probe, positions(7))[-1].float().cpu())
        timed("second_prefill", lambda: model(probe, positions(7))[-1].float().cpu())
        out["argmax"] = int(torch.argmax(logits))
    return out


def run_candidates(a, run) -> dict:
    keys = ["kv_cache_alloc", "first_prefill", "graph_capture", "probe_prefill", "second_prefill"]
    results = {}
    print(f"{'candidate':<44}" + "".join(f"{k:>16}" for k in keys) + f"{'to ready':>10}{'argmax':>8}")
    for name, spec in CANDIDATES.items():
        if a.only and not any(o in name for o in a.only.split(",")):
            continue
        results[name] = []
        for _ in range(a.repeat):
            try:
                r = run({"mode": "cand"}, ("--cand", spec))
            except SystemExit:
                print(f"{name:<44} failed")
                break
            results[name].append(r)
            print(f"{name:<44}" + "".join(f"{r.get(k, 0):>16.4f}" for k in keys)
                  + f"{sum(r.get(k, 0) for k in keys[:4]):>10.4f}{r['argmax']:>8}", flush=True)
    for spec in ("", CANDIDATES["previous model (all four)"]) if not a.only else ():
        r = run({"mode": "cand_ops"}, ("--cand", spec))
        results[f"ops [{spec}]"] = r
        print(f"first prefill op by op [{spec or 'as shipped'}]: {r['first_prefill']} s")
        for op, dt in list(r["ops"].items())[:16]:
            print(f"    {op:<44}{dt:>9.4f}")
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="8b-shape")
    ap.add_argument("--json")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--mode", default="")
    ap.add_argument("--sdpa", default="default", help="default, or an SDPBackend name for the op-by-op run (math, ...)")
    ap.add_argument("--cand", default="")
    ap.add_argument("--only", default="", help="with --candidates: only those whose name contains one of these (comma-separated)")
    ap.add_argument("--candidates", action="store_true", help="only the candidate model changes (CANDIDATES)")
    a = ap.parse_args()
    if a.child:
        if a.mode.startswith("cand"):
            print(json.dumps(candidate_child(a.preset, a.cand, a.mode == "cand_ops")))
            return 0
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

    if a.candidates:
        results = run_candidates(a, run)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=2)
        return 0
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
