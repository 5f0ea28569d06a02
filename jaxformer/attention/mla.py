"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434, section 2.1; DeepSeek-V3): the maths.

Letters beyond the legend: C the latent's width (`model.mla.kv_lora_rank`), R the decoupled RoPE dims
(`rope_head_dim`), N each head's query/key dims without positions (`nope_head_dim`), V each head's value
dims (`v_head_dim`).

A token's keys and values come from one latent c [C] (normalised) and one rope key r [R] shared by the
heads, both projected down from x [D] (`kv_down`: D -> C + R). In the plain form (training, a prefill)
the latent is projected up per head (`kv_up`: C -> H (N + V)) into keys [H, N + R] (each head's N, then
the shared R) and values [H, V], and attention runs as usual. In the absorbed form (decoding) the cache
holds c and r alone, (C + R) values per token and layer, and the up-projection never runs on it:

    q_nope . (c W_UK^h) = (q_nope W_UK^h^T) . c        W_UK^h = kv_up[:, h, :N]   [C, N]
    sum_s p_s (c_s W_UV^h) = (sum_s p_s c_s) W_UV^h     W_UV^h = kv_up[:, h, N:]   [C, V]

so each query is folded into the latent's space ([H, C]), scored against the cached latents and rope
keys, and the weighted sum of latents is projected to values once per query. The two forms are equal
up to rounding. Plain `jax.numpy`, no Flax; the module is `jaxformer.attention.mla_layer`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.attention.kernels import AttentionImpl, dot_product_attention
from jaxformer.attention.masks import Mask

Array = jax.Array


def split_latent(kv_BSX: Array, rank: int) -> tuple[Array, Array]:
    """The down-projection's output [B, S, C + R] cut into the latent [B, S, C] and the rope key [B, S, R].

    Args:
        kv_BSX: [B, S, C + R] x @ kv_down.
        rank: C.

    Returns:
        (c_BSC, r_BSR).
    """
    return kv_BSX[..., :rank], kv_BSX[..., rank:]


def plain_attention(
    q_nope_BTHN: Array,
    q_rope_BTHR: Array,
    k_nope_BSHN: Array,
    k_rope_BSR: Array,
    v_BSHV: Array,
    *,
    mask: Mask | Array | None,
    scale: float,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    return_weights: bool = False,
    implementation: AttentionImpl = "naive",
    spec_BTHK: tuple = (),
) -> Array | tuple[Array, Array]:
    """Attention with keys [H, N + R] (each head's own N, the shared rope key's R) and values [H, V]:
    `kernels.dot_product_attention` (reference or fused) on queries and keys of N + R dims and values
    padded with zeros to the same width (the kernels take one head dim), the padding cut off after.

    Args:
        q_nope_BTHN: [B, T, H, N] the queries' dims without positions.
        q_rope_BTHR: [B, T, H, R] the queries' rope dims, rotated.
        k_nope_BSHN: [B, S, H, N] the keys' dims without positions (the latent projected up).
        k_rope_BSR: [B, S, R] the rope key, rotated, shared by the heads.
        v_BSHV: [B, S, H, V] the values.
        mask: which keys each query sees (a `Mask`, or a boolean array broadcastable to [B, H, T, S]).
        scale: the logits' factor ((N + R)^-0.5 by default).
        dropout_rate: attention-weight dropout.
        dropout_rng: its key, or None (no dropout).
        return_weights: also return the weights [B, H, T, S] (float32).
        implementation: the config's `attention_impl`.
        spec_BTHK: the sharding of [B, T, H, K] activations (splash runs per shard).

    Returns:
        [B, T, H, V] (and the weights with `return_weights`).
    """
    H, V = q_nope_BTHN.shape[2], v_BSHV.shape[-1]
    k_rope_BSHR = jnp.broadcast_to(k_rope_BSR[:, :, None, :], (*k_rope_BSR.shape[:2], H, k_rope_BSR.shape[-1]))
    q_BTHK = jnp.concatenate([q_nope_BTHN, q_rope_BTHR], axis=-1)
    k_BSHK = jnp.concatenate([k_nope_BSHN, k_rope_BSHR.astype(k_nope_BSHN.dtype)], axis=-1)
    K = q_BTHK.shape[-1]
    width = max(K, V)  # zeros add nothing to q . k or to the weighted sum of values
    pad = lambda x, n: jnp.pad(x, ((0, 0),) * 3 + ((0, n - x.shape[-1]),)) if x.shape[-1] < n else x
    result = dot_product_attention(
        pad(q_BTHK, width), pad(k_BSHK, width), pad(v_BSHV, width),
        mask=mask, scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        return_weights=return_weights, implementation=implementation, spec_BTHK=spec_BTHK,
    )  # fmt: skip
    out_BTHW, weights = result if return_weights else (result, None)
    return (out_BTHW[..., :V], weights) if return_weights else out_BTHW[..., :V]


