"""Scaled dot-product attention: the reference (einsums, float32 softmax) and the dispatch to fused
kernels (XLA's and cuDNN's through `jax.nn.dot_product_attention`, the Pallas splash kernel on TPU).

`dot_product_attention` takes masks as structure (`jaxformer.attention.masks.Mask`) and gives each
kernel what it can take; `choose_backend` says which path runs, and `log_fallback` says once why a
call left the fused path. `dropout` lives here because the reference applies it to the attention
probabilities; the layers use it on activations too. Plain `jax.numpy`, no Flax.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Literal

import jax
import jax.numpy as jnp

from jaxformer.attention.masks import Mask, as_mask

Array = jax.Array
AttentionImpl = Literal["naive", "auto", "xla", "cudnn", "splash"]
KVLayout = Literal["BSGK", "BGSK"]


_fallbacks_logged: set[str] = set()


def log_fallback(reason: str) -> None:
    """Say once per reason why attention left the fused path (a warning on the "jaxformer" logger).

    Args:
        reason: what could not run fused, and what runs instead.
    """
    if reason not in _fallbacks_logged:
        _fallbacks_logged.add(reason)
        logging.getLogger("jaxformer").warning("attention: %s", reason)


def fused_attention_args(mask: Mask | Array | None, B: int, T: int, S: int) -> dict:
    """The keyword arguments of `jax.nn.dot_product_attention` that say `mask`: `is_causal` and
    per-row lengths where the structure allows, a dense `mask` only for what structure cannot say
    to it (segments, a causal offset over several queries, or a dense array given by the caller).

    Args:
        mask: a `Mask`, a dense boolean array broadcastable to [B, H, T, S], or None.
        B: batch size.
        T: number of queries.
        S: number of keys.

    Returns:
        Keyword arguments for `jax.nn.dot_product_attention`: `is_causal`, `query_seq_lengths`,
        `key_value_seq_lengths` and `mask`, as the structure needs.
    """
    if mask is None:
        return {}
    if not isinstance(mask, Mask):  # a dense array from the caller
        return {"mask": jnp.asarray(mask, bool)}
    args, rest = {}, Mask(q_segments=mask.q_segments, kv_segments=mask.kv_segments)
    if mask.causal and mask.q_offset is not None:
        rest = dataclasses.replace(rest, causal=True, q_offset=mask.q_offset, window=mask.window)
    elif mask.causal:
        args["is_causal"] = True
        if mask.window:  # the window's left side, the query itself not counted; nothing to its right
            args["local_window_size"] = (mask.window - 1, 0)
    for name, key in (("q_lengths", "query_seq_lengths"), ("kv_lengths", "key_value_seq_lengths")):
        if getattr(mask, name) is not None:
            args[key] = jnp.broadcast_to(getattr(mask, name).astype(jnp.int32), (B,))
    dense = rest.dense(T, S)
    if dense is not None:
        args["mask"] = dense
    return args


def _fused(q_BTHK, k_BSGK, v_BSGK, mask, bias, scale, backend: str) -> Array:
    """`jax.nn.dot_product_attention` with `backend`, told the mask as structure; rows that see
    no key get zeros (JAX would give them the mean of v)."""
    B, T, H, _ = q_BTHK.shape
    S = k_BSGK.shape[1]
    args = fused_attention_args(mask, B, T, S)
    if backend == "cudnn" and "mask" in args:
        # cuDNN takes a dense mask only as a bias of the full [T, S]; a broadcast one is rejected.
        args["mask"] = jnp.broadcast_to(args["mask"], (args["mask"].shape[0], 1, T, S))
    if bias is not None:
        bias = bias.astype(q_BTHK.dtype)
    out_BTHK = jax.nn.dot_product_attention(
        q_BTHK, k_BSGK, v_BSGK, bias=bias, scale=scale, implementation=backend, **args
    )
    if "mask" in args:  # a dense part: it decides which rows see a key
        dense = mask.dense(T, S) if isinstance(mask, Mask) else mask
        live_BT = jnp.any(jnp.broadcast_to(dense, (dense.shape[0], H, T, S)), axis=(1, 3))
    else:  # structure alone: lengths decide (a causal row always sees its own key)
        live_BT = None if mask is None else mask.live_queries(T)
    if live_BT is not None:
        out_BTHK = out_BTHK * live_BT[:, :, None, None].astype(out_BTHK.dtype)
    return out_BTHK


def _platform() -> str:
    """The platform the code being traced will run on: the devices of the mesh in context (a TPU
    slice compiled for from a CPU machine is "tpu"), else JAX's default backend."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


