#!/usr/bin/env bash
# Train on a Cloud TPU pod slice: get the slice (a queued resource, created or reused), copy this
# checkout and the experiment to every worker, install, run the same `jaxformer train` on all of
# them, and bring each worker's log back. `jax.distributed.initialize()` finds the pod's other
# workers by itself (mesh.distributed=true), so no coordinator is given.
#
# Plan first, on any machine, so that the pod is not paid for a configuration that does not fit:
#   jaxformer plan --config experiments/gpt2_1p3b.py --target tpu-v5p:4x4x4
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/tpu_pod.sh --name NAME --zone ZONE --type TYPE --config experiments/X.py --workdir DIR
                          [--version RUNTIME] [--project PROJECT] [--spot] [--set SECTION.FIELD=VALUE]...
                          [--logs LOCAL_DIR] [--restarts N] [--dry-run]

  --name       queued resource and TPU VM name (reused when it exists)
  --zone       e.g. us-east5-a
  --type       accelerator type, e.g. v5p-128, v5litepod-256, v4-256, v6e-64
  --config     the experiment file, copied with this checkout
  --workdir    checkpoints and metrics: a path every worker sees (a gcsfuse or NFS mount)
  --version    TPU VM runtime (default tpu-ubuntu2204-base)
  --spot       a spot (preemptible) slice; training resumes from the workdir when rerun
  --set        a config override, passed to `jaxformer train` (repeatable)
  --logs       where each worker's log lands (default logs/NAME)
  --restarts   rerun the training on all workers up to N times (default 0) after it fails other than
               with exit 1 (a non-finite loss) or 2 (a bad input): a lost worker makes the others
               exit 4; each rerun resumes from the workdir's latest checkpoint
  --dry-run    print the gcloud commands instead of running them
EOF
}

name="" zone="" type="" config="" workdir="" version="tpu-ubuntu2204-base" project="" spot="" dry="" logs="" restarts=0
sets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --name) name=$2; shift 2 ;;
    --zone) zone=$2; shift 2 ;;
    --type) type=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    --workdir) workdir=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --project) project=$2; shift 2 ;;
    --spot) spot=1; shift ;;
    --set) sets+=(--set "$2"); shift 2 ;;
    --logs) logs=$2; shift 2 ;;
    --restarts) restarts=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "tpu_pod.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
for required in name zone type config workdir; do
  if [ -z "${!required}" ]; then
    echo "tpu_pod.sh: --$required is required" >&2
    usage >&2
    exit 2
  fi
done
cd "$(dirname "$0")/.."
[ -f "$config" ] || { echo "tpu_pod.sh: --config $config is not a file (a path in this checkout)" >&2; exit 2; }
logs=${logs:-logs/$name}

where=(--zone "$zone")
[ -n "$project" ] && where+=(--project "$project")
run() {  # the command, shown; run unless --dry-run
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  [ -n "$dry" ] || "$@"
}

# 1. The slice: reuse the queued resource when it exists, else ask for one and wait until it is ACTIVE.
state() { gcloud compute tpus queued-resources describe "$name" "${where[@]}" --format='value(state.state)' 2>/dev/null; }
if [ -n "$dry" ] || [ -z "$(state)" ]; then
  run gcloud compute tpus queued-resources create "$name" --node-id "$name" "${where[@]}" \
    --accelerator-type "$type" --runtime-version "$version" ${spot:+--spot}
fi
if [ -z "$dry" ]; then
  until [ "$(state)" = ACTIVE ]; do
    case "$(state)" in FAILED|SUSPENDED) echo "tpu_pod.sh: queued resource $name is $(state)" >&2; exit 1 ;; esac
    echo "waiting for $name ($(state))..."
    sleep 30
  done
fi

# 2. This checkout (without virtual environments and runs) and the experiment, on every worker.
bundle=${TMPDIR:-/tmp}/jaxformer-$name.tar.gz
run tar czf "$bundle" --exclude=.venv --exclude=.git --exclude=runs --exclude=logs .
run gcloud compute tpus tpu-vm scp "$bundle" "$name:jaxformer.tar.gz" "${where[@]}" --worker=all
run gcloud compute tpus tpu-vm ssh "$name" "${where[@]}" --worker=all --command \
  "mkdir -p jaxformer && tar xzf jaxformer.tar.gz -C jaxformer && cd jaxformer && python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu]'"

# 3. The same command on every worker; each keeps its own log.
train="cd jaxformer && .venv/bin/jaxformer train --config $(printf '%q' "$config") --workdir $(printf '%q' "$workdir") --set mesh.distributed=true"
for s in "${sets[@]}"; do [ "$s" = --set ] || train+=" --set $(printf '%q' "$s")"; done
for ((attempt = 0; ; attempt++)); do
  status=0
  run gcloud compute tpus tpu-vm ssh "$name" "${where[@]}" --worker=all --command "set -o pipefail; $train 2>&1 | tee -a train.log" || status=$?
  if [ "$status" -eq 0 ] || [ "$status" -eq 1 ] || [ "$status" -eq 2 ] || [ "$attempt" -ge "$restarts" ]; then
    break
  fi
  echo "tpu_pod.sh: training exited with $status; running it again on all workers ($((attempt + 1)) of $restarts)" >&2
done

# 4. Logs back, one file per worker.
workers=1
if [ -z "$dry" ]; then
  workers=$(gcloud compute tpus tpu-vm describe "$name" "${where[@]}" --format='value(networkEndpoints.ipAddress)' | tr ';' '\n' | grep -c .)
fi
run mkdir -p "$logs"
for ((w = 0; w < workers; w++)); do
  run gcloud compute tpus tpu-vm scp "$name:jaxformer/train.log" "$logs/worker-$w.log" "${where[@]}" --worker="$w"
done
echo "logs in $logs/; the slice is still up: gcloud compute tpus queued-resources delete $name ${where[*]} --force"
exit "$status"
