"""int8 weights for a frozen LoRA base (QLoRA-style, `lora.base="int8"`): pure maths, no Flax.

A kernel W [in..., out...] is stored as q = round(W / s) in int8 with s = max|W| / 127 over the input
axes: one float32 scale per output channel, kept with the input axes as size 1 (`[1..., out...]`), so
it broadcasts against q and carries the kernel's logical axis names with `None` on the input axes.
The rounding error of an element is at most s / 2: 1/254 of its channel's largest weight.

Where it is used, a layer multiplies by the kernel through `einsum`, which dequantizes (q * s, in
the compute dtype) inside the layer, one layer at a time in a scanned stack, and whose backward
dequantizes again rather than keep the float kernel: the base is frozen, so the only gradient is
the input's, x' = y' W^T, and JAX's autodiff would otherwise save every layer's dequantized kernel
for it (a float copy of the model in the step's temporaries when the stack is not rematerialised).

Why not qwix (0.1.8, Google's JAX quantization library, which installs beside our jax and flax):
tried on our Transformer, `qwix.quantize_model` with a PTQ int8 rule fails on scanned stacks
(`AssertionError: shape=(16, 2, 8) spec=('layers', 'embed', 'heads', 'kv')`: it reads the stacked
kernel's sharding names inside the scan body, where the layers axis is gone) and, unrolled, also
quantizes the tied embedding that `jnp.take` then cannot read; `qwix.apply_lora_to_model` cannot tell
q, k and v apart ("Multiple candidate params found": it finds a weight by matching the einsum's operand
to same-shaped parameters) and brings LoRA params of its own beside ours (PEFT import/export, merge,
seeds). Its quantized weights are `WithAux(QArray)` pytrees whose scales carry no logical axis names
for our sharding rules. The maths needed here is two lines; it is kept here, testable on its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array
INT8_MAX = 127
PROJECTION = "int8_projection"  # the name of `einsum`'s output, which remat's `dots_saveable` keeps as a matmul's


def quantize(w: Array, in_axes: tuple[int, ...]) -> tuple[Array, Array]:
    """(q int8 like w, scale float32 [w's shape with `in_axes` of size 1]): symmetric absmax per output channel.

    Args:
        w: a float kernel, e.g. [D, H, K].
        in_axes: its input (contracted) axes.

    Returns:
        (q int8 of w's shape, scale float32).
    """
    absmax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=in_axes, keepdims=True)  # [1..., out...]
    scale = jnp.where(absmax > 0, absmax / INT8_MAX, 1.0)  # an all-zero channel stays zero, without 0/0
    q = jnp.clip(jnp.round(w.astype(jnp.float32) / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def dequantize(q: Array, scale: Array, dtype) -> Array:
    """q * scale in `dtype` (the product in float32, rounded once).

    Args:
        q: int8 kernel.
        scale: float32 scale, broadcastable to q.
        dtype (jnp.dtype): the result's dtype.

    Returns:
        q's shape in `dtype`.
    """
    return (q.astype(jnp.float32) * scale).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def einsum(spec: str, x: Array, q: Array, scale: Array, dtype) -> Array:
    """jnp.einsum(spec, x, dequantize(q, scale, dtype)) for a frozen kernel: only x has a gradient.

    `spec` is "x,w->y" where every letter of x appears in w or y (a projection), so the input's
    gradient is the einsum "y,w->x" of y's gradient and the kernel, dequantized anew in the backward.

    Args:
        spec: the einsum, "x,w->y" in the legend's letters.
        x: the input.
        q: the int8 kernel.
        scale: its float32 scale.
        dtype (jnp.dtype): the compute dtype.

    Returns:
        y in `dtype`.
    """
    return jnp.einsum(spec, x, dequantize(q, scale, dtype))


def _einsum_fwd(spec, x, q, scale, dtype):
    return einsum(spec, x, q, scale, dtype), (q, scale)  # residuals: the int8 kernel and its scale, no float copy


def _einsum_bwd(spec, dtype, residuals, dy):
    q, scale = residuals
    operands, y = spec.replace(" ", "").split("->")
    x, w = operands.split(",")
    dx = jnp.einsum(f"{y},{w}->{x}", dy, dequantize(q, scale, dtype))
    return dx, None, None  # the frozen kernel and its scale get no gradient


einsum.defvjp(_einsum_fwd, _einsum_bwd)
