"""Plan before you launch: compile the training step ahead of time for the configured mesh and
report, per device, what it holds and whether it fits.

Nothing is allocated: the state is abstract (shapes, dtypes and shardings), and `jit(...).lower(...)
.compile()` runs XLA's real partitioner and scheduler for the mesh. Two kinds of devices:

- a TPU slice (`--target tpu-v5p:4x4x4`, any topology libtpu names): with `jaxformer[tpu]` installed,
  libtpu's compile-only devices of that slice, on any machine; the TPU compiler itself decides the
  buffers, so the bytes are the slice's own.
- fake CPU devices (`--devices 64`, or `--target gpu-h100x8`: 8 of them with an H100's memory and
  peak from the chip table). XLA's CPU compiler decides the buffers; a GPU's compiler fuses and
  schedules differently, so read those figures as the program's shape, not a promise to the byte.

With a chip (a target, or a table entry for the devices), the plan adds a roofline lower bound on
the step time (the larger of FLOPs / peak and bytes accessed / memory bandwidth, both per chip from
the compiler's cost analysis), the tokens/s it implies and the MFU it leaves as a ceiling.

    jaxformer plan --config experiments/paper_base_en_de.py --target tpu-v4:4x4x8
    jaxformer plan --config experiments/paper_base_en_de.py --devices 8 --set mesh.fsdp=8 --device-memory 80GB
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import jax
import numpy as np

from jaxformer import chips, sharding
from jaxformer.config import Config, ConfigError
from jaxformer.train import flops_per_example, make_steps, state_factory


@dataclasses.dataclass(frozen=True)
class Target:
    """What to plan for: `count` devices of `chip`, a TPU slice's compile-only devices or fake CPUs."""

    name: str  # as given: "tpu-v5p:4x4x4", "gpu-h100x8"
    chip: chips.Chip
    count: int
    topology: str | None = None  # the libtpu topology of a TPU target ("v5p:4x4x4")

    def devices(self) -> list | None:
        """The TPU slice's compile-only devices (None: this process's own, fake CPUs for a GPU target)."""
        from jaxformer import tpu

        return tpu.topology_devices(self.topology) if self.topology else None


