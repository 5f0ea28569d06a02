"""Plan before you launch: compile the training step ahead of time for the configured mesh and
report, per device, what it holds and whether it fits.

Nothing is allocated: the state is abstract (shapes, dtypes and shardings), and `jit(...).lower(...)
.compile()` runs XLA's real partitioner and scheduler for the mesh. On a laptop the mesh is made of
fake CPU devices (`jaxformer plan --devices 64`): the paper's base model on 8 devices plans in about
a minute on 2 cores, four compiles with `--device-memory` (one without). XLA's CPU compiler decides the
buffers; a GPU's or TPU's compiler fuses and schedules differently, so read the figures as the
program's shape, not a promise to the byte.

    jaxformer plan --config experiments/paper_base_en_de.py --devices 8 --set mesh.fsdp=8 --device-memory 80GB
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np

from jaxformer import sharding
from jaxformer.config import Config, ConfigError
from jaxformer.train import flops_per_example, make_steps, state_factory


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

    def table(self) -> str:
        gb = lambda b: f"{b / 1e9:9.3f} GB"
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items())
        lines = [
            f"mesh {mesh} over {self.devices} devices, global batch {self.batch_size}; per device:",
            f"  parameters         {gb(self.parameters)}",
            f"  optimizer state    {gb(self.optimizer_state)}",
            f"  gradients          {gb(self.gradients)}   (the parameters' size)",
            f"  activations        {gb(self.activations)}   (XLA's temporaries less the gradients)",
            f"  compiled step      arguments {self.arguments / 1e9:.3f} GB, outputs {self.outputs / 1e9:.3f} GB "
            f"(aliased to donated arguments {self.aliased / 1e9:.3f} GB), temporaries {self.temporaries / 1e9:.3f} GB, "
            f"code {self.code / 1e9:.3f} GB",
            f"  peak               {gb(self.peak)}",
            f"FLOPs per step: {self.flops_per_device:.4g} per device (XLA), model {self.model_flops:.4g} in all",
        ]
        if self.device_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"device memory {self.device_memory / 1e9:.3f} GB: batch {self.batch_size} {verdict}")
            largest = "none: even the smallest batch does not fit" if not self.largest_batch else self.largest_batch
            lines.append(f"largest global batch that fits: {largest}")
        return "\n".join(lines)


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
    T, objective = cfg.data.max_len, cfg.train.objective
    rows = sharding.batch_sharding(mesh)
    ids = jax.ShapeDtypeStruct((batch_size, T), np.int32, sharding=rows)
    per_row = lambda dtype: jax.ShapeDtypeStruct((batch_size,), dtype, sharding=rows)
    if objective == "classify":
        return {"src": ids, "src_lengths": per_row(np.int32), "label": per_row(np.int32)}
    batch = {"inputs": ids, "targets": ids, "weights": jax.ShapeDtypeStruct((batch_size, T), np.float32, sharding=rows)}
    return batch | ({"src": ids, "src_lengths": per_row(np.int32)} if objective == "seq2seq" else {})


def _shard_bytes(tree) -> int:
    """Bytes of this device's shard of every leaf (ShapeDtypeStructs with shardings)."""
    leaves = jax.tree.leaves(tree)
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)


def plan(cfg: Config, device_memory: float | None = None, batch_size: int | None = None) -> Plan:
    """Compile `cfg`'s training step for its mesh over this process's devices (abstract state) and
    report per-device bytes; with `device_memory`, whether it fits and the largest batch that does."""
    mesh = sharding.make_mesh(cfg.mesh)
    batch_size = cfg.train.batch_size if batch_size is None else batch_size
    with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
        graphdef, create, optimizer = state_factory(cfg)
        abstract = jax.eval_shape(create)
        shardings = sharding.state_shardings(abstract, mesh)
        leaves, treedef = jax.tree.flatten(abstract)
        state = treedef.unflatten(
            [
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                for a, s in zip(leaves, jax.tree.leaves(shardings), strict=True)
            ]
        )
        train_step = jax.jit(make_steps(graphdef, cfg, optimizer)[0], out_shardings=(shardings, None), donate_argnums=0)
        shards = math.prod(mesh.shape[a] for a in sharding.BATCH)

        def compiled_at(B: int):
            if B % shards:
                raise ConfigError(f"train.batch_size={B} does not divide over the {shards} batch shards")
            return train_step.lower(state, abstract_batch(cfg, B, mesh)).compile()

        def peak_of(compiled) -> int:
            m = compiled.memory_analysis()
            return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                    + m.temp_size_in_bytes + m.generated_code_size_in_bytes)  # fmt: skip

        compiled = compiled_at(batch_size)
        m = compiled.memory_analysis()
        params, opt = _shard_bytes(state.params), _shard_bytes(state.opt_state)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        peak = peak_of(compiled)
        fits, largest = None, None
        if device_memory is not None:
            fits = peak <= device_memory
            largest = _largest_batch(compiled_at, peak_of, shards, device_memory)
    T = cfg.data.max_len
    return Plan(
        devices=mesh.size, mesh=dict(mesh.shape), batch_size=batch_size, parameters=params, optimizer_state=opt,
        gradients=params, activations=max(m.temp_size_in_bytes - params, 0), arguments=m.argument_size_in_bytes,
        outputs=m.output_size_in_bytes, aliased=m.alias_size_in_bytes, temporaries=m.temp_size_in_bytes,
        code=m.generated_code_size_in_bytes, peak=peak, flops_per_device=float(cost.get("flops", float("nan"))),
        model_flops=flops_per_example(cfg.model, cfg.train.objective, T, T) * batch_size,
        device_memory=device_memory, fits=fits, largest_batch=largest,
    )  # fmt: skip


def _largest_batch(compiled_at, peak_of, shards: int, memory: float) -> int:
    """The largest multiple of `shards` whose step fits in `memory`: memory grows about linearly with
    the batch, so two compiles give the line; the guess is then checked and stepped down if over."""
    small, large = shards, 4 * shards
    p_small, p_large = peak_of(compiled_at(small)), peak_of(compiled_at(large))
    if p_small > memory:
        return 0
    per_row = max((p_large - p_small) / (large - small), 1.0)
    guess = max(shards, int((memory - p_small) / per_row + small) // shards * shards)
    while guess > shards and peak_of(compiled_at(guess)) > memory:
        guess -= shards
    return guess
