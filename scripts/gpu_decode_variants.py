#!/usr/bin/env python3
"""Where one decode step of the reference engine goes, and what fusing more would buy, on a GPU:

    python3 scripts/gpu_decode_variants.py [--preset 8b-shape] [--work DIR]

Builds the engine in this process (no HTTP) at 8 slots, then times (median of 50, synchronized):
  - the replay of each of the engine's decode graphs (B = 1, 2, 4, 8 rows) and Engine.decode end to end;
  - the capture of the graphs (what a start and a KV-cache restore pay);
  - the step with q/k/v and gate/up each one matrix product (copies of the weights: what fusing them in the
    processed weights would buy);
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


def timed(fn, sync, n: int = 50) -> float:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def make_step(model, B: int, fused: list):
    """The engine's decode step over the first B slots with q/k/v and gate/up each one matrix product (fused:
    per layer, the concatenated weights)."""
    import torch.nn.functional as F

    from restartkit.reference.model import kernels
    from restartkit.reference.model.llama import attend
    cfg = model.config
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rows = model._key_pos[:B]

    def step(tok, pos, mask):
        x, delta = model.model.embed_tokens(tok), None
        for i, layer in enumerate(model.model.layers):
            a = layer.self_attn
            x, h = kernels.add_rms_norm(x, delta, layer.input_layernorm.weight, layer.input_layernorm.eps)
            q, k, v = F.linear(h, fused[i][0]).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = kernels.rope_write_kv(q.view(B, nh, hd), k.view(B, nkv, hd), v.view(B, nkv, hd), model._cos,
                                      model._sin, pos, rows, model.cache_k[i], model.cache_v[i])
            o = attend(q.view(B, nkv, nh // nkv, hd), model.cache_k[i][:B], model.cache_v[i][:B], mask)
            norm = layer.post_attention_layernorm
            x, h = kernels.add_rms_norm(x, a.o_proj(o.reshape(B, nh * hd)), norm.weight, norm.eps)
            gate, up = F.linear(h, fused[i][1]).chunk(2, dim=-1)
            delta = layer.mlp.down_proj(kernels.silu_mul(gate.contiguous(), up.contiguous()))
        return model.lm_head(kernels.add_rms_norm(x, delta, model.model.norm.weight, model.model.norm.eps)[1]).float()
    return step


def check(got, want) -> str:
    same = bool((got.argmax(-1) == want.argmax(-1)).all())
    return f"greedy {'same' if same else 'DIFFERENT'}, max logit gap {float((got - want).abs().max()):.3g}"


def inputs(model, B: int, position: int, dev):
    import torch
    L = model.cache_k.shape[3]
    tok = torch.full((B,), 5, dtype=torch.long, device=dev)
    pos = torch.full((B,), position, dtype=torch.long, device=dev)
    key = torch.arange(L, device=dev)
    mask = torch.zeros(B, 1, 1, L, dtype=model.cache_k.dtype, device=dev)
    mask.masked_fill_((key[None, :] > pos[:, None])[:, None, None, :], float("-inf"))
    return tok, pos, mask


def graphed(fn, args):
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*args)
    return g, out


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

    from restartkit.reference.runtime.engine import Engine, EngineOptions
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
            t0 = time.perf_counter()
            eng.capture_decode_graph()
            sync()
            rows.append((f"capture of the {len(g.sizes)} graphs", (time.perf_counter() - t0) * 1000, ""))
            one = eng.decode([0], [5], [8]).float()
            rows.append(("B=1 graph against B=8 graph, row 0", 0.0, check(one, ref[:1])))
        for B in (1, 8):
            args = inputs(m, B, 8, dev)
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
            rows.append((f"eager B={B} against the graph", 0.0, check(fast, ref[:B])))
        if gpu:
            fused = [(torch.cat([ly.self_attn.q_proj.weight, ly.self_attn.k_proj.weight,
                                 ly.self_attn.v_proj.weight]),
                      torch.cat([ly.mlp.gate_proj.weight, ly.mlp.up_proj.weight])) for ly in m.model.layers]
            for B in (1, 8):
                step = make_step(m, B, fused)
                args = inputs(m, B, 8, dev)
                out = step(*args).float()
                n = kernels_per_step(step, args)
                graph, _ = graphed(step, args)
                rows.append((f"+ fused q/k/v and gate/up, B={B} ({n} kernels)", timed(graph.replay, sync),
                             check(out, ref[:B])))
                del graph
            del fused
            buf = torch.empty(eng.weight_bytes() // 2, dtype=torch.bfloat16, device=dev)
            rows.append(("weights read floor (clone / 2)", timed(buf.clone, sync, n=10) / 2, ""))
    print(f"{d} KV heads; slots {m.cache_k.shape[1]}, positions {m.cache_k.shape[3]}")
    for what, ms, verdict in rows:
        print(f"{what:<58} {ms:8.3f} ms  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
