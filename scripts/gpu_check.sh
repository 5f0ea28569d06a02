#!/usr/bin/env bash
# Every GPU check in one command, on a machine with an NVIDIA GPU and jaxformer's dependencies
# (`pip install -e ".[test,bench]"` with a CUDA build of jax: `pip install "jax[cuda12]"`):
#
#   bash scripts/gpu_check.sh [OUT_DIR [PART ...]]   # or: make gpu-check
#   bash scripts/gpu_check.sh OUT_DIR quick          # the headline figures alone, under 8 minutes on one H100
#
# On a machine that cannot reach a package index (jax with CUDA, torch and transformers installed, the
# rest missing or older), carry jaxformer's other dependencies as wheels in a folder of the checkout
# (`wheels/`, ignored by git; WHEELS names another, WHEELS= none). Make it where pip reaches the index,
# for the machine's Python (`python3 --version` there; 3.12 on the machines this was written for):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d wheels flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8
#
# Carry only what the machine lacks, in versions its jax takes: jax 0.11.2's CUDA images already hold
# flax 0.12.10, optax 0.2.8 and orbax-checkpoint 0.12.4, which run `quick` (2026-11-27, one H100), while
# flax 0.12.8 does not import on jax 0.11.2; wheels that do not import where the machine's own do are
# set aside with a message.
#
# (3.3 MB: what `quick` imports beyond jax, numpy, torch and transformers; their own needs, msgpack,
# tensorstore, rich, treescope, etils, humanize, simplejson and the rest, are in the usual CUDA images.
# The other parts need more: grain, array-record, portpicker, tensorboardX, optuna, alembic, sqlalchemy,
# colorlog and mako, then pytest-xdist and transformers 4.57 for `tests`.) Copy the checkout with wheels/
# in it to the GPU machine; there the script installs every wheel in it first, with no index and no
# dependency resolution, into a folder of its own (WHEEL_SITE, default /tmp/jaxformer-wheels) put on
# PYTHONPATH, so that nothing the machine has installed changes:
#
#   pip install --no-index --find-links wheels --no-deps --target /tmp/jaxformer-wheels wheels/*.whl
#
# Two versions of one package in wheels/ stop it before it installs anything.
#
# The parts, each under 10 minutes on one H100 (all of them, in this order, when none is named; the
# predictions first, so that they are on record before anything is measured):
#   device   the device and versions
#   plan     `jaxformer plan`'s predictions for the four peaks of the 1.3B shape the accelerators guide
#            sets them beside (unrolled and scanned without remat at batch 8, scanned dots_saveable and
#            without remat at 16): XLA's GPU compiler for an H100 without using it (--target gpu-h100:1x1,
#            as from a CPU machine), then on this machine's first GPU itself (autotuned); then the one of
#            the four no other part measures, scanned without remat at batch 16 (out of memory on 80 GB
#            when last measured)
#   quick    the headline figures, for a GPU at hand for minutes (run it alone): one command of under 8
#            minutes on one H100 (scripts/gpu_quick.py; each step capped, 420 s in all, QUICK_BUDGET_S):
#            the device; the cuDNN ring-block test (as `long` runs it, its cudnn case); decode ms/token
#            at batch 1 and 32 (as `decode`, greedy only); the 1.3B shape's jaxformer configuration
#            (scanned, remat "auto", cuDNN attention, bf16, batch 16: one compile, 9 timed steps) beside
#            torch.compile of Hugging Face's GPT2LMHeadModel at the same batch: tokens/s, MFU, peak
#            memory (QUICK_BATCH, QUICK_STACK, QUICK_ATTENTION change the configuration). One
#            markdown table at the end, also in OUT_DIR/quick.md (figures in quick.json, the steps'
#            output in quick.log). QUICK_SHAPE=tiny runs the same path at toy shapes on a CPU
#   gpt2     the 1.3B GPT-2 shape (D=2048 L=24 H=16 V=50304 T=1024), bf16, AdamW, no dropout, at batch
#            8 and 16: jaxformer unrolled and scanned (remat "auto", which is dots_saveable when scanned)
#            beside Hugging Face PyTorch GPT-2 + torch.compile, each in a process of its own: tokens/s,
#            MFU and peak memory, scanned against unrolled, and jaxformer's best against torch's best
#   gpt2_big the same at batch 24 and 32, scanned (auto) and scanned with full remat; then unrolled
#            and scanned without remat (what "auto" avoids) at batch 8, without torch
#   decode   decoding ms/token at batch 1 and 32 (D=1024, L=12, bf16)
#   moe      mixture of experts against dense at equal active parameters, decoder-only and
#            encoder-decoder (D=1024, L=8 per stack, T=1024, B=8, bf16): the dense FFN (4D) beside 8
#            experts of width 2D, 2 a token, with a capacity of 1.25 and dropless (jax.lax.ragged_dot),
#            interleaved rounds: tokens/s and the ratio to dense (`scripts/benchmark.py --moe 8,2`)
#   long     long context on one GPU: the 1.3B shape at T=16384, batch 1, scanned, one step measured in a
#            process of its own (scripts/long_context_step.py: peak bytes in use, XLA's device and host
#            bytes, step time) with the plain loss, the chunked loss, remat "offload_inputs" and
#            train.offload_optimizer; then `jaxformer plan`'s prediction for the plain and chunked steps,
#            deviceless (--target gpu-h100:1x1) and on this GPU. (Ring attention needs a context axis of
#            2 or more devices: on one GPU only the loss and the offload options apply; first, though,
#            the test of cuDNN's calls as the ring's blocks use them.) LONG_T: another T
#   serve    the inference engine at the 1.3B shape (scanned, bf16; 64 requests, 32 at once, prompts and
#            outputs of 8-64 tokens): `benchmark.py --serve` against static `generate` and transformers'
#            PyTorch `generate`, then one more round of each jax path under JAX's profiler (device-busy
#            time against wall time, the longest kernels); then the same without XLA's CUDA graphs
#            (--xla_gpu_enable_command_buffer=), to tell whether they cost the engine its calls. About 7
#            minutes on one H100 (each run's warm-up compiles 36 shapes, 101 s there); run it alone.
#            SERVE_SHAPE replaces its shape's flags (a smoke run on a CPU)
#   serve_pages  the engine where reading its pages costs: the 1.3B shape with prompts of up to 1024
#            tokens (64 requests, 32 at once, outputs of 8-64), its decoding steps reading the pages by
#            JAX's Pallas (Triton) paged kernel (--attention auto), then gathering them into a dense copy
#            for cuDNN (--attention cudnn), each against static `generate` with the same attention:
#            whether the kernel pays. About 6 minutes on one H100; run it alone. SERVE_PAGES_SHAPE
#            replaces its shape's flags, SERVE_PAGES_ATTENTION the two settings ("auto xla" on a CPU)
#   serve_spec  speculative decoding by prompt lookup at the serve part's shape: the engine at one step a
#            call, without drafts and drafting 4 tokens a step (`--serve-speculate 4`), against static
#            `generate`, with the share of drafts taken. About 6 minutes on one H100; run it alone.
#            SERVE_SPEC_SHAPE replaces its shape's flags
#   tests    the test suite on the GPU (4 workers; conftest pins float32 matmul precision and stops each
#            worker preallocating GPU memory), with the GPU-only check that cuDNN flash attention is
#            in the compiled training step
# Each part's output is also written to OUT_DIR (default gpu_check/). GPT2_SHAPE replaces the 1.3B
# shape's flags (a smoke run on a CPU: GPT2_SHAPE="--d-model 64 --heads 4 --layers 2 --vocab 512 --seq 64").
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
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

