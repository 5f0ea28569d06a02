"""XLA's GPU compiler (JAX's CUDA plugin, `pip install -e ".[gpu-plan]"`) for H100s from this machine,
without a GPU: each mode's training, evaluation and cached decoding steps compile with cuDNN's fused
attention in them and no [B, H, T, S] score tensor, packed rows give cuDNN their segments as a bias
broadcast over heads, what cuDNN refuses goes to XLA's path, the shipped descriptions of each GPU
parse, a scanned layer stack needs no more memory than an unrolled one, host offload puts the layer
inputs and Adam's moments in host memory, and the serving engine's decode step reads its pages by
Triton's paged kernel where its prefill gathers them for cuDNN.
Skipped without the plugin."""

import dataclasses
import logging
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jax_cuda12_plugin", reason="XLA's GPU compiler is not installed: pip install -e '.[gpu-plan]'")

from jaxformer import build_model, count_params, decode, gpu, sharding
from jaxformer.config import Config, DataConfig, DecodeConfig, MeshConfig, TrainConfig, tiny
from jaxformer.functional import Mask, dot_product_attention
from jaxformer.plan import abstract_batch, parse_target, plan, with_shardings
from jaxformer.state import state_factory
from jaxformer.train import make_steps

TARGET = "gpu-h100:1x2"  # one host of 2 H100s: data parallel over them
T, S = 128, 96  # target and source lengths, unequal so that each [., ., T, S] block is told apart
H = 4  # heads of 64
OBJECTIVE = {"encoder_only": "mlm", "decoder_only": "lm", "encoder_decoder": "seq2seq"}
# For the tests of which attention runs: matmuls by cuBLAS rather than Triton kernels, which take a third
# of a compile here. Attention's path is chosen as the step is traced; the memory tests keep the defaults.
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}


def tiny_gpu(mode: str, pack: bool = False, **mesh) -> Config:
    """One layer per stack, head dim 64, bfloat16, attention left to "auto" (cuDNN on GPU)."""
    layers = dict(num_encoder_layers=0 if mode == "decoder_only" else 1)
    layers |= dict(num_decoder_layers=0 if mode == "encoder_only" else 1)
    model = tiny(
        mode, vocab_size=128, d_model=64 * H, num_heads=H, d_ff=256, max_len=T, dtype="bfloat16",
        attention_impl="auto", **layers,
    )  # fmt: skip
    data = DataConfig(max_len=T, src_max_len=S if mode == "encoder_decoder" else None, pack=pack)
    train = TrainConfig(objective=OBJECTIVE[mode], batch_size=8, optimizer="adamw")
    return Config(model=model, data=data, train=train, mesh=MeshConfig(**mesh))


@pytest.fixture(scope="module")
def devices():
    return parse_target(TARGET).devices()


def fused_calls(text: str) -> list[str]:
    """cuDNN's fused attention calls in a compiled GPU program, by kind."""
    return re.findall(r'custom_call_target="__cudnn\$(fmha\w*)"', text)


def score_blocks(text: str) -> set[tuple[int, ...]]:
    """The 4-D arrays of the program whose last two dims are two of the lengths (T, S): [B, H, T, S]
    score or probability tensors, or a bias/mask of them ([B, 1, T, S])."""
    shapes = {tuple(int(n) for n in m) for m in re.findall(r"\[(\d+),(\d+),(\d+),(\d+)\]", text)}
    return {s for s in shapes if s[2] in (T, S) and s[3] in (T, S)}


def lowered_steps(cfg: Config, devices) -> tuple:
    """The training and evaluation steps of `cfg` lowered for `devices` (abstract state, batch 8)."""
    mesh = sharding.make_mesh(cfg.mesh, devices)
    with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
        graphdef, create, optimizer = state_factory(cfg)
        abstract = jax.eval_shape(create)
        shardings = sharding.state_shardings(abstract, mesh)
        state, batch = with_shardings(abstract, shardings), abstract_batch(cfg, cfg.train.batch_size, mesh)
        train, evaluate = make_steps(graphdef, cfg, optimizer)
        train_step = jax.jit(train, out_shardings=(shardings, None), donate_argnums=0)
        return train_step.lower(state, batch), jax.jit(evaluate).lower(state, batch)


