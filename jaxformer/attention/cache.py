"""The KV cache: keys and values of the positions decoded so far, written in place a few rows at a time.

A self-attention cache holds keys and values heads-major, [B, G, S, K] (the attention products
read them in place, where [B, S, G, K] would be transposed in full at every step); slot s holds
position s. With a context axis the slots are split over it by position (`CACHE`). On one device a
local layer's cache (a sliding window's) is a ring of the window's slots (`ring_positions`, `write_ring`).
The layer that
fills and reads it is `jaxformer.attention.layer.MultiHeadAttention` (`empty_cache`, `extend`).

A paged cache (the inference engine's) holds every sequence's keys and values in one pool of pages
instead; `page_slots`, `write_pages` and `read_pages` below are its maths, and `extend` attends over it
in place when its cache entry carries a page table.
Plain `jax.numpy`, no Flax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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


def write_valid_rows(buffer_BS: Array, new_BT: Array, start_B: Array, valid_BT: Array, axis: int = 1) -> Array:
    """`write_rows` of the positions that are `valid` only: slot start_b + t of row b takes new[b, t]
    where valid[b, t], and keeps what it holds elsewhere.

    Args:
        buffer_BS: the buffer, [B, S, ...] (or [B, G, S, K] with axis=2).
        new_BT: the rows to write, the buffer's shape with T in place of S.
        start_B: [B] int, where each row's slice starts.
        valid_BT: [B, T] bool, which of the T are written.
        axis: the slot axis.

    Returns:
        The updated buffer, its shape and dtype.
    """
    T = new_BT.shape[axis]
    held_BT = jax.vmap(lambda buf, start: jax.lax.dynamic_slice_in_dim(buf, start, T, axis - 1))(buffer_BS, start_B)
    valid = valid_BT.reshape(valid_BT.shape[:1] + (1,) * (axis - 1) + (T,) + (1,) * (new_BT.ndim - axis - 1))
    return write_rows(buffer_BS, jnp.where(valid, new_BT.astype(buffer_BS.dtype), held_BT), start_B, axis)


# A local layer's cache (a sliding window of W positions) is a ring of R = min(W, S_max) slots: position p
# lives at slot p % R, so the ring holds the R latest positions, all that a query of the window sees.


def ring_positions(last_B: Array, slots: int) -> Array:
    """[B, R] the position each slot of a ring of R slots holds once every position up to `last_B` has been
    written at slot p % R: last - ((last - s) mod R); negative where nothing was written yet.

    Args:
        last_B: [B] int, each row's latest position written (-1: none).
        slots: R.

    Returns:
        [B, R] int positions.
    """
    return last_B[:, None] - (last_B[:, None] - jnp.arange(slots)[None, :]) % slots


def write_ring(ring_BGRK: Array, new_BGTK: Array, first_B: Array, count_B: Array | None = None) -> Array:
    """The ring ([B, G, R, K] heads-major) after new positions first_b, first_b + 1, ... are written at
    slots p % R in order: each slot takes the newest new position it holds and keeps its own otherwise.

    Args:
        ring_BGRK: [B, G, R, K] the ring, holding every position before `first_B`.
        new_BGTK: [B, G, T, K] keys (or values) of T positions from `first_B` on.
        first_B: [B] int, each row's first new position.
        count_B: [B] int, how many of the T are real (the rest, padding, are not written); None: all T.

    Returns:
        The updated ring, its shape and dtype.
    """
    R, T = ring_BGRK.shape[2], new_BGTK.shape[2]
    count_B = jnp.full_like(first_B, T) if count_B is None else count_B
    t_BR = ring_positions(first_B + count_B - 1, R) - first_B[:, None]  # index into T; < 0: an older position
    taken_BGRK = jnp.take_along_axis(new_BGTK, jnp.clip(t_BR, 0, T - 1)[:, None, :, None], axis=2)
    return jnp.where((t_BR >= 0)[:, None, :, None], taken_BGRK.astype(ring_BGRK.dtype), ring_BGRK)


# A paged cache (the inference engine's, `jaxformer.engine`): a pool of pages [G, N, page, K] shared by
# every sequence, and a page table [B, P] per row listing its pages in order, so position p of row b
# lives in page table[b, p // page] at offset p % page. Page 0 is scratch: positions that are not real
# (a chunk's padding, an idle row) write there, and no row reads it as one of its own pages. The pool is
# heads-major, heads outermost, as the Pallas paged-attention kernels of TPU and GPU read it
# (`jaxformer.attention.paged_kernel`); a row's pages of each head gathered side by side become its
# [B, G, S, K] keys by moving whole [P * page, K] blocks (position-major pages [page, G, K] had to be
# transposed K values at a time, which cost ~7x the rest of the attention on CPU at 32 rows of 12 pages).
# Latent attention's pools (`model.mla`) have no heads' axis: its latents [N, page, C] and rope keys
# [N, page, R], (C + R) values a position, read by the absorbed form.


def page_slots(table_BP: Array, positions_BT: Array, valid_BT: Array, page_size: int) -> tuple[Array, Array]:
    """Where each position lives: (page [B, T], offset [B, T]); page 0 (scratch) where not `valid`.

    Args:
        table_BP: [B, P] the rows' page tables.
        positions_BT: [B, T] positions.
        valid_BT: [B, T] bool, the positions that are real.
        page_size: positions per page.

    Returns:
        result (tuple[Array, Array]): (page_BT, offset_BT), int32.
    """
    column_BT = jnp.clip(positions_BT // page_size, 0, table_BP.shape[1] - 1)
    page_BT = jnp.take_along_axis(table_BP, column_BT, axis=1)
    return jnp.where(valid_BT, page_BT, 0).astype(jnp.int32), (positions_BT % page_size).astype(jnp.int32)


def write_pages(pool_GNPK: Array, new_BTGK: Array, page_BT: Array, offset_BT: Array) -> Array:
    """pool[g, page[b, t], offset[b, t]] = new[b, t, g] for every (b, t, g): B * T * G rows of K values
    written, the rest of the pool untouched (in place where the pool is donated or carried by a loop).
    Writes to page 0 are scratch. A latent pool [N, page, X] (no heads' axis: latent attention's) takes
    new [B, T, X] the same way.

    Args:
        pool_GNPK: [G, N, page, K] the pool (or a latent pool [N, page, X]).
        new_BTGK: [B, T, G, K] keys (or values) of new positions (or [B, T, X] latents).
        page_BT: [B, T] their pages.
        offset_BT: [B, T] their offsets in the pages.

    Returns:
        The updated pool, its shape and dtype.
    """
    # A scatter of [G, K] windows: the heads' axis stays whole, so its split over a mesh axis is kept.
    if pool_GNPK.ndim == 3:  # a latent pool [N, page, X]
        return pool_GNPK.at[page_BT, offset_BT].set(new_BTGK.astype(pool_GNPK.dtype))
    new_GBTK = jnp.moveaxis(new_BTGK, 2, 0).astype(pool_GNPK.dtype)
    return pool_GNPK.at[:, page_BT, offset_BT].set(new_GBTK)


def read_pages(pool_GNPK: Array, table_BP: Array) -> Array:
    """Each row's pages in its table's order, heads-major as the dense cache: [B, G, P * page, K] (slot s
    of row b is position s of its sequence). One gather of P whole pages per row and head, then whole
    [P * page, K] blocks moved into place; attention reads the result as it reads a dense cache. A latent pool
    [N, page, X] gives [B, P * page, X] (its pages are contiguous already: no move).

    Args:
        pool_GNPK: [G, N, page, K] the pool (or [N, page, X]).
        table_BP: [B, P] int, the pages of each row (page 0 where it has none).

    Returns:
        [B, G, P * page, K] (or [B, P * page, X]).
    """
    B, P = table_BP.shape
    if pool_GNPK.ndim == 3:  # a latent pool: a row's pages side by side are its slots
        N, S, X = pool_GNPK.shape
        return jnp.take(pool_GNPK.reshape(N, S * X), table_BP, axis=0, mode="clip").reshape(B, P * S, X)
    G, N, S, K = pool_GNPK.shape
    # The heads' axis stays its own (its split over a mesh axis is kept); whole [P * page, K] blocks move after.
    rows_GBP = jnp.take(pool_GNPK.reshape(G, N, S * K), table_BP, axis=1, mode="clip")  # [G, B, P, page * K]
    return jnp.swapaxes(rows_GBP, 0, 1).reshape(B, G, P * S, K)
