"""Plan before you launch: compile the training step ahead of time for the configured mesh and
report, per device, what it holds and whether it fits.

Nothing is allocated: the state is abstract (shapes, dtypes and shardings), and `jit(...).lower(...)
.compile()` runs XLA's real partitioner and scheduler for the mesh. Two kinds of devices:

- a TPU slice (`--target tpu-v5p:4x4x4`, any topology libtpu names): with `jaxformer[tpu]` installed,
  libtpu's compile-only devices of that slice, on any machine; the TPU compiler itself decides the
  buffers, so the bytes are the slice's own.
- NVIDIA GPUs (`--target gpu-h100:1x8`, hosts x GPUs a host; gpu-h200, gpu-a100-40g, gpu-a100-80g):
  with `jaxformer[gpu-plan]` installed, XLA's GPU compiler for compile-only CUDA devices of XLA's
  description of that GPU, on any machine (`jaxformer.gpu`); cuDNN's fused attention is in the step.
  That compiler gives no cost analysis without a device: the FLOPs are the model's, and the bytes
  accessed are counted from the compiled program (`bytes_moved`: each op's operands read and result
  written once, a loop's body once a trip).
- fake CPU devices (`--devices 64`, or a GPU target without the GPU compiler: N of them with the
  chip's memory and peak from the chip table). XLA's CPU compiler decides the buffers; a GPU's
  compiler fuses and schedules differently, so read those figures as the program's shape, not a
  promise to the byte.

With a chip (a target, or a table entry for the devices), the plan adds a roofline lower bound on
the step time (the larger of FLOPs / peak and bytes accessed / memory bandwidth, both per chip from
the compiler's cost analysis, or the model's FLOPs and the bytes counted from the compiled program
where it gives none), the tokens/s it implies and the MFU it leaves as a ceiling.

The figures of each compiled step are kept on disk (`cache_dir()`): the TPU compiler takes from
half a minute to two minutes per step of a real model, and the same plan again reads them back.

    jaxformer plan --config experiments/paper_base_en_de.py --target tpu-v4:4x4x8
    jaxformer plan --config experiments/gpt2_1p3b.py --target gpu-h100:1x8
    jaxformer plan --config experiments/paper_base_en_de.py --devices 8 --set mesh.fsdp=8 --device-memory 80GB
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import time

import jax

from jaxformer import chips, observe, sharding
from jaxformer.config import Config, ConfigError
from jaxformer.plan.compile import (
    Compiled,
    _cache_key,
    _cache_read,
    _cache_write,
    _give_back_memory,
    _shard_bytes,
    abstract_batch,
    cache_dir,
    lower_train_step,
    with_shardings,
)
from jaxformer.plan.hlo import (
    COLLECTIVES,
    DTYPE_BYTES,
    HLO_INSTRUCTION,
    HLO_PLUMBING,
    HLO_SLICING,
    KERNEL_CALL,
    bytes_moved,
    collective_bytes,
    cudnn_calls,
    hlo_ops,
    kernel_calls,
    parse_hlo,
    shape_bytes,
)
from jaxformer.plan.search import _largest_batch, _refused_bytes
from jaxformer.plan.targets import Target, parse_bytes, parse_target
from jaxformer.state import state_factory, state_shardings
from jaxformer.train import flops_per_example, make_steps

# The names of the module this package was, wherever they now live (users import them from here).
__all__ = [
    "COLLECTIVES",
    "DTYPE_BYTES",
    "HLO_INSTRUCTION",
    "HLO_PLUMBING",
    "HLO_SLICING",
    "KERNEL_CALL",
    "Compiled",
    "Target",
    "abstract_batch",
    "bytes_moved",
    "cache_dir",
    "collective_bytes",
    "cudnn_calls",
    "hlo_ops",
    "kernel_calls",
    "lower_train_step",
    "parse_bytes",
    "parse_hlo",
    "parse_target",
    "shape_bytes",
    "with_shardings",
]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-device bytes of one compiled training step, and what follows for a device memory.

    Attributes:
        devices: the number of devices planned for.
        mesh: the mesh's axis sizes, by name.
        batch_size: the global batch the figures are for.
        parameters: this device's shards of the trained parameters (LoRA: the adapters)
        optimizer_state: this device's shards of the optimizer state, bytes.
        gradients: the parameters' size: float32 gradients, sharded alike
        activations: XLA's temporaries less the gradients: activations kept for the backward pass, workspace
        arguments: XLA's memory analysis of the compiled step, per device
        outputs: the step's outputs, bytes per device.
        aliased: outputs written into donated arguments
        temporaries: XLA's temporaries, bytes per device.
        code: the compiled program, bytes.
        peak: arguments + outputs - aliased + temporaries + code
        flops_per_device: XLA's cost analysis of the partitioned step (NaN: none, a deviceless GPU compile)
        model_flops: the model's FLOPs per step, all devices (3 x forward, as MFU counts them)
        device_memory: the memory of one device, bytes (None: not known).
        fits: whether the peak fits in device_memory (None: not known).
        largest_batch: the largest batch (a multiple of the batch shards) that fits
        refused_batch: the smallest batch the search found not to fit (None: none tried)
        target: "tpu-v5p:4x4x4", "gpu-h100x8"; None: this process's devices
        chip: the chip table's name, when the devices are a chip it knows
        eval_peak: the evaluation step's peak bytes per device, same batch
        bytes_accessed: per device and step, XLA's cost analysis (else counted from the compiled program)
        tokens_per_step: predicted (target) tokens of a global batch
        compute_seconds: flops_per_device / the chip's dense peak in the compute dtype
        memory_seconds: bytes_accessed / the chip's memory bandwidth
        step_seconds: roofline lower bound: the larger of the two
        tokens_per_second: at that bound: an upper bound
        mfu_ceiling: model FLOPs / (devices x peak x step_seconds)
        compile_seconds: all compiles of this plan (train, eval, the batches tried)
        cached_steps: steps whose figures were read from the plan cache, not compiled
        requested_batch: the configured batch; batch_size differs when it did not compile
        over_memory: the TPU compiler's refusal of the configured batch
        attention_kernels: fused attention kernels in the training step: splash (TPU), cuDNN's (GPU)
        frozen: LoRA: this device's shards of the frozen base, in the compute dtype (or int8)
        frozen_storage: LoRA: how the frozen base is stored ("bfloat16"; "int8 + float32 scales")
        collectives: {kind: (bytes, ops)} per device of the step's collectives (MoE under expert
            parallelism; None: not counted)
        optimizer_on_host: train.offload_optimizer: the optimizer state waits in host memory
        host_arguments: the compiled step's arguments in host memory, bytes per device (offloaded state)
        host_outputs: its outputs in host memory, bytes per device
        host_temporaries: its temporaries in host memory, bytes per device (offloaded activations)
    """

    devices: int
    mesh: dict
    batch_size: int
    parameters: int  # this device's shards of the trained parameters (LoRA: the adapters)
    optimizer_state: int
    gradients: int  # the parameters' size: float32 gradients, sharded alike
    activations: int  # XLA's temporaries less the gradients: activations kept for the backward pass, workspace
    arguments: int  # XLA's memory analysis of the compiled step, per device
    outputs: int
    aliased: int  # outputs written into donated arguments
    temporaries: int
    code: int
    peak: int  # arguments + outputs - aliased + temporaries + code
    flops_per_device: float  # XLA's cost analysis of the partitioned step (NaN: none, a deviceless GPU compile)
    model_flops: float  # the model's FLOPs per step, all devices (3 x forward, as MFU counts them)
    device_memory: float | None = None
    fits: bool | None = None
    largest_batch: int | None = None  # the largest batch (a multiple of the batch shards) that fits
    refused_batch: int | None = None  # the smallest batch the search found not to fit (None: none tried)
    target: str | None = None  # "tpu-v5p:4x4x4", "gpu-h100x8"; None: this process's devices
    chip: str | None = None  # the chip table's name, when the devices are a chip it knows
    eval_peak: int | None = None  # the evaluation step's peak bytes per device, same batch
    bytes_accessed: float | None = None  # per device and step, XLA's cost analysis (else counted from the program)
    tokens_per_step: int = 0  # predicted (target) tokens of a global batch
    compute_seconds: float | None = None  # flops_per_device / the chip's dense peak in the compute dtype
    memory_seconds: float | None = None  # bytes_accessed / the chip's memory bandwidth
    step_seconds: float | None = None  # roofline lower bound: the larger of the two
    tokens_per_second: float | None = None  # at that bound: an upper bound
    mfu_ceiling: float | None = None  # model FLOPs / (devices x peak x step_seconds)
    compile_seconds: float = 0.0  # all compiles of this plan (train, eval, the batches tried)
    cached_steps: int = 0  # steps whose figures were read from the plan cache, not compiled
    requested_batch: int | None = None  # the configured batch; batch_size differs when it did not compile
    over_memory: str | None = None  # the TPU compiler's refusal of the configured batch
    attention_kernels: int = 0  # fused attention kernels in the training step: splash (TPU), cuDNN's (GPU)
    # MoE under expert parallelism (mesh.expert > 1): the training step's collectives, {kind: (bytes per
    # device, ops)} from the compiled program (a loop's body once), the all-to-all among them carrying
    # tokens to their experts and back where the compiler chose it; None: not counted
    collectives: dict | None = None
    frozen: int = 0  # LoRA: this device's shards of the frozen base, in the compute dtype (or int8)
    frozen_storage: str = ""  # LoRA: how the frozen base is stored ("bfloat16"; "int8 + float32 scales")
    optimizer_on_host: bool = False  # train.offload_optimizer: the optimizer state waits in host memory
    host_arguments: int = 0  # the compiled step's bytes in host memory, per device (offloaded state, activations)
    host_outputs: int = 0
    host_temporaries: int = 0

    def as_dict(self) -> dict:
        """The plan's fields, a figure nobody gave (NaN: XLA's FLOPs from a deviceless GPU compile) as None.

        Returns:
            field -> value.
        """
        nan = lambda v: isinstance(v, float) and math.isnan(v)
        return {k: None if nan(v) else v for k, v in dataclasses.asdict(self).items()}

    def table(self) -> str:
        """The plan as the table `jaxformer plan` prints: each figure per device, with its share of memory.

        Returns:
            The table, one string of lines.
        """
        gb = lambda b: f"{b / 1e9:9.3f} GB"
        share = lambda b: f"   {100 * b / self.device_memory:5.1f}% of memory" if self.device_memory else ""
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items())
        where = f"{self.target} ({self.chip}): " if self.target else ""
        lines = []
        if self.over_memory:
            lines.append(f"batch {self.requested_batch} does NOT fit: {self.over_memory}")
            lines.append(f"shown: the largest batch that fits, {self.batch_size}")
        lines += [
            f"{where}mesh {mesh} over {self.devices} devices, global batch {self.batch_size}; per device:",
            *(
                [f"  frozen base        {gb(self.frozen)}   (LoRA: not trained, {self.frozen_storage})"]
                if self.frozen
                else []
            ),
            f"  {'adapters' if self.frozen else 'parameters':19}{gb(self.parameters)}",
            f"  optimizer state    {gb(self.optimizer_state)}{'   (in host memory)' if self.optimizer_on_host else ''}",
            f"  gradients          {gb(self.gradients)}   (the parameters' size)",
            f"  activations        {gb(self.activations)}   (XLA's temporaries less the gradients)",
            f"  compiled step      arguments {self.arguments / 1e9:.3f} GB, outputs {self.outputs / 1e9:.3f} GB "
            f"(aliased to donated arguments {self.aliased / 1e9:.3f} GB), temporaries {self.temporaries / 1e9:.3f} GB, "
            f"code {self.code / 1e9:.3f} GB",
            f"  peak               {gb(self.peak)}{share(self.peak)}",
        ]
        if self.host_arguments or self.host_outputs or self.host_temporaries:
            lines.append(
                f"  host memory        arguments {self.host_arguments / 1e9:.3f} GB, outputs "
                f"{self.host_outputs / 1e9:.3f} GB, temporaries {self.host_temporaries / 1e9:.3f} GB (not in the "
                "device's peak, which is at least the compiler's own estimate with offload)"
            )
        if self.eval_peak is not None:
            lines.append(f"  eval step peak     {gb(self.eval_peak)}{share(self.eval_peak)}")
        if self.attention_kernels:
            tpu = (self.chip or "").startswith("TPU")
            kind = "splash kernels" if tpu else "cuDNN fused attention"
            lines.append(f"  attention          {kind}: {self.attention_kernels} {'Pallas' if tpu else 'custom'} calls")
        if self.collectives is not None:
            moved = ", ".join(f"{kind} {b / 1e9:.4f} GB ({n} ops)" for kind, (b, n) in self.collectives.items() if n)
            lines.append(f"  collectives        per step: {moved or 'none'} (a loop's body once)")
        n, fmt = self.devices, lambda x: observe.value("flops", x)
        flops = lambda per_device: f"{fmt(per_device)} per device, {fmt(per_device * n)} in all"
        costed = math.isfinite(self.flops_per_device)
        xla = f"XLA's {flops(self.flops_per_device)}" if costed else "XLA's: none (no cost analysis without a GPU)"
        lines.append(f"FLOPs per step: {xla}; the model's {flops(self.model_flops / n)}")
        if self.step_seconds is not None:
            ceilings = {"tokens_per_s": self.tokens_per_second, "mfu": self.mfu_ceiling}
            accessed = "accessed" if costed else "moved, counted from the compiled program"
            lines.append(
                f"roofline: step >= {self.step_seconds * 1e3:.2f} ms (compute {self.compute_seconds * 1e3:.2f} ms, "
                f"memory {self.memory_seconds * 1e3:.2f} ms for {self.bytes_accessed / 1e9:.3f} GB {accessed}); "
                f"ceilings: {observe.line(ceilings, ('tokens_per_s', 'mfu'))}"
            )
        if self.device_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"device memory {self.device_memory / 1e9:.3f} GB: batch {self.requested_batch} {verdict}")
            largest = {None: "not searched (--no-largest)", 0: "none: even the smallest batch does not fit"}
            found = largest.get(self.largest_batch, self.largest_batch)
            bound = f" (batch {self.refused_batch} does not)" if self.largest_batch and self.refused_batch else ""
            lines.append(f"largest global batch that fits: {found}{bound}")
        cached = f"; {self.cached_steps} steps read from the plan cache" if self.cached_steps else ""
        lines.append(f"compiled in {self.compile_seconds:.1f} s{cached}")
        return "\n".join(lines)