def compiled_train_step(cfg: Config, devices):
    return lowered_steps(cfg, devices)[0].compile()


def compiled_steps(cfg: Config, devices) -> tuple[str, str]:
    """The compiled text of the training and evaluation steps of `cfg`."""
    return tuple(lowered.compile(NO_TRITON_GEMM).as_text() for lowered in lowered_steps(cfg, devices))


@pytest.mark.parametrize(
    "mode, packed",
    [("encoder_only", False), ("decoder_only", False), ("decoder_only", True), ("encoder_decoder", False),
     ("encoder_decoder", True)],
)  # fmt: skip
def test_each_mode_trains_and_evaluates_with_cudnn_fused_attention(mode, packed, devices):
    """Encoder rows padded to their lengths (told to cuDNN as lengths), causal decoder rows, cross-attention
    over source lengths, and packed rows (segments in the encoder, the decoder and across): the training
    step runs each attention as a cuDNN forward and backward call, evaluation as a forward call. Lengths
    and causality are structure: no [., ., T, S] array at all. Segments are a dense mask, which cuDNN
    takes as a bias ("ScaleBias" calls): one [B, 1, T, S] block each, broadcast over heads, never the
    [B, H, T, S] scores."""
    train, evaluate = compiled_steps(tiny_gpu(mode, pack=packed, data=2), devices)
    attentions = {"encoder_only": 1, "decoder_only": 1, "encoder_decoder": 3}[mode]
    kind = "fmhaScaleBiasSoftmax" if packed else "fmhaSoftmax"
    assert sorted(fused_calls(train)) == [kind] * attentions + [f"{kind}Backward"] * attentions
    assert fused_calls(evaluate) == [kind] * attentions
    B = 8 // 2  # rows a device
    biases = {(B, 1, T, T), (B, 1, T, S), (B, 1, S, S)} if mode == "encoder_decoder" else {(B, 1, T, T)}
    biases = biases if packed else set()  # decoder, cross, encoder
    assert score_blocks(train) == biases and score_blocks(evaluate) == biases


@pytest.mark.parametrize("mode", ["decoder_only", "encoder_decoder"])
def test_cached_decoding_compiles_with_cudnn_fused_attention(mode, devices):
    """Greedy decoding with the KV cache (a T-position prefill into T + 64 slots, then one position a step
    over the cache, its valid length told to cuDNN as lengths; cross-attention over source lengths): every
    attention is a cuDNN forward call, prefill and step alike, and no score tensor is built."""
    cfg = tiny_gpu(mode, data=2)
    mesh = sharding.make_mesh(cfg.mesh, devices)
    rng = jax.eval_shape(lambda: jax.random.key(0))  # abstract: nothing is placed on a device
    with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
        graphdef, create, _ = state_factory(cfg)
        abstract = jax.eval_shape(create).params
        params = with_shardings(abstract, sharding.state_shardings(abstract, mesh))
        rows = sharding.batch_sharding(mesh)
        ids = jax.ShapeDtypeStruct((8, T), np.int32, sharding=rows)
        per_row = jax.ShapeDtypeStruct((8,), np.int32, sharding=rows)
        src = (jax.ShapeDtypeStruct((8, S), np.int32, sharding=rows), per_row) if mode == "encoder_decoder" else None
        settings = DecodeConfig(strategy="greedy", max_new_tokens=64)
        text = decode._generate.lower(
            graphdef, params, ids, per_row, per_row, src, rng,
            settings=settings, num_new=64, length=T + 64, eos_id=1, pad_id=0,
        ).compile(NO_TRITON_GEMM).as_text()  # fmt: skip
    # Prefill and step: decoder self-attention; encoder-decoder adds the encoder's and cross-attention's.
    assert fused_calls(text) == ["fmhaSoftmax"] * {"decoder_only": 2, "encoder_decoder": 5}[mode]
    cache = {s for s in map(tuple, re.findall(r"\[(\d+),(\d+),(\d+),(\d+)\]", text)) if s[-1] == str(T + 64)}
    assert not score_blocks(text) and not cache  # nothing [., ., ., T + 64]: no scores over the cache either


