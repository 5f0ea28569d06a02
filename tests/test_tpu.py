"""The TPU compiler (libtpu, `pip install -e ".[tpu]"`) on a v5e:2x2 slice from this machine: each mode's
training, evaluation and cached decoding steps compile for TPU with splash attention in them, the
planner's bytes are what the parameter count and dtypes say, a scanned layer stack needs no more
memory than an unrolled one, a plan for v5p prints no compiler stack trace, and a mesh the slice
cannot hold is refused by name. Skipped without libtpu."""

import dataclasses
import math
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("libtpu")

from jaxformer import build_model, count_params, decode, sharding
from jaxformer.config import Config, ConfigError, DataConfig, DecodeConfig, MeshConfig, TrainConfig, tiny
from jaxformer.plan import Compiled, lower_train_step, parse_target, plan, with_shardings
from jaxformer.state import state_factory
from jaxformer.tpu import accelerator_type

SLICE = "tpu-v5e:2x2"  # 4 chips, the smallest slice libtpu names
T = 128  # splash attention's tile: lengths are multiples of it
OBJECTIVE = {"encoder_only": "mlm", "decoder_only": "lm", "encoder_decoder": "seq2seq"}


def tiny_tpu(mode: str, **mesh) -> Config:
    """One layer per stack, head dim 128, bfloat16, attention left to "auto" (splash on TPU)."""
    layers = dict(num_encoder_layers=0 if mode == "decoder_only" else 1)
    layers |= dict(num_decoder_layers=0 if mode == "encoder_only" else 1)
    model = tiny(
        mode, vocab_size=128, d_model=256, num_heads=2, d_ff=256, max_len=T, dtype="bfloat16",
        attention_impl="auto", **layers,
    )  # fmt: skip
    train = TrainConfig(objective=OBJECTIVE[mode], batch_size=8, optimizer="adamw")
    return Config(model=model, data=DataConfig(max_len=T), train=train, mesh=MeshConfig(**mesh))


@pytest.fixture(scope="module")
def target():
    return parse_target(SLICE)


@pytest.mark.parametrize("mode", ["encoder_only", "decoder_only", "encoder_decoder"])
def test_each_mode_compiles_for_tpu_with_splash_attention(mode, target):
    """Data x tensor parallel over the 4 chips: the training step holds a splash kernel's forward and
    its two backward kernels per attention, evaluation the forward; the planner's parameter and
    Adam-state bytes per chip are the parameter count's float32 bytes split 2 ways by tensor parallelism
    (embeddings, heads, feed-forward) or held whole (norms, biases of D), and the compiler's arguments
    hold them."""
    cfg = tiny_tpu(mode, data=2, tensor=2)
    planned = plan(cfg, target=target, largest=False)
    attentions = {"encoder_only": 1, "decoder_only": 1, "encoder_decoder": 3}[mode]
    assert planned.attention_kernels == 3 * attentions  # forward, dq and dkv of each attention
    assert planned.chip == "TPU v5e" and planned.devices == 4 and planned.eval_peak > 0
    n = count_params(build_model(cfg.model))
    whole = 4 * n  # float32
    assert whole / 2 <= planned.parameters <= whole  # split 2 ways where the tensor axis reaches
    assert planned.optimizer_state == pytest.approx(2 * planned.parameters, abs=64)  # Adam's mu, nu (+ counts)
    batch_bytes = 8 * T * 4 * 5 // 2  # this chip's rows of the int32/float32 batch arrays, at most
    held = planned.parameters + planned.optimizer_state
    assert held <= planned.arguments <= 1.05 * held + batch_bytes + 4096  # within the compiler's padding
    assert planned.fits and planned.step_seconds > 0 and 0 < planned.mfu_ceiling < 1


def test_the_ring_attends_each_block_with_splash(target):
    """Context parallelism over the 4 chips (`ring.fused_kernel` with splash's calls): a decoder-only
    training step over 1,024 positions laid zig-zag (blocks of 256, whose halves are whole tiles)
    compiles with splash kernels inside the ring for each kind of block the layout gives (full,
    causal, and the two halves), forward (its log-sum-exp kept) and backward (dq and dkv, told the
    whole row's statistics), where dense blocks would have none. (`tests/test_ring.py` runs the same
    kernels through Pallas's interpreter against attention over all keys.) Long blocks are where
    this pays: over 8,192 positions (2,048 a chip) the step needs 220 MB of temporaries against
    491 MB with dense blocks (not compiled here: 80 s). The training step alone is compiled, as `plan`
    compiles and counts it, without the evaluation step beside it."""
    base = tiny_tpu("decoder_only", data=1, context=4)
    model = base.model.replace(max_len=1024, context_layout="zigzag")
    cfg = dataclasses.replace(base, model=model, data=dataclasses.replace(base.data, max_len=1024))
    lowered, _ = lower_train_step(cfg, sharding.make_mesh(cfg.mesh, target.devices()), cfg.train.batch_size)
    # each of the 4 kinds: a forward, the forward again where remat recomputes the layer, dq and dkv
    assert Compiled.of(lowered).kernels == 4 * 4


