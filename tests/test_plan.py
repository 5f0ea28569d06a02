"""`jaxformer plan` against the real thing: on an 8-device CPU mesh, its per-device bytes equal those
of the arrays training creates and of the step it compiles, and its largest batch is the edge of fit;
the search for that edge against memory curves that bend as a TPU compiler's do; the plan cache; a
context axis cutting the planned activations."""

import json
import math
import subprocess
import sys
import types

import processes
import pytest

SMALL = [
    "model.d_model=64", "model.num_heads=4", "model.d_ff=128", "model.num_decoder_layers=2", "model.max_len=64",
    "data.max_len=64", "train.batch_size=16",
]  # fmt: skip

WORKER = """
import json, sys
import jax, numpy as np
from jaxformer import sharding
from jaxformer.config import apply_overrides, load_experiment
from jaxformer.plan import plan
from jaxformer.state import init_state
from jaxformer.train import jit_steps, make_steps

cfg = apply_overrides(load_experiment("experiments/lm_shakespeare.py"), sys.argv[1:])
planned = plan(cfg)
mesh = sharding.make_mesh(cfg.mesh)
with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
    graphdef, state, optimizer = init_state(cfg, mesh)  # real, sharded arrays
    train, _ = jit_steps(*make_steps(graphdef, cfg, optimizer), state, mesh)
    B, T = cfg.train.batch_size, cfg.data.max_len
    batch = sharding.global_batch(
        {"inputs": np.ones((B, T), np.int32), "targets": np.ones((B, T), np.int32),
         "weights": np.ones((B, T), np.float32)}, mesh, B)
    real = train.lower(state, batch).compile().memory_analysis()
on_device0 = lambda tree: sum(next(s.data.nbytes for s in x.addressable_shards if s.device == jax.devices()[0])
                              for x in jax.tree.leaves(tree))
device_memory = planned.peak * 3
edge = plan(cfg, device_memory=device_memory, within=0)  # to one batch step
over = plan(cfg, device_memory=device_memory, batch_size=edge.largest_batch + 8, largest=False)
print(json.dumps({
    "planned": [planned.parameters, planned.optimizer_state, planned.arguments, planned.temporaries],
    "real": [on_device0(state.params), on_device0(state.opt_state), real.argument_size_in_bytes,
             real.temp_size_in_bytes],
    "largest": edge.largest_batch, "fits_at_largest": plan(cfg, device_memory, edge.largest_batch, largest=False).fits,
    "fits_past_it": over.fits, "refused": edge.refused_batch,
}))
"""


def test_plan_equals_the_arrays_and_step_of_real_training_on_8_devices(on_8_devices):
    r = on_8_devices["real"]
    assert r["planned"] == r["real"]  # parameters, optimizer state, compiled arguments and temporaries
    assert r["largest"] > 16 and r["largest"] % 8 == 0
    assert r["fits_at_largest"] and not r["fits_past_it"] and r["refused"] == r["largest"] + 8


CONTEXT_WORKER = """
import json, sys
from jaxformer.config import apply_overrides, load_experiment
from jaxformer.plan import plan
base = apply_overrides(load_experiment("experiments/lm_shakespeare.py"), sys.argv[1:])
planned = {name: plan(apply_overrides(base, mesh), largest=False) for name, mesh in
           {"rows": ["mesh.data=8"], "context": ["mesh.data=1", "mesh.context=8"]}.items()}
print(json.dumps({name: [p.activations, p.mesh] for name, p in planned.items()}))
"""

# Both workers in one process on 8 CPU devices (the count is fixed when JAX starts), one after the
# other, each given its own arguments; each prints its result as one JSON line.
RUNS = {
    "real": (WORKER, [*SMALL, "mesh.data=2", "mesh.fsdp=4"]),
    # 8 rows of 256 tokens (after SMALL's settings: they win)
    "context": (CONTEXT_WORKER, [*SMALL, "model.max_len=256", "data.max_len=256", "train.batch_size=8"]),
}
DRIVER = """
import json, sys
for script, argv in json.loads(sys.argv[1]):
    sys.argv = ["-c", *argv]
    exec(compile(script, "<worker>", "exec"), {"__name__": "__main__"})
"""