def ring_gpu(mode: str, n: int, length: int = T, impl: str = "auto") -> Config:
    """`tiny_gpu` with the sequence split over a context axis of `n` (zig-zag where attention is causal)."""
    cfg = tiny_gpu(mode, context=n, data=1)
    layout = "contiguous" if mode == "encoder_only" else "zigzag"
    model = cfg.model.replace(max_len=length, attention_impl=impl, context_layout=layout)
    return dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, max_len=length))


def head_blocks(text: str, shapes: set[tuple[int, int]]) -> set[tuple[int, ...]]:
    """The [B, H, t, s] arrays of the program with (t, s) one of `shapes`: a ring block's scores or
    probabilities (a bias broadcast over heads, [B, 1, t, s], is not one)."""
    found = {tuple(int(n) for n in m) for m in re.findall(r"\[(\d+),(\d+),(\d+),(\d+)\]", text)}
    return {s for s in found if s[1] == H and s[2:] in shapes}


@pytest.mark.parametrize("mode", ["encoder_only", "decoder_only", "encoder_decoder"])
def test_the_ring_attends_each_block_with_cudnn_in_each_mode(mode):
    """Context parallelism over 4 H100s (`ring.fused_kernel` with cuDNN's calls): the training step's
    ring attends its blocks with cuDNN's forward and backward calls in every kind a block can be (no
    mask, causal, zig-zag's halves, and a bias for the rest), evaluation with the forward ones; the
    blocks travel by collective-permute, and no block of [B, H, t, s] scores is built, where the
    dense blocks ("naive") build them."""
    devices = parse_target("gpu-h100:1x4").devices()
    train, evaluate = compiled_steps(ring_gpu(mode, 4), devices)
    shapes = {(T // 4, T // 4), (T // 4, S // 4), (S // 4, S // 4)}
    calls = {"fmhaSoftmax", "fmhaScaleBiasSoftmax"}
    assert set(fused_calls(train)) == calls | {f"{c}Backward" for c in calls}
    assert set(fused_calls(evaluate)) == calls
    masks = set(re.findall(r'mask_type\\?"\s*:\s*\\?"(\w+)', train))
    assert masks == ({"NO_MASK"} if mode == "encoder_only" else {"NO_MASK", "CAUSAL"})
    assert "collective-permute" in train and not head_blocks(train, shapes) and not head_blocks(evaluate, shapes)
    if mode == "decoder_only":
        dense, _ = compiled_steps(ring_gpu(mode, 4, impl="naive"), devices)
        assert not fused_calls(dense) and head_blocks(dense, shapes)


def test_cudnn_inside_the_ring_needs_a_third_of_the_dense_blocks_temporaries():
    """A decoder-only training step over 4096 positions on 4 H100s (zig-zag, 1024 a device, 8 rows):
    XLA's GPU compiler lays out 129 MB of temporaries with cuDNN inside the ring against 389 MB with
    dense blocks (float32 [8, 4, 1024, 1024] scores a step); at 16,384 positions 866 MB against
    4.90 GB."""
    devices = parse_target("gpu-h100:1x4").devices()
    temporaries = {
        impl: compiled_train_step(ring_gpu("decoder_only", 4, 4096, impl), devices).memory_analysis().temp_size_in_bytes
        for impl in ("auto", "naive")
    }
    assert temporaries["auto"] < 0.4 * temporaries["naive"], temporaries


def test_what_cudnn_refuses_runs_on_xla_s_path(devices, caplog):
    """ "auto" on an H100 (traced for it, lowered only): bfloat16 with head dim 64 goes to cuDNN; head dim
    20 (cuDNN wants a multiple of 8) and float32 (cuDNN computes in 16 bits) go to XLA's path, each said
    once in the log, never silently."""
    mesh = jax.sharding.Mesh(np.asarray(devices[:1]), ("data",))

    def lowered(dtype, K: int) -> str:
        q = jax.ShapeDtypeStruct((2, T, H, K), dtype)
        attend = lambda q, k, v: dot_product_attention(q, k, v, mask=Mask(causal=True), implementation="auto")
        with jax.set_mesh(mesh):
            return jax.jit(attend).lower(q, q, q).as_text()

    with caplog.at_level(logging.WARNING, logger="jaxformer"):
        assert "__cudnn$fmha" in lowered(jnp.bfloat16, 64)
        assert "__cudnn$fmha" not in lowered(jnp.bfloat16, 20) and "__cudnn$fmha" not in lowered(jnp.float32, 64)
    said = caplog.text
    assert "cuDNN flash attention cannot serve this call" in said and "needs bfloat16 or float16" in said


@pytest.mark.skipif(gpu.nvidia_gpus_here(), reason="an NVIDIA GPU here: JAX runs on it")
def test_a_process_with_the_cuda_plugin_and_no_gpu_runs_on_the_cpu_without_a_traceback():
    """As `jaxformer` starts (train, plan, ...): left alone, JAX would try CUDA first in every process
    and print "Unable to load CUDA" with a traceback before falling back to the CPU."""
    code = "from jaxformer.tpu import compile_only_without_chips as c; c(); import jax; print(jax.default_backend())"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "cpu", out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "Unable to load CUDA" not in out.stderr, out.stderr[-2000:]


def test_each_gpu_description_parses_as_its_chip():
    """Every shipped description parses with this jaxlib's plugin, and its devices are the chip the
    table names for it (memory within the table's figure: the description counts the usable bytes)."""
    from jaxformer import chips

    for name, (chip_name, _) in gpu.SPECS.items():
        devices = gpu.topology_devices(name, 2, 4)
        assert len(devices) == 8 and {d.process_index for d in devices} == {0, 1}
        assert chips.lookup(devices[0].device_kind).name == chip_name, (name, devices[0].device_kind)
        memory = int(re.search(r"device_memory_size: (\d+)", gpu.spec_text(name)).group(1))
        assert 0.95 <= memory / chips.lookup(devices[0].device_kind).memory_bytes <= 1.1


def test_a_scanned_stack_needs_no_more_memory_than_an_unrolled_one_on_h100(devices):
    """As on TPU: remat "auto" keeps a scanned 4-layer stack's temporaries within 5% of the unrolled
    stack's on XLA's GPU compiler. The scanned one is planned through a target of two hosts (one GPU
    each): cuDNN's calls counted, the parameters' and Adam's bytes what the parameter count says
    (float32, data parallel: whole), the bytes moved at least the buffers'."""
    base = tiny_gpu("decoder_only", data=2)
    train = dataclasses.replace(base.train, batch_size=32)  # 16 rows a device: activations dominate
    scanned, unrolled = (
        dataclasses.replace(
            base, model=base.model.replace(num_decoder_layers=4, d_ff=1024, scan_layers=scan), train=train
        )
        for scan in (True, False)
    )
    assert scanned.model.remat == unrolled.model.remat == "auto"
    across = parse_target("gpu-h100:2x1")  # the same two GPUs on two hosts: data parallel across them
    assert across.hosts == 2 and {d.process_index for d in across.devices()} == {0, 1}
    planned = plan(scanned, target=across, largest=False, jobs=1)
    assert planned.chip == "H100 SXM" and planned.devices == 2 and planned.fits and planned.eval_peak > 0
    assert planned.attention_kernels == 3  # the loop's body, once: forward, forward again (remat), backward
    n = count_params(build_model(scanned.model))
    assert 4 * n <= planned.parameters <= 4 * n + 4096
    assert planned.optimizer_state == pytest.approx(2 * planned.parameters, abs=64)  # Adam's mu, nu
    assert "cuDNN fused attention: 3 custom calls" in planned.table()
    assert planned.as_dict()["flops_per_device"] is None  # no cost analysis deviceless: null in --json, not NaN
    # The memory term counts what the program moves: at least every argument read and every output and
    # temporary buffer written once (temporaries are reused buffers: activations move more than that).
    assert planned.bytes_accessed >= planned.arguments + planned.outputs + planned.temporaries
    assert "moved, counted from the compiled program" in planned.table()
    unrolled_temporaries = compiled_train_step(unrolled, devices).memory_analysis().temp_size_in_bytes
    assert planned.temporaries <= 1.05 * unrolled_temporaries, (planned.temporaries, unrolled_temporaries)


def test_the_bytes_a_matmul_moves_are_its_operands_and_result():
    """Without a cost analysis the roofline's memory term is counted from the compiled program: one
    bfloat16 matmul on an H100 (a cuBLAS call) reads its two operands and writes its result, once."""
    from jaxformer.plan import bytes_moved

    device = parse_target("gpu-h100:1x1").devices()[0]
    M, K, N = 1024, 2048, 4096
    one = jax.sharding.SingleDeviceSharding(device)
    a, b = (jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=one) for shape in ((M, K), (K, N)))
    compiled = jax.jit(jnp.dot).lower(a, b).compile()
    assert compiled.cost_analysis() is None or "bytes accessed" not in compiled.cost_analysis()
    assert bytes_moved(compiled.as_text()) == 2 * (M * K + K * N + M * N)


def test_host_offload_moves_bytes_off_the_h100(devices):
    """As on TPU (tests/test_tpu.py): remat "offload_inputs" with train.offload_optimizer, compiled by XLA's
    GPU compiler beside the same step without offload (remat "full"): each layer's input (rows x T x D in
    bfloat16) waits in host memory, Adam's two moments are host arguments, and the device's arguments
    fall by the moments. Without offload nothing is on the host. The device's peak is not asserted: at
    such shapes the update's peak is the same with and without (docs/guides/long-context.md)."""
    from jaxformer.plan import Compiled, lower_train_step

    base = tiny_gpu("decoder_only", data=2)  # 4 rows a GPU
    L, D = 2, base.model.d_model
    mesh = sharding.make_mesh(base.mesh, devices)

    def compiled(remat: str, offload_optimizer: bool):
        model = base.model.replace(num_decoder_layers=L, scan_layers=True, remat=remat)
        train = dataclasses.replace(base.train, offload_optimizer=offload_optimizer)
        lowered, abstract = lower_train_step(dataclasses.replace(base, model=model, train=train), mesh, 8)
        return Compiled.of(lowered), abstract

    (plain, abstract), (offloaded, _) = compiled("full", False), compiled("offload_inputs", True)
    moments = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.opt_state))
    layer_inputs = L * 4 * T * D * 2  # bfloat16
    assert plain.host_arguments == plain.host_temporaries == 0
    assert layer_inputs <= offloaded.host_temporaries <= 2 * layer_inputs  # (the compiler may double-buffer)
    assert moments <= offloaded.host_arguments <= moments + 4096
    assert moments <= plain.arguments - offloaded.arguments <= moments + 4096


