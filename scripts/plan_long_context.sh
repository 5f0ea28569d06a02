#!/usr/bin/env bash
# The long-context plan table of docs/guides/long-context.md: the 1.3B GPT-2 shape
# (experiments/gpt2_1p3b.py) at 8k, 32k and 128k tokens on a TPU v5p slice of 8 chips, compiled by
# the TPU compiler (needs jaxformer[tpu]; no TPU), with and without the context axis and the chunked
# loss. Each line prints one plan as JSON into $OUT (default plan_long_context/); a compile of the
# long steps takes minutes on a small machine. Usage: scripts/plan_long_context.sh [LENGTH ...]
set -u
OUT=${OUT:-plan_long_context}
TARGET=${TARGET:-tpu-v5p:2x2x2}
mkdir -p "$OUT"
# name | mesh and batch: one row per batch shard (fsdp=8), or one sequence over the 8 chips (context=8)
MESHES=(
  "fsdp8|--set mesh.data=1 --set mesh.fsdp=8 --set train.batch_size=8"
  "context8|--set mesh.data=1 --set mesh.fsdp=1 --set mesh.context=8 --set train.batch_size=1"
)
LOSSES=("plain|--set train.loss_chunk=0" "chunked|--set train.loss_chunk=auto")
EXTRA=${EXTRA:-}  # more overrides for every line (offload: EXTRA="--set model.remat=offload_inputs --set train.offload_optimizer=true")
TAG=${TAG:-}
LENGTHS=("$@")
[ $# -gt 0 ] || LENGTHS=(8192 32768 131072)
for T in "${LENGTHS[@]}"; do
  for mesh in "${MESHES[@]}"; do
    for loss in "${LOSSES[@]}"; do
      name="T${T}_${mesh%%|*}_${loss%%|*}${TAG}"
      echo "== $name $(date -u +%H:%M:%S)"
      # shellcheck disable=SC2086
      jaxformer plan --config experiments/gpt2_1p3b.py --target "$TARGET" --no-largest --jobs 1 --json \
        --set data.max_len="$T" --set model.max_len="$T" ${mesh#*|} ${loss#*|} $EXTRA \
        > "$OUT/$name.json" 2> "$OUT/$name.log"
      echo "   exit $? $(date -u +%H:%M:%S)"
    done
  done
done