def parse_target(name: str) -> Target:
    """ "tpu-v4:4x4x8" (any topology libtpu names: v4, v5e, v5p, v6e), "gpu-h100x8", "gpu-a100-80gbx4"."""
    if name.startswith("tpu-"):
        from jaxformer import tpu

        topology = name[len("tpu-") :]
        devices = tpu.topology_devices(topology)
        chip = chips.lookup(devices[0].device_kind)
        if chip is None:
            raise ConfigError(f"--target {name}: the chip table has no entry for {devices[0].device_kind!r}")
        return Target(name, chip, len(devices), topology)
    m = re.fullmatch(r"gpu-(.+)x(\d+)", name, re.IGNORECASE)
    chip = chips.lookup(m.group(1).upper()) if m else None
    if chip is None or chip.name.startswith("TPU"):
        known = ", ".join(c.name for _, c in chips.CHIPS if not c.name.startswith("TPU"))
        raise ConfigError(
            f"--target {name!r}: say tpu-TOPOLOGY (tpu-v5p:4x4x4) or gpu-CHIPxN (gpu-h100x8); GPUs known: {known}"
        )
    return Target(name, chip, int(m.group(2)))


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-device bytes of one compiled training step, and what follows for a device memory."""

    devices: int
    mesh: dict
    batch_size: int
    parameters: int  # this device's shards of the parameters
    optimizer_state: int
    gradients: int  # the parameters' size: float32 gradients, sharded alike
    activations: int  # XLA's temporaries less the gradients: activations kept for the backward pass, workspace
    arguments: int  # XLA's memory analysis of the compiled step, per device
    outputs: int
    aliased: int  # outputs written into donated arguments
    temporaries: int
    code: int
    peak: int  # arguments + outputs - aliased + temporaries + code
    flops_per_device: float  # XLA's cost analysis of the partitioned step
    model_flops: float  # the model's FLOPs per step, all devices (3 x forward, as MFU counts them)
    device_memory: float | None = None
    fits: bool | None = None
    largest_batch: int | None = None  # the largest batch (a multiple of the batch shards) that fits
    target: str | None = None  # "tpu-v5p:4x4x4", "gpu-h100x8"; None: this process's devices
    chip: str | None = None  # the chip table's name, when the devices are a chip it knows
    eval_peak: int | None = None  # the evaluation step's peak bytes per device, same batch
    bytes_accessed: float | None = None  # per device and step, XLA's cost analysis
    tokens_per_step: int = 0  # predicted (target) tokens of a global batch
    compute_seconds: float | None = None  # flops_per_device / the chip's dense peak in the compute dtype
    memory_seconds: float | None = None  # bytes_accessed / the chip's memory bandwidth
    step_seconds: float | None = None  # roofline lower bound: the larger of the two
    tokens_per_second: float | None = None  # at that bound: an upper bound
    mfu_ceiling: float | None = None  # model FLOPs / (devices x peak x step_seconds)
    compile_seconds: float = 0.0  # all compiles of this plan (train, eval, the batches tried)
    requested_batch: int | None = None  # the configured batch; batch_size differs when it did not compile
    over_memory: str | None = None  # the TPU compiler's refusal of the configured batch
    attention_kernels: int | None = 0  # Pallas (Mosaic) kernels in the compiled training step (splash on TPU)

    def table(self) -> str:
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
            f"  parameters         {gb(self.parameters)}",
            f"  optimizer state    {gb(self.optimizer_state)}",
            f"  gradients          {gb(self.gradients)}   (the parameters' size)",
            f"  activations        {gb(self.activations)}   (XLA's temporaries less the gradients)",
            f"  compiled step      arguments {self.arguments / 1e9:.3f} GB, outputs {self.outputs / 1e9:.3f} GB "
            f"(aliased to donated arguments {self.aliased / 1e9:.3f} GB), temporaries {self.temporaries / 1e9:.3f} GB, "
            f"code {self.code / 1e9:.3f} GB",
            f"  peak               {gb(self.peak)}{share(self.peak)}",
        ]
        if self.eval_peak is not None:
            lines.append(f"  eval step peak     {gb(self.eval_peak)}{share(self.eval_peak)}")
        if self.attention_kernels:
            lines.append(f"  attention          splash kernels: {self.attention_kernels} Pallas calls in the step")
        lines.append(f"FLOPs per step: {self.flops_per_device:.4g} per device (XLA), model {self.model_flops:.4g} all")
        if self.step_seconds is not None:
            lines.append(
                f"roofline: step >= {self.step_seconds * 1e3:.2f} ms (compute {self.compute_seconds * 1e3:.2f} ms, "
                f"memory {self.memory_seconds * 1e3:.2f} ms for {self.bytes_accessed / 1e9:.3f} GB accessed): "
                f"<= {self.tokens_per_second:,.0f} tokens/s, MFU <= {100 * self.mfu_ceiling:.1f}%"
            )
        if self.device_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"device memory {self.device_memory / 1e9:.3f} GB: batch {self.requested_batch} {verdict}")
            largest = {None: "not searched (--no-largest)", 0: "none: even the smallest batch does not fit"}
            lines.append(f"largest global batch that fits: {largest.get(self.largest_batch, self.largest_batch)}")
        lines.append(f"compiled in {self.compile_seconds:.1f} s")
        return "\n".join(lines)


KERNEL_CALL = "tpu_custom_call"  # how a compiled TPU program calls a Pallas (Mosaic) kernel


def parse_bytes(text: str) -> float:
    """ "80GB", "80 GiB", "16G", "1.5e10" -> bytes (GB = 1e9, GiB = 2**30)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*(?:([kmgt])(i?)b?|b?)\s*", text, re.IGNORECASE)
    if not m:
        raise ConfigError(f"--device-memory: cannot read {text!r} as a size (e.g. 80GB, 16GiB)")
    unit = m.group(2)
    scale = 1 if not unit else (1024 if m.group(3) else 1000) ** ("KMGT".index(unit.upper()) + 1)
    return float(m.group(1)) * scale


def abstract_batch(cfg: Config, batch_size: int, mesh) -> dict:
    """ShapeDtypeStructs of a global training batch of `cfg`'s objective, sharded over the batch axes."""
    d, objective = cfg.data, cfg.train.objective
    rows = sharding.batch_sharding(mesh)
    shaped = lambda *shape, dtype=np.int32: jax.ShapeDtypeStruct((batch_size, *shape), dtype, sharding=rows)
    S, T, N = d.src_len, d.max_len, d.max_segments  # the source has its own width
    # Packed rows say their padding by segments (and positions) where unpacked ones give lengths.
    source = {"src_segments": shaped(S), "src_positions": shaped(S)} if d.pack else {"src_lengths": shaped()}
    if objective == "classify":
        labels = {"label": shaped(N), "weights": shaped(N, dtype=np.float32)} if d.pack else {"label": shaped()}
        return {"src": shaped(S)} | source | labels
    batch = {"inputs": shaped(T), "targets": shaped(T), "weights": shaped(T, dtype=np.float32)}
    if objective == "seq2seq":
        target = {"tgt_segments": shaped(T), "tgt_positions": shaped(T)} if d.pack else {}
        return batch | {"src": shaped(S)} | source | target
    return batch | ({"segments": shaped(T), "positions": shaped(T)} if d.pack else {})


