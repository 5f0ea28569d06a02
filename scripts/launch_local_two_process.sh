#!/usr/bin/env bash
# Multi-host on one machine: two processes with 4 CPU devices each form one 8-device mesh
# (data=4 x fsdp=2) through jax.distributed; each process loads half of every batch.
#
#   bash scripts/launch_local_two_process.sh [experiments/copy_task.py] [runs/two_process] [--set K=V]...
#
# Like a cluster's job restart (SLURM --requeue, a JobSet's maxRestarts): when a process fails, the
# other is stopped and both start again, up to RESTARTS times (default 3); each start resumes from
# the workdir's latest checkpoint, bitwise. A restart follows exit code 4 (a process lost its peer:
# one line says which, at what step, from which checkpoint) or a death by a signal; any other
# exit code ends the job with it (3: preempted after saving). PYTHON picks the interpreter.
set -uo pipefail
config=${1:-experiments/copy_task.py}
workdir=${2:-runs/two_process}
extra=("${@:3}")
port=${PORT:-12355}
restarts=${RESTARTS:-3}
python=${PYTHON:-.venv/bin/python}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=4" JAX_PLATFORMS=cpu  # the caller's flags kept
export JAX_COORDINATOR_ADDRESS=127.0.0.1:$port JAX_NUM_PROCESSES=2
train=(-m jaxformer.cli train --config "$config" --workdir "$workdir" --set mesh.data=4 --set mesh.fsdp=2 "${extra[@]}")
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done' EXIT
for ((attempt = 0; ; attempt++)); do
  JAX_PROCESS_ID=1 "$python" "${train[@]}" --quiet &
  pids=($!)
  JAX_PROCESS_ID=0 "$python" "${train[@]}" &
  pids+=($!)
  echo "launch_local_two_process.sh: start $attempt: process 0 is pid ${pids[1]}, process 1 is pid ${pids[0]}" >&2
  wait -n -p ended "${pids[@]}"
  status=$?
  for p in "${pids[@]}"; do
    [ "$p" = "$ended" ] && continue
    if [ "$status" -ne 0 ]; then  # one failed: the other says so and exits 4 itself, or is killed in 60 s
      for ((i = 0; i < 600; i++)); do kill -0 "$p" 2>/dev/null && sleep 0.1 || break; done
      kill -9 "$p" 2>/dev/null
    fi
    wait "$p"
    s=$?
    [ "$status" -ne 0 ] || status=$s
  done
  pids=()
  # Restart after a lost process (4) or a death by signal; 0, 3 (preempted), 1 and 2 (the run's own
  # verdict: a non-finite loss, a bad input) would only come back.
  if [ "$status" -ne 4 ] && [ "$status" -le 128 ] || [ "$attempt" -ge "$restarts" ]; then
    exit "$status"
  fi
  echo "launch_local_two_process.sh: a process exited with $status; restarting both ($((attempt + 1)) of $restarts)" >&2
done