# Carried wheels (see the top): installed before any part, without an index or dependency resolution.
wheels=${WHEELS-wheels}  # WHEELS= (empty): none, whatever wheels/ holds
if [ -n "$wheels" ] && compgen -G "$wheels/*.whl" >/dev/null; then
  site=${WHEEL_SITE:-/tmp/jaxformer-wheels}
  whls=("$wheels"/*.whl)
  dupes=$(for w in "${whls[@]}"; do w=${w##*/}; echo "${w%%-*}"; done | tr 'A-Z-' 'a-z_' | sort | uniq -d |
    paste -sd ' ')  # a wheel's name: distribution-version-...; one name twice is two versions
  if [ -n "$dupes" ]; then
    echo "gpu_check: two versions of one package in $wheels/ ($dupes): keep one of each" >&2
    exit 2
  fi
  echo "== wheels: ${#whls[@]} from $wheels/ into $site (no index, no dependencies)"
  timeout 60 "$py" -m pip install -q --no-index --find-links "$wheels" --no-deps --no-compile --no-cache-dir \
    --upgrade --disable-pip-version-check --target "$site" "${whls[@]}" 2>&1 | tee "$out/wheels.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check: installing the wheels in $wheels/ failed (above)" >&2; exit 1; }
  # Carried wheels made for another jax can fail where the machine's own work (flax 0.12.8 on jax 0.11.2:
  # "jax.experimental.hijax has no attribute HiPrimitive"; its CUDA image's flax 0.12.10 runs): then use those.
  probe=(-c "import flax.nnx, optax, orbax.checkpoint")
  if PYTHONPATH="$PWD:$site${PYTHONPATH#"$PWD"}" "$py" "${probe[@]}" 2>"$out/wheels_probe.log"; then
    export PYTHONPATH="$PWD:$site${PYTHONPATH#"$PWD"}"
  elif "$py" "${probe[@]}" 2>/dev/null; then
    echo "gpu_check: the wheels in $wheels/ do not import here ($(tail -n 1 "$out/wheels_probe.log")); the machine's own flax, optax and orbax do: using those"
  else
    echo "gpu_check: flax, optax and orbax import neither from $wheels/ nor from the machine (below)" >&2
    cat "$out/wheels_probe.log" >&2
    exit 1
  fi
