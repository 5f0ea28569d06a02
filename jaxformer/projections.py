"""How a layer applies its weight kernels: the einsum in the compute dtype, a kernel stored in int8
dequantized where it is read (`jaxformer.quant`), and a LoRA adapter's update added (`jaxformer.lora`).

Shared by every layer that holds kernels: attention (`jaxformer.attention.layer`), the feed-forward
and the heads (`jaxformer.layers`, `jaxformer.models`).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxformer import quant

Array = jax.Array


def project(module: nnx.Module, name: str, spec: str, x: Array) -> Array:
    """`einsum(spec, x, module.<name>)` in the compute dtype. A kernel stored in int8 beside its
    `<name>_scale` (a LoRA run's frozen base, `lora.quantize_base`) is dequantized here, in the layer
    that reads it: one layer at a time in a scanned stack, and again in the backward (`quant.einsum`).

    Args:
        module: the layer holding the kernel (and its `<name>_scale` when quantized).
        name: the kernel's attribute name ("q", "wo", ...).
        spec: the einsum, in the legend's letters ("BTD,DHK->BTHK").
        x: the input, in the compute dtype.

    Returns:
        The einsum's output, in the compute dtype.
    """
    dt = module.cfg.dtype
    scale = getattr(module, f"{name}_scale", None)
    if scale is None:
        return jnp.einsum(spec, x, getattr(module, name)[...].astype(dt))
    y = quant.einsum(spec, x, getattr(module, name)[...], scale[...], dt)
    return checkpoint_name(y, quant.PROJECTION)  # saved as `dots_saveable` saves a matmul


def adapted(module: nnx.Module, name: str, x: Array, y: Array, dropout_rng: Array | None) -> Array:
    """`y = x @ module.<name>`, plus the update of its LoRA adapter (`jaxformer.lora`) if it has one.

    The adapter's dropout key is folded from the sublayer's with the kernel's name: the masks of
    the layer's own dropout stay what they are without LoRA.

    Args:
        module: the layer holding kernel `name` (and its adapter, if any).
        name: the kernel's attribute name.
        x: the input the kernel was applied to.
        y: x @ the kernel, as computed by the caller.
        dropout_rng: the sublayer's dropout key, or None.

    Returns:
        `y` plus the adapter's update, y's shape.
    """
    adapter = getattr(module, f"{name}_lora", None)
    if adapter is None:
        return y
    rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, zlib.crc32(name.encode()) & 0x7FFFFFFF)
    return y + adapter(x, rng).astype(y.dtype)
