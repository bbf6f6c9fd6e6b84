#!/usr/bin/env python3
"""Users' traffic against the reference engine on a GPU (issue 57's workload): scripts/bench_serving.py against
`restartkit engine serve` at one or more token budgets, then a verdict table:

    python3 scripts/gpu_serving.py [--device cuda] [--preset 8b-shape] [--budgets 512,2048] [--clients 1,8,32,64]
        [--seconds 30] [--max-num-seqs 64] [--max-model-len 4096] [--gpu-memory-utilization 0.9]
        [--work /tmp/rk-serving]

Prompts of 64-2,048 tokens (log-uniform), streamed greedy answers of 32-256 tokens.  The verdicts, at each
budget: at 64 clients a first token within 1.5 s at p99 and at least 3,400 output tokens/s; one client at most
5 ms per output token (p50); no errors.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchlib import ROOT, print_verdicts, reference_model, start_server, stop_server


def serve(model: Path, a, budget: int, log: Path) -> subprocess.Popen:
    return start_server([sys.executable, "-m", "restartkit.reference.serving.server", "--model", str(model), "--device",
                         a.device, "--port", str(a.port), "--max-model-len", str(a.max_model_len), "--max-num-seqs",
                         str(a.max_num_seqs), "--max-num-batched-tokens", str(budget), "--max-queued-seqs", "1024",
                         *(["--gpu-memory-utilization", str(a.gpu_memory_utilization)] if a.gpu_memory_utilization
                           else [])], a.port, log)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default=None, help="default: 8b-shape on cuda, tiny on the CPU")
    p.add_argument("--budgets", default="512", help="--max-num-batched-tokens values, comma-separated")
    p.add_argument("--clients", default="1,8,32,64")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.0,
                   help="a paged KV cache of this share of the GPU (0: every sequence at max-model-len)")
    p.add_argument("--prompt-max", type=int, default=2048)
    p.add_argument("--answer-max", type=int, default=256)
    p.add_argument("--port", type=int, default=8793)
    p.add_argument("--work", default="/tmp/rk-serving")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    a = p.parse_args()
    model, preset = reference_model(a.work, a.device, a.preset)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results, verdicts = {}, []
    for budget in (int(b) for b in a.budgets.split(",")):
        proc = serve(model, a, budget, out / f"engine-{budget}.log")
        rows_file = out / f"serving-{budget}.json"
        try:
            subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--url",
                            f"http://127.0.0.1:{a.port}", "--clients", a.clients, "--seconds", str(a.seconds),
                            "--prompt-max", str(a.prompt_max), "--answer-max", str(a.answer_max), "--vocab",
                            str(vocab), "--json-out", str(rows_file)], cwd=ROOT, timeout=1800)
        finally:
            stop_server(proc)
        rows = {r["clients"]: r for r in json.loads(rows_file.read_text())}
        results[budget] = rows
        top, one = rows[max(rows)], rows.get(1)
        verdicts += [(f"budget {budget}, {top['clients']} clients: TTFT p99 {top['ttft_p99_s']} s <= 1.5 s",
                      (top["ttft_p99_s"] or 1e9) <= 1.5),
                     (f"budget {budget}, {top['clients']} clients: {top['output_tok_s']:,.0f} out tok/s >= 3,400",
                      top["output_tok_s"] >= 3400),
                     (f"budget {budget}: no errors", not any(r["errors"] for r in rows.values()))]
        if one:
            verdicts.append((f"budget {budget}, one client: TPOT p50 {one['tpot_p50_ms']} ms <= 5 ms",
                             (one["tpot_p50_ms"] or 1e9) <= 5.0))
    (out / "serving.json").write_text(json.dumps({"preset": preset, "device": a.device, "results": results}, indent=1))
    print("| budget | clients | output tok/s | prompt tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for budget, rows in results.items():
        for r in rows.values():
            print(f"| {budget} | {r['clients']} | {r['output_tok_s']:,.0f} | {r['prompt_tok_s']:,.0f} | "
                  f"{r['ttft_p50_s']} / {r['ttft_p99_s']} | {r['tpot_p50_ms']} / {r['tpot_p99_ms']} | {r['errors']} |")
    return print_verdicts(verdicts)


if __name__ == "__main__":
    sys.exit(main())