def choose_backend(implementation: str, q_BTHK: Array, needs_reference: str | None) -> str:
    """Which path runs: "naive", "xla", "cudnn" or "splash". "auto" takes cuDNN flash attention on
    GPU in bfloat16/float16, splash attention on TPU, XLA's fused attention elsewhere, and the
    reference where weights or dropout on the probabilities are asked for; each fallback is logged once.

    Args:
        implementation: the config's `attention_impl`.
        q_BTHK: [B, T, H, K] the queries (their dtype decides cuDNN).
        needs_reference: what only the reference path can do for this call, or None.

    Returns:
        "naive", "xla", "cudnn" or "splash".

    Raises:
        ValueError: a fused kernel asked for by name cannot do what `needs_reference` says.
    """
    if needs_reference:
        if implementation in ("xla", "cudnn", "splash"):
            raise ValueError(f"implementation={implementation!r} cannot {needs_reference}; use 'naive' or 'auto'")
        if implementation == "auto":
            log_fallback(f"the reference path runs, since no fused kernel can {needs_reference}")
        return "naive"
    if implementation != "auto":
        return implementation
    platform = _platform()
    if platform == "tpu":
        return "splash"
    if platform != "gpu":
        return "xla"
    if q_BTHK.dtype not in (jnp.bfloat16, jnp.float16):
        log_fallback(f"cuDNN flash attention needs bfloat16 or float16, not {q_BTHK.dtype}: XLA's path runs")
        return "xla"
    return "cudnn"


SPLASH_BLOCK = 128  # splash attention's tiles: query and key lengths must be multiples of it


def _splash_unservable(mask, bias, B: int, T: int, S: int, H: int, G: int, spec_BTHK) -> str | None:
    """Why the splash kernel cannot take this call (None: it can)."""
    if bias is not None:
        return "splash attention takes no logits bias"
    if mask is not None and not isinstance(mask, Mask):
        return "splash attention takes masks as structure, not a dense array"
    if isinstance(mask, Mask) and mask.causal and mask.q_offset is not None:
        return "splash attention's causal mask has no per-row offset (decoding several positions over a cache)"
    if T % SPLASH_BLOCK or S % SPLASH_BLOCK:
        return f"splash attention needs query and key lengths that are multiples of {SPLASH_BLOCK}, not {T} and {S}"
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        ways = lambda axes: math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
        b_axes, t_axes, h_axes, k_axes = tuple(spec_BTHK) + (None,) * (4 - len(spec_BTHK))
        if t_axes is not None or k_axes is not None:
            return "splash attention runs per shard of batch and heads: the length or head dim is split"
        if B % ways(b_axes) or H % ways(h_axes) or G % ways(h_axes):
            return f"B={B}, H={H} or G={G} does not divide over the mesh axes {b_axes} and {h_axes}"
    return None


def _at_default_precision(f, n_ids: int):
    """`f(q, k, v, *ids)` traced, forward and backward, at the default matmul precision: Mosaic
    multiplies bfloat16 tiles only at their own precision, and a float32 request in context (a
    config's "highest") on bfloat16 inputs fails to compile. The integer ids get no cotangent."""
    default = lambda: jax.default_matmul_precision("default")

    @jax.custom_vjp
    def run(q, k, v, *ids):
        with default():
            return f(q, k, v, *ids)

    def forward(q, k, v, *ids):
        with default():
            out, pullback = jax.vjp(lambda q, k, v: f(q, k, v, *ids), q, k, v)
        return out, pullback

    def backward(pullback, g):
        with default():
            return (*pullback(g), *(None,) * n_ids)

    run.defvjp(forward, backward)
    return run