def with_shardings(abstract, shardings):
    """The abstract state (or parameters) with each leaf's sharding: what `jit(...).lower` compiles for."""
    leaves, treedef = jax.tree.flatten(abstract)
    shaped = zip(leaves, jax.tree.leaves(shardings), strict=True)
    return treedef.unflatten([jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in shaped])


def _shard_bytes(tree) -> int:
    """Bytes of this device's shard of every leaf (ShapeDtypeStructs with shardings)."""
    leaves = jax.tree.leaves(tree)
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)


def plan(
    cfg: Config,
    device_memory: float | None = None,
    batch_size: int | None = None,
    target: Target | None = None,
    largest: bool = True,
    progress=None,
) -> Plan:
    """Compile `cfg`'s training and evaluation steps for its mesh (abstract state) and report
    per-device bytes; with `device_memory`, whether it fits and the largest batch that does.

    `target` lays the mesh over a TPU slice's compile-only devices (or, for a GPU, takes this
    process's fake CPU devices) and brings the chip's memory, peak and bandwidth. `largest=False`
    skips the search for the largest batch (two or more compiles); `progress(message)` hears of each compile.
    """
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
    compile_seconds = 0.0
    with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
        graphdef, create, optimizer = state_factory(cfg)
        abstract = jax.eval_shape(create)
        shardings = sharding.state_shardings(abstract, mesh)
        state = with_shardings(abstract, shardings)
        train, evaluate = make_steps(graphdef, cfg, optimizer)
        train_step = jax.jit(train, out_shardings=(shardings, None), donate_argnums=0)
        shards = math.prod(mesh.shape[a] for a in sharding.BATCH)
        compiled: dict[int, object] = {}  # batch -> compiled step, or the compiler's out-of-memory message

        def compile_timed(step, B: int):
            nonlocal compile_seconds
            if B % shards:
                raise ConfigError(f"train.batch_size={B} does not divide over the {shards} batch shards")
            start = time.perf_counter()
            try:
                return step.lower(state, abstract_batch(cfg, B, mesh)).compile()
            except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program over its HBM
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                return str(e).splitlines()[0]
            finally:
                took = time.perf_counter() - start
                compile_seconds += took
                if progress:
                    name = "training" if step is train_step else "evaluation"
                    progress(f"compiled the {name} step at batch {B}: {took:.1f} s")

        def peak_at(B: int) -> float:
            if B not in compiled:
                compiled[B] = compile_timed(train_step, B)
                if progress:
                    said = compiled[B] if isinstance(compiled[B], str) else f"peak {_peak(compiled[B]) / 1e9:.3f} GB"
                    progress(f"  batch {B}: {said}")
            if isinstance(compiled[B], str):  # refused: over memory, by the compiler's figure if it gives one
                return max(_refused_bytes(compiled[B]), math.nextafter(device_memory or 0.0, math.inf))
            return _peak(compiled[B])

        params, opt = _shard_bytes(state.params), _shard_bytes(state.opt_state)
        requested, over_memory = batch_size, None
        p_requested = peak_at(batch_size)
        fits = None if device_memory is None else p_requested <= device_memory
        find = device_memory is not None and (largest or isinstance(compiled[batch_size], str))
        largest = _largest_batch(peak_at, shards, device_memory, batch_size) if find else None
        if isinstance(compiled[batch_size], str):  # the compiler said no: show the largest batch that compiles
            over_memory = compiled[batch_size]
            if not largest:
                raise ConfigError(f"train.batch_size: even a batch of {shards} does not fit: {over_memory}")
            batch_size = largest
        step = compiled[batch_size]
        m = step.memory_analysis()
        cost = step.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        peak = _peak(step)
        kernels = _kernel_calls(step)
        evaluated = compile_timed(jax.jit(evaluate), batch_size)
        eval_peak = None if isinstance(evaluated, str) else _peak(evaluated)
    T = cfg.data.max_len
    flops, accessed = float(cost.get("flops", float("nan"))), float(cost.get("bytes accessed", float("nan")))
    model_flops = flops_per_example(cfg.model, cfg.train.objective, cfg.data.src_len, T) * batch_size
    tokens = batch_size * (1 if cfg.train.objective == "classify" else T)
    roofline = {}
    if chip is not None:
        peak_flops = chip.peak(cfg.model.dtype)
        # XLA's cost analysis counts a loop's body once (scan_layers): never below the model's own count.
        compute, memory = max(flops, model_flops / mesh.size) / peak_flops, accessed / chip.bandwidth
        bound = max(compute, memory)
        roofline = dict(
            compute_seconds=compute, memory_seconds=memory, step_seconds=bound, tokens_per_second=tokens / bound,
            mfu_ceiling=model_flops / (mesh.size * peak_flops * bound),
        )  # fmt: skip
    return Plan(
        devices=mesh.size, mesh=dict(mesh.shape), batch_size=batch_size, parameters=params, optimizer_state=opt,
        gradients=params, activations=max(m.temp_size_in_bytes - params, 0), arguments=m.argument_size_in_bytes,
        outputs=m.output_size_in_bytes, aliased=m.alias_size_in_bytes, temporaries=m.temp_size_in_bytes,
        code=m.generated_code_size_in_bytes, peak=peak, flops_per_device=flops, model_flops=model_flops,
        device_memory=device_memory, fits=fits, largest_batch=largest, target=target.name if target else None,
        chip=chip.name if chip else None, eval_peak=eval_peak, bytes_accessed=accessed, tokens_per_step=tokens,
        compile_seconds=compile_seconds, requested_batch=requested, over_memory=over_memory, attention_kernels=kernels,
        **roofline,
    )  # fmt: skip


