"""The paged KV cache's decoding step (`paged_step`: the model's decoding step over pages) and the
per-row sampling of the engine's compiled step. Plain `jax.numpy` and the model.

The pool of one layer holds keys (or values) as [G, N, page, K]: N pages of `page` positions each. A
sequence's page table [P] lists its pages in order, so position p lives in page table[p // page] at
offset p % page. Page 0 is scratch: rows and positions that write nothing real (padding of a chunk, an
idle slot) write there, and no sequence reads it as one of its own pages. A layer of latent attention
(`model.mla`) pages its latents instead, [N, page, C] and its rope keys [N, page, R] (`empty_pools`). The maths of pages
(`page_slots`, `write_pages`, `read_pages`) lives with the other caches' in `jaxformer.attention.cache`.

Attention reads the pool in place: each layer writes only the new positions' keys and values into their
pages, then gathers each row's pages by its table (an XLA gather of whole pages, heads-major as the pool
holds them, so that they land as a dense cache [B, G, S, K]) and attends over them. On a TPU or an NVIDIA
GPU a decoding step (one position a row) is attended by JAX's Pallas paged-attention kernel instead, which
reads the pages where they lie (`jaxformer.attention.paged_kernel`, where it serves); prefill chunks gather.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.attention.cache import read_pages
from jaxformer.attention.masks import Mask
from jaxformer.sharding import constrain

Array = jax.Array
PAGES = ("heads", None, None, None)  # a pool [G, N, page, K]: heads split over `tensor` like the model's
LATENT_PAGES = (None, None, None)  # latent attention's pools [N, page, C]: one latent for every head


def empty_pools(mcfg, num_pages: int, page_size: int) -> list[dict]:
    """Each decoder layer's zeroed pools: {"k", "v"}: [G, N, page, K], or with latent attention
    (`model.mla`) {"c": [N, page, C], "r": [N, page, R]}: (C + R) values a position, not 2 G K.

    Args:
        mcfg (ModelConfig): the model's config.
        num_pages: N (page 0 the scratch).
        page_size: positions per page.

    Returns:
        One dict of pools per decoder layer, in the compute dtype.
    """
    if mcfg.mla.enabled:
        widths = {"c": mcfg.mla.kv_lora_rank, "r": mcfg.mla.rope_head_dim}
        shapes = {n: ((num_pages, page_size, w), LATENT_PAGES) for n, w in widths.items()}
    else:
        shape = (mcfg.kv_heads, num_pages, page_size, mcfg.dim_per_head)
        shapes = {n: (shape, PAGES) for n in "kv"}
    # One program per pool shape (not per layer and pool), traced under the mesh in effect for this call.
    zeros = jax.jit(lambda shape, spec: constrain(jnp.zeros(shape, mcfg.dtype), spec), static_argnums=(0, 1))
    return [{n: zeros(*s) for n, s in shapes.items()} for _ in range(mcfg.num_decoder_layers)]


def gather_rows(pools: list, table_BP: Array) -> list[dict]:
    """Each layer's pools read for the rows of a call once, as a dense cache: a call of several decoding
    steps then writes each step's keys and values into these as well as into the pages, and attends over
    them, instead of gathering every row's pages again at every step (`paged_step`'s `rows`).

    Args:
        pools (list[dict]): per layer {"k", "v"}: [G, N, page, K] (or latent attention's {"c", "r"}).
        table_BP: [B, P] the rows' page tables.

    Returns:
        Per layer {"k", "v"}: [B, G, P * page, K] (or {"c": [B, P * page, C], "r": [B, P * page, R]}).
    """
    spec = lambda x: ("batch", "heads", None, None) if x.ndim == 4 else ("batch", None, None)
    read = lambda pool: constrain(read_pages(pool, table_BP), spec(pool))
    return [{n: read(pool) for n, pool in layer.items()} for layer in pools]


def paged_step(
    model,
    pools: list,
    table_BP: Array,
    ids_BT: Array,
    positions_BT: Array,
    valid_BT: Array,
    memory: list | None = None,
    src_lengths_B: Array | None = None,
    last_B: Array | None = None,
    rows: list | None = None,
):
    """The model's decoding step over paged caches: logits of T new positions per row (or of one,
    `last_B`), their keys and values written into the rows' pages.

    Each layer's cache entry is its pools with the rows' page tables (`MultiHeadAttention.extend` reads
    such an entry in place): the layer writes the T new positions' keys and values into their pages
    (`valid` False: scratch page 0), gathers each row's P pages and attends over them with the causal
    cache mask (slot s holds position s; a slot past a row's last position is seen by none of its real
    positions). Nothing else of the pool is copied. With `rows` (`gather_rows`, for this table) each
    layer writes the valid new positions into its rows too and attends over them, gathering nothing.

    Args:
        model (Transformer): a decodable model (`decode.decodable`), decoder_only or encoder_decoder.
        pools (list[dict]): per layer {"k", "v"}: [G, N, page, K]; latent attention's {"c": [N, page, C],
            "r": [N, page, R]}.
        table_BP: [B, P] the rows' page tables.
        ids_BT: [B, T] new ids.
        positions_BT: [B, T] their positions.
        valid_BT: [B, T] bool, which are real (others write to scratch).
        memory: encoder_decoder: per layer the rows' cross-attention {"k", "v"}: [B, G, S, K]; or None.
        src_lengths_B: [B] the rows' source lengths (with `memory`).
        last_B: [B] int, the position (index into T) of each row whose logits are wanted (the output
            head runs on those alone: [B, 1, V]); None: every position's.
        rows: per layer the rows' pages read once (`gather_rows` of `pools` and `table_BP`), or None.

    Returns:
        result (tuple[Array, list, list | None]): (logits [B, T, V] or [B, 1, V], the updated pools,
            the updated rows or None).
    """
    # Padding reads position 0: a position past a sinusoidal or learned table is NaN (`jnp.take` fills), and
    # padding's NaN keys and values in the scratch page would reach every row that reads it (0 x NaN).
    positions_BT = jnp.where(valid_BT, positions_BT, 0)
    extra = [{} for _ in pools] if rows is None else [{"rows": r} for r in rows]
    layers = [
        {"self": {**pool, "table": table_BP, "valid": valid_BT, **x}} for pool, x in zip(pools, extra, strict=True)
    ]
    cache = {"layers": layers}
    if memory is not None:  # cross-attention over each row's source, its keys and values computed once
        cache = {"layers": [v | {"memory": m} for v, m in zip(layers, memory, strict=True)]}
        cache["memory_mask"] = Mask(kv_lengths=src_lengths_B)
    logits_BTV, cache = model.decode_step(cache, ids_BT, positions_BT, logits_at_B=last_B)
    selves = [layer["self"] for layer in cache["layers"]]
    pools = [{n: entry[n] for n in pool} for entry, pool in zip(selves, pools, strict=True)]
    return logits_BTV, pools, None if rows is None else [entry["rows"] for entry in selves]


# ----------------------------------------------------------------------------- per-row sampling


def filter_rows(logits_BV: Array, top_k_B: Array, top_p_B: Array, min_p_B: Array) -> Array:
    """`decode.min_p_filter`, `top_k_filter` then `top_p_filter` (`decode.sample_logits`' order) with a
    min-p, a k and a p per row (min-p = 0, k = 0, p = 1: off), so one compiled step serves every mix of
    requests.

    Args:
        logits_BV: [B, V] logits (already divided by the temperature).
        top_k_B: [B] int, the k largest kept (0: all).
        top_p_B: [B] float, the nucleus mass kept (1: all).
        min_p_B: [B] float, the fraction of the likeliest token's probability kept (0: all).

    Returns:
        [B, V], the dropped logits -inf.
    """
    V = logits_BV.shape[-1]
    floor_B1 = jnp.max(logits_BV, axis=-1, keepdims=True) + jnp.log(min_p_B)[:, None]  # log 0: -inf, all kept
    logits_BV = jnp.where(logits_BV < floor_B1, -jnp.inf, logits_BV)
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


def penalize(
    logits_BV: Array, counts_BV: Array, seen_BV: Array, presence_B: Array, frequency_B: Array, repetition_B: Array,
    bias_BV: Array,
) -> Array:  # fmt: skip
    """Each row's logits under its penalties and biases (`SamplingParams`): the repetition penalty on the
    tokens of its prompt and output (divided where positive, multiplied where negative, as vLLM and Hugging
    Face), then the frequency and presence penalties on the output's counts (as OpenAI and vLLM), then the
    biases added.

    Args:
        logits_BV: [B, V] logits.
        counts_BV: [B, V] int32, each token's count in the row's output so far.
        seen_BV: [B, V] bool, the tokens of the row's prompt.
        presence_B: [B] float32 (0: off).
        frequency_B: [B] float32 (0: off).
        repetition_B: [B] float32 (1: off).
        bias_BV: [B, V] float32 (0: none).

    Returns:
        [B, V] float32 logits.
    """
    logits_BV = logits_BV.astype(jnp.float32)
    repeated_BV = seen_BV | (counts_BV > 0)
    r_B1 = repetition_B[:, None]
    logits_BV = jnp.where(repeated_BV, jnp.where(logits_BV > 0, logits_BV / r_B1, logits_BV * r_B1), logits_BV)
    logits_BV = logits_BV - frequency_B[:, None] * counts_BV - presence_B[:, None] * (counts_BV > 0)
    return logits_BV + bias_BV


def choose_rows(
    logits_BV: Array, keys_B: Array, temperature_B: Array, top_k_B: Array, top_p_B: Array, min_p_B: Array
) -> tuple[Array, Array]:
    """Each row's next token and its log-probability: greedy where temperature is 0, else a draw from
    softmax(logits / temperature) under the row's min-p, top-k and top-p (`decode.sample_logits` per row).

    Args:
        logits_BV: [B, V] logits.
        keys_B: [B] PRNG keys (`request_keys`).
        temperature_B: [B] float (0: greedy).
        top_k_B: [B] int (0: off).
        top_p_B: [B] float (1: off).
        min_p_B: [B] float (0: off).

    Returns:
        result (tuple[Array, Array]): (tokens [B] int32, float32 log-probabilities [B] under the model).
    """
    logits_BV = logits_BV.astype(jnp.float32)  # softmax and its log in float32
    sampled = temperature_B > 0
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

    def draw(_):  # the filters' two sorts of [B, V] and the draw's noise cost more than the model's step on a
        scaled_BV = logits_BV / jnp.where(sampled, temperature_B, 1.0)[:, None]  # CPU: run only when asked
        filtering = jnp.any(sampled & ((top_k_B > 0) | (top_p_B < 1.0) | (min_p_B > 0.0)))
        filter_ = lambda x: filter_rows(x, top_k_B, top_p_B, min_p_B)
        filtered_BV = jax.lax.cond(filtering, filter_, lambda x: x, scaled_BV)
        drawn_B = jax.vmap(jax.random.categorical)(keys_B, filtered_BV).astype(jnp.int32)
        return jnp.where(sampled, drawn_B, greedy_B)

    # A row's token never depends on the others': the filters leave a row with k = 0, p = 1, min-p 0 as it is.
    tokens_B = jax.lax.cond(jnp.any(sampled), draw, lambda _: greedy_B, None)
    logp_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BV), tokens_B[:, None], axis=1)[:, 0]
    return tokens_B, logp_B