def absorbed_attention(
    q_nope_BTHN: Array,
    q_rope_BTHR: Array,
    c_BSC: Array,
    r_BSR: Array,
    kv_up_CHX: Array,
    *,
    mask: Mask | Array | None,
    scale: float,
) -> Array:
    """Attention over cached latents without projecting them up (the absorbed form, module docstring):
    logits = (q_nope W_UK^T) . c + q_rope . r, softmax in float32, output (sum_s p_s c_s) W_UV.

    Args:
        q_nope_BTHN: [B, T, H, N] the queries' dims without positions.
        q_rope_BTHR: [B, T, H, R] the queries' rope dims, rotated.
        c_BSC: [B, S, C] the cached latents (normalised).
        r_BSR: [B, S, R] the cached rope keys (rotated).
        kv_up_CHX: [C, H, N + V] the up-projection, in the compute dtype: W_UK its first N, W_UV the rest.
        mask: which cache slots each query sees (a `Mask`, or a boolean array broadcastable to [B, H, T, S]).
        scale: the logits' factor.

    Returns:
        [B, T, H, V], in c's dtype; a query that sees no slot gets zeros.
    """
    N = q_nope_BTHN.shape[-1]
    T, S = q_nope_BTHN.shape[1], c_BSC.shape[1]
    w_uk_CHN, w_uv_CHV = kv_up_CHX[..., :N], kv_up_CHX[..., N:]
    q_lat_BTHC = jnp.einsum("BTHN,CHN->BTHC", q_nope_BTHN, w_uk_CHN)
    # Logits and softmax in float32 whatever the compute dtype, as the reference attention does.
    logits_BHTS = jnp.einsum("BTHC,BSC->BHTS", q_lat_BTHC, c_BSC, preferred_element_type=jnp.float32)
    logits_BHTS += jnp.einsum("BTHR,BSR->BHTS", q_rope_BTHR, r_BSR, preferred_element_type=jnp.float32)
    logits_BHTS = logits_BHTS * scale
    dense = mask.dense(T, S) if isinstance(mask, Mask) else mask
    if dense is not None:
        logits_BHTS = jnp.where(dense, logits_BHTS, jnp.finfo(jnp.float32).min)
    weights_BHTS = jax.nn.softmax(logits_BHTS, axis=-1)
    if dense is not None:  # a query that sees nothing would weigh every slot alike: zero it
        weights_BHTS = jnp.where(dense, weights_BHTS, 0.0)
    o_lat_BTHC = jnp.einsum("BHTS,BSC->BTHC", weights_BHTS.astype(c_BSC.dtype), c_BSC)
    return jnp.einsum("BTHC,CHV->BTHV", o_lat_BTHC, w_uv_CHV)


def cache_bytes_per_token(rank: int, rope_dim: int, itemsize: int) -> int:
    """Bytes one token adds to one layer's latent cache: (C + R) * itemsize (against 2 * G * K * itemsize
    for a KV cache).

    Args:
        rank: C.
        rope_dim: R.
        itemsize: bytes per value of the cache's dtype.

    Returns:
        The bytes.
    """
    return (rank + rope_dim) * itemsize
