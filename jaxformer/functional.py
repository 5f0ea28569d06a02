"""Pure maths of the Transformer: attention, masks, positions, activations, norms, losses.

Plain `jax.numpy`, no Flax: every function here works under `jit`, `grad` and `vmap` and
can be called from any JAX code.

Dimension legend (used in names and shape comments across jaxformer):
  B batch, T target/query length, S source/key length, D model width, H query heads,
  G key/value heads (H = G * R for grouped-query attention), K head dim,
  F feed-forward width, V vocabulary, L layers, C classes.

Masks are boolean, True = may attend, broadcastable to [B, H, T, S].
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

Array = jax.Array
AttentionImpl = Literal["naive", "auto", "xla", "cudnn"]
KVLayout = Literal["BSGK", "BGSK"]


def lift(p: Array, x: Array) -> Array:
    """Give parameter `p` (trailing axes of `x`) leading singleton axes to x's rank.

    Explicit broadcasting keeps code valid under jax_numpy_rank_promotion="raise".
    """
    return p.reshape((1,) * (x.ndim - p.ndim) + p.shape)


# ----------------------------------------------------------------------------- attention


def dot_product_attention(
    q_BTHK: Array,
    k_BSGK: Array,
    v_BSGK: Array,
    *,
    kv_layout: KVLayout = "BSGK",
    mask: Array | None = None,
    bias: Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    return_weights: bool = False,
    implementation: AttentionImpl = "naive",
) -> Array | tuple[Array, Array]:
    """softmax(Q K^T / sqrt(K) + bias, masked) V, with grouped-query support.

    Args:
      q_BTHK: queries. k_BSGK, v_BSGK: keys and values with G heads, H % G == 0
        (G == H is multi-head, G == 1 is multi-query attention).
      kv_layout: "BGSK" takes keys and values heads-major ([B, G, S, K]), the layout
        of a KV cache: the products then read it in place, where [B, S, G, K] would
        be transposed in full at every decoding step.
      mask: boolean, True = attend, broadcastable to [B, H, T, S]. A query whose
        row is fully masked gets a zero output (never NaN).
      bias: additive logits bias broadcastable to [B, H, T, S] (e.g. ALiBi, T5).
      dropout_rate, dropout_rng: attention-weight dropout; no dropout when the
        rate is 0 or the key is None (evaluation).
      return_weights: also return the attention weights [B, H, T, S] (float32).
      implementation: "naive" is the einsum reference below; "xla"/"cudnn" call
        `jax.nn.dot_product_attention` with that backend (cuDNN flash attention on
        GPU); "auto" lets JAX choose when it can (no weights, no dropout) and
        falls back to "naive" otherwise.

    Returns:
      out_BTHK in the dtype of v (and the weights if requested).
    """
    B, T, H, K = q_BTHK.shape
    G = k_BSGK.shape[2 if kv_layout == "BSGK" else 1]
    if H % G:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads G={G}")
    if k_BSGK.shape != v_BSGK.shape:
        raise ValueError(f"keys {k_BSGK.shape} and values {v_BSGK.shape} differ in shape")
    use_dropout = dropout_rate > 0.0 and dropout_rng is not None
    if implementation != "naive" and not (return_weights or use_dropout):
        backend = None if implementation == "auto" else implementation
        if kv_layout == "BGSK":
            k_BSGK, v_BSGK = jnp.swapaxes(k_BSGK, 1, 2), jnp.swapaxes(v_BSGK, 1, 2)
        out_BTHK = jax.nn.dot_product_attention(q_BTHK, k_BSGK, v_BSGK, bias=bias, mask=mask, implementation=backend)
        if mask is not None:  # JAX gives a fully masked row the mean of v; we give zeros.
            live_BT = jnp.any(jnp.broadcast_to(mask, (B, H, T, mask.shape[-1])), axis=-1)
            out_BTHK = out_BTHK * jnp.swapaxes(live_BT, 1, 2)[..., None].astype(out_BTHK.dtype)
        return out_BTHK
    if implementation in ("xla", "cudnn"):
        raise ValueError(
            f"implementation={implementation!r} cannot return weights or apply dropout; use 'naive' or 'auto'"
        )

    R = H // G
    q_BTGRK = q_BTHK.reshape(B, T, G, R, K)
    # Logits and softmax in float32 whatever the compute dtype: bfloat16 exp/sum lose too much.
    logits_BGRTS = jnp.einsum(f"BTGRK,{kv_layout}->BGRTS", q_BTGRK, k_BSGK, preferred_element_type=jnp.float32)
    logits_BHTS = logits_BGRTS.reshape(B, H, T, -1) / math.sqrt(K)
    if bias is not None:
        logits_BHTS = logits_BHTS + bias.astype(jnp.float32)
    if mask is not None:
        logits_BHTS = jnp.where(mask, logits_BHTS, jnp.finfo(jnp.float32).min)
    weights_BHTS = jax.nn.softmax(logits_BHTS, axis=-1)
    if mask is not None:  # a fully masked row would be uniform; zero it instead.
        weights_BHTS = jnp.where(mask, weights_BHTS, 0.0)
    probs_BHTS = dropout(weights_BHTS, dropout_rate, dropout_rng)
    probs_BGRTS = probs_BHTS.reshape(B, G, R, T, -1).astype(v_BSGK.dtype)
    out_BTGRK = jnp.einsum(f"BGRTS,{kv_layout}->BTGRK", probs_BGRTS, v_BSGK)
    out_BTHK = out_BTGRK.reshape(B, T, H, K)
    return (out_BTHK, weights_BHTS) if return_weights else out_BTHK


def dropout(x: Array, rate: float, rng: Array | None) -> Array:
    """Inverted dropout: zero with probability `rate`, scale the rest by 1/(1-rate).

    The identity when `rng` is None or `rate` is 0 (evaluation).
    """
    if rng is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


# ----------------------------------------------------------------------------- masks


def padding_mask(tokens_BS: Array, pad_id: int = 0) -> Array:
    """Key mask from token ids: [B, 1, 1, S], True where the key is not padding."""
    return (tokens_BS != pad_id)[:, None, None, :]


def causal_mask(T: int, S: int | None = None, offset: int = 0) -> Array:
    """[1, 1, T, S] lower-triangular mask: query t sees keys s <= t + offset."""
    S = T if S is None else S
    q_pos = jnp.arange(T)[:, None] + offset
    return (jnp.arange(S)[None, :] <= q_pos)[None, None]


def cross_attention_mask(q_tokens_BT: Array, kv_tokens_BS: Array, pad_id: int = 0) -> Array:
    """[B, 1, T, S]: True where neither the query nor the key is padding."""
    q_live = (q_tokens_BT != pad_id)[:, None, :, None]
    kv_live = (kv_tokens_BS != pad_id)[:, None, None, :]
    return q_live & kv_live


def segment_mask(q_segments_BT: Array, kv_segments_BS: Array) -> Array:
    """[B, 1, T, S] for packed sequences: attend only within the same segment (0 = padding)."""
    same = q_segments_BT[:, None, :, None] == kv_segments_BS[:, None, None, :]
    return same & (kv_segments_BS != 0)[:, None, None, :]


def cache_mask(positions_BT: Array, S: int) -> Array:
    """[B, 1, T, S] over a KV cache whose slot s holds position s: a query at position p sees slots 0..p."""
    return jnp.arange(S)[None, None, None, :] <= positions_BT[:, None, :, None]


def write_rows(buffer_BS: Array, new_BT: Array, start_B: Array, axis: int = 1) -> Array:
    """buffer[b, start_b : start_b + T] = new[b] for each row b along `axis` (the slot axis of a KV
    cache, 1 for [B, S, ...], 2 for heads-major [B, G, S, K]); the other axes are kept.

    Starts must leave room: like `lax.dynamic_update_slice`, a start past S - T is clamped.
    """
    row_axis = axis - 1  # inside one row
    write = lambda buf, new, start: jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), start, row_axis)
    return jax.vmap(write)(buffer_BS, new_BT, start_B)


def combine_masks(*masks: Array | None) -> Array | None:
    """Logical AND of the masks that are not None (None if all are)."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    out = present[0]
    for m in present[1:]:
        out = jnp.logical_and(out, m)
    return out