ENGINE_STEP = (4, 17, 16, 8)  # the engine step's slots, pool pages, page size, pages a row


def engine_step_on_h100s(target: str, mesh_cfg: MeshConfig, pool_spec: tuple, width: int, verify: bool = False):
    """The serving engine's compiled step (`engine.steps._forward`, one step a call) on `target`'s H100s:
    a one-layer bfloat16 decoder, head dim 64 (4 heads over 2 kv heads), `ENGINE_STEP`'s slots and pages,
    `width` positions a row (`verify`: each position drawing, speculative decoding's check), the pools laid
    out by `pool_spec` over the mesh, everything else replicated.
    Returns (the compiled step, the parameters' abstract state)."""
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxformer.engine import steps as engine_steps
    from jaxformer.layers import without_id_checks

    mesh = sharding.make_mesh(mesh_cfg, parse_target(target).devices())
    mcfg = tiny(
        "decoder_only", vocab_size=64, d_model=64 * H, num_heads=H, num_kv_heads=2, d_ff=256, max_len=128,
        num_decoder_layers=1, attention_impl="auto", dtype="bfloat16",
    )  # fmt: skip
    B, N, page, P = ENGINE_STEP
    whole = NamedSharding(mesh, PartitionSpec())
    spec = lambda dtype, *shape: jax.ShapeDtypeStruct(shape, dtype, sharding=whole)
    pool = jax.ShapeDtypeStruct(
        (mcfg.kv_heads, N, page, mcfg.dim_per_head), mcfg.dtype, sharding=NamedSharding(mesh, PartitionSpec(*pool_spec))
    )
    with sharding.use(mesh, sharding.rules_for(mesh_cfg)):
        graphdef, params = nnx.split(nnx.eval_shape(lambda: without_id_checks(build_model(mcfg))))
        params = with_shardings(params, sharding.state_shardings(params, mesh))
        # seeds, temperature, top-k, top-p, min-p; the EOS id, each row's first position for it
        f32 = spec(np.float32, B)
        sampling = (spec(np.uint32, B), f32, spec(np.int32, B), f32, f32, spec(np.int32), spec(np.int32, B))
        compiled = engine_steps._forward.lower(
            graphdef, params, [{"k": pool, "v": pool}], spec(np.int32, B, P), spec(np.int32, B, width),
            spec(np.int32, B, width), spec(bool, B, width), spec(np.int32, B), sampling, None,
            spec(np.int32, B), steps=1, verify=verify,
        ).compile(NO_TRITON_GEMM)  # fmt: skip
    return compiled, params


