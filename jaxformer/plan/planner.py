"""`plan()`: a config's training and evaluation steps compiled for a target, side by side and through
the cache, the search for the largest batch run on them, and the figures put together as a `Plan`."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import math

import jax

from jaxformer import chips, sharding
from jaxformer.config import Config, ConfigError
from jaxformer.plan.compile import (
    Compiled,
    _cache_key,
    _compile_cached,
    _shard_bytes,
    abstract_batch,
    with_shardings,
)
from jaxformer.plan.report import Plan
from jaxformer.plan.roofline import roofline
from jaxformer.plan.search import _largest_batch, _refused_bytes
from jaxformer.plan.targets import Target
from jaxformer.state import state_factory, state_shardings
from jaxformer.train import flops_per_example, make_steps


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
        params, opt = _shard_bytes(state.params), _shard_bytes(state.opt_state)
        frozen = _shard_bytes(state.frozen) if state.frozen is not None else 0
        held = 2 * params + frozen + (0 if cfg.train.offload_optimizer else opt)  # + float32 gradients
        _check_state_fits(held, device_memory, sharding.axis_sizes(mesh))
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

            def read() -> None:
                nonlocal cached
                cached += 1
                if progress:
                    progress(f"read the {name} step at batch {size} from the plan cache")

            def done(figures: Compiled, start: float, end: float) -> None:
                busy.append((start, end))
                if progress:
                    said = figures.refused or f"peak {figures.peak / 1e9:.3f} GB"
                    progress(f"compiled the {name} step at batch {size}: {end - start:.1f} s, {said}")

            gpu = mesh.devices.flat[0].platform == "gpu"
            return _compile_cached(pool, key, program, gpu=gpu, collectives=experts, on_read=read, on_compiled=done)

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
    ceilings = {}
    if chip is not None:
        ceilings = roofline(chip, cfg.model.dtype, flops, model_flops, accessed, mesh.size, tokens)
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
        host_outputs=step.host_outputs, host_temporaries=step.host_temporaries, **ceilings,
    )  # fmt: skip


def _check_state_fits(state_bytes: float, memory: float | None, axes: dict[str, int]) -> None:
    """Refuse, before any compile, a mesh whose training state alone (each device's shard of the
    parameters, their float32 gradients, the optimizer's moments unless offloaded, a frozen base)
    exceeds a device's memory: no batch can fit, and a compiler asked for such a step may fail
    otherwise than by saying so (XLA's GPU compiler without a GPU stops on its CUDA libraries)."""
    if memory is None or state_bytes <= memory:
        return
    split = " x ".join(f"{name} {size}" for name, size in axes.items())
    raise ConfigError(
        f"mesh: the training state alone is {state_bytes / 1e9:.3g} GB a device (parameters, their gradients and "
        f"the optimizer's moments over {split}) > {memory / 1e9:.3g} GB: split it over more devices (mesh.fsdp, "
        "mesh.expert, mesh.stage), train.offload_optimizer, or LoRA (lora.rank)"
    )


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
