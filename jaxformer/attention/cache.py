"""The KV cache: keys and values of the positions decoded so far, written in place a few rows at a time.

A self-attention cache holds keys and values heads-major, [B, G, S, K] (the attention products
read them in place, where [B, S, G, K] would be transposed in full at every step); slot s holds
position s. With a context axis the slots are split over it by position (`CACHE`). The layer that
fills and reads it is `jaxformer.attention.layer.MultiHeadAttention` (`empty_cache`, `extend`).
Plain `jax.numpy`, no Flax.
"""

from __future__ import annotations

import jax

Array = jax.Array
CACHE = ("batch", "heads", "length", None)  # a KV cache [B, G, S, K] split by position on the context axis


def write_rows(buffer_BS: Array, new_BT: Array, start_B: Array, axis: int = 1) -> Array:
    """buffer[b, start_b : start_b + T] = new[b] for each row b along `axis` (the slot axis of a KV
    cache, 1 for [B, S, ...], 2 for heads-major [B, G, S, K]); the other axes are kept.

    Starts must leave room: like `lax.dynamic_update_slice`, a start past S - T is clamped.

    Args:
        buffer_BS: the buffer, [B, S, ...] (or [B, G, S, K] with axis=2).
        new_BT: the rows to write, the buffer's shape with T in place of S.
        start_B: [B] int, where each row's slice starts.
        axis: the slot axis.

    Returns:
        The updated buffer, its shape and dtype.
    """
    row_axis = axis - 1  # inside one row
    write = lambda buf, new, start: jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), start, row_axis)
    return jax.vmap(write)(buffer_BS, new_BT, start_B)
