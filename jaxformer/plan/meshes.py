"""`jaxformer plan --search`: which split of the devices over (stage, data, fsdp, tensor), with how many
micro-batches, a config wants on a target (docs/guides/pipeline.md).

A small set of candidate meshes (`candidates`): stages of powers of two that divide the layers,
tensor parallelism of 1 or the widest that divides the heads within a host (at most 8), the rest of
the devices all FSDP or all data, and for S > 1 stages the most micro-batches of 4 S, 2 S or S that
the batch divides over the batch shards (GPipe, one chunk a stage: more micro-batches, less bubble,
and the same activations in all). Before compiling, a candidate whose batch does not divide, or
whose parameters, gradients and optimizer state alone (their shards, read from the abstract state
on that mesh) exceed the device's memory, is left out with the reason. The rest compile as `plan`
compiles (the same disk cache, `jobs` side by side), each giving its per-device peak from the
compiler's memory analysis.

The bound of a step is a roofline, the largest of three floors, each per device:

- compute: the model's FLOPs over the devices and the chip's peak, divided by 1 - bubble, the
  bubble being (S - 1) / (M + S - 1) of a stage's ticks (`pipeline.bubble_fraction`);
- memory: the compiler's bytes accessed over the memory bandwidth;
- links: the bytes each axis's collectives move, over the link that axis runs on (`traffic`): the
  stage permutes (a micro-batch's activations forward and their gradient back each tick), FSDP's
  gathers and gradient reduce-scatter, the data axis's gradient all-reduce and the tensor axis's
  activation all-reduces, counted from the shapes (a compiled program counts a loop's body once).
  An axis that spans hosts of a GPU target runs on the hosts' network (`chips.LINKS`).

The best is the candidate that fits with the smallest bound.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import re

import jax
import numpy as np

from jaxformer import chips, sharding
from jaxformer.config import Config, ConfigError, apply_overrides
from jaxformer.pipeline import bubble_fraction
from jaxformer.plan.compile import (
    Compiled,
    _cache_key,
    _compile_cached,
    _shard_bytes,
    lower_train_step,
    with_shardings,
)
from jaxformer.plan.targets import Target
from jaxformer.state import state_factory, state_shardings
from jaxformer.train import flops_per_example

MAX_STAGES = 8  # deeper pipelines need more micro-batches than a batch of a few thousand rows has
MAX_TENSOR = 8  # tensor parallelism stays within a host's (or a TPU board's) fast links


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One split of the devices.

    Attributes:
        stage: S, pipeline stages.
        data: data-parallel ways.
        fsdp: FSDP ways.
        tensor: tensor-parallel ways.
        microbatches: M, the pipeline's micro-batches (1 without stages).
    """

    stage: int
    data: int
    fsdp: int
    tensor: int
    microbatches: int

    def overrides(self) -> list[str]:
        """The `--set` lines that give a config this split.

        Returns:
            "section.field=value" strings.
        """
        pipelined = ["mesh.schedule=gpipe", "model.scan_layers=true"] if self.stage > 1 else []
        return [
            f"mesh.stage={self.stage}", "mesh.virtual_stages=1", f"mesh.data={self.data}", f"mesh.fsdp={self.fsdp}",
            f"mesh.tensor={self.tensor}", "mesh.expert=1", "mesh.context=1", f"train.grad_accum={self.microbatches}",
            *pipelined,
        ]  # fmt: skip

    @property
    def name(self) -> str:
        """ "S2 d1 f4 t1 M8": the split in a table's cell."""
        return f"S{self.stage} d{self.data} f{self.fsdp} t{self.tensor} M{self.microbatches}"


