"""Pure maths of the Transformer: positions, activations, norms, pooling, losses.

Plain `jax.numpy`, no Flax: every function here works under `jit`, `grad` and `vmap` and
can be called from any JAX code.

Dimension legend (used in names and shape comments across jaxformer):
  B batch, T target/query length, S source/key length, D model width, H query heads,
  G key/value heads (H = G * R for grouped-query attention), K head dim,
  F feed-forward width, V vocabulary, L layers, C classes, N segments (examples) of a packed row.

Attention (masks as structure, the reference and the fused kernels' dispatch, the KV cache's
writes) lives in `jaxformer.attention`; its functions are re-exported here, so
`functional.dot_product_attention`, `functional.Mask`, `functional.dropout` and the rest import
as they always did.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

# Attention lives in jaxformer.attention; its names stay importable from here.
from jaxformer.attention.cache import write_rows  # noqa: F401
from jaxformer.attention.kernels import (  # noqa: F401
    AttentionImpl,
    KVLayout,
    choose_backend,
    dot_product_attention,
    dropout,
    fused_attention_args,
    log_fallback,
)
from jaxformer.attention.masks import (  # noqa: F401
    Mask,
    as_mask,
    causal_cache_mask,
    causal_mask,
    combine_masks,
    cross_attention_mask,
    padding_mask,
    segment_mask,
)

Array = jax.Array


def lift(p: Array, x: Array) -> Array:
    """Give parameter `p` (trailing axes of `x`) leading singleton axes to x's rank.

    Explicit broadcasting keeps code valid under jax_numpy_rank_promotion="raise".

    Args:
        p: a parameter whose axes are the trailing axes of `x` (e.g. a norm scale [D]).
        x: the array it is combined with (e.g. activations [B, T, D]).

    Returns:
        `p` reshaped to x's rank, with leading axes of size 1 (e.g. [1, 1, D]).
    """
    return p.reshape((1,) * (x.ndim - p.ndim) + p.shape)


# ----------------------------------------------------------------------------- positions


def sinusoidal_positions(length: int, d_model: int, max_timescale: float = 10_000.0) -> Array:
    """The paper's table [T, D]: PE(p, 2i) = sin(p / 10000^(2i/D)), PE(p, 2i+1) = cos(...).

    Args:
        length: T, the number of positions.
        d_model: D, even.
        max_timescale: the base of the wavelengths (the paper's 10000).

    Returns:
        [T, D] float32.

    Raises:
        ValueError: `d_model` is odd.
    """
    if d_model % 2:
        raise ValueError(f"sinusoidal positions need an even d_model, got {d_model}")
    pos_T1 = jnp.arange(length, dtype=jnp.float32)[:, None]
    two_i = jnp.arange(0, d_model, 2, dtype=jnp.float32)
    angles_TI = pos_T1 / max_timescale ** (two_i / d_model)[None, :]
    pe = jnp.zeros((length, d_model), jnp.float32)
    return pe.at[:, 0::2].set(jnp.sin(angles_TI)).at[:, 1::2].set(jnp.cos(angles_TI))


def rope_frequencies(dim: int, base: float = 10_000.0, scaling: object | None = None) -> tuple[np.ndarray, float]:
    """RoPE's inverse frequencies base^(-2i/dim), stretched by a RoPE scaling, and the attention factor.

    As Hugging Face's `ROPE_INIT_FUNCTIONS` compute them. `linear`: every frequency / factor. `yarn`:
    with r_i = original_max_len * inv_freq_i / (2 pi) the turns of pair i over the trained length, pairs
    below dim index floor(d(beta_fast)) are kept, above ceil(d(beta_slow)) divided by factor, a linear
    ramp between, where d(b) = dim ln(original_max_len / (2 pi b)) / (2 ln base); the attention factor is
    mscale(factor, mscale) / mscale(factor, mscale_all_dim), or mscale(factor, 1) without them.
    `llama3`: wavelengths over original_max_len / low_freq_factor divided by factor, under
    original_max_len / high_freq_factor kept, a blend between.

    Args:
        dim: the rotated dims (K, or MLA's R); even.
        base: the base of the frequencies.
        scaling: None (plain RoPE) or a `model.rope_scaling` section (`RopeScalingConfig`: its kind,
            factor, original_max_len, beta_fast, beta_slow, mscale, mscale_all_dim, low_freq_factor,
            high_freq_factor).

    Returns:
        (inv_freq [dim/2] float32, attention_factor): cos and sin are multiplied by the factor.

    Raises:
        ValueError: `dim` is odd, or an unknown kind.
    """
    if dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {dim}")
    kind = "none" if scaling is None else scaling.kind
    inv_freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)  # [dim/2]
    if kind == "none":
        return inv_freq.astype(np.float32), 1.0
    f = scaling.factor
    if kind == "linear":
        return (inv_freq / f).astype(np.float32), 1.0
    if kind == "yarn":
        n = scaling.original_max_len
        turns_dim = lambda b: dim * math.log(n / (b * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(turns_dim(scaling.beta_fast)), 0)
        high = min(math.ceil(turns_dim(scaling.beta_slow)), dim - 1)
        high = high + 0.001 if low == high else high  # as Hugging Face: no zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)  # 0 kept .. 1 divided
        inv_freq = inv_freq / f * ramp + inv_freq * (1 - ramp)
        return inv_freq.astype(np.float32), scaling.attention_factor
    if kind == "llama3":
        n, lo, hi = scaling.original_max_len, scaling.low_freq_factor, scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (n / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * inv_freq / f + smooth * inv_freq
        inv_freq = np.where(wavelen > n / lo, inv_freq / f, np.where(wavelen < n / hi, inv_freq, blended))
        return inv_freq.astype(np.float32), 1.0
    raise ValueError(f"unknown RoPE scaling kind {kind!r}")


def apply_rope(x_BTHK: Array, positions_BT: Array, base: float = 10_000.0, scaling: object | None = None) -> Array:
    """Rotary position embedding (Su et al. 2021), rotate-half convention.

    Feature pairs (i, i + K/2) are rotated by angle pos * base^(-2i/K), so the dot
    product of a rotated query and key depends only on their relative position. A RoPE
    scaling (`rope_frequencies`) changes the frequencies and multiplies the result by its
    attention factor.

    Args:
        x_BTHK: queries or keys, [B, T, H, K] (K even).
        positions_BT: [B, T] positions of the tokens.
        base: the base of the rotary frequencies.
        scaling: None, or a `model.rope_scaling` section (`rope_frequencies`).

    Returns:
        [B, T, H, K] in x's dtype.

    Raises:
        ValueError: K is odd.
    """
    K = x_BTHK.shape[-1]
    inv_freq, factor = rope_frequencies(K, base, scaling)
    angles_BTk = positions_BT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)[None, None, :]
    sin, cos = jnp.sin(angles_BTk)[:, :, None, :], jnp.cos(angles_BTk)[:, :, None, :]
    if factor != 1.0:  # YaRN's temperature, on cos and sin as Hugging Face applies it
        sin, cos = sin * factor, cos * factor
    x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BTHK.dtype)


def relative_position_buckets(relative_S: Array, *, bidirectional: bool, num_buckets: int, max_distance: int) -> Array:
    """T5's buckets (Raffel et al. 2020) of relative positions key - query: exact below half the
    buckets, logarithmic up to `max_distance`, the last bucket beyond. Bidirectional: half the
    buckets for keys after the query; otherwise keys after the query share bucket 0.

    Args:
        relative_S: relative positions (key - query), any shape.
        bidirectional: keys after the query get buckets of their own (an encoder).
        num_buckets: the number of buckets.
        max_distance: distances beyond it share the last bucket.

    Returns:
        int32 buckets, the shape of `relative_S`.
    """
    n = num_buckets
    offset = 0
    if bidirectional:
        n //= 2
        offset = jnp.where(relative_S > 0, n, 0)
        distance = jnp.abs(relative_S)
    else:
        distance = jnp.maximum(-relative_S, 0)
    exact = n // 2
    # Past `exact`, distances share buckets logarithmically up to max_distance; clamp before the log.
    far = exact + (
        jnp.log(jnp.maximum(distance, exact).astype(jnp.float32) / exact) / math.log(max_distance / exact) * (n - exact)
    ).astype(jnp.int32)
    return offset + jnp.where(distance < exact, distance, jnp.minimum(far, n - 1))


def relative_position_bias(
    q_positions_BT: Array, kv_positions_BS: Array, table_NH: Array, *, bidirectional: bool, max_distance: int
) -> Array:
    """Attention logits bias [B, H, T, S] from a learned table [num_buckets, H] of relative positions.

    Args:
        q_positions_BT: [B, T] positions of the queries.
        kv_positions_BS: [B, S] positions of the keys.
        table_NH: [num_buckets, H] learned bias per bucket and head.
        bidirectional: as in `relative_position_buckets`.
        max_distance: as in `relative_position_buckets`.

    Returns:
        [B, H, T, S] float32 bias.
    """
    relative_BTS = kv_positions_BS[:, None, :] - q_positions_BT[:, :, None]
    buckets_BTS = relative_position_buckets(
        relative_BTS, bidirectional=bidirectional, num_buckets=table_NH.shape[0], max_distance=max_distance
    )
    return jnp.moveaxis(jnp.take(table_NH, buckets_BTS, axis=0), -1, 1)  # [B, T, S, H] -> [B, H, T, S]


# ----------------------------------------------------------------------------- activations


def relu(x: Array) -> Array:
    """The paper's FFN activation.

    Args:
        x: any array.

    Returns:
        max(x, 0), x's shape.
    """
    return jax.nn.relu(x)


def gelu(x: Array) -> Array:
    """GELU, tanh approximation (GPT-2's "gelu_new", T5 v1.1's gated GELU).

    Args:
        x: any array.

    Returns:
        GELU(x), x's shape.
    """
    return jax.nn.gelu(x, approximate=True)


def gelu_exact(x: Array) -> Array:
    """GELU as defined, x * Phi(x) with the erf (BERT, BART: Hugging Face's "gelu").

    Args:
        x: any array.

    Returns:
        GELU(x), x's shape.
    """
    return jax.nn.gelu(x, approximate=False)


def swiglu(gate: Array, up: Array) -> Array:
    """SwiGLU (Shazeer 2020): silu(x W_gate) * (x W_up).

    Args:
        gate: x W_gate, [B, T, F].
        up: x W_up, [B, T, F].

    Returns:
        [B, T, F].
    """
    return jax.nn.silu(gate) * up


def geglu(gate: Array, up: Array) -> Array:
    """GEGLU (Shazeer 2020): gelu(x W_gate) * (x W_up), tanh GELU as in T5 v1.1 and Gemma.

    Args:
        gate: x W_gate, [B, T, F].
        up: x W_up, [B, T, F].

    Returns:
        [B, T, F].
    """
    return gelu(gate) * up


ACTIVATIONS = {"relu": relu, "gelu": gelu, "gelu_exact": gelu_exact}  # gated ones take two inputs
GATED_ACTIVATIONS = {"swiglu": swiglu, "geglu": geglu}


# ----------------------------------------------------------------------------- norms


def layer_norm(x: Array, scale: Array | None, bias: Array | None, eps: float = 1e-6) -> Array:
    """LayerNorm over the last axis; statistics in float32 for bfloat16 inputs.

    Args:
        x: [..., D].
        scale: [D] gain, or None.
        bias: [D] bias, or None.
        eps: added to the variance.

    Returns:
        x's shape and dtype.
    """
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    if scale is not None:
        y = y * lift(scale.astype(jnp.float32), y)
    if bias is not None:
        y = y + lift(bias.astype(jnp.float32), y)
    return y.astype(x.dtype)


def rms_norm(x: Array, scale: Array | None, eps: float = 1e-6, *, plus_one: bool = False) -> Array:
    """RMSNorm (Zhang & Sennrich 2019) over the last axis; statistics in float32.

    Args:
        x: [..., D].
        scale: [D] gain, or None.
        eps: added to the mean square.
        plus_one: the gain is (1 + scale), as Gemma stores it (scale initialised at 0).

    Returns:
        x's shape and dtype.
    """
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
    if scale is not None:
        gain = scale.astype(jnp.float32)
        y = y * lift(1.0 + gain if plus_one else gain, y)
    return y.astype(x.dtype)


# ----------------------------------------------------------------------------- pooling


def segment_pool(x_BSD: Array, segments_BS: Array, num_segments: int, how: Literal["first", "mean"]) -> Array:
    """[B, N, D] one vector per segment of packed rows: segment n + 1's first token ("first", BERT's
    [CLS]) or the mean of its tokens ("mean"), in float32; zeros for a segment a row does not hold.

    N = num_segments; segment ids are 1..N, 0 is padding.

    Args:
        x_BSD: [B, S, D] hidden states.
        segments_BS: [B, S] segment ids (0 = padding).
        num_segments: N, the segments a row may hold.
        how: "first" or "mean".

    Returns:
        [B, N, D] float32.
    """
    ids_N = jnp.arange(1, num_segments + 1)
    member_BNS = segments_BS[:, None, :] == ids_N[None, :, None]
    x_BSD = x_BSD.astype(jnp.float32)
    if how == "first":  # a gather, not a one-hot matmul: exact whatever the matmul precision
        first_BN = jnp.argmax(member_BNS, axis=-1)
        pooled_BND = jnp.take_along_axis(x_BSD, first_BN[..., None], axis=1)
        return jnp.where(member_BNS.any(-1)[..., None], pooled_BND, 0.0)
    count_BN1 = jnp.maximum(member_BNS.sum(-1, keepdims=True), 1).astype(jnp.float32)
    # HIGHEST: a bfloat16 pass of the matmul would round the sums the unpacked mean keeps in float32.
    total_BND = jnp.einsum("BNS,BSD->BND", member_BNS.astype(jnp.float32), x_BSD, precision=jax.lax.Precision.HIGHEST)
    return total_BND / count_BN1


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

    Args:
        logits_BTV: [B, T, V] logits.
        labels_BT: [B, T] int labels.
        weights_BT: [B, T] weights (0 = ignore), or None for all ones.
        label_smoothing: eps, the probability mass spread over the V classes.
        z_loss: the weight of log(Z)^2.
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
    """The logit of each label: [B, T].

    Args:
        logits_BTV: [B, T, V] logits.
        labels_BT: [B, T] int labels.

    Returns:
        [B, T], the logits' dtype.
    """
    return jnp.take_along_axis(logits_BTV, labels_BT[..., None], axis=-1)[..., 0]


def token_logprobs(logits_BTV: Array, targets_BT: Array, temperature: float = 1.0) -> Array:
    """log p(target | prefix) at each position under softmax(logits / temperature), in float32 (a
    bfloat16 normaliser loses the small probabilities). Post-training's sequence scores are sums of these.

    Args:
        logits_BTV: [B, T, V] logits.
        targets_BT: [B, T] the ids whose log-probabilities are taken.
        temperature: the sampling temperature the targets were drawn at (1: the model's own distribution).

    Returns:
        [B, T] float32 log-probabilities.
    """
    logits = logits_BTV.astype(jnp.float32) / temperature
    return label_logits(logits, targets_BT) - jax.nn.logsumexp(logits, axis=-1)


def top1_correct(logits_BTV: Array, labels_BT: Array) -> Array:
    """[B, T] bool: the label's logit is the largest (a tie counts as correct).

    One max over V, shared with the loss's log-sum-exp, instead of an argmax's second pass.

    Args:
        logits_BTV: [B, T, V] logits.
        labels_BT: [B, T] int labels.

    Returns:
        [B, T] boolean.
    """
    return label_logits(logits_BTV, labels_BT) >= logits_BTV.max(-1)


def cross_entropy_sums(
    logits_BTV: Array, labels_BT: Array, weights_BT: Array, *, label_smoothing: float = 0.0, z_loss: float = 0.0
) -> dict[str, Array]:
    """The summed loss (smoothed, with z-loss), summed unsmoothed NLL (for perplexity), summed top-1
    hits and summed weight of a batch of logits: what a step adds up and divides by the count.

    Args:
        logits_BTV: [B, T, V] logits.
        labels_BT: [B, T] int labels.
        weights_BT: [B, T] weights (0 = ignore).
        label_smoothing: as in `cross_entropy`.
        z_loss: as in `cross_entropy`.

    Returns:
        Scalars (float32) "loss", "nll", "correct" and "weight".
    """
    loss, w = cross_entropy(logits_BTV, labels_BT, weights_BT, label_smoothing=label_smoothing, z_loss=z_loss)
    nll, _ = cross_entropy(logits_BTV, labels_BT, weights_BT)  # shares log Z with the loss once XLA fuses them
    correct = top1_correct(logits_BTV.astype(jnp.float32), labels_BT).astype(jnp.float32) * w
    return {"loss": loss.sum(), "nll": nll.sum(), "correct": correct.sum(), "count": w.sum()}


def chunked_cross_entropy(
    h_BTD: Array,
    head: Callable[[Array], Array],
    labels_BT: Array,
    weights_BT: Array,
    *,
    chunk: int | None,
    blocks: int = 1,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> dict[str, Array]:
    """`cross_entropy_sums(head(h_BTD), ...)` computed `chunk` positions at a time, so that only one
    chunk's [B, chunk, V] logits exist at once, in the forward pass and in the backward.

    `head` maps hidden states [B, t, D] to logits [B, t, V] for any t (the model's output layer, whole:
    tied or untied, bias, a masked-LM transform); `chunk` None (or >= T) is the plain loss, one call.
    Chunks cut the length axis and keep the batch axis whole, so each chunk is sharded over the batch
    (and the vocabulary) as the whole would be. A length split over devices (the context axis) in
    `blocks` equal blocks is cut block by block: each chunk takes chunk / blocks positions of every
    block, so it stays split as the hidden states are (chunks of the whole length would each gather
    their positions onto every device, and every device would compute every chunk). Each block is
    padded to a multiple of chunk / blocks with weight 0.

    The chunk body runs under `jax.checkpoint` inside `lax.scan`: the forward keeps only the running
    sums, and the backward recomputes each chunk's logits before taking their gradient (dW adds up in
    the scan's carry). That costs one more [chunk, D] x [D, V] product per chunk (the output layer's
    FLOPs x 4/3) where a custom_vjp computing the gradient in the forward pass (Liger's) would not,
    but it differentiates any `head` without a hand-written gradient (LoRA, biases, the MLM
    transform, sharding constraints), and evaluation pays nothing for it.
    Same float32 numerics as the plain loss; only the order of the sums differs.

    Args:
        h_BTD: [B, T, D] final hidden states.
        head: hidden states [B, t, D] -> logits [B, t, V].
        labels_BT: [B, T] int labels.
        weights_BT: [B, T] weights (0 = ignore).
        chunk: positions per chunk, or None for one call; a multiple of `blocks`.
        blocks: the equal blocks the length axis is split in over devices (T and chunk divisible by it).
        label_smoothing: as in `cross_entropy`.
        z_loss: as in `cross_entropy`.

    Returns:
        The sums of `cross_entropy_sums`: "loss", "nll", "correct", "weight".

    Raises:
        ValueError: T or `chunk` is not divisible by `blocks`.
    """
    sums = functools.partial(cross_entropy_sums, label_smoothing=label_smoothing, z_loss=z_loss)
    B, T = labels_BT.shape
    if chunk is None or chunk >= T:
        return sums(head(h_BTD), labels_BT, weights_BT)
    if T % blocks or chunk % blocks:
        raise ValueError(f"length {T} and chunk {chunk} must be divisible by the blocks ({blocks})")
    Tb, c = T // blocks, chunk // blocks  # positions of a block; of a block in a chunk
    n = -(-Tb // c)  # chunks; each block's last part padded with weight 0

    def split(x):  # [B, T, ...] -> [n, B, chunk, ...]: chunk i holds positions i*c..(i+1)*c-1 of every block
        x = x.reshape(B, blocks, Tb, *x.shape[2:])
        x = jnp.pad(x, [(0, 0), (0, 0), (0, n * c - Tb)] + [(0, 0)] * (x.ndim - 3))
        x = jnp.moveaxis(x.reshape(B, blocks, n, c, *x.shape[3:]), 2, 0)  # [n, B, blocks, c, ...]
        return x.reshape(n, B, chunk, *x.shape[4:])

    xs = (split(h_BTD), split(labels_BT), split(weights_BT.astype(jnp.float32)))  # [n, B, c, D], [n, B, c] x 2

    @functools.partial(jax.checkpoint, prevent_cse=False)  # inside scan, CSE cannot undo the recomputation
    def chunk_sums(h_BcD, labels_Bc, weights_Bc):
        return sums(head(h_BcD), labels_Bc, weights_Bc)  # logits [B, c, V], gone when the chunk is done

    def body(total, x):
        return jax.tree.map(jnp.add, total, chunk_sums(*x)), None

    zeros = {k: jnp.zeros((), jnp.float32) for k in ("loss", "nll", "correct", "count")}
    return jax.lax.scan(body, zeros, xs)[0]
