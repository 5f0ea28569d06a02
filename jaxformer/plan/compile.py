"""One step compiled ahead of time: a config's training step lowered on an abstract state and batch,
the figures a plan reads from the compiled program (`Compiled`), and the disk cache that keeps them."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import pathlib
import re
import tempfile
import time

import jax
import numpy as np

from jaxformer import sharding
from jaxformer.config import Config
from jaxformer.plan.hlo import bytes_moved, collective_bytes, cudnn_calls, kernel_calls
from jaxformer.state import TrainState, state_factory, state_shardings
from jaxformer.train import make_steps


def abstract_batch(cfg: Config, batch_size: int, mesh) -> dict:
    """ShapeDtypeStructs of a global training batch of `cfg`'s objective, sharded over the batch axes.

    Args:
        cfg: the run's config.
        batch_size: the global batch.
        mesh (jax.sharding.Mesh): the mesh.

    Returns:
        key -> jax.ShapeDtypeStruct ([B, T] and others).
    """
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


def lower_train_step(cfg: Config, mesh, batch_size: int) -> tuple[jax.stages.Lowered, TrainState]:
    """`cfg`'s training step lowered for `mesh` as training lays it out (the state's shardings, an
    offloaded optimizer state in host memory, the state donated) on an abstract state and batch:
    nothing is allocated. `Compiled.of(lowered)` gives its figures.

    Args:
        cfg: the run's config.
        mesh (jax.sharding.Mesh): the mesh (real devices, fake CPU ones or a compile-only target's).
        batch_size: the global batch.

    Returns:
        The lowered step and the abstract state (ShapeDtypeStructs).
    """
    with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
        graphdef, create, optimizer = state_factory(cfg)
        abstract = jax.eval_shape(create)
        shardings = state_shardings(cfg, abstract, mesh)
        step = jax.jit(make_steps(graphdef, cfg, optimizer)[0], out_shardings=(shardings, None), donate_argnums=0)
        return step.lower(with_shardings(abstract, shardings), abstract_batch(cfg, batch_size, mesh)), abstract


def with_shardings(abstract, shardings):
    """The abstract state (or parameters) with each leaf's sharding: what `jit(...).lower` compiles for.

    Args:
        abstract (object): a pytree of ShapeDtypeStructs.
        shardings (object): the same pytree of shardings.

    Returns:
        tree (object): the pytree of sharded ShapeDtypeStructs.
    """
    leaves, treedef = jax.tree.flatten(abstract)
    shaped = zip(leaves, jax.tree.leaves(shardings), strict=True)
    return treedef.unflatten([jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in shaped])


def _shard_bytes(tree) -> int:
    """Bytes of this device's shard of every leaf (ShapeDtypeStructs with shardings)."""
    leaves = jax.tree.leaves(tree)
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What a plan reads from one compiled step, per device: XLA's memory and cost analyses, the
    fused attention kernels, or the TPU compiler's refusal of a program over its memory.

    Attributes:
        arguments: arguments, bytes per device.
        outputs: outputs, bytes per device.
        aliased: outputs written into donated arguments
        temporaries: temporaries, bytes per device.
        code: the compiled program, bytes.
        flops: XLA's FLOPs per device (NaN: none).
        bytes_accessed: XLA's bytes accessed per device (NaN: none).
        bytes_moved: counted from the compiled program's text (`bytes_moved`), where XLA gives no
            cost analysis (a GPU target); NaN: not counted
        kernels: Pallas kernel calls in the step (`kernel_calls`), or cuDNN attention calls (`cudnn_calls`)
        collectives: {kind: (bytes, ops)} (`collective_bytes`); None: not counted
        host_arguments: arguments in host memory, bytes per device (offloaded optimizer state)
        host_outputs: outputs in host memory, bytes per device
        host_temporaries: temporaries in host memory, bytes per device (offloaded activations)
        compiler_peak: the compiler's own estimate of the device's peak (its heap simulation); 0: none
        refused: the compiler's out-of-memory message: nothing else is known
    """

    arguments: int = 0
    outputs: int = 0
    aliased: int = 0  # outputs written into donated arguments
    temporaries: int = 0
    code: int = 0
    flops: float = math.nan
    bytes_accessed: float = math.nan
    bytes_moved: float = math.nan  # counted from the compiled text (`bytes_moved`) where XLA gives no cost analysis
    kernels: int = 0  # Pallas kernel calls in the step (`kernel_calls`), or cuDNN attention calls (`cudnn_calls`)
    collectives: dict | None = None  # {kind: (bytes, ops)} (`collective_bytes`); None: not counted
    refused: str | None = None  # the compiler's out-of-memory message: nothing else is known
    host_arguments: int = 0  # the same in host memory (offloaded optimizer state, activations)
    host_outputs: int = 0
    host_temporaries: int = 0
    compiler_peak: int = 0  # the compiler's own estimate of the device's peak (its heap simulation), if it gives one

    @property
    def peak(self) -> int:
        """Bytes held at once: arguments, outputs not written into donated arguments, temporaries, code;
        with host offload, at least the compiler's own estimate (the copies' device buffers: an
        offloaded optimizer state is updated on the device beside the copy it came from)."""
        held = self.arguments + self.outputs - self.aliased + self.temporaries + self.code
        offloaded = self.host_arguments or self.host_outputs or self.host_temporaries
        return max(held, self.compiler_peak) if offloaded else held

    @classmethod
    def of(cls, lowered, gpu: bool = False, collectives: bool = False) -> Compiled:
        """The figures of `lowered` compiled.

        Args:
            lowered (jax.stages.Lowered): a lowered step.
            gpu: compiled for GPUs, whose attention kernels show in the compiled text.
            collectives: count the collectives in the compiled text (asked only of MoE steps under
                expert parallelism). The compiler writes the program's text itself: v5p's compiled text
                of a SparseCore-offloaded gather makes jaxlib print a stack trace (see `kernel_calls`).

        Returns:
            The figures.
        """
        directory = tempfile.TemporaryDirectory() if collectives else contextlib.nullcontext()
        try:
            with directory as dump:  # the compiler writes the program's text itself: on v5p (SparseCore
                # offload) jaxlib cannot read a compiled program back (`kernel_calls`)
                options = {"xla_dump_to": dump, "xla_dump_hlo_as_text": True, "xla_dump_hlo_module_re": ".*_step"}
                compiled = lowered.compile(options if collectives else None)
                texts = sorted(pathlib.Path(dump).glob("*after_optimizations.txt")) if collectives else []
                moved = collective_bytes("\n".join(path.read_text() for path in texts)) if collectives else None
        except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program over its HBM
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            return cls(refused=str(e).splitlines()[0])
        m = compiled.memory_analysis()
        cost = compiled.cost_analysis() or {}  # none from XLA's GPU compiler without a GPU
        cost = (cost[0] if cost else {}) if isinstance(cost, list) else cost
        text = compiled.as_text() if gpu else ""
        return cls(
            collectives=moved,
            arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes, aliased=m.alias_size_in_bytes,
            temporaries=m.temp_size_in_bytes, code=m.generated_code_size_in_bytes,
            host_arguments=m.host_argument_size_in_bytes, host_outputs=m.host_output_size_in_bytes,
            host_temporaries=m.host_temp_size_in_bytes, compiler_peak=getattr(m, "peak_memory_in_bytes", 0),
            flops=float(cost.get("flops", math.nan)), bytes_accessed=float(cost.get("bytes accessed", math.nan)),
            bytes_moved=bytes_moved(text) if gpu and "bytes accessed" not in cost else math.nan,
            kernels=cudnn_calls(text) if gpu else kernel_calls(lowered.as_text()),
        )  # fmt: skip


def cache_dir() -> pathlib.Path | None:
    """Where the figures of compiled steps are kept: $JAXFORMER_PLAN_CACHE (empty: nowhere), else
    $XDG_CACHE_HOME/jaxformer/plan or ~/.cache/jaxformer/plan. A plan compiled once is read back in
    seconds; a TPU compile-only executable cannot be kept by JAX's own cache (it cannot be loaded).

    Returns:
        The directory, or None (nothing kept).
    """
    if (path := os.environ.get("JAXFORMER_PLAN_CACHE")) is not None:
        return pathlib.Path(path) if path else None
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "jaxformer" / "plan"


# The installed distributions whose versions decide what a compiler makes of a program: JAX and XLA's
# CPU compiler, libtpu, the CUDA plugins of any CUDA major (`jax-cuda12-plugin`, `jax-cuda13-pjrt`) and cuDNN.
_COMPILERS = re.compile(r"(jax|jaxlib|libtpu(-nightly)?|jax-cuda\d+-(plugin|pjrt)|nvidia-cudnn-cu\d+)")


def compiler_versions() -> dict[str, str]:
    """{name: version} of the installed compilers' distributions (`_COMPILERS`), by normalised name.

    Returns:
        The versions, sorted by name.
    """
    found = {}
    for dist in importlib.metadata.distributions():
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower()
        if _COMPILERS.fullmatch(name):
            found[name] = dist.version
    return dict(sorted(found.items()))


def _cache_key(lowered, mesh) -> str:
    """The program (its StableHLO), the devices it is laid on and everything else that decides what
    the compiler makes of it: versions (of the TPU and GPU compilers too), XLA and libtpu flags, JAX's
    compiler settings."""
    device = mesh.devices.flat[0]
    settings = {
        "versions": compiler_versions(), "platform": device.platform, "device_kind": device.device_kind,
        "devices": [d.id for d in mesh.devices.flat], "mesh": sharding.axis_sizes(mesh),
        "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")},
        "figures": 2,  # how the figures are read: 2 counts tuple all-reduces with numbered elements
        "jax": {k: str(jax.config.values[k]) for k in sorted(jax.config.values) if "optimization" in k
                or "memory_fitting" in k or k == "jax_disable_most_optimizations"},
    }  # fmt: skip
    text = lowered.as_text() + json.dumps(settings, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _cache_read(key: str) -> Compiled | None:
    directory = cache_dir()
    try:
        figures = json.loads((directory / f"{key}.json").read_text()) if directory else None
    except (OSError, ValueError):  # absent or unreadable: compile
        return None
    if not isinstance(figures, dict) or set(figures) != {f.name for f in dataclasses.fields(Compiled)}:
        return None  # written by a version with other figures: compile
    return Compiled(**figures)


def _cache_write(key: str, figures: Compiled) -> None:
    directory = cache_dir()
    if directory is None:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f"{key}.{os.getpid()}.tmp"
        partial.write_text(json.dumps(dataclasses.asdict(figures)))
        partial.replace(directory / f"{key}.json")  # whole or absent, for a reader beside us
    except OSError:  # a read-only home: the plan is still right, only not kept
        pass


def _compile_cached(pool, key: str, lower, *, gpu: bool, collectives: bool = False, on_read=None, on_compiled=None):
    """The figures of the program `lower()` gives: read back from the plan cache under `key`, or the program
    lowered here (tracing reads this thread's mesh) and compiled in `pool`, then written to the cache.
    `on_read()` is called on a cache hit; `on_compiled(figures, start, end)` after a compile, with its times."""
    if (figures := _cache_read(key)) is not None:
        if on_read:
            on_read()
        done = concurrent.futures.Future()
        done.set_result(figures)
        return done
    lowered = lower()

    def compile_() -> Compiled:
        start = time.perf_counter()
        figures = Compiled.of(lowered, gpu=gpu, collectives=collectives)
        end = time.perf_counter()
        _give_back_memory()
        if on_compiled:
            on_compiled(figures, start, end)
        _cache_write(key, figures)
        return figures

    return pool.submit(compile_)


def _give_back_memory() -> None:
    """Hand the heap a compile has freed back to the system (glibc keeps it otherwise): a search of
    paper_base on v4:4x4x8 held 18 GB after ten compiles of at most 5 GB each."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL(None).malloc_trim(0)