@dataclasses.dataclass(frozen=True)
class Row:
    """A candidate and its figures; `why` says why it was not compiled or did not fit.

    Attributes:
        candidate: the split.
        state: parameters, gradients and optimizer state, bytes a device (from the abstract state).
        peak: the compiled step's peak, bytes a device (None: not compiled or refused).
        fits: the peak fits the device's memory.
        compute_seconds: the model's FLOPs a device over the chip's peak, with the bubble.
        memory_seconds: bytes accessed over the memory bandwidth.
        link_seconds: the collectives' bytes over their links (NaN: no link figures for the chip).
        stage_bytes: bytes a device sends over the stage axis a step (the permutes).
        bubble: (S - 1) / (M + S - 1).
        step_seconds: the bound: the largest of the three.
        why: why it was left out or did not fit ("" when it fits).
    """

    candidate: Candidate
    state: int
    peak: int | None = None
    fits: bool = False
    compute_seconds: float = math.nan
    memory_seconds: float = math.nan
    link_seconds: float = math.nan
    stage_bytes: float = 0.0
    bubble: float = 0.0
    step_seconds: float = math.nan
    why: str = ""


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def candidates(cfg: Config, devices: int, per_host: int | None = None) -> list[Candidate]:
    """The splits of `devices` the search compiles (the module docstring), before the memory check.

    Args:
        cfg: the run's config (its model, batch and objective).
        devices: the devices to split.
        per_host: devices a host (tensor parallelism stays within one); None: all.

    Returns:
        The candidates whose axes divide the model and the batch.

    Raises:
        ConfigError: no split divides the batch, naming train.batch_size.
    """
    m, B = cfg.model, cfg.train.batch_size
    stacks = [n for n in (m.num_encoder_layers, m.num_decoder_layers) if n > 0]
    pipelines = not (m.moe.enabled or cfg.lora.enabled or cfg.train.objective == "preference")
    stages = [s for s in _powers_of_two(MAX_STAGES) if devices % s == 0 and all(n % s == 0 for n in stacks)]
    stages = stages if pipelines else [1]
    kv = m.num_kv_heads or m.num_heads
    widest = max(
        t for t in _powers_of_two(min(MAX_TENSOR, per_host or MAX_TENSOR))
        if m.num_heads % t == 0 and kv % t == 0 and m.d_ff % t == 0
    )  # fmt: skip
    out = []
    for S in stages:
        for t in sorted({1, widest}):
            if (devices // S) % t:
                continue
            rest = devices // (S * t)
            for d, f in dict.fromkeys([(1, rest), (rest, 1)]):
                # the most micro-batches of 4 S, 2 S, S that the batch shards divide: the smallest bubble
                fit = [M for M in ((4 * S, 2 * S, S) if S > 1 else (1,)) if B % M == 0 and (B // M) % (d * f) == 0]
                if fit:
                    out.append(Candidate(S, d, f, t, fit[0]))
    if not out:
        raise ConfigError(
            f"train.batch_size={B} does not divide over the batch shards of any split of {devices} devices "
            f"(stages {stages}, tensor {sorted({1, widest})}): make it a multiple of {devices}"
        )
    return out


def traffic(cfg: Config, c: Candidate, params: int) -> dict[str, float]:
    """Bytes a device moves over each axis in a training step, counted from the shapes.

    Args:
        cfg: the run's config.
        c: the split.
        params: this device's shards of the parameters, bytes (float32).

    Returns:
        {axis: bytes} for stage (the permutes: a micro-batch's activations forward, their gradient back,
        M + S - 1 ticks), fsdp (the parameters gathered for the forward and again for the backward in the
        compute dtype, the gradients reduce-scattered in float32), data (the gradients' ring all-reduce)
        and tensor (two all-reduces of the activations a layer forward, two backward).
    """
    m, d = cfg.model, cfg.data
    dtype = np.dtype(m.dtype).itemsize
    T, D, B = d.max_len, m.d_model, cfg.train.batch_size
    rows = B // (c.data * c.fsdp)  # this device's rows of the batch
    layers = (m.num_encoder_layers + m.num_decoder_layers) // c.stage
    count = params / 4  # float32 parameters
    ticks = c.microbatches + c.stage - 1
    return {
        "stage": 2 * ticks * (rows // c.microbatches) * T * D * dtype if c.stage > 1 else 0.0,
        "fsdp": count * (c.fsdp - 1) * (2 * dtype + 4),
        "data": 2 * params * (c.data - 1) / c.data,
        "tensor": 4 * layers * rows * T * D * dtype * 2 * (c.tensor - 1) / c.tensor,
    }


def _spans_hosts(c: Candidate, per_host: int | None) -> dict[str, bool]:
    """Which axes reach across hosts: the mesh lays its axes out stage outermost, tensor innermost."""
    inner, out = 1, {}
    for axis in ("tensor", "fsdp", "data", "stage"):
        inner *= getattr(c, axis)
        out[axis] = per_host is not None and getattr(c, axis) > 1 and inner > per_host
    return out


def link_seconds(chip: chips.Chip | None, moved: dict[str, float], spans: dict[str, bool]) -> float:
    """The collectives' time at the links' bandwidth: each axis's bytes over its own link.

    Args:
        chip: the chip (None or not in `chips.LINKS`: NaN).
        moved: {axis: bytes} (`traffic`).
        spans: {axis: whether it reaches across hosts}.

    Returns:
        Seconds a step, or NaN.
    """
    links = chips.LINKS.get(chip.name) if chip else None
    if links is None:
        return math.nan
    within, across = links[:2]
    return sum(b / (across if spans[axis] else within) for axis, b in moved.items())


def search(
    cfg: Config, target: Target | None = None, device_memory: float | None = None, progress=None, jobs: int = 2
) -> list[Row]:
    """Compile the candidate splits of `cfg` for `target` and bound each one's step (module docstring).

    Args:
        cfg: the run's config.
        target: the TPU slice or GPUs, or None (this process's devices).
        device_memory: bytes of one device, or None (the target chip's).
        progress (Callable[[str], None] | None): told of each compile, or None.
        jobs: compiles side by side.

    Returns:
        One row a candidate, in the order of `candidates`.

    Raises:
        ConfigError: no split divides the batch, or the device's memory is unknown.
    """
    devices = target.devices() if target else None
    devices = jax.devices() if devices is None else devices
    chip = target.chip if target else chips.lookup(devices[0].device_kind)
    memory = device_memory or (chip.memory_bytes if chip else None)
    if memory is None:
        raise ConfigError("--device-memory: give the memory of one device, which --search compares each split against")
    # A GPU target's hosts are linked by their network; a TPU slice's chips all by ICI
    per_host = len(devices) // target.hosts if target is not None and target.topology is None else None
    rows, pending = [], {}
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for c in candidates(cfg, len(devices), per_host):
            try:  # a split the config refuses, or whose axes do not divide a parameter, is a row that says why
                cc = apply_overrides(cfg, c.overrides())
                mesh = sharding.make_mesh(cc.mesh, devices)
                with sharding.use(mesh, sharding.rules_for(cc.mesh)):
                    _, create, _ = state_factory(cc)
                    abstract = jax.eval_shape(create)
                    shards = state_shardings(cc, abstract, mesh)
            except ConfigError as e:
                rows.append(Row(c, 0, why=f"refused: {e}"))
                continue
            params = _shard_bytes(with_shardings(abstract.params, shards.params))
            state = 2 * params + _shard_bytes(
                with_shardings(abstract.opt_state, shards.opt_state)
            )  # + float32 gradients
            if state > memory:
                why = f"state alone {state / 1e9:.1f} GB > {memory / 1e9:.1f} GB: not compiled"
                rows.append(Row(c, state, why=why))
                continue
            lowered, _ = lower_train_step(cc, mesh, cc.train.batch_size)
            key = hashlib.sha256((_cache_key(lowered, mesh) + json.dumps(cc.to_dict(), sort_keys=True)).encode())
            rows.append(Row(c, state))
            pending[len(rows) - 1] = (cc, params, _compile(pool, lowered, key.hexdigest(), c, mesh, progress))
        for i, (cc, params, future) in pending.items():
            rows[i] = _bounded(rows[i], cc, params, future.result(), chip, memory, len(devices), per_host)
    return rows


def _compile(pool, lowered, key: str, c: Candidate, mesh, progress) -> concurrent.futures.Future:
    """The figures of `lowered`, from the plan cache or compiled in `pool`."""
    said = lambda figures: figures.refused or f"peak {figures.peak / 1e9:.3f} GB"
    return _compile_cached(
        pool, key, lambda: lowered, gpu=mesh.devices.flat[0].platform == "gpu",
        on_read=progress and (lambda: progress(f"read {c.name} from the plan cache")),
        on_compiled=progress and (lambda figures, *_: progress(f"compiled {c.name}: {said(figures)}")),
    )  # fmt: skip


def _bounded(row: Row, cfg: Config, params: int, step: Compiled, chip, memory: float, n: int, per_host) -> Row:
    """`row` with its compiled peak and the three floors of its step's time."""
    c = row.candidate
    bubble, moved = bubble_fraction(c.stage, c.microbatches), traffic(cfg, c, params)
    row = dataclasses.replace(row, bubble=bubble, stage_bytes=moved["stage"])
    if step.refused:  # "... required for HLO temporaries (99.31G) exceeds available HBM (95.73G) ..."
        temporaries = re.search(r"temporaries \(([\d.]+G)\)", step.refused)
        return dataclasses.replace(row, why=f"refused: temporaries {temporaries[1]}" if temporaries else "refused")
    fits = step.peak <= memory
    why = "" if fits else f"peak {step.peak / 1e9:.1f} GB > {memory / 1e9:.1f} GB"
    if chip is None:
        return dataclasses.replace(row, peak=step.peak, fits=fits, why=why)
    model_flops = flops_per_example(cfg.model, cfg.train.objective, cfg.data.src_len, cfg.data.max_len)
    compute = model_flops * cfg.train.batch_size / n / chip.peak(cfg.model.dtype) / (1 - bubble)
    accessed = step.bytes_accessed if math.isfinite(step.bytes_accessed) else step.bytes_moved
    memory_s = accessed / chip.bandwidth if math.isfinite(accessed) else 0.0
    links = link_seconds(chip, moved, _spans_hosts(c, per_host))
    bound = max(compute, memory_s, links if math.isfinite(links) else 0.0)
    return dataclasses.replace(
        row, peak=step.peak, fits=fits, compute_seconds=compute, memory_seconds=memory_s, link_seconds=links,
        step_seconds=bound, why=why,
    )  # fmt: skip


def best(rows: list[Row]) -> Row | None:
    """The row that fits with the smallest bound (None: none fits).

    Args:
        rows: the search's rows.

    Returns:
        The row, or None.
    """
    fitting = [r for r in rows if r.fits and math.isfinite(r.step_seconds)]
    return min(fitting, key=lambda r: r.step_seconds, default=None)


def table(rows: list[Row], device_memory: float | None = None) -> str:
    """The rows as `jaxformer plan --search` prints them, the best marked and named last.

    Args:
        rows: the search's rows.
        device_memory: bytes of one device, for the heading (None: not said).

    Returns:
        The table's text.
    """
    top = best(rows)
    gb = lambda b: "-" if b is None else f"{b / 1e9:.3g}"
    s = lambda x: "-" if not math.isfinite(x) else f"{x:.3g}"
    head = "| split | state GB | peak GB | fits | bubble | stage GB moved | compute s | memory s | links s | bound s |"
    lines = [head, "|---" * 10 + "|"]
    for r in rows:
        mark = " **best**" if r is top else ""
        fits = "yes" if r.fits else (r.why or "no")
        lines.append(
            f"| {r.candidate.name}{mark} | {gb(r.state)} | {gb(r.peak)} | {fits} | {r.bubble:.2f} | "
            f"{r.stage_bytes / 1e9:.3g} | {s(r.compute_seconds)} | {s(r.memory_seconds)} | {s(r.link_seconds)} | "
            f"{s(r.step_seconds)} |"
        )
    memory = f" of {device_memory / 1e9:.1f} GB" if device_memory else ""
    lines.append(
        f"best: {top.candidate.name} ({', '.join(top.candidate.overrides()[:5])}), bound {top.step_seconds:.3g} s"
        if top
        else f"no split fits{memory}"
    )
    return "\n".join(lines)