@pytest.mark.parametrize("mode", ["decoder_only", "encoder_decoder"])
def test_cached_decoding_compiles_for_tpu(mode, target):
    """Greedy decoding with the KV cache (a 128-position prefill through splash into 256 slots, then
    one position per step by XLA's path) compiles for the slice, batch over data and heads over tensor
    parallelism."""
    cfg = tiny_tpu(mode, data=2, tensor=2)
    mesh = sharding.make_mesh(cfg.mesh, target.devices())
    rng = jax.eval_shape(lambda: jax.random.key(0))  # abstract: nothing is placed on the slice
    with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
        graphdef, create, _ = state_factory(cfg)
        abstract = jax.eval_shape(create).params
        shardings = sharding.state_shardings(abstract, mesh)
        params = with_shardings(abstract, shardings)
        rows = sharding.batch_sharding(mesh)
        ids = jax.ShapeDtypeStruct((8, T), np.int32, sharding=rows)
        per_row = jax.ShapeDtypeStruct((8,), np.int32, sharding=rows)
        src = (ids, per_row) if mode == "encoder_decoder" else None
        settings = DecodeConfig(strategy="greedy", max_new_tokens=128)
        compiled = decode._generate.lower(
            graphdef, params, ids, per_row, per_row, src, rng,
            settings=settings, num_new=128, length=T + 128, eos_id=1, pad_id=0,
        ).compile()  # fmt: skip
    assert "tpu_custom_call" in compiled.as_text()  # the prefill's splash kernel


def test_a_scanned_stack_needs_no_more_memory_than_an_unrolled_one(target):
    """remat "auto" keeps a scanned stack's temporaries at the unrolled stack's or below: in a scan it
    keeps matmul outputs only. (With remat "none" a scan stores every value of every layer that the
    backward pass reads: 3.4x the unrolled temporaries at these shapes.) The training step alone is
    compiled, as `plan` compiles it (its `temporaries` are these), without the evaluation step beside it."""
    base = tiny_tpu("decoder_only", data=4)
    train = dataclasses.replace(base.train, batch_size=64)  # 16 rows a chip: activations dominate
    mesh = sharding.make_mesh(base.mesh, target.devices())
    temporaries = {}
    for scan in (False, True):
        model = base.model.replace(num_decoder_layers=4, d_ff=1024, scan_layers=scan)
        assert model.remat == "auto"
        lowered, _ = lower_train_step(dataclasses.replace(base, model=model, train=train), mesh, train.batch_size)
        temporaries[scan] = Compiled.of(lowered).temporaries
    assert temporaries[True] <= 1.05 * temporaries[False]


def test_a_plan_on_a_slice_with_sparsecores_prints_no_compiler_stack_trace(capfd):
    """v5p's compiler offloads the embedding gather (vocabulary 2048 x 128 columns a chip, 2048 ids) to
    the SparseCores as async ops whose compiled text jaxlib's HLO reader refuses: asking for it printed
    an "async-update instruction should have 1 operands but sees 3" RET_CHECK and a C++ stack trace per
    step. The plan counts kernels in the lowered program instead; the compiler's figures are unchanged."""
    base = tiny_tpu("decoder_only", fsdp=8)
    model = base.model.replace(d_model=1024, vocab_size=2048)
    cfg = dataclasses.replace(base, model=model, train=dataclasses.replace(base.train, batch_size=16))
    capfd.readouterr()
    planned = plan(cfg, target=parse_target("tpu-v5p:2x2x2"), largest=False)
    err = capfd.readouterr().err
    assert "Begin stack trace" not in err and "RET_CHECK" not in err, err
    assert planned.attention_kernels == 3  # splash forward, dq, dkv: as counted in the compiled text
    # The compiler's figures are whole: the parameters (float32) and Adam's two moments over 8 chips
    # of FSDP are in its arguments, and its FLOPs are the model's (matmuls: 6 x parameters x tokens).
    n = count_params(build_model(cfg.model))
    assert 4 * n / 8 <= planned.parameters <= 1.01 * 4 * n / 8 + 4096
    assert planned.optimizer_state == pytest.approx(2 * planned.parameters, rel=0.01)
    held = planned.parameters + planned.optimizer_state
    assert held <= planned.arguments <= 1.05 * held + 16 * T * 4 * 3 and planned.peak > planned.arguments
    assert planned.fits and planned.eval_peak > 0
    assert 0.8 <= planned.flops_per_device * planned.devices / planned.model_flops <= 1.5