# ----------------------------------------------------------------------------- positions


def sinusoidal_positions(length: int, d_model: int, max_timescale: float = 10_000.0) -> Array:
    """The paper's table [T, D]: PE(p, 2i) = sin(p / 10000^(2i/D)), PE(p, 2i+1) = cos(...)."""
    if d_model % 2:
        raise ValueError(f"sinusoidal positions need an even d_model, got {d_model}")
    pos_T1 = jnp.arange(length, dtype=jnp.float32)[:, None]
    two_i = jnp.arange(0, d_model, 2, dtype=jnp.float32)
    angles_TI = pos_T1 / max_timescale ** (two_i / d_model)[None, :]
    pe = jnp.zeros((length, d_model), jnp.float32)
    return pe.at[:, 0::2].set(jnp.sin(angles_TI)).at[:, 1::2].set(jnp.cos(angles_TI))


def apply_rope(x_BTHK: Array, positions_BT: Array, base: float = 10_000.0) -> Array:
    """Rotary position embedding (Su et al. 2021), rotate-half convention.

    Feature pairs (i, i + K/2) are rotated by angle pos * base^(-2i/K), so the dot
    product of a rotated query and key depends only on their relative position.
    """
    K = x_BTHK.shape[-1]
    if K % 2:
        raise ValueError(f"RoPE needs an even head dim, got {K}")
    inv_freq_k = base ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)  # [K/2]
    angles_BTk = positions_BT[..., None].astype(jnp.float32) * inv_freq_k[None, None, :]
    sin, cos = jnp.sin(angles_BTk)[:, :, None, :], jnp.cos(angles_BTk)[:, :, None, :]
    x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BTHK.dtype)


