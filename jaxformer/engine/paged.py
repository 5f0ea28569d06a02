"""The paged KV cache's maths: pages gathered into a sequence's view, new keys and values written into
pages, and the model's decoding step run over pages (`paged_step`). Plain `jax.numpy` and the model.

The pool of one layer holds keys (or values) as [N, page, G, K]: N pages of `page` positions each. A
sequence's page table [P] lists its pages in order, so position p lives in page table[p // page] at
offset p % page. Page 0 is scratch: rows and positions that write nothing real (padding of a chunk, an
idle slot) write there, and no sequence reads it as one of its own pages.

The reference path (every backend here): an XLA gather of each row's pages into a dense view
[B, G, P * page, K], the model's cached attention over it (`Transformer.decode_step`, masks from the
positions), then a scatter of the new positions' keys and values into their pages. TPU's Pallas ragged
paged attention (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`), which reads pages in place,
is not wired in yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.attention.masks import Mask

Array = jax.Array
PAGES = (None, None, "heads", None)  # a pool [N, page, G, K]: heads split over `tensor` like the model's


def gather_pages(pool_NPGK: Array, table_BP: Array) -> Array:
    """Each row's pages, in its table's order, as one dense heads-major view.

    Args:
        pool_NPGK: [N, page, G, K] the pool.
        table_BP: [B, P] int, the pages of each row (page 0 where it has none).

    Returns:
        [B, G, P * page, K]: slot s of row b is position s of its sequence.
    """
    x_BPSGK = jnp.take(pool_NPGK, table_BP, axis=0)  # [B, P, page, G, K]
    B, P, S, G, K = x_BPSGK.shape
    return jnp.swapaxes(x_BPSGK.reshape(B, P * S, G, K), 1, 2)


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


def write_pages(pool_NPGK: Array, new_BTGK: Array, page_BT: Array, offset_BT: Array) -> Array:
    """pool[page[b, t], offset[b, t]] = new[b, t] for every (b, t) (writes to page 0 are scratch).

    Args:
        pool_NPGK: [N, page, G, K] the pool.
        new_BTGK: [B, T, G, K] keys (or values) of new positions.
        page_BT: [B, T] their pages.
        offset_BT: [B, T] their offsets in the pages.

    Returns:
        The updated pool, its shape and dtype.
    """
    return pool_NPGK.at[page_BT, offset_BT].set(new_BTGK.astype(pool_NPGK.dtype))


def paged_step(
    model,
    pools: list,
    table_BP: Array,
    ids_BT: Array,
    positions_BT: Array,
    valid_BT: Array,
    memory: list | None = None,
    src_lengths_B: Array | None = None,
):
    """The model's decoding step over paged caches: logits of T new positions per row, their keys and
    values written into the rows' pages.

    Each layer's pages are gathered into a view [B, G, P * page + T, K] (T scratch slots at the end, so
    a chunk's padding past the last page never clamps the real writes), the model attends over it with
    its causal cache mask (slot s holds position s; padding sits after every real position and is seen
    by none), and the new keys and values, read back from the view at their positions, go to their pages.

    Args:
        model (Transformer): a decodable model (`decode.decodable`), decoder_only or encoder_decoder.
        pools (list[dict]): per layer {"k", "v"}: [N, page, G, K].
        table_BP: [B, P] the rows' page tables.
        ids_BT: [B, T] new ids.
        positions_BT: [B, T] their positions.
        valid_BT: [B, T] bool, which are real (others write to scratch).
        memory: encoder_decoder: per layer the rows' cross-attention {"k", "v"}: [B, G, S, K]; or None.
        src_lengths_B: [B] the rows' source lengths (with `memory`).

    Returns:
        result (tuple[Array, list]): (logits [B, T, V], the updated pools).
    """
    T, page_size = ids_BT.shape[1], pools[0]["k"].shape[1]
    pad = ((0, 0), (0, 0), (0, T), (0, 0))
    views = [{"self": {n: jnp.pad(gather_pages(pool[n], table_BP), pad) for n in "kv"}} for pool in pools]
    cache = {"layers": views}
    if memory is not None:  # cross-attention over each row's source, its keys and values computed once
        cache = {"layers": [v | {"memory": m} for v, m in zip(views, memory, strict=True)]}
        cache["memory_mask"] = Mask(kv_lengths=src_lengths_B)
    logits_BTV, cache = model.decode_step(cache, ids_BT, positions_BT)
    page_BT, offset_BT = page_slots(table_BP, positions_BT, valid_BT, page_size)
    S = views[0]["self"]["k"].shape[2]
    index_B1T1 = jnp.clip(positions_BT, 0, S - 1)[:, None, :, None]
    updated = []
    for pool, layer in zip(pools, cache["layers"], strict=True):
        new = {n: jnp.swapaxes(jnp.take_along_axis(layer["self"][n], index_B1T1, axis=2), 1, 2) for n in "kv"}
        updated.append({n: write_pages(pool[n], new[n], page_BT, offset_BT) for n in "kv"})
    return logits_BTV, updated


# ----------------------------------------------------------------------------- per-row sampling


def filter_rows(logits_BV: Array, top_k_B: Array, top_p_B: Array) -> Array:
    """`decode.top_k_filter` then `decode.top_p_filter` with a k and a p per row (k = 0, p = 1: off), so
    one compiled step serves every mix of requests.

    Args:
        logits_BV: [B, V] logits (already divided by the temperature).
        top_k_B: [B] int, the k largest kept (0: all).
        top_p_B: [B] float, the nucleus mass kept (1: all).

    Returns:
        [B, V], the dropped logits -inf.
    """
    V = logits_BV.shape[-1]
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)
    kth_B1 = jnp.take_along_axis(sorted_BV, jnp.clip(top_k_B - 1, 0, V - 1)[:, None], axis=1)
    drop_BV = (top_k_B > 0)[:, None] & (top_k_B < V)[:, None] & (logits_BV < kth_B1)
    logits_BV = jnp.where(drop_BV, -jnp.inf, logits_BV)
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)
    probs_BV = jax.nn.softmax(sorted_BV.astype(jnp.float32), axis=-1)
    kept_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV < top_p_B[:, None]  # the mass above has not reached p
    threshold_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((top_p_B < 1.0)[:, None] & (logits_BV < threshold_B1), -jnp.inf, logits_BV)


def request_keys(seeds_B: Array, positions_B: Array) -> Array:
    """One PRNG key per row from its request's seed and the position of the token it draws: a request
    draws the same tokens alone or among others, and again after a preemption recomputes it.

    Args:
        seeds_B: [B] uint32 request seeds.
        positions_B: [B] int, the positions of the tokens drawn.

    Returns:
        [B] keys.
    """
    fold = lambda s, p: jax.random.fold_in(jax.random.fold_in(jax.random.key(0), s), p)
    return jax.vmap(fold)(seeds_B, positions_B)


def choose_rows(logits_BV: Array, keys_B: Array, temperature_B: Array, top_k_B: Array, top_p_B: Array):
    """Each row's next token and its log-probability: greedy where temperature is 0, else a draw from
    softmax(logits / temperature) under the row's top-k and top-p (`decode.sample_logits` per row).

    Args:
        logits_BV: [B, V] logits.
        keys_B: [B] PRNG keys (`request_keys`).
        temperature_B: [B] float (0: greedy).
        top_k_B: [B] int (0: off).
        top_p_B: [B] float (1: off).

    Returns:
        result (tuple[Array, Array]): (tokens [B] int32, float32 log-probabilities [B] under the model).
    """
    logits_BV = logits_BV.astype(jnp.float32)  # softmax and its log in float32
    sampled = temperature_B > 0
    scaled_BV = logits_BV / jnp.where(sampled, temperature_B, 1.0)[:, None]
    drawn_B = jax.vmap(jax.random.categorical)(keys_B, filter_rows(scaled_BV, top_k_B, top_p_B))
    tokens_B = jnp.where(sampled, drawn_B, jnp.argmax(logits_BV, axis=-1)).astype(jnp.int32)
    logp_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BV), tokens_B[:, None], axis=1)[:, 0]
    return tokens_B, logp_B