@pytest.fixture(scope="module")
def on_8_devices() -> dict:
    """Each of RUNS's workers' results, by name."""
    env = processes.cpu_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = processes.run([sys.executable, "-c", DRIVER, json.dumps(list(RUNS.values()))], env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(RUNS), out.stdout[-3000:]
    return {name: json.loads(line) for name, line in zip(RUNS, lines, strict=True)}


def test_a_context_axis_cuts_the_planned_activations_of_long_rows(on_8_devices):
    """8 rows of 256 tokens on 8 devices, a row a device (data=8) or each row split 8 ways (context=8):
    a device holds as many tokens either way, but its attention scores fall from a row's [H, T, T] to
    the ring's [rows, H, T/8, T/8] blocks, so the plan's activations a device fall."""
    r = on_8_devices["context"]
    assert r["rows"][1] == {"data": 8, "fsdp": 1, "tensor": 1} and r["context"][1]["context"] == 8
    assert 0 < r["context"][0] < 0.75 * r["rows"][0], r


def test_plan_command_prints_json_and_says_what_does_not_fit(tmp_path):
    """`plan --devices 4` starts itself again with 4 CPU devices (the refused mesh below goes that way);
    the two plans are given the devices in XLA_FLAGS already, as the command passes them on, and plan in
    the process they start in (one interpreter's start each, not two)."""
    cmd = ["-m", "jaxformer.cli", "plan", "--config", "experiments/lm_shakespeare.py", "--devices", "4"]
    sets = [a for s in [*SMALL, "mesh.fsdp=4"] for a in ("--set", s)]
    env = processes.cpu_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")
    out = processes.run([sys.executable, *cmd, *sets, "--json"], env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    planned = json.loads(out.stdout)
    assert planned["devices"] == 4 and planned["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert planned["parameters"] > 0 and planned["peak"] >= planned["arguments"]
    tight = processes.run([sys.executable, *cmd, *sets, "--device-memory", "1MB"], env=env)
    assert tight.returncode == 1 and "does NOT fit" in tight.stdout and "even the smallest batch" in tight.stdout
    bad = subprocess.run([sys.executable, *cmd, "--set", "mesh.fsdp=3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "mesh" in bad.stderr and "Traceback" not in bad.stderr


GIB = 2**30


def tpu_like(edge: int, memory: float, rounds: list):
    """A TPU compiler's peaks for a round of batches: a fixed part and a slope that grows with B below
    the edge (small batches understate the rows' memory); above it, a refusal whose figure
    understates the excess (rematerialisation flattens it), or gives none past twice the edge."""

    def peak(batch: int) -> float:
        fits = 0.8 * GIB + 0.2 * GIB * batch / edge + (memory - GIB) * (batch / edge) ** 1.2
        if batch <= edge:
            return fits
        return memory + 0.3 * (fits - memory) if batch < 2 * edge else math.inf

    def peaks_at(batches: list[int]) -> list[float]:
        rounds.append(batches)
        return [peak(b) for b in batches]

    return peaks_at


@pytest.mark.parametrize("edge", [100_352, 7_168, 131_072])
def test_the_largest_batch_search_brackets_the_edge_within_its_tolerance_in_few_compiles(edge):
    """One compile at a time, then two side by side (the next try beside the one that would follow
    it): the same bracket, in fewer rounds."""
    from jaxformer.plan import _largest_batch

    memory, shards = 30.75 * GIB, 128
    rounds = {1: [], 2: []}
    for jobs, tried in rounds.items():
        fits, over = _largest_batch(tpu_like(edge, memory, tried), shards, memory, 256, within=0.02, jobs=jobs)
        assert fits <= edge < over and fits % shards == 0 and over - fits <= 0.02 * over
        compiles = [b for batches in tried for b in batches]
        assert len(compiles) == len(set(compiles)) and all(len(batches) <= jobs for batches in tried)
        assert compiles[:2] == [256, 512]  # the configured batch, then its double
    assert len(rounds[1]) <= 10 and len(rounds[2]) <= 6 and len(rounds[2]) < len(rounds[1]), rounds
    exact, above = _largest_batch(tpu_like(edge, memory, []), shards, memory, start=256, within=0.0, jobs=2)
    assert exact == edge // shards * shards and above == exact + shards


def test_the_search_is_not_misled_by_a_compiler_that_rematerialises_over_its_limit():
    """XLA's GPU compiler never refuses: past its own limit it rematerialises, so a batch just above the
    limit can peak below one just under it (the 1.3B shape on 8 H100s: 78.4 GB at 2936, 72.5 GB at
    2944). The search extends the line through the rising points, not the falling pair: the edge in
    four rounds, no try past it by more than a fifth (it once doubled to 5888 and 11776)."""
    import numpy as np

    from jaxformer.plan import _largest_batch

    memory, tried = 80e9, []

    def peak(batch: int) -> float:  # the compiler's peaks at 512, 1024, 2936; then from 2944 to 3312
        if batch <= 2936:
            return float(np.interp(batch, [512, 1024, 2936], [16.343e9, 29.769e9, 78.378e9]))
        return 72.481e9 + (80.034e9 - 72.481e9) * (batch - 2944) / (3264 - 2944)

    def peaks_at(batches: list[int]) -> list[float]:
        tried.append(batches)
        return [peak(b) for b in batches]

    fits, over = _largest_batch(peaks_at, 8, memory, start=512, within=0.02, jobs=2)
    assert peak(fits) <= memory < peak(over) and over - fits <= 0.02 * over
    assert len(tried) <= 4 and max(b for batches in tried for b in batches) < 1.2 * over, tried


@pytest.mark.parametrize(
    "dtype, flops, model_flops, accessed, step, mfu",
    [
        ("bfloat16", 2e12, 4e12, 1e9, 2e12 / 100e12, 1.0),  # compute-bound: 20 ms of FLOPs, 1 ms of bytes
        ("bfloat16", 1e11, 4e12, 1e9, 2e12 / 100e12, 1.0),  # XLA counted a scanned loop's body once: the model's
        ("float32", math.nan, 2e12, 1e12, 1e12 / 1e12, 2e12 / (2 * 50e12 * 1.0)),  # no cost analysis; memory-bound
    ],
)
def test_the_roofline_is_the_slower_of_compute_and_memory(dtype, flops, model_flops, accessed, step, mfu):
    """By hand, on a made-up chip of 100 TFLOP/s in bfloat16, 50 in float32 and 1 TB/s, two devices."""
    from jaxformer.chips import Chip
    from jaxformer.plan import roofline

    chip = Chip("made-up", bfloat16=100e12, float32=50e12, memory_bytes=1e9, bandwidth=1e12, source="this test")
    got = roofline(chip, dtype, flops, model_flops, accessed, devices=2, tokens=1000)
    assert got["step_seconds"] == max(got["compute_seconds"], got["memory_seconds"]) == pytest.approx(step)
    assert got["memory_seconds"] == pytest.approx(accessed / 1e12)
    assert got["tokens_per_second"] == pytest.approx(1000 / step) and got["mfu_ceiling"] == pytest.approx(mfu)


def test_a_refusal_gives_the_peak_it_implies():
    from jaxformer.plan import _refused_bytes

    said = (
        "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required for "
        "HLO temporaries (42.47G) exceeds available HBM (30.75G). HLO module: jit_train_step."
    )
    assert _refused_bytes(said, 32 * GIB) == pytest.approx((32 + 42.47 - 30.75) * GIB)
    assert _refused_bytes("RESOURCE_EXHAUSTED: out of memory", 32 * GIB) == math.inf


def test_a_second_plan_of_the_same_program_reads_the_figures_back(tmp_path, monkeypatch):
    """The plan cache holds each compiled step's figures under its program and devices: the same
    plan again compiles nothing and says the same; another batch is another program; an empty
    JAXFORMER_PLAN_CACHE keeps nothing."""
    from jaxformer.config import apply_overrides, load_experiment
    from jaxformer.plan import plan

    monkeypatch.setenv("JAXFORMER_PLAN_CACHE", str(tmp_path))
    cfg = apply_overrides(load_experiment("experiments/lm_shakespeare.py"), SMALL)
    first = plan(cfg, largest=False)
    assert first.cached_steps == 0 and first.compile_seconds > 0 and len(list(tmp_path.glob("*.json"))) == 2
    again = plan(cfg, largest=False)
    assert again.cached_steps == 2 and again.compile_seconds == 0
    timing = {"compile_seconds", "cached_steps"}
    assert {k: v for k, v in vars(again).items() if k not in timing} == {
        k: v for k, v in vars(first).items() if k not in timing
    }
    other = plan(cfg, batch_size=8, largest=False)
    assert other.cached_steps == 0 and other.temporaries != first.temporaries
    monkeypatch.setenv("JAXFORMER_PLAN_CACHE", "")
    assert plan(cfg, largest=False).cached_steps == 0 and len(list(tmp_path.glob("*.json"))) == 4


def test_kernels_are_counted_per_call_as_the_compiler_inlines_the_program():
    """A function's Pallas calls count once per call of it, through nested calls; a loop body's once."""
    from jaxformer.plan import kernel_calls

    lowered = """module @jit_train {
  func.func public @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @layer(%arg0) : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @layer(%0) : (tensor<8xf32>) -> tensor<8xf32>
    %2 = stablehlo.while(%iterArg = %1) : tensor<8xf32>
      %3 = func.call @_splash_attention(%iterArg) : (tensor<8xf32>) -> tensor<8xf32>
    return %2 : tensor<8xf32>
  }
  func.func private @layer(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = func.call @_splash_attention(%arg0) : (tensor<8xf32>) -> tensor<8xf32>
    %1 = stablehlo.custom_call @tpu_custom_call(%0) {backend_config = "tpu_custom_call"}
    return %1 : tensor<8xf32>
  }
  func.func private @_splash_attention(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.custom_call @tpu_custom_call(%arg0) : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}"""
    assert kernel_calls(lowered) == 2 * (1 + 1) + 1
    assert kernel_calls("module {}") == 0


def test_gpu_targets_are_read_and_fall_back_to_fake_cpus_without_the_gpu_compiler(monkeypatch):
    """gpu-GPU:HOSTSxGPUS names hosts and GPUs; the old gpu-CHIPxN is one host of N. Without JAX's CUDA
    plugin (or for a GPU XLA has no description of here) the plan takes that many fake CPU devices and
    says why in one line; with it, XLA's GPU compiler. Names it cannot read are refused with the forms."""
    from jaxformer import gpu
    from jaxformer.config import ConfigError
    from jaxformer.plan import parse_target

    monkeypatch.setattr(gpu, "has_gpu_compiler", lambda: False)
    h100 = parse_target("gpu-h100:4x8")
    assert (h100.chip.name, h100.count, h100.hosts, h100.fake_cpus) == ("H100 SXM", 32, 4, True)
    assert (
        h100.note.count("\n") == 0 and "pip install 'jaxformer[gpu-plan]'" in h100.note and "32 fake CPU" in h100.note
    )
    old = parse_target("gpu-a100-80gbx4")
    assert (old.chip.name, old.count, old.hosts, old.fake_cpus) == ("A100 80GB", 4, 1, True)
    monkeypatch.setattr(gpu, "has_gpu_compiler", lambda: True)
    names = {"gpu-h100:1x8": "h100", "gpu-H200:2x4": "h200", "gpu-a100-40g:1x2": "a100-40g", "gpu-h100x8": "h100"}
    assert {name: parse_target(name).gpu for name in names} == names
    assert parse_target("gpu-h100:2x4").fake_cpus is False and parse_target("gpu-h100:2x4").note is None
    l4 = parse_target("gpu-l4x2")  # in the chip table, not among XLA's descriptions here
    assert l4.fake_cpus and "no description of the L4" in l4.note
    for bad in ("gpu-h300:1x8", "gpu-h100:0x8", "gpu-nonesuchx8"):
        with pytest.raises(ConfigError, match="gpu-GPU:HOSTSxGPUS"):
            parse_target(bad)


def test_collectives_are_counted_by_kind_from_the_compiled_text():
    """Each op's result buffers, in bytes of its dtype; an async op counted once, at its `-done`; a
    tuple as long as the TPU compiler's gradient all-reduces (its elements numbered from the 6th)."""
    from jaxformer.plan import collective_bytes

    text = """
  %all-to-all.10 = (f32[1,2,40,128]{3,2,1,0}, f32[1,2,40,128]{3,2,1,0}) all-to-all(%a, %b), dimensions={0}
  %ar = bf16[64,32]{1,0} all-reduce(%g), to_apply=%add
  %ar.2 = (f32[]{:T(128)}, f32[8]{0:T(128)}, f32[], f32[], f32[], /*index=5*/f32[2,3]{1,0:T(8,128)}) all-reduce(%a)
  %cp-start = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%x), source_target_pairs={{0,1}}
  %cp-done = f32[8]{0} collective-permute-done(%cp-start)
  %fusion = f32[8]{0} fusion(%cp-done), kind=kLoop, calls=%all-gather-like
"""
    got = collective_bytes(text)
    assert got["all-to-all"] == (2 * 2 * 40 * 128 * 4, 1)
    assert got["all-reduce"] == (64 * 32 * 2 + (4 + 8 * 4 + 3 * 4 + 6 * 4), 2)  # a long tuple numbers its elements
    assert got["collective-permute"] == (8 * 4, 1)
    assert got["all-gather"] == (0, 0) and got["reduce-scatter"] == (0, 0)


def test_bytes_moved_counts_what_xla_s_cost_analysis_counts_and_a_loop_once_a_trip():
    """Where XLA gives its cost analysis (here, the CPU compiler), the count from the compiled text
    agrees with it: a matmul's bytes exactly, and a scan of L matmuls with the loop's body counted once
    (as XLA counts it) to within its scalars. `bytes_moved` counts the body once per trip instead: its
    growth from 3 to 6 layers is 3 trips of the body, each at least the layer's input and weights read
    and its output written (a dynamic slice of the stacked weights counted as the slice, not the stack)."""
    import jax
    import jax.numpy as jnp

    from jaxformer.plan import bytes_moved, hlo_ops

    M, K = 64, 128
    xla = lambda compiled: compiled.cost_analysis()["bytes accessed"]
    a, b = jax.ShapeDtypeStruct((M, K), jnp.float32), jax.ShapeDtypeStruct((K, 2 * K), jnp.float32)
    matmul = jax.jit(jnp.dot).lower(a, b).compile()
    assert bytes_moved(matmul.as_text()) == xla(matmul) >= 4 * (M * K + K * 2 * K + M * 2 * K)

    def stack(x, w):  # [M, K] through L layers [L, K, K]
        return jax.lax.scan(lambda x, w_l: (jnp.tanh(x @ w_l), None), x, w)[0]

    moved, body = {}, {}
    for L in (3, 6):
        compiled = jax.jit(stack).lower(a, jax.ShapeDtypeStruct((L, K, K), jnp.float32)).compile()
        ops = hlo_ops(compiled.as_text())
        assert sum(once for _, once, _ in ops) == pytest.approx(xla(compiled), abs=256)
        moved[L], body[L] = bytes_moved(compiled.as_text()), sum(once for _, once, times in ops if times == L)
    assert body[3] == body[6] >= 4 * (2 * M * K + K * K)
    assert moved[6] - moved[3] == 3 * body[3]
    assert body[6] < 4 * 6 * K * K  # a trip reads the slice, not the whole [6, K, K] stack


def test_plan_search_compiles_each_split_and_names_the_one_with_the_smallest_bound():
    """Three splits of 2 fake H100s (2 layers of width 32, one head: no tensor axis): FSDP, data, and
    2 stages of 4 micro-batches (of 4 S, 2 S, S, the most that a batch of 4 divides). Each row's bound
    is the largest of its floors, its bubble and stage traffic are the formulas', the pipeline's
    compute is the others' over 1 - bubble, and the best is the fitting row with the smallest bound."""
    tiny = ["model.d_model=32", "model.num_heads=1", "model.d_ff=64", "model.num_decoder_layers=2",
            "model.max_len=32", "data.max_len=32", "train.batch_size=4", "model.vocab_size=64"]  # fmt: skip
    cmd = ["-m", "jaxformer.cli", "plan", "--config", "experiments/lm_shakespeare.py", "--target", "gpu-h100x2"]
    env = processes.cpu_env(JAXFORMER_PLAN_CACHE="")
    out = processes.run([sys.executable, *cmd, "--search", *[a for s in tiny for a in ("--set", s)]], env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["split", "state GB", "peak GB", "fits", "bubble", "stage GB moved", "compute s", "memory s",
                    "links s", "bound s"]  # fmt: skip
    rows = {}
    for line in lines[2:-1]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].replace(" **best**", "")] = dict(zip(head, cells, strict=True))
    assert set(rows) == {"S1 d1 f2 t1 M1", "S1 d2 f1 t1 M1", "S2 d1 f1 t1 M4"}
    value = lambda row, col: float(rows[row][col])
    for name, row in rows.items():
        assert row["fits"] == "yes" and float(row["peak GB"]) >= float(row["state GB"]) > 0
        floors = [value(name, c) for c in ("compute s", "memory s", "links s")]
        assert value(name, "bound s") == pytest.approx(max(floors), rel=1e-2)
    assert value("S2 d1 f1 t1 M4", "bubble") == pytest.approx(1 / 5, abs=5e-3)  # (S - 1) / (M + S - 1)
    assert value("S2 d1 f1 t1 M4", "compute s") * (1 - 1 / 5) == pytest.approx(
        value("S1 d1 f2 t1 M1", "compute s"), rel=1e-2
    )
    # 2 (M + S - 1) ticks, one way and back, of a micro-batch of 1 row x 32 positions x 32 float32 widths
    assert value("S2 d1 f1 t1 M4", "stage GB moved") == pytest.approx(2 * 5 * 1 * 32 * 32 * 4 / 1e9, rel=1e-2)
    best = min(rows, key=lambda name: value(name, "bound s"))
    assert "**best**" in next(line for line in lines if line.startswith(f"| {best}"))
    assert lines[-1].startswith(f"best: {best} (")


def test_the_plan_cache_key_names_every_cuda_major_s_compiler(monkeypatch):
    """A CUDA 13 plugin's version is in the key as a CUDA 12 one is: upgrading either compiles again."""
    import importlib.metadata

    import jax

    from jaxformer import sharding
    from jaxformer.config import MeshConfig
    from jaxformer.plan import compile as plan_compile

    real = importlib.metadata.distributions
    lowered = jax.jit(lambda x: x + 1).lower(1.0)
    mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])

    def key_with(version):
        plugin = types.SimpleNamespace(metadata={"Name": "jax_cuda13_plugin"}, version=version)  # as installed
        monkeypatch.setattr(importlib.metadata, "distributions", lambda: [*real(), plugin])
        return plan_compile.compiler_versions(), plan_compile._cache_key(lowered, mesh)

    (versions, old), (_, new) = key_with("0.10.2"), key_with("0.11.0")
    assert versions["jax-cuda13-plugin"] == "0.10.2" and versions["jax"] == jax.__version__
    assert old != new