def _splash(q_BTHK, k_BSGK, v_BSGK, mask: Mask | None, scale: float | None, spec_BTHK) -> Array:
    """The Pallas splash-attention kernel (TPU), told the mask as structure: causal as its static
    mask, lengths and segments as segment ids. Mosaic kernels are not partitioned by the compiler,
    so it runs under `shard_map`, once per shard of batch and heads of the mesh in context."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash
    from jax.sharding import PartitionSpec as P

    B, T, _, K = q_BTHK.shape
    S = k_BSGK.shape[1]
    q_BTHK = q_BTHK * jnp.asarray(1 / math.sqrt(K) if scale is None else scale, q_BTHK.dtype)  # the kernel takes none
    # Segment ids say lengths and segments at once: a query sees keys of its own id. Keys past a
    # row's length and segment 0 (padding) get id 0; queries that should see nothing get -1.
    segments = None
    if isinstance(mask, Mask) and any(
        x is not None for x in (mask.q_lengths, mask.kv_lengths, mask.q_segments, mask.kv_segments)
    ):
        q_ids_BT = jnp.ones((B, T), jnp.int32) if mask.q_segments is None else mask.q_segments.astype(jnp.int32)
        kv_ids_BS = jnp.ones((B, S), jnp.int32) if mask.kv_segments is None else mask.kv_segments.astype(jnp.int32)
        if mask.kv_lengths is not None:
            kv_ids_BS = jnp.where(jnp.arange(S)[None, :] < mask.kv_lengths[:, None], kv_ids_BS, 0)
        if mask.q_lengths is not None:
            q_ids_BT = jnp.where(jnp.arange(T)[None, :] < mask.q_lengths[:, None], q_ids_BT, 0)
        segments = (jnp.where(q_ids_BT == 0, -1, q_ids_BT), kv_ids_BS)
    causal = isinstance(mask, Mask) and mask.causal
    window = mask.window if causal else 0
    blocks = splash.BlockSizes(*(SPLASH_BLOCK,) * 2, *(SPLASH_BLOCK,) * 6)

    def attend(q_BTHK, k_BSGK, v_BSGK, *segments):  # one shard: its rows and heads
        H_local = q_BTHK.shape[2]
        one = splash.CausalMask((T, S)) if causal else splash.FullMask((T, S))
        if window:  # the causal band of the window: window - 1 keys before the query, none after
            one = splash.LocalMask((T, S), window_size=(window - 1, 0), offset=0)
        kernel = splash.make_splash_mha(
            splash.MultiHeadMask([one] * H_local), block_sizes=blocks, head_shards=1, q_seq_shards=1
        )
        q_BHTK, k_BGSK, v_BGSK = (jnp.swapaxes(x, 1, 2) for x in (q_BTHK, k_BSGK, v_BSGK))
        run = lambda q, k, v, *ids: jax.vmap(kernel)(
            q, k, v, **({"segment_ids": splash.SegmentIds(*ids)} if ids else {})
        )
        if q_BTHK.dtype in (jnp.bfloat16, jnp.float16):
            run = _at_default_precision(run, len(segments))
        return jnp.swapaxes(run(q_BHTK, k_BGSK, v_BGSK, *segments), 1, 2)

    args = (q_BTHK, k_BSGK, v_BSGK, *(segments or ()))
    if not jax.sharding.get_abstract_mesh().empty:
        b_axes, _, h_axes, _ = tuple(spec_BTHK) + (None,) * (4 - len(spec_BTHK))
        x_spec, ids_spec = P(b_axes, None, h_axes, None), P(b_axes, None)
        in_specs = (x_spec,) * 3 + (ids_spec,) * len(segments or ())
        attend = jax.shard_map(attend, in_specs=in_specs, out_specs=x_spec, check_vma=False)
    out_BTHK = attend(*args)
    if segments is not None:  # rows that see no key get zeros (the kernel gives them the mean of v)
        live_BT = jnp.any(mask.dense(T, S)[:, 0], axis=-1)
        out_BTHK = jnp.where(live_BT[:, :, None, None], out_BTHK, jnp.zeros((), out_BTHK.dtype))
    return out_BTHK


def dot_product_attention(
    q_BTHK: Array,
    k_BSGK: Array,
    v_BSGK: Array,
    *,
    kv_layout: KVLayout = "BSGK",
    mask: Mask | Array | None = None,
    bias: Array | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    return_weights: bool = False,
    implementation: AttentionImpl = "naive",
    spec_BTHK: tuple = (),
    softcap: float = 0.0,
) -> Array | tuple[Array, Array]:
    """softmax(Q K^T * scale + bias, masked) V, with grouped-query support; scale 1/sqrt(K) by default.

    Args:
      q_BTHK: queries.
      k_BSGK: keys with G heads, H % G == 0 (G == H is multi-head, G == 1 is multi-query
        attention).
      v_BSGK: values, the shape of the keys.
      kv_layout: "BGSK" takes keys and values heads-major ([B, G, S, K]), the layout
        of a KV cache: the products then read it in place, where [B, S, G, K] would
        be transposed in full at every decoding step.
      mask: a `Mask` (structure: causal, lengths, segments), or a boolean array, True =
        attend, broadcastable to [B, H, T, S]. A query that sees no key gets a zero output
        (never NaN).
      bias: additive logits bias broadcastable to [B, H, T, S] (e.g. ALiBi, T5's relative positions).
      scale: the logits' factor; None is 1/sqrt(K) (T5 uses 1: its initialisation holds the scale).
      dropout_rate: attention-weight dropout; none when it is 0.
      dropout_rng: the dropout key; none when it is None (evaluation).
      return_weights: also return the attention weights [B, H, T, S] (float32).
      implementation: "naive" is the einsum reference below; "xla"/"cudnn" call
        `jax.nn.dot_product_attention` with that backend, the mask given as structure
        (cuDNN flash attention on GPU); "splash" is the Pallas splash-attention kernel
        (TPU); "auto" picks cuDNN on GPU in bfloat16/float16, splash on TPU, XLA
        elsewhere, and the reference when weights or dropout are asked for.
      spec_BTHK: how [B, T, H, K] activations are split over the mesh in context (a
        PartitionSpec, as the sharding rules give it): splash runs once per shard of it.
      softcap: > 0: the scaled logits become softcap * tanh(logits / softcap) before the bias and
        the mask (Gemma 2); the reference path alone.

    Returns:
      out_BTHK in the dtype of v (and the weights if requested).

    Raises:
        ValueError: H is not a multiple of G, keys and values differ in shape, or the implementation
            asked for cannot serve the call (weights or dropout from a fused kernel, splash off TPU).
    """
    B, T, H, K = q_BTHK.shape
    G = k_BSGK.shape[2 if kv_layout == "BSGK" else 1]
    if H % G:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads G={G}")
    if k_BSGK.shape != v_BSGK.shape:
        raise ValueError(f"keys {k_BSGK.shape} and values {v_BSGK.shape} differ in shape")
    mask = as_mask(mask)
    use_dropout = dropout_rate > 0.0 and dropout_rng is not None
    needs = "return weights" if return_weights else "apply dropout to probabilities" if use_dropout else None
    needs = "soft-cap the attention logits" if softcap else needs
    backend = choose_backend(implementation, q_BTHK, needs)
    if backend != "naive":
        if kv_layout == "BGSK":
            k_BSGK, v_BSGK = jnp.swapaxes(k_BSGK, 1, 2), jnp.swapaxes(v_BSGK, 1, 2)
        if backend == "splash":
            G = k_BSGK.shape[2]
            why = _splash_unservable(mask, bias, B, T, k_BSGK.shape[1], H, G, spec_BTHK)
            if why is None:
                return _splash(q_BTHK, k_BSGK, v_BSGK, mask, scale, spec_BTHK)
            if implementation == "splash":
                raise ValueError(f"implementation='splash' cannot serve this call: {why}")
            log_fallback(f"{why}: XLA's path runs")
            backend = "xla"
        if backend == "cudnn" and implementation == "auto":
            try:  # cuDNN's limits (head dim, lengths with a bias, GPU generation) are checked as it traces
                return _fused(q_BTHK, k_BSGK, v_BSGK, mask, bias, scale, "cudnn")
            except (NotImplementedError, ValueError, RuntimeError) as e:
                log_fallback(f"cuDNN flash attention cannot serve this call ({e}): XLA's path runs")
                backend = "xla"
        return _fused(q_BTHK, k_BSGK, v_BSGK, mask, bias, scale, backend)

    S = k_BSGK.shape[2 if kv_layout == "BGSK" else 1]
    dense = mask.dense(T, S) if isinstance(mask, Mask) else mask
    R = H // G
    # Multi-head attention (G == H) contracts over the heads as they are: the size-1 group axis of the
    # grouped form costs XLA:CPU a transposed copy of a [B, H, T, S] block per product and gradient.
    q_spec, kv_spec, w_spec = ("BTHK", kv_layout.replace("G", "H"), "BHTS") if R == 1 else ("BTGRK", kv_layout, "BGRTS")
    q = q_BTHK if R == 1 else q_BTHK.reshape(B, T, G, R, K)
    # Logits and softmax in float32 whatever the compute dtype: bfloat16 exp/sum lose too much.
    logits = jnp.einsum(f"{q_spec},{kv_spec}->{w_spec}", q, k_BSGK, preferred_element_type=jnp.float32)
    logits_BHTS = logits.reshape(B, H, T, -1) * (1 / math.sqrt(K) if scale is None else scale)
    if softcap:  # Gemma 2: the logits bounded smoothly to (-softcap, softcap)
        logits_BHTS = softcap * jnp.tanh(logits_BHTS / softcap)
    if bias is not None:
        logits_BHTS = logits_BHTS + bias.astype(jnp.float32)
    if dense is not None:
        logits_BHTS = jnp.where(dense, logits_BHTS, jnp.finfo(jnp.float32).min)
    weights_BHTS = jax.nn.softmax(logits_BHTS, axis=-1)
    if dense is not None and not _every_query_sees_a_key(mask):  # a fully masked row would be uniform: zero it
        weights_BHTS = jnp.where(dense, weights_BHTS, 0.0)
    probs_BHTS = dropout(weights_BHTS, dropout_rate, dropout_rng).astype(v_BSGK.dtype)
    probs = probs_BHTS if R == 1 else probs_BHTS.reshape(B, G, R, T, -1)
    out = jnp.einsum(f"{w_spec},{kv_spec}->{q_spec}", probs, v_BSGK)
    out_BTHK = out.reshape(B, T, H, K)
    return (out_BTHK, weights_BHTS) if return_weights else out_BTHK


def _every_query_sees_a_key(mask: Mask | Array | None) -> bool:
    """Whether `mask` (structure) lets every query see at least one key: causal alone (query t sees key
    0), so no row of its softmax needs zeroing. Lengths, segments, a causal offset or a dense array may
    leave a query with none."""
    if not isinstance(mask, Mask):
        return mask is None
    return mask.causal and all(
        x is None for x in (mask.q_lengths, mask.kv_lengths, mask.q_segments, mask.kv_segments, mask.q_offset)
    )


def dropout(x: Array, rate: float, rng: Array | None) -> Array:
    """Inverted dropout: zero with probability `rate`, scale the rest by 1/(1-rate).

    The identity when `rng` is None or `rate` is 0 (evaluation).

    Args:
        x: any array.
        rate: probability of zeroing an element, in [0, 1).
        rng: a PRNG key, or None (evaluation: no dropout).

    Returns:
        An array of x's shape and dtype.
    """
    if rng is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)