def test_the_engine_s_decode_step_reads_pages_by_triton_and_its_prefill_gathers_them_for_cudnn_on_h100():
    """The serving engine's compiled step (`engine.steps._forward`) for one H100, bfloat16, head dim 64 (4 heads
    over 2 kv heads), over page tables of 8 pages of 16. Its decode step [4, 1] reads each row's pages where
    they lie by JAX's Pallas paged-attention kernel for GPUs (a Triton kernel): no gather of pages, no dense
    copy of them, no cuDNN call. A prefill chunk [4, 8] reads each row's pages by XLA's gather of whole pages
    (slices of the 2 kv heads x 16 x 64 values), landing as the dense [B, S, G, K] keys and values that
    cuDNN's fused attention reads, told its causal offset as a [B, 1, T, S] bias. No [B, H, T, S] scores.
    Nothing goes to or from the host inside the step; the pools are updated in place (aliased, not
    copied). The temporaries are cuBLAS's 4 MiB workspace, in whose space the compiler also lays the
    gathered pages (not live at once), and the bfloat16 copies of the float32 weights."""
    found = {}
    for width in (1, 8):  # a decode step, a prefill chunk
        compiled, params = engine_step_on_h100s("gpu-h100:1x1", MeshConfig(), (), width)
        found[width] = compiled.as_text(), compiled.memory_analysis()
    B, N, page, P, G, K = *ENGINE_STEP, 2, 64
    gathered = 2 * B * P * page * G * K * 2  # keys and values, bfloat16
    weights = sum(x.size for x in jax.tree.leaves(params)) * 2  # their bfloat16 copies (float32 parameters)
    workspace = 4 * 2**20  # cuBLAS's, one region for every matmul
    for width in (1, 8):
        text, memory = found[width]
        targets = set(re.findall(r'custom_call_target="([^"]+)"', text))
        gathers = f"slice_sizes={{{G},1,{page * K}}}" in text  # the gather of whole pages, both kv heads
        dense = f"bf16[{B},{P * page},{G},{K}]" in text  # the gathered pages as a dense cache
        if width == 1:  # the Triton paged kernel (Pallas's custom call), neither gather nor cuDNN
            assert targets == {"__cublas$lt$matmul", "__gpu$xla.gpu.triton"}, targets
            assert "paged_attention" in text and not gathers and not dense
        else:  # what cuDNN reads: the gathered pages; the chunk's causal offset, a bias
            assert targets == {"__cublas$lt$matmul", "__cudnn$fmhaScaleBiasSoftmax"}, targets
            assert re.findall(r'mask_type\\?"\s*:\s*\\?"(\w+)', text) == ["NO_MASK"]
            assert gathers and dense and f"bf16[{B},1,{width},{P * page}]" in text
        assert not head_blocks(text, {(width, P * page)})
        assert not re.search(r"S\(5\)|infeed|outfeed|\bsend\(|\brecv\(|MoveTo|pinned_host", text)
        host = (memory.host_argument_size_in_bytes, memory.host_output_size_in_bytes, memory.host_temp_size_in_bytes)
        assert host == (0, 0, 0)
        assert memory.alias_size_in_bytes == 2 * G * N * page * K * 2  # the pools, donated and written in place
        # No [B, H, T, S] block and no copy of a pool: cuBLAS's workspace, the weights in bfloat16, the pages.
        assert workspace <= memory.temp_size_in_bytes <= workspace + weights + gathered, width


