#!/usr/bin/env python3
"""`vllm bench serve` (vLLM's own serving benchmark) against the reference engine and against `vllm serve`, on the
same checkpoint, one engine at a time, on the CPU; a side-by-side table:

    python3 scripts/vllm_bench_compare.py [--preset small] [--concurrency 1,8,16] [--input-len 256]
        [--output-len 96] [--range-ratio 0.5] [--prompts-per-client 4] [--max-num-seqs 16] [--budget N]
        [--engines reference,vllm] [--work /tmp/rk-vbench]

Random prompts (vLLM's `random` dataset, input and output lengths drawn within --range-ratio of the given ones),
`--ignore-eos`, streamed completions; each engine serves with --max-num-seqs sequences, the same max_model_len and
the same KV-cache size, float32.  Needs vLLM's CPU build in this interpreter's environment (scripts/setup installs it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchlib import ROOT, cpu_line, reference_model, start_server, stop_server

from restartkit.engines.reference import CPU_ENV

BIN = Path(sys.executable).parent


def start(kind: str, model: Path, port: int, a, log: Path) -> subprocess.Popen:
    if kind == "reference":
        return start_server([sys.executable, "-m", "restartkit.reference.serving.server", "--model", str(model), "--port",
                             str(port), "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
                             "--served-model-name", "m", "--max-queued-seqs", "1024",
                             "--kv-cache-memory", f"{a.vllm_kv_gib}G",
                             *(["--max-num-batched-tokens", str(a.budget)] if a.budget else [])],
                            port, log, env=CPU_ENV, path="/v1/models")
    return start_server([str(BIN / "vllm"), "serve", str(model), "--port", str(port), "--dtype", "float32",
                         "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
                         "--served-model-name", "m"], port, log, env={"VLLM_CPU_KVCACHE_SPACE": str(a.vllm_kv_gib)},
                        path="/v1/models")


def bench(model: Path, port: int, clients: int, a, out: Path, name: str) -> dict:
    subprocess.run([str(BIN / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url",
                    f"http://127.0.0.1:{port}", "--model", str(model), "--served-model-name", "m", "--tokenizer",
                    str(model), "--dataset-name", "random", "--random-input-len", str(a.input_len),
                    "--random-output-len", str(a.output_len), "--random-range-ratio", str(a.range_ratio),
                    "--num-prompts", str(max(8, clients * a.prompts_per_client)), "--max-concurrency", str(clients),
                    "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
                    "--save-result", "--result-dir", str(out), "--result-filename", name, "--seed", "0"],
                   cwd=ROOT, check=True, timeout=3600, stdout=subprocess.DEVNULL)
    r = json.loads((out / name).read_text())
    return {k: r.get(k) for k in ("completed", "failed", "output_throughput", "total_token_throughput",
                                  "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms",
                                  "duration")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--concurrency", default="1,8,16")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--prompts-per-client", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--vllm-kv-gib", type=int, default=2,
                   help="both engines' KV cache (VLLM_CPU_KVCACHE_SPACE; the reference engine's --kv-cache-memory)")
    p.add_argument("--budget", type=int, default=0, help="the reference engine's --max-num-batched-tokens (0: its default)")
    p.add_argument("--engines", default="reference,vllm")
    p.add_argument("--port", type=int, default=8795)
    p.add_argument("--work", default="/tmp/rk-vbench")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    a = p.parse_args()
    model, _ = reference_model(a.work, "cpu", a.preset)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for kind in a.engines.split(","):
        proc = start(kind, model, a.port, a, out / f"{kind}.log")
        try:
            for c in (int(x) for x in a.concurrency.split(",")):
                rows[(kind, c)] = bench(model, a.port, c, a, out, f"{kind}-{c}.json")
                r = rows[(kind, c)]
                print(f"{kind} x{c}: {r['output_throughput']:.0f} out tok/s, TTFT p50 {r['p50_ttft_ms']:.0f} ms, "
                      f"TPOT p50 {r['p50_tpot_ms']:.1f} ms, {r['completed']} done, {r['failed']} failed", flush=True)
        finally:
            stop_server(proc)
    machine = cpu_line()
    (out / "compare.json").write_text(json.dumps({"machine": machine, **{f"{k}:{c}": v for (k, c), v in rows.items()}},
                                                 indent=1))
    print(f"machine: {machine}")
    print("| clients | engine | output tok/s | total tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | "
          "ITL p50 / p99 (ms) | done / failed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (kind, c), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"| {c} | {kind} | {r['output_throughput']:,.0f} | {r['total_token_throughput']:,.0f} | "
              f"{r['p50_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | {r['p50_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} | "
              f"{r['p50_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} | {r['completed']} / {r['failed']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
