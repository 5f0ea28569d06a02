#!/usr/bin/env bash
# Multi-host on one machine: two processes with 4 CPU devices each form one 8-device mesh
# (data=4 x fsdp=2) through jax.distributed; each process loads half of every batch.
#
#   bash scripts/launch_local_two_process.sh [experiments/copy_task.py] [runs/two_process]
set -euo pipefail
config=${1:-experiments/copy_task.py}
workdir=${2:-runs/two_process}
port=${PORT:-12355}
export XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu
export JAX_COORDINATOR_ADDRESS=127.0.0.1:$port JAX_NUM_PROCESSES=2
mesh=(--set mesh.data=4 --set mesh.fsdp=2)
JAX_PROCESS_ID=1 .venv/bin/jaxformer train --config "$config" --workdir "$workdir" "${mesh[@]}" --quiet &
worker=$!
trap 'kill $worker 2>/dev/null || true' EXIT
JAX_PROCESS_ID=0 .venv/bin/jaxformer train --config "$config" --workdir "$workdir" "${mesh[@]}"
wait $worker
