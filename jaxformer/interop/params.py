"""Our side of a checkpoint: where a rule's parameter path lives in the model (unrolled, scanned in
blocks, an expert's slice of a stack: `_locate`), a tensor placed on its devices before the next is
read (`_fill`, a stack filled there slice by slice), the fresh heads a checkpoint lacks
(`_fresh_params`), and one parameter gathered back to the host (`_host_param`). load_hf, save_hf
and PEFT's adapters all go through it.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.config import ModelConfig
from jaxformer.models import Transformer


def _stacked_path(path: str, block: int = 1, head: int = 0) -> tuple[str, int | None]:
    """An unrolled path in a scanned model: ("encoder.stack.layers.q", 3) for "encoder.stack.layers.3.q";
    scanned in blocks of `block` layers (`ModelConfig.scan_block`, MoE every N-th layer), layer i is
    position i % N of block i // N: ("encoder.stack.layers.1.q", 1) for layer 3 with N = 2. A stack
    starting with `head` dense layers (`ModelConfig.dense_head`) keeps them unrolled in `dense_layers`
    ("decoder.stack.dense_layers.0.q", None) and counts the blocks from layer `head`."""
    match = re.match(r"^(.*)\.layers\.(\d+)\.(.*)$", path)
    if not match or path.startswith("mtp."):  # multi-token prediction's one layer is never scanned
        return path, None
    i = int(match[2])
    if i < head:
        return f"{match[1]}.dense_layers.{i}.{match[3]}", None
    i -= head
    position = "" if block == 1 else f".{i % block}"
    return f"{match[1]}.layers{position}.{match[3]}", i // block


def _head(cfg, path: str) -> int:
    """The unrolled dense layers a scanned stack of `path` starts with (`ModelConfig.dense_head`)."""
    stack = path.split(".")[0]
    return cfg.dense_head(stack) if stack in ("encoder", "decoder") else 0


def _locate(path: str, scanned: bool, block: int = 1, head: int = 0) -> tuple[str, tuple[int, ...]]:
    """Where a rule's (unrolled) path lives: the parameter and the leading indices of its slice in it.
    "decoder.stack.layers.3.ffn.wi[1]" is ("decoder.stack.layers.3.ffn.wi", (1,)) unrolled, and
    ("decoder.stack.layers.ffn.wi", (3, 1)) scanned (the layer axis first, then the expert axis;
    in blocks of `block` layers after `head` unrolled ones, `_stacked_path`)."""
    match = re.fullmatch(r"(.*)\[(\d+)\]", path)
    path, index = (match[1], (int(match[2]),)) if match else (path, ())
    if scanned:
        stacked, layer = _stacked_path(path, block, head)
        return stacked, index if layer is None else (layer, *index)
    return path, index


def _fill(arrays: list[np.ndarray], targets: list, pending: dict, flat: dict, placement: dict) -> dict:
    """Place a checkpoint tensor's parameter arrays (by path); a slice of a stacked parameter (a
    scanned layer's, an expert's) goes into its stack in `pending`, on the stack's devices, and a
    stack with every slice in is done.

    A function of its own so that no host array outlives this tensor: a loop variable would keep
    the last one alive while the next tensor is read.
    """
    placed = {}
    for (path, index), array in zip(targets, arrays, strict=True):
        sharding = placement.get(path)
        if not index:
            placed[path] = _place(array, sharding)
            continue
        if path not in pending:  # its first slice: the stack, zeros, straight on its devices
            pending[path] = (jnp.zeros(flat[path].shape, jnp.float32, device=sharding), set())
        stack, done = pending.pop(path)
        stack = _set_layer(stack, _place(array, _layer_sharding(sharding, len(index))), index, sharding)
        done.add(index)
        if len(done) == math.prod(stack.shape[: len(index)]):
            placed[path] = stack
        else:
            pending[path] = (stack, done)
    return placed


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _set_layer(stack: jax.Array, layer: jax.Array, index: tuple, sharding) -> jax.Array:
    """stack[index] = layer (`index` the leading indices: layer, expert), written in place (the stack
    is donated), laid out as `sharding`: a stack filled slice by slice on its devices, never whole on
    the host. The indices are traced: one compiled program serves every slice."""
    start = (*index, *(0,) * layer.ndim)
    stack = jax.lax.dynamic_update_slice(stack, layer.reshape((1,) * len(index) + layer.shape), start)
    return stack if sharding is None else jax.lax.with_sharding_constraint(stack, sharding)


def _layer_sharding(stacked, leading: int):
    """The sharding of one slice of a stack sharded as `stacked` (its `leading` axes dropped)."""
    if stacked is None:
        return None
    return jax.sharding.NamedSharding(stacked.mesh, jax.sharding.PartitionSpec(*stacked.spec[leading:]))


def _key(part: str):
    return int(part) if part.isdigit() else part


def _place(array: np.ndarray, sharding) -> jax.Array:
    # Parameters are float32 (compute runs in ModelConfig.dtype); a float32 tensor is not copied again.
    # device_put, also without a sharding: jnp.asarray would compile a program for each shape to stage it.
    return jax.device_put(array.astype(np.float32, copy=False), sharding)


def _fresh_params(cfg: ModelConfig, paths: list[str], placement: dict, mesh) -> dict:
    """Freshly initialised parameters at `paths` (the heads a checkpoint lacks), by path. Under jit
    only they are computed and placed: the rest of the initialisation is dead code XLA drops, so a
    new head on a large checkpoint never initialises the whole model again."""

    def create() -> dict:
        state = nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        every = {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(state)}
        return {p: every[p] for p in paths}

    with _rules_in_effect(mesh):
        return jax.jit(create, out_shardings={p: placement[p] for p in paths} if placement else None)()


def _rules_in_effect(mesh):
    """The mesh and rules context for sharded loading (the caller's rules if set, else the default)."""
    import contextlib

    import flax.linen as nn

    from jaxformer import sharding
    from jaxformer.config import MeshConfig

    if mesh is None or nn.get_logical_axis_rules():
        return contextlib.nullcontext()
    return sharding.use(mesh, sharding.rules_for(MeshConfig()))


def _param_shape(flat: dict, path: str, cfg: ModelConfig) -> tuple[int, ...]:
    stacked, index = _locate(path, cfg.scan_layers, cfg.scan_block, _head(cfg, path))
    return flat[stacked].shape[len(index) :]


def _host_param(flat: dict, path: str, cfg: ModelConfig) -> np.ndarray:
    """One parameter (one layer's or expert's slice of a stack) gathered to the host as float32."""
    stacked, index = _locate(path, cfg.scan_layers, cfg.scan_block, _head(cfg, path))
    value = flat[stacked][...]
    return np.asarray(jax.device_get(value[index] if index else value), np.float32)