# ----------------------------------------------------------------------------- activations


def relu(x: Array) -> Array:
    """The paper's FFN activation."""
    return jax.nn.relu(x)


def gelu(x: Array) -> Array:
    """GELU, tanh approximation (BERT, GPT-2)."""
    return jax.nn.gelu(x, approximate=True)


def swiglu(gate: Array, up: Array) -> Array:
    """SwiGLU (Shazeer 2020): silu(x W_gate) * (x W_up)."""
    return jax.nn.silu(gate) * up


ACTIVATIONS = {"relu": relu, "gelu": gelu}  # gated activations take two inputs: see swiglu
GATED_ACTIVATIONS = {"swiglu": swiglu}


# ----------------------------------------------------------------------------- norms


def layer_norm(x: Array, scale: Array | None, bias: Array | None, eps: float = 1e-6) -> Array:
    """LayerNorm over the last axis; statistics in float32 for bfloat16 inputs."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    if scale is not None:
        y = y * lift(scale.astype(jnp.float32), y)
    if bias is not None:
        y = y + lift(bias.astype(jnp.float32), y)
    return y.astype(x.dtype)


def rms_norm(x: Array, scale: Array | None, eps: float = 1e-6) -> Array:
    """RMSNorm (Zhang & Sennrich 2019) over the last axis; statistics in float32."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
    if scale is not None:
        y = y * lift(scale.astype(jnp.float32), y)
    return y.astype(x.dtype)


# ----------------------------------------------------------------------------- losses


def cross_entropy(
    logits_BTV: Array,
    labels_BT: Array,
    weights_BT: Array | None = None,
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> tuple[Array, Array]:
    """Per-token cross entropy with label smoothing and z-loss, in float32.

    The smoothed target puts 1 - eps on the label and eps / V on every class
    (Szegedy et al. 2016; the paper uses eps = 0.1). z-loss adds z * log(Z)^2
    (PaLM) to keep the softmax normaliser near 1.

    Returns:
      (loss_BT, weights_BT): the per-token loss, zeroed where weights are 0, and
      the float32 weights (all ones if none were given).
    """
    # Written from log Z and the label's logit, never a [B, T, V] log-softmax: its extra passes over
    # the logits (and their gradient) cost ~10% of a small LM's training step.
    logits = logits_BTV.astype(jnp.float32)  # losses in float32 whatever the compute dtype
    log_z = jax.nn.logsumexp(logits, axis=-1)
    nll = log_z - label_logits(logits, labels_BT)
    loss = nll
    if label_smoothing:  # -mean_v log p_v = log Z - mean_v logit_v; skipped when 0 (a [B, T, V] pass)
        loss = (1.0 - label_smoothing) * nll + label_smoothing * (log_z - logits.mean(-1))
    if z_loss:
        loss = loss + z_loss * jnp.square(log_z)
    w = jnp.ones(labels_BT.shape, jnp.float32) if weights_BT is None else weights_BT.astype(jnp.float32)
    return jnp.where(w > 0, loss, 0.0) * w, w


def label_logits(logits_BTV: Array, labels_BT: Array) -> Array:
    """The logit of each label: [B, T]."""
    return jnp.take_along_axis(logits_BTV, labels_BT[..., None], axis=-1)[..., 0]


def top1_correct(logits_BTV: Array, labels_BT: Array) -> Array:
    """[B, T] bool: the label's logit is the largest (a tie counts as correct).

    One max over V, shared with the loss's log-sum-exp, instead of an argmax's second pass.
    """
    return label_logits(logits_BTV, labels_BT) >= logits_BTV.max(-1)
