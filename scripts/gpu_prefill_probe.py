#!/usr/bin/env python3
"""Where a prefill of the reference engine goes, on a GPU (no HTTP):

    python3 scripts/gpu_prefill_probe.py --model DIR [--device cuda]

Times (median of 20, synchronized) a prompt's prefill of 1, 3, 64 and 512 tokens into one KV-cache slot: through
the engine's prefill graphs (restartkit.reference.runtime.graphs), and eagerly with the fused kernels and in
torch form (restartkit.reference.model.kernels); checks the graph's last-token logits against the eager
prefill's (greedy token equal, largest logit gap).  Then the time the device spends in kernels during an eager
3-token prefill (torch.profiler): a prefill whose wall time is far above its kernels' time waits on the host;
and the operators that take the most host time in it."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import timed  # noqa: E402  (median of n synchronized calls)


def main() -> int:
    import torch

    from restartkit.reference.model import kernels
    from restartkit.reference.sched.engine import Engine, EngineOptions
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--sizes", default="", help="prefill graph sizes to capture, comma-separated (default: the engine's)")
    p.add_argument("--lengths", default="1,3,64,512", help="prompt lengths to time")
    a = p.parse_args()
    from restartkit.reference.runtime import graphs
    if a.sizes:
        graphs.PREFILL_SIZES = tuple(int(x) for x in a.sizes.split(","))
    lengths = [int(x) for x in a.lengths.split(",")]
    eng = Engine(EngineOptions(model=a.model, device=a.device, max_model_len=1024, max_num_seqs=8))
    eng.start()
    m, dev, sync = eng.model, eng.device, torch.cuda.synchronize
    print(f"prefill graphs for {eng._graphs.prompt_sizes} tokens; the capture of every graph took "
          f"{eng.phases['cuda_graph_capture'] * 1000:.0f} ms")

    def prefill(n):
        return lambda: m(torch.arange(1, n + 1, device=dev), torch.arange(n, device=dev), 7)
    rows = []
    with torch.inference_mode():
        for n in lengths:
            if not eng._graphs.prefills(n):
                continue
            tokens = list(range(1, n + 1))
            graph = eng.prefill(7, tokens, 0).float().clone()
            eager = prefill(n)()[-1:]
            same = bool((graph.argmax(-1) == eager.argmax(-1)).all())
            rows.append((f"prefill of {n} tokens, graph (against eager: greedy {'same' if same else 'DIFFERENT'}, "
                         f"max logit gap {float((graph - eager).abs().max()):.3g})",
                         timed(lambda: eng.prefill(7, tokens, 0), sync, n=20)))
        for form in ("fused", "torch form"):
            if form != "fused":
                os.environ[kernels.NO_TRITON_ENV] = "1"
                kernels._triton.cache_clear()
            for n in lengths:
                rows.append((f"prefill of {n} tokens, {form}", timed(prefill(n), sync, n=20)))
            os.environ.pop(kernels.NO_TRITON_ENV, None)
            kernels._triton.cache_clear()
        run = prefill(3)
        run()
        sync()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            sync()
    events = prof.key_averages()
    cuda = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.append((f"3-token prefill: {sum(e.count for e in cuda)} kernels, their device time",
                 sum(e.self_device_time_total for e in cuda) / 1000))
    for what, ms in rows:
        print(f"{what:<90} {ms:8.3f} ms")
    print("host time by operator, 3-token prefill (profiled):")
    cpu = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.self_cpu_time_total, reverse=True)
    for e in cpu[:12]:
        print(f"  {e.key[:60]:<60} {e.count:5d} calls {e.self_cpu_time_total / 1000:8.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
