#!/usr/bin/env bash
# `vllm bench serve` (vLLM's own client, from the project's venv) against the reference engine and against
# `vllm serve` (the CPU build) on the same model and the same random workload, one after the other.
#   scripts/bench_serve_cpu.sh [WORKDIR]     (PROMPTS=N, CONCURRENCY=N, IN=N, OUT=N, PRESET=small)
# Prints vLLM's result block for each; the JSON results land in WORKDIR/results.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/rk-bench-serve}
PRESET=${PRESET:-small}; PROMPTS=${PROMPTS:-64}; CONCURRENCY=${CONCURRENCY:-8}; IN=${IN:-128}; OUT=${OUT:-64}
V=.venv/bin
mkdir -p "$W/results"
M="$W/models/$PRESET"
[ -f "$M/config.json" ] || $V/restartkit model create --preset "$PRESET" --out "$M" >/dev/null
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT
wait_ready() {  # $1 port, $2 seconds
  for _ in $(seq 1 "$2"); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done
  echo "not ready on port $1 within $2 s" >&2; return 1
}
bench() {  # $1 label, $2 port
  $V/vllm bench serve --backend openai --base-url "http://127.0.0.1:$2" --endpoint /v1/completions \
    --model "$PRESET" --tokenizer "$M" --dataset-name random --random-input-len "$IN" --random-output-len "$OUT" \
    --ignore-eos --num-prompts "$PROMPTS" --max-concurrency "$CONCURRENCY" --seed 0 \
    --save-result --result-dir "$W/results" --result-filename "$1.json" 2>&1 \
    | sed -n '/Serving Benchmark Result/,/^=\{20,\}$/p'
}
echo "== reference engine ($PRESET, float32, CPU) =="
$V/restartkit engine serve --model "$M" --port 8731 --max-model-len 512 --max-num-seqs "$CONCURRENCY" \
  --served-model-name "$PRESET" >"$W/reference.log" 2>&1 & pids+=($!)
wait_ready 8731 120
bench reference 8731
kill "${pids[-1]}"; wait "${pids[-1]}" 2>/dev/null || true
echo "== vllm serve ($PRESET, float32, CPU) =="
VLLM_CPU_KVCACHE_SPACE=${KV_GIB:-2} $V/vllm serve "$M" --port 8732 --dtype float32 --max-model-len 512 \
  --served-model-name "$PRESET" --max-num-seqs "$CONCURRENCY" >"$W/vllm.log" 2>&1 & pids+=($!)
wait_ready 8732 600
bench vllm 8732