elif [ -n "${WHEELS:-}" ]; then
  echo "gpu_check: WHEELS=$WHEELS holds no .whl files" >&2
  exit 2
fi

parts=("${@:2}")
[ ${#parts[@]} -gt 0 ] || parts=(device plan quick gpt2 gpt2_big decode moe long tests)
shape=(${GPT2_SHAPE:---d-model 2048 --heads 16 --layers 24 --vocab 50304 --seq 1024 --steps 10} --attention auto)
for part in "${parts[@]}"; do
  case $part in
    device)
      run device "$py" -c "import jax, jaxlib, flax; print(jax.__version__, jaxlib.__version__, flax.__version__); print(jax.devices())"
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null | tee "$out/nvidia-smi.log" ;;
    quick)  # its own caps add up to QUICK_BUDGET_S; the outer limit only catches a hang in the driver
      run quick timeout -k 10 $((${QUICK_BUDGET_S:-420} + 30)) "$py" scripts/gpu_quick.py "$out" ;;
    gpt2) run gpt2 "$py" scripts/benchmark.py --gpt2-vs-torch "${shape[@]}" --batches 8,16 --stacks unrolled,scanned ;;
    gpt2_big)
      run gpt2_big "$py" scripts/benchmark.py --gpt2-vs-torch "${shape[@]}" --batches 24,32 --stacks scanned,scanned:full
      run gpt2_scan_none "$py" scripts/benchmark.py --gpt2-vs-torch "${shape[@]}" --batches 8 \
        --stacks unrolled,scanned:none --no-peer ;;
    decode)
      run decode "$py" scripts/benchmark.py --decode --modes decoder_only --d-model 1024 --heads 16 --layers 12 \
        --vocab 50304 --dtype bfloat16 --attention auto --decode-lengths 256 --decode-batches 1,32 --recompute-lengths "" ;;
    moe)
      run moe "$py" scripts/benchmark.py --moe 8,2 --modes decoder_only,encoder_decoder --d-model 1024 --heads 16 \
        --layers 8 --vocab 32000 --seq 1024 --batch 8 --dtype bfloat16 --attention auto --steps 5 --rounds 3 ;;
    plan)
      for config in "unrolled_b8 scan_layers=false remat=none 8" "scanned_none_b8 scan_layers=true remat=none 8" \
        "scanned_dots_b16 scan_layers=true remat=dots_saveable 16" "scanned_none_b16 scan_layers=true remat=none 16"; do
        read -r name scan remat batch <<<"$config"
        flags=(--config experiments/gpt2_1p3b.py --no-largest --set mesh.fsdp=1 --set "model.$scan" --set "model.$remat"
          --set "train.batch_size=$batch")
        run "plan_$name" "$py" -m jaxformer.cli plan "${flags[@]}" --target gpu-h100:1x1
        CUDA_VISIBLE_DEVICES=0 run "plan_${name}_on_this_gpu" "$py" -m jaxformer.cli plan "${flags[@]}"
      done
      # Measured: the other three are gpt2's (unrolled 8, scanned 16) and gpt2_big's (scanned:none 8).
      run plan_measured_scanned_none_b16 "$py" scripts/benchmark.py --gpt2-vs-torch "${shape[@]}" --batches 16 \
        --stacks scanned:none --no-peer ;;
    long)
      # first, cuDNN's calls as the ring's blocks use them, against attention over all keys
      run long_ring_cudnn_blocks "$py" -m pytest -q -rs tests/test_ring.py -k fused_kernel_s_blocks
      T=${LONG_T:-16384}
      long=(--config experiments/gpt2_1p3b.py --set "data.max_len=$T" --set "model.max_len=$T" --set train.batch_size=1
        --set mesh.data=1 --set mesh.fsdp=1)
      for config in "plain remat=full loss_chunk=0 false" "chunked remat=full loss_chunk=auto false" \
        "chunked_offload_inputs remat=offload_inputs loss_chunk=auto false" \
        "chunked_offload_optimizer remat=full loss_chunk=auto true"; do
        read -r name remat chunk opt <<<"$config"
        flags=("${long[@]}" --set "model.$remat" --set "train.$chunk" --set "train.offload_optimizer=$opt")
        XLA_PYTHON_CLIENT_MEM_FRACTION=.95 run "long_${T}_$name" "$py" scripts/long_context_step.py "${flags[@]}"
        if [ "$opt" = false ] && [ "${remat#remat=}" = full ]; then
          run "long_${T}_${name}_plan" "$py" -m jaxformer.cli plan "${flags[@]}" --no-largest --target gpu-h100:1x1
          CUDA_VISIBLE_DEVICES=0 run "long_${T}_${name}_plan_on_this_gpu" "$py" -m jaxformer.cli plan "${flags[@]}" \
            --no-largest
        fi
      done ;;
    serve)
      serve=(--serve --scan --attention auto --dtype bfloat16 ${SERVE_SHAPE:---d-model 2048 --heads 16 --layers 24 \
        --vocab 50304 --seq 64 --serve-requests 64 --serve-max-new 64 --serve-slots 32 --rounds 3})
      run serve "$py" scripts/benchmark.py "${serve[@]}" --serve-profile "$out/serve_profile"
      XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_command_buffer=" \
        run serve_without_cuda_graphs "$py" scripts/benchmark.py "${serve[@]}" ;;
    serve_pages)
      shape=(${SERVE_PAGES_SHAPE:---d-model 2048 --heads 16 --layers 24 --vocab 50304 --seq 1024 --serve-requests 64 \
        --serve-max-new 64 --serve-slots 32 --rounds 3})
      for attention in ${SERVE_PAGES_ATTENTION:-auto cudnn}; do  # the paged kernel, then the gather (prefills gather)
        run "serve_pages_$attention" "$py" scripts/benchmark.py --serve --scan --attention "$attention" \
          --dtype bfloat16 "${shape[@]}"
      done ;;
    serve_spec)
      spec=(${SERVE_SPEC_SHAPE:---d-model 2048 --heads 16 --layers 24 --vocab 50304 --seq 64 --serve-requests 64 \
        --serve-max-new 64 --serve-slots 32 --rounds 3})
      run serve_spec "$py" scripts/benchmark.py --serve --scan --attention auto --dtype bfloat16 --serve-steps 1 \
        --serve-speculate 4 "${spec[@]}" ;;
    tests) run tests "$py" -m pytest -n 4 --dist loadfile -q -ra ;;
    *) echo "gpu_check: no part named $part (device, plan, quick, gpt2, gpt2_big, decode, moe, long, serve, serve_pages, serve_spec, tests)" >&2
      exit 2 ;;
  esac
done
echo "== gpu_check done (status $status); logs in $out/"
exit $status