def plan(
    cfg: Config,
    device_memory: float | None = None,
    batch_size: int | None = None,
    target: Target | None = None,
    largest: bool = True,
    progress=None,
    within: float = 0.02,
    jobs: int = 2,
) -> Plan:
    """Compile `cfg`'s training and evaluation steps for its mesh (abstract state) and report
    per-device bytes; with `device_memory`, whether it fits and the largest batch that does.

    `target` lays the mesh over a TPU slice's or GPU hosts' compile-only devices (or, for a GPU
    without XLA's GPU compiler installed, this process's fake CPU devices) and brings the chip's
    memory, peak and bandwidth. `largest=False`
    skips the search for the largest batch (two or more compiles), which stops once the largest batch
    known to fit is within `within` (a fraction) of the smallest known not to; `progress(message)`
    hears of each compile. Up to `jobs` steps compile side by side, each on its own thread: the
    evaluation step beside the training step, and the search's next try beside the one that would
    follow it. Each compiled step's figures are kept in `cache_dir()`.

    Args:
        cfg: the run's config.
        device_memory: bytes of one device, or None (the target chip's, or unknown).
        batch_size: the global batch, or None (`train.batch_size`).
        target: the TPU slice or GPUs, or None (this process's devices).
        largest: search for the largest batch that fits.
        progress (Callable[[str], None] | None): told of each compile, or None.
        within: the search's precision, a fraction.
        jobs: compiles side by side.

    Returns:
        The `Plan`.

    Raises:
        ConfigError: the mesh does not fit the target, or no batch fits, named.
        ValueError: jobs < 1.
    """
    if jobs < 1:
        raise ValueError(f"jobs: at least one compile at a time, got {jobs}")
    devices = target.devices() if target else None
    chip = target.chip if target else chips.lookup(jax.devices()[0].device_kind)
    if device_memory is None and target is not None:
        device_memory = target.chip.memory_bytes
    try:
        mesh = sharding.make_mesh(cfg.mesh, devices)
    except ConfigError as e:
        if target is None:
            raise
        raise ConfigError(f"{e} (--target {target.name} has {target.count} chips)") from None
    batch_size = cfg.train.batch_size if batch_size is None else batch_size
    busy: list[tuple[float, float]] = []  # when each compile ran (compiles side by side count once)
    with sharding.use(mesh, sharding.rules_for(cfg.mesh)), concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        graphdef, create, optimizer = state_factory(cfg)
        abstract = jax.eval_shape(create)
        shardings = state_shardings(cfg, abstract, mesh)
        state = with_shardings(abstract, shardings)
        train, evaluate = make_steps(graphdef, cfg, optimizer)
        train_step = jax.jit(train, out_shardings=(shardings, None), donate_argnums=0)
        shards = math.prod(mesh.shape[a] for a in sharding.BATCH)
        experts = cfg.model.moe.num_experts > 0 and mesh.shape["expert"] > 1  # count the all-to-all
        compiled: dict[int, concurrent.futures.Future] = {}  # batch -> the training step's figures
        cached = 0

        def lower(step, size: int):
            if size % shards:
                raise ConfigError(f"train.batch_size={size} does not divide over the {shards} batch shards")
            lowered = step.lower(state, abstract_batch(cfg, size, mesh))
            step.clear_cache()  # the traces JAX keeps for each batch shape: hundreds of MB a compile
            return lowered

        # The configured training program says the code, devices and versions; with the whole config it
        # says the training step at any other batch (one lowering keys them all). Evaluation is keyed by its own.
        configured = lower(train_step, batch_size)
        base = _cache_key(configured, mesh) + json.dumps(cfg.to_dict(), sort_keys=True)

        def submit(name: str, size: int, key: str, program) -> concurrent.futures.Future:
            """`program()` (a step, lowered here: tracing reads this thread's mesh) compiled in the pool,
            or its figures read back from the plan cache."""
            nonlocal cached
            if (figures := _cache_read(key)) is not None:
                cached += 1
                if progress:
                    progress(f"read the {name} step at batch {size} from the plan cache")
                done = concurrent.futures.Future()
                done.set_result(figures)
                return done
            lowered = program()

            def compile_() -> Compiled:
                start = time.perf_counter()
                figures = Compiled.of(lowered, gpu=mesh.devices.flat[0].platform == "gpu", collectives=experts)
                busy.append((start, time.perf_counter()))
                _give_back_memory()
                if progress:
                    said = figures.refused or f"peak {figures.peak / 1e9:.3f} GB"
                    progress(f"compiled the {name} step at batch {size}: {busy[-1][1] - start:.1f} s, {said}")
                _cache_write(key, figures)
                return figures

            return pool.submit(compile_)

        def training(size: int) -> concurrent.futures.Future:
            if size not in compiled:
                key = hashlib.sha256(f"{base} {size}".encode()).hexdigest()
                program = lambda: configured if size == batch_size else lower(train_step, size)
                compiled[size] = submit("training", size, key, program)
            return compiled[size]

        def evaluation(size: int) -> concurrent.futures.Future:
            program = lower(jax.jit(evaluate), size)
            return submit("evaluation", size, _cache_key(program, mesh), lambda: program)

        def peaks_at(sizes: list[int]) -> list[float]:
            futures = [training(size) for size in sizes]  # all in the pool before any is awaited
            return [_peak(future.result(), device_memory) for future in futures]

        params, opt = _shard_bytes(state.params), _shard_bytes(state.opt_state)
        frozen = _shard_bytes(state.frozen) if state.frozen is not None else 0
        requested, configured_step = batch_size, training(batch_size)
        evaluated = evaluation(batch_size)  # beside the first round of the search
        find = device_memory is not None and (largest or configured_step.result().refused)
        largest, refused = (
            _largest_batch(peaks_at, shards, device_memory, batch_size, within, jobs) if find else (None, None)
        )
        fits = None if device_memory is None else _peak(configured_step.result(), device_memory) <= device_memory
        if over_memory := configured_step.result().refused:  # the compiler said no: show the largest that compiles
            if not largest:
                raise ConfigError(f"train.batch_size: even a batch of {shards} does not fit: {over_memory}")
            batch_size = largest
            evaluated = evaluation(batch_size)
        step, evaluated = compiled[batch_size].result(), evaluated.result()
    compile_seconds = _union(busy)
    T = cfg.data.max_len
    flops, accessed = step.flops, step.bytes_accessed
    if not math.isfinite(accessed):  # no cost analysis (XLA's GPU compiler without a GPU): counted from its program
        accessed = step.bytes_moved if math.isfinite(step.bytes_moved) else float(step.arguments + step.outputs)
    model_flops = flops_per_example(cfg.model, cfg.train.objective, cfg.data.src_len, T) * batch_size
    tokens = batch_size * (1 if cfg.train.objective == "classify" else T)
    roofline = {}
    if chip is not None:
        peak_flops = chip.peak(cfg.model.dtype)
        # XLA's cost analysis counts a loop's body once (scan_layers): never below the model's own count.
        compute = max(flops if math.isfinite(flops) else 0.0, model_flops / mesh.size) / peak_flops
        memory = accessed / chip.bandwidth
        bound = max(compute, memory)
        roofline = dict(
            compute_seconds=compute, memory_seconds=memory, step_seconds=bound, tokens_per_second=tokens / bound,
            mfu_ceiling=model_flops / (mesh.size * peak_flops * bound),
        )  # fmt: skip
    return Plan(
        devices=mesh.size, mesh=sharding.axis_sizes(mesh), batch_size=batch_size, parameters=params,
        optimizer_state=opt,
        gradients=params, activations=max(step.temporaries - params, 0), arguments=step.arguments,
        outputs=step.outputs, aliased=step.aliased, temporaries=step.temporaries, code=step.code, peak=step.peak,
        flops_per_device=flops, model_flops=model_flops, device_memory=device_memory, fits=fits,
        largest_batch=largest, refused_batch=refused, target=target.name if target else None,
        chip=chip.name if chip else None, eval_peak=None if evaluated.refused else evaluated.peak,
        bytes_accessed=accessed, tokens_per_step=tokens, compile_seconds=compile_seconds, cached_steps=cached,
        requested_batch=requested, over_memory=over_memory, attention_kernels=step.kernels, frozen=frozen,
        collectives=step.collectives,
        frozen_storage="int8 kernels + float32 scales" if cfg.lora.base == "int8" else cfg.model.dtype,
        optimizer_on_host=cfg.train.offload_optimizer, host_arguments=step.host_arguments,
        host_outputs=step.host_outputs, host_temporaries=step.host_temporaries, **roofline,
    )  # fmt: skip


def _peak(figures: Compiled, memory: float | None) -> float:
    """A compiled step's peak; a refused one's is above `memory`, by the compiler's figure if it gives one."""
    if not figures.refused:
        return figures.peak
    memory = memory or 0.0
    return max(_refused_bytes(figures.refused, memory), math.nextafter(memory, math.inf))


def _union(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the (start, end) spans: time spent compiling, however many ran at once."""
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        total, end = total + max(0.0, b - max(a, end)), max(end, b)
    return total
