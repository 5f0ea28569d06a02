#!/usr/bin/env bash
# Every GPU check in one command, on a machine with an NVIDIA GPU and jaxformer's dependencies
# (`pip install -e ".[test,bench]"` with a CUDA build of jax: `pip install "jax[cuda12]"`):
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # or: make gpu-check
#
#   1. the device and versions
#   2. the test suite on the GPU (4 workers; conftest pins float32 matmul precision and stops each
#      worker preallocating GPU memory), including the GPU-only check that cuDNN flash attention is
#      in the compiled training step
#   3. the 1.3B GPT-2 shape (D=2048 L=24 H=16 V=50304 T=1024), bf16, AdamW, no dropout: jaxformer
#      unrolled and scanned (with and without remat) beside Hugging Face PyTorch GPT-2 + torch.compile,
#      tokens/s, MFU and peak memory of each at batch 8 and 16, and the ratio of the best
#   4. decoding ms/token at batch 1 and 32 (D=1024, L=12, bf16)
# Each part's output is also written to OUT_DIR (default gpu_check/).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_check}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
run() {  # run NAME CMD...: show and keep the output; remember a failure, go on
  local name=$1
  shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "== $name failed (exit $rc)"; status=1; }
}

run device "$py" -c "import jax, jaxlib, flax; print(jax.__version__, jaxlib.__version__, flax.__version__); print(jax.devices())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null | tee "$out/nvidia-smi.log"
run tests "$py" -m pytest -n 4 --dist loadfile -q -ra
shape=(--d-model 2048 --heads 16 --layers 24 --vocab 50304 --seq 1024 --steps 10 --attention auto)
run gpt2_unrolled "$py" scripts/benchmark.py --gpt2-vs-torch "${shape[@]}" --batches 8,16
run gpt2_scanned "$py" scripts/benchmark.py --gpt2-vs-torch "${shape[@]}" --batches 8,16 --scan
run gpt2_scanned_dots "$py" scripts/benchmark.py --gpt2-vs-torch "${shape[@]}" --batches 16,24 --scan --remat dots_saveable
run decode "$py" scripts/benchmark.py --decode --modes decoder_only --d-model 1024 --heads 16 --layers 12 \
  --vocab 50304 --dtype bfloat16 --attention auto --decode-lengths 256 --decode-batches 1,32 --recompute-lengths ""
echo "== gpu_check done (status $status); logs in $out/"
exit $status