def test_speculative_decoding_s_check_reads_the_gathered_pages_by_cudnn_on_h100():
    """The engine's check of drafted tokens (`verify`: [4, 5], a token drawn at every position) compiles for
    one H100 as a prefill chunk does: the pages gathered whole for cuDNN's fused attention, nothing to or
    from the host, the pools written in place, a token for each position."""
    compiled, _ = engine_step_on_h100s("gpu-h100:1x1", MeshConfig(), (), 5, verify=True)
    text, memory = compiled.as_text(), compiled.memory_analysis()
    B, N, page, _, G, K = *ENGINE_STEP, 2, 64
    targets = set(re.findall(r'custom_call_target="([^"]+)"', text))
    assert targets == {"__cublas$lt$matmul", "__cudnn$fmhaScaleBiasSoftmax"}, targets
    assert f"slice_sizes={{{G},1,{page * K}}}" in text  # the gather of whole pages, both kv heads
    assert (memory.host_argument_size_in_bytes, memory.host_output_size_in_bytes) == (0, 0)
    assert memory.alias_size_in_bytes == 2 * G * N * page * K * 2
    assert compiled.out_info[0].shape == (B, 5)


def test_the_engine_s_decode_step_runs_triton_s_paged_kernel_per_shard_of_heads_on_two_h100s():
    """The decode step over pools whose kv heads are split over the tensor axis of two H100s: the Triton
    kernel runs once per shard (in `shard_map`, each device its head of keys and values), the pools keep
    their sharding, and no page is gathered nor any pool gathered whole (the all-gathers are the logits',
    split over the vocabulary, for sampling)."""
    from jax.sharding import PartitionSpec

    compiled, _ = engine_step_on_h100s("gpu-h100:1x2", MeshConfig(tensor=2), ("tensor",), 1)
    (_, N, page, _), G, K = ENGINE_STEP, 2, 64
    text = compiled.as_text()
    assert text.count('custom_call_target="__gpu$xla.gpu.triton"') == 1  # one kernel, each device its shard
    assert f"bf16[1,{N},{page},{K}]" in text and f"bf16[{G},{N},{page},{K}]" not in text  # a head a device
    assert f"slice_sizes={{1,1,{page * K}}}" not in text  # no gather of pages (a pool whole: the line above)
    assert compiled.output_shardings[-1][0]["k"].spec == PartitionSpec("tensor")
