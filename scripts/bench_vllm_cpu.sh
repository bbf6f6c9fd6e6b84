#!/usr/bin/env bash
# vLLM (the CPU build) restarted five ways, side by side: cold, criu (the whole process), ipc (the weights
# from restartkit's weight cache), criu+ipc (a weights-less snapshot, the weights re-attached from the cache)
# and standby (a second vLLM kept armed).  As root with CRIU installed.
#   scripts/bench_vllm_cpu.sh [WORKDIR]      (REPEAT=N runs each strategy N times; default 2)
# io_uring is switched off for the run (vLLM opens one otherwise, which CRIU cannot dump) and put back after.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/rk-vllm-bench}
RK=".venv/bin/python -m restartkit.cli"
P="$W/vllm.toml"
old=$(cat /proc/sys/kernel/io_uring_disabled)
trap 'echo $old > /proc/sys/kernel/io_uring_disabled; $RK standby disarm --policy $P >/dev/null 2>&1 || true; $RK stop --policy $P >/dev/null 2>&1 || true; $RK weightcache release --policy $P --stop --force >/dev/null 2>&1 || true' EXIT
echo 2 > /proc/sys/kernel/io_uring_disabled
mkdir -p "$W/models"
[ -f "$W/models/small/config.json" ] || $RK model create --preset small --out "$W/models/small" >/dev/null
policy() {  # $1: [criu] weights
cat > "$P" <<TOML
[service]
name = "vllm-cpu-bench"
engine = "vllm"
model = "$W/models/small"
port = 8710
device = "cpu"
dtype = "float32"
max_model_len = 256
engine_args = ["--gpu-memory-utilization", "0.1"]
env = { VLLM_CPU_KVCACHE_SPACE = "${KV_GIB:-2}" }
state_dir = "$W/state"
[restart]
start_timeout_s = 600
[ipc]
socket_dir = "$W/wc"
fallback = false
[criu]
weights = "$1"
[standby]
enabled = true
kv_ahead = "never"
TOML
}
policy include
$RK stop --policy "$P" >/dev/null
$RK preload --policy "$P" --detach
$RK start --policy "$P"
R=${REPEAT:-2}
$RK bench --policy "$P" --strategies cold,ipc --repeat "$R" --out "$W/bench-cold-ipc"
$RK snapshot create --policy "$P"                 # the whole process: weights and KV cache in the image
$RK bench --policy "$P" --strategies criu --repeat "$R" --out "$W/bench-criu"
policy auto
$RK restart --policy "$P" --strategy ipc --strict >/dev/null   # an engine that loaded from the cache
$RK snapshot create --policy "$P"                 # weights-less: released before the dump, re-attached after
$RK bench --policy "$P" --strategies criu+ipc --repeat "$R" --out "$W/bench-criu-ipc"
for i in $(seq "$R"); do
  $RK standby arm --policy "$P"
  $RK bench --policy "$P" --strategies standby --repeat 1 --out "$W/bench-standby-$i"
done
$RK snapshot list --policy "$P"