def _peak(compiled) -> int:
    """Bytes a compiled step holds at once per device: arguments, outputs not written into donated
    arguments, temporaries and code."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes + m.generated_code_size_in_bytes)  # fmt: skip


def _kernel_calls(compiled) -> int | None:
    """Pallas (Mosaic) kernel calls in a compiled program; None where its text cannot be had (the
    TPU compiler's text of some scanned programs fails a check of XLA's)."""
    try:
        return compiled.as_text().count(f'custom_call_target="{KERNEL_CALL}"')
    except jax.errors.JaxRuntimeError:
        return None


def _refused_bytes(message: str) -> float:
    """What a TPU compiler's out-of-memory refusal says the temporaries need (at least the peak's
    share of it), or infinity when it says no figure."""
    m = re.search(r"required for HLO temporaries \(([\d.]+)([KMGT])\)", message)
    return float(m.group(1)) * 1024 ** ("KMGT".index(m.group(2)) + 1) if m else math.inf


def _largest_batch(peak_at, shards: int, memory: float, start: int | None = None) -> int:
    """The largest multiple of `shards` whose step fits in `memory`. Memory grows about linearly with
    the batch, so two compiles give a line and its edge is tried first; once a batch is over, the
    gap between the largest that fits and the smallest that does not is closed by lines through
    them and halvings (a TPU compiler's refusal gives no figure), one step apart or 12 tries.
    The line is drawn through `start` (the configured batch, compiled already) and its double when it
    fits, as memory per row at small batches understates it at large ones."""
    small = shards
    if start is not None and start > shards and peak_at(start) <= memory:
        small = start
    elif peak_at(small) > memory:
        return 0
    large = 2 * small if small > shards else 4 * shards
    p_small, p_large = peak_at(small), peak_at(large)
    fits, p_fits = (large, p_large) if p_large <= memory else (small, p_small)  # the largest known to fit
    over = None if p_large <= memory else large  # the smallest known not to
    if math.isfinite(p_large):
        per_row = max((p_large - p_small) / (large - small), 1.0)
        guess = int((memory - p_small) / per_row + small) // shards * shards
    else:
        guess = (small + large) // 2 // shards * shards
    p_over = math.inf
    for tries in range(12):
        if over is not None:
            guess = min(guess, over - shards)
        if guess <= fits:
            break
        p = peak_at(guess)
        if p <= memory:
            if over is None:
                return guess  # the line's edge fits
            fits, p_fits = guess, p
        else:
            over, p_over = guess, p
        if math.isfinite(p_over) and p_over > p_fits and tries % 2 == 0:  # the line between the two nearest
            guess = fits + int((memory - p_fits) / ((p_over - p_fits) / (over - fits))) // shards * shards
        else:  # or halve the gap (its ratio when wide): a refusal gives no figure, a line can fall short
            middle = math.sqrt(fits * over) if over > 4 * fits else (fits + over) / 2
            guess = int(middle) // shards * shards
    return fits