def test_a_mesh_the_slice_cannot_hold_is_refused_by_name():
    cmd = [sys.executable, "-m", "jaxformer.cli", "plan", "--config", "experiments/lm_shakespeare.py"]
    out = subprocess.run([*cmd, "--target", SLICE, "--set", "mesh.fsdp=3"], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "accelerator type" not in out.stderr  # libtpu's warning, answered with the slice's name
    assert "mesh" in out.stderr and "fsdp" in out.stderr and "tpu-v5e:2x2 has 4 chips" in out.stderr
    bad = subprocess.run([*cmd, "--target", "tpu-v9z:2x2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "tpu-v9z:2x2" in bad.stderr and "Traceback" not in bad.stderr
    names = {"v4:2x2x1": "v4-8", "v5p:4x4x4": "v5p-128", "v5e:16x16": "v5litepod-256", "v6e:8x8": "v6e-64"}
    assert {t: accelerator_type(t) for t in names} == names and accelerator_type("v4") is None
    with pytest.raises(ConfigError, match="gpu-CHIPxN"):
        parse_target("gpu-nonesuchx8")
    assert parse_target("gpu-h100x8").chip.name == "H100 SXM" and math.isclose(parse_target("gpu-h100x8").count, 8)


def test_profiling_stands_down_in_a_process_that_compiled_for_a_slice(target, tmp_path):
    """JAX's profiler crashes the process (segmentation fault) once libtpu is loaded for compile-only
    devices, as here: a run asked to profile says so and trains on without a trace."""
    from jaxformer.observe import Profiler

    profiler = Profiler(tmp_path, (0, 1))
    with pytest.warns(UserWarning, match="no profile: this process compiled for a TPU slice"):
        profiler.before(0)
    profiler.after(0, None)
    profiler.stop()
    assert not (tmp_path / "profile").exists()


def test_a_moe_plan_counts_the_collectives_of_expert_parallelism(capfd):
    """A decoder with MoE layers on v5p (8 chips, experts split 4 ways): the plan reads the training
    step's collectives from the compiled program, which the compiler writes out itself (jaxlib cannot
    read v5p's compiled text back), with no stack trace; the tokens travel to their experts' chips and
    back by the MoE layer's explicit all-to-all (dispatch and combine, forward and backward: 4 a
    layer), and the gradients are reduced. A plan without an expert axis does not count them."""
    from jaxformer.config import MoEConfig

    moe = MoEConfig(num_experts=8, experts_per_token=2, capacity_factor=1.25)
    base = tiny_tpu("decoder_only", data=2, expert=4)
    cfg = dataclasses.replace(base, model=base.model.replace(moe=moe))
    capfd.readouterr()
    planned = plan(cfg, target=parse_target("tpu-v5p:2x2x2"), largest=False, jobs=1)
    err = capfd.readouterr().err
    assert "Begin stack trace" not in err and "RET_CHECK" not in err, err
    moved = planned.collectives
    assert set(moved) == {"all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute"}
    assert moved["all-reduce"][1] > 0 and sum(b for b, _ in moved.values()) > 0
    assert moved["all-to-all"][1] == 4 * cfg.model.num_decoder_layers, moved
    assert "collectives        per step: " in planned.table()


def test_host_offload_moves_bytes_off_the_device(target):
    """remat "offload_inputs" and train.offload_optimizer, compiled by the TPU compiler beside the same
    step without offload (remat "full"): each layer's input (rows x T x D in bfloat16) waits in host
    memory, Adam's two moments become host arguments, the device's arguments fall by the moments to
    the parameters and the batch, and the compiler's estimate of the device's peak falls. Without
    offload nothing is on the host.

    Not asserted: the device's temporaries. At this shape they rise with offload (4.5 -> 5.2 MB with
    "offload_inputs" alone: the transfers' buffers outweigh 0.5 MB of layer inputs; "offload_dots"
    against "dots_saveable" likewise, 4.6 -> 7.0 MB), where the guide's larger step shows them fall.
    (On CPU nothing moves: tests/test_train.py checks the values.)"""
    from jaxformer.plan import Compiled, lower_train_step

    base = tiny_tpu("decoder_only", data=4)  # 2 rows a chip
    L, D = 4, base.model.d_model
    mesh = sharding.make_mesh(base.mesh, target.devices())

    def compiled(remat: str, offload_optimizer: bool):
        model = base.model.replace(d_ff=4 * D, num_decoder_layers=L, scan_layers=True, remat=remat)
        train = dataclasses.replace(base.train, offload_optimizer=offload_optimizer)
        lowered, abstract = lower_train_step(dataclasses.replace(base, model=model, train=train), mesh, 8)
        return Compiled.of(lowered), abstract

    (plain, abstract), (offloaded, _) = compiled("full", False), compiled("offload_inputs", True)
    size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    params, moments, batch = size(abstract.params), size(abstract.opt_state), 2 * T * 4 * 3  # data=4: all whole
    layer_inputs = L * 2 * T * D * 2  # bfloat16
    assert plain.host_arguments == plain.host_temporaries == 0
    assert layer_inputs <= offloaded.host_temporaries <= 2 * layer_inputs  # (the compiler may double-buffer)
    assert moments <= offloaded.host_arguments <= moments + 4096
    assert moments <= plain.arguments - offloaded.arguments <= moments + 4096
    assert params <= offloaded.arguments <= params + batch + 4096  # no moments on the device between steps
    assert 0 < offloaded.compiler_peak < plain.compiler_peak
