#!/usr/bin/env bash
# cold vs criu on a real vLLM (the CPU build), as root with CRIU installed.
#   scripts/bench_vllm_cpu.sh [WORKDIR]
# io_uring is switched off for the run (vLLM opens one otherwise, which CRIU cannot dump) and put back after.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/rk-vllm-bench}
RK=".venv/bin/python -m restartkit.cli"
old=$(cat /proc/sys/kernel/io_uring_disabled)
trap 'echo $old > /proc/sys/kernel/io_uring_disabled; $RK stop --policy $W/vllm.toml >/dev/null 2>&1 || true' EXIT
echo 2 > /proc/sys/kernel/io_uring_disabled
mkdir -p "$W"
mkdir -p "$W/models"
[ -f "$W/models/small/config.json" ] || $RK model create --preset small --out "$W/models/small" >/dev/null
cat > "$W/vllm.toml" <<TOML
[service]
name = "vllm-cpu-bench"
engine = "vllm"
model = "$W/models/small"
port = 8710
device = "cpu"
dtype = "float32"
max_model_len = 256
engine_args = ["--gpu-memory-utilization", "0.1"]
env = { VLLM_CPU_KVCACHE_SPACE = "1" }
state_dir = "$W/state"
[restart]
start_timeout_s = 300
TOML
$RK stop --policy "$W/vllm.toml" >/dev/null
$RK start --policy "$W/vllm.toml"
$RK snapshot create --policy "$W/vllm.toml"
$RK bench --policy "$W/vllm.toml" --strategies cold,criu --repeat ${REPEAT:-3} --out "$W/bench"
