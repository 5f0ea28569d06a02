"""Context parallelism: attention over a sequence sharded across the devices of a mesh axis.

Each device holds a block of the queries, keys and values of every row. Two strategies:

- **ring** (Liu et al., 2023, "Ring Attention with Blockwise Transformers"): the key/value blocks
  travel around the ring (`ppermute`) while each device folds every visiting block into its queries'
  running softmax (max, sum, output: the online softmax of flash attention). No device ever holds
  more than two key/value blocks. The backward pass is a second trip around the ring: the blocks
  travel again with their gradient accumulators, and come home with the sum of every device's part.
  It is written by hand (`jax.custom_vjp`), from the saved output and log-sum-exp, as flash attention's
  is: autodiff through the loop would keep every step's [T, S] scores.
- **all-gather**: every device gathers all keys and values, then attends its queries to them: one
  collective, S keys a device; simplest for short rings.

Masks come from global token indices, so any layout of the sequence over the devices works:
`q_index_BT` / `kv_index_BS` say which position of the whole sequence each local token is. Causal
attention over contiguous blocks leaves the first device idle for most of the ring (its queries see
only its own keys) and the last one busy on every step; `layout_order(T, n, "zigzag")` gives each
device block i and block 2n - 1 - i (Striped/zig-zag ring attention, as in Llama 3 context
parallelism), so every device has the same share of the causal triangle; a block no query of a
device sees is skipped there (`lax.cond`), in both passes. A sliding window (`window`: query t sees
t - window < s <= t) is part of that visibility, so blocks wholly before every query's window are
skipped too, and one the window cuts is masked.

The kernel that attends each visiting block (`DENSE`, or a fused kernel: cuDNN, splash) is
`jaxformer.attention.ring_kernels`. The functions below run inside `jax.shard_map` with the sequence
axis named `axis_name`; `context_attention` wraps them for arrays sharded over a mesh.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxformer.attention.ring_kernels import (
    DENSE,
    KERNELS,
    MASKED,
    NEG,
    SKIP,
    UNSERVABLE,
    BlockKernel,
    Where,
    _grouped,
    _kv_meta,
    _scores,
    _ungrouped,
    _visible,
    block_kind,
)

Array = jax.Array
Layout = Literal["contiguous", "zigzag", "striped"]


def _shift(tree, axis_name: str, n: int):
    """Every device's `tree` to the next device of the ring (device i's block goes to i + 1)."""
    return jax.lax.ppermute(tree, axis_name, [(i, (i + 1) % n) for i in range(n)])


# ----------------------------------------------------------------------------- ring


def ring_attention(
    q_BTHK: Array,
    k_BSGK: Array,
    v_BSGK: Array,
    where: Where,
    axis_name: str,
    axis_size: int,
    causal: bool,
    scale,
    kernel: BlockKernel = DENSE,
    window: int = 0,
) -> Array:
    """softmax(Q K^T * scale, masked) V over the whole sequence, for this device's query block.

    Call inside `jax.shard_map`: q, k, v, `where` are this device's blocks ([B, T, H, K] and
    [B, S, G, K], H % G == 0); `axis_name` is the ring's mesh axis, of `axis_size` devices. A query
    that sees no key gets a zero output. Returns [B, T, H, K] in q's dtype.

    Args:
        q_BTHK: [B, T, H, K] this device's queries.
        k_BSGK: [B, S, G, K] this device's keys.
        v_BSGK: [B, S, G, K] this device's values.
        where: the positions and masks of this device's blocks.
        axis_name: the ring's mesh axis.
        axis_size: the number of devices on it.
        causal: query t sees keys s <= t (positions in the whole sequence).
        scale (float): the logits' factor (1/sqrt(K) for the paper's attention).
        kernel: how each visiting block is attended (`DENSE`, or a fused kernel: `fused_kernel`).
        window: with causal, > 0: query t sees only keys t - window < s <= t (sliding-window
            attention); a visiting block wholly outside the window is skipped, one it cuts is masked.

    Returns:
        [B, T, H, K] in q's dtype.
    """
    return _ring(q_BTHK, k_BSGK, v_BSGK, where, axis_name, axis_size, causal, scale, kernel, window)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _ring(q_BTHK, k_BSGK, v_BSGK, where, axis_name, n, causal, scale, kernel, window):
    return _ring_forward(q_BTHK, k_BSGK, v_BSGK, where, axis_name, n, causal, scale, kernel, window)[0]


def _kind(kernel: BlockKernel, vis: Array, causal: bool) -> Array:
    return block_kind(vis, causal) if kernel.classify else jnp.where(vis.any(), MASKED, SKIP)


def _ring_forward(q_BTHK, k_BSGK, v_BSGK, where, axis_name, n, causal, scale, kernel, window):
    q = kernel.enter(q_BTHK, k_BSGK.shape[2])  # in the kernel's layout

    def fold(carry, kv):  # one visiting block into the running output and log-sum-exp
        o, lse = carry
        k, v, meta = kv
        vis = _visible(where, meta, causal, window)
        kind = _kind(kernel, vis, causal)

        def compute(_):
            o_blk, lse_blk = kernel.fwd(q, k, v, vis, kind, causal, scale)
            lse_new = jnp.logaddexp(lse, lse_blk)
            return o * jnp.exp(lse - lse_new)[..., None] + o_blk * jnp.exp(lse_blk - lse_new)[..., None], lse_new

        return jax.lax.cond(kind != SKIP, compute, lambda _: (o, lse), None)

    # The loop carries vary over the mesh axes q varies over (shard_map's types): made "like" q.
    o = jnp.zeros_like(q, jnp.float32)
    lse = jnp.full_like(q[..., 0], NEG, jnp.float32)
    kv = (k_BSGK, v_BSGK, _kv_meta(where))
    carry = fold((o, lse), kv)

    def step(_, state):
        carry, kv = state
        kv = _shift(kv, axis_name, n)
        return fold(carry, kv), kv

    (o, lse), _ = jax.lax.fori_loop(1, n, step, (carry, kv))
    seen = lse > NEG / 2  # NEG plus the log of at most n blocks that saw nothing
    out = kernel.leave(jnp.where(seen[..., None], o, 0.0))
    return out.astype(q_BTHK.dtype), jnp.where(seen, lse, NEG)


def _ring_fwd(q_BTHK, k_BSGK, v_BSGK, where, axis_name, n, causal, scale, kernel, window):
    out, lse = _ring_forward(q_BTHK, k_BSGK, v_BSGK, where, axis_name, n, causal, scale, kernel, window)
    return out, (q_BTHK, k_BSGK, v_BSGK, where, out, lse)


def _ring_bwd(axis_name, n, causal, scale, kernel, window, res, dout_BTHK):
    """A second trip around the ring: each visiting block's share of the gradients from the whole
    attention's output and log-sum-exp (`BlockKernel.bwd`); dK and dV travel with their block."""
    q_BTHK, k_BSGK, v_BSGK, where, out_BTHK, lse = res
    q, out, do = (kernel.enter(x, k_BSGK.shape[2]) for x in (q_BTHK, out_BTHK, dout_BTHK))
    seen = kernel.seen(out, do)

    def step(_, state):
        dq, (k, v, meta, dk, dv) = state
        vis = _visible(where, meta, causal, window)
        kind = _kind(kernel, vis, causal)

        def compute(_):
            dq_blk, dk_blk, dv_blk = kernel.bwd(q, k, v, vis, kind, causal, scale, seen, lse, do)
            return dq + dq_blk, dk + dk_blk, dv + dv_blk

        dq, dk, dv = jax.lax.cond(kind != SKIP, compute, lambda _: (dq, dk, dv), None)
        return dq, _shift((k, v, meta, dk, dv), axis_name, n)  # after n shifts each block is home

    zeros_kv = jnp.zeros_like(k_BSGK, jnp.float32)
    dq0 = jnp.zeros_like(q, jnp.float32)
    state = (dq0, (k_BSGK, v_BSGK, _kv_meta(where), zeros_kv, zeros_kv))
    dq, (_, _, _, dk, dv) = jax.lax.fori_loop(0, n, step, state)
    return (
        kernel.leave(dq).astype(q_BTHK.dtype),
        dk.astype(k_BSGK.dtype),
        dv.astype(v_BSGK.dtype),
        jax.tree.map(lambda x: None if x is None else np.zeros(x.shape, jax.dtypes.float0), where),
    )


_ring.defvjp(_ring_fwd, _ring_bwd)


# ----------------------------------------------------------------------------- all-gather


def allgather_attention(
    q_BTHK: Array, k_BSGK: Array, v_BSGK: Array, where: Where, axis_name: str, causal: bool, scale, window: int = 0
) -> Array:
    """The same result as `ring_attention`, by gathering every key and value block first (autodiff:
    the gather's transpose sums the key/value gradients back onto their devices).

    Args:
        q_BTHK: [B, T, H, K] this device's queries.
        k_BSGK: [B, S, G, K] this device's keys.
        v_BSGK: [B, S, G, K] this device's values.
        where: the positions and masks of this device's blocks.
        axis_name: the context mesh axis.
        causal: query t sees keys s <= t (positions in the whole sequence).
        scale (float): the logits' factor.
        window: with causal, > 0: query t sees only keys t - window < s <= t.

    Returns:
        [B, T, H, K] in q's dtype.
    """
    gather = lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
    k, v = gather(k_BSGK), gather(v_BSGK)
    meta = tuple(gather(x) for x in _kv_meta(where))
    q = _grouped(q_BTHK, k.shape[2])
    vis = _visible(where, meta, causal, window)
    s = _scores(q, k, vis, scale)
    m = jax.lax.stop_gradient(s.max(-1, keepdims=True))
    p = jnp.where(vis, jnp.exp(s - m), 0.0)
    l = p.sum(-1, keepdims=True)
    w = p / jnp.where(l > 0, l, 1.0)
    out = jnp.einsum("BGRTS,BSGK->BGRTK", w.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return _ungrouped(out).astype(q_BTHK.dtype)


def _row_and_head_axes(mesh_shape, spec_BTHK: tuple, B: int, H: int, G: int) -> tuple:
    """The mesh axes of the batch and heads dimensions in `spec_BTHK`, each kept only where it divides
    them (a batch of 3 samples on a data axis of 4 stays whole on each device, as `constrain` leaves it)."""
    b_axes, _, h_axes, _ = tuple(spec_BTHK) + (None,) * (4 - len(spec_BTHK))
    ways = lambda axes: int(np.prod([mesh_shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ())]))
    return (b_axes if B % ways(b_axes) == 0 else None), (h_axes if H % ways(h_axes) == G % ways(h_axes) == 0 else None)


# ----------------------------------------------------------------------------- decoding over a sharded cache


def _write_local(cache_BGSK: Array, new_BTGK: Array, slots_BS: Array, q_index_BT: Array) -> Array:
    """This device's cache slots (`slots_BS`: their positions) with the new keys or values written
    where a new position is one of them: one slot a step (T = 1) in place, more by matching."""
    new_BGTK = jnp.swapaxes(new_BTGK, 1, 2).astype(cache_BGSK.dtype)
    if new_BTGK.shape[1] == 1:
        local_B = q_index_BT[:, 0] - slots_BS[:, 0]  # where the one new position falls in this block
        inside_B = (local_B >= 0) & (local_B < cache_BGSK.shape[2])
        at_B = jnp.clip(local_B, 0, cache_BGSK.shape[2] - 1)

        def write(buf_GSK, new_GTK, at, inside):
            old_GTK = jax.lax.dynamic_slice_in_dim(buf_GSK, at, 1, axis=1)
            return jax.lax.dynamic_update_slice_in_dim(buf_GSK, jnp.where(inside, new_GTK, old_GTK), at, axis=1)

        return jax.vmap(write)(cache_BGSK, new_BGTK, at_B, inside_B)
    match_BST = slots_BS[:, :, None] == q_index_BT[:, None, :]
    written_BGSK = jnp.einsum("BST,BGTK->BGSK", match_BST.astype(cache_BGSK.dtype), new_BGTK)
    return jnp.where(match_BST.any(-1)[:, None, :, None], written_BGSK, cache_BGSK)


def cache_attention(
    q_BTHK: Array,
    k_BGSK: Array,
    v_BGSK: Array,
    *,
    q_index_BT: Array | None,
    causal: bool,
    kv_lengths_B: Array | None = None,
    new_kv: tuple[Array, Array] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    axis: str = "context",
    scale: float | None = None,
    spec_BTHK: tuple = (),
    window: int = 0,
) -> tuple[Array, Array, Array]:
    """Decoding: a few new queries (the same on every device of `axis`) attend to a KV cache whose
    slots are split over `axis` ([B, G, S, K] heads-major, slot s holds position s, device i the
    i-th block of S / n slots); nothing of the cache moves.

    `new_kv` (keys and values [B, T, G, K] of the queries' own positions `q_index_BT`) are first
    written into the cache by the device that holds their slots. Each device then attends its
    queries to its own slots (causal: slot <= the query's position; `kv_lengths_B`: slots past a
    row's length are padding) and keeps the partial softmax (max m, sum l, output o); the blocks
    are combined exactly by log-sum-exp: m* = pmax(m), o = psum(o e^(m - m*)) / psum(l e^(m - m*)),
    an all-reduce of [B, H, T, K] a layer.

    Args:
        q_BTHK: [B, T, H, K] the new queries, whole on every device of `axis`.
        k_BGSK: [B, G, S, K] the cached keys, slots split over `axis`.
        v_BGSK: [B, G, S, K] the cached values, split alike.
        q_index_BT: [B, T] the queries' positions (None: not causal, all 0).
        causal: a query sees the slots at or before its position.
        kv_lengths_B: [B] filled slots of each row (the rest are padding), or None.
        new_kv: (k_BTGK, v_BTGK) of the queries' own positions, written into the cache first, or None.
        mesh: the mesh (None: the one in context).
        axis: the mesh axis the cache's slots are split over.
        scale: the logits' scale (None: K**-0.5).
        spec_BTHK: the queries' partition spec, for the row and head axes the mesh splits.
        window: with causal, > 0: a query at position t sees only the slots t - window < s <= t (a local
            layer's sliding window); a device none of whose slots a query sees adds nothing to its sum.

    Returns:
        (out_BTHK, k_BGSK, v_BGSK): the attention output and the cache with `new_kv` written.

    Raises:
        ValueError: S is not divisible by the axis's size.
    """
    mesh_shape = (mesh or jax.sharding.get_abstract_mesh()).shape
    n = mesh_shape[axis]
    (B, T, H, K), (G, S) = q_BTHK.shape, k_BGSK.shape[1:3]
    q_index_BT = jnp.zeros((B, T), jnp.int32) if q_index_BT is None else q_index_BT  # (None: not causal)
    if S % n:
        raise ValueError(f"cache: {S} slots are not divisible by the context axis ({axis}={n})")
    scale = K**-0.5 if scale is None else scale
    b_axes, h_axes = _row_and_head_axes(mesh_shape, spec_BTHK, B, H, G)
    q_spec, cache_spec, ids_spec = P(b_axes, None, h_axes, None), P(b_axes, h_axes, axis, None), P(b_axes, None)
    lengths_spec = None if kv_lengths_B is None else P(b_axes)
    new_specs = None if new_kv is None else (q_spec, q_spec)

    def local(q_BTHK, k_BGSK, v_BGSK, q_index_BT, kv_lengths_B, new_kv):
        B, G, S_local, _ = k_BGSK.shape
        first = jax.lax.axis_index(axis) * S_local
        slots_BS = jnp.broadcast_to(first + jnp.arange(S_local, dtype=jnp.int32), (B, S_local))
        if new_kv is not None:
            new_k, new_v = new_kv
            k_BGSK = _write_local(k_BGSK, new_k, slots_BS, q_index_BT)
            v_BGSK = _write_local(v_BGSK, new_v, slots_BS, q_index_BT)
        vis = _visible(Where(q_index_BT, slots_BS, kv_lengths_B=kv_lengths_B), (slots_BS, None), causal, window)
        q = _grouped(q_BTHK, G)  # [B, G, R, T, K]
        s = jnp.einsum("BGRTK,BGSK->BGRTS", q, k_BGSK, preferred_element_type=jnp.float32) * scale
        s = jnp.where(vis, s, NEG)
        m = s.max(-1)  # [B, G, R, T]
        p = jnp.where(vis, jnp.exp(s - m[..., None]), 0.0)
        o = jnp.einsum("BGRTS,BGSK->BGRTK", p.astype(v_BGSK.dtype), v_BGSK, preferred_element_type=jnp.float32)
        m_all = jax.lax.pmax(m, axis)
        corr = jnp.exp(m - m_all)
        o, l = jax.lax.psum((o * corr[..., None], p.sum(-1) * corr), axis)
        out = jnp.where((l > 0)[..., None], o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
        return _ungrouped(out).astype(q_BTHK.dtype), k_BGSK, v_BGSK

    f = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, cache_spec, cache_spec, ids_spec, lengths_spec, new_specs),
        out_specs=(q_spec, cache_spec, cache_spec),
    )
    return f(q_BTHK, k_BGSK, v_BGSK, q_index_BT.astype(jnp.int32), kv_lengths_B, new_kv)


# ----------------------------------------------------------------------------- layouts and the wrapper


def layout_order(T: int, n: int, layout: Layout) -> np.ndarray:
    """The sequence's positions in the order they are laid over `n` devices (device i holds the i-th
    of n equal blocks): `contiguous` 0..T-1; `zigzag` blocks i and 2n-1-i of 2n; `striped` t = i mod n.

    Args:
        T: the sequence length.
        n: the devices on the context axis.
        layout: "contiguous", "zigzag" or "striped".

    Returns:
        [T] int positions.

    Raises:
        ValueError: an unknown layout, or T not divisible as the layout needs (2n for zigzag, n for striped).
    """
    if layout == "contiguous":
        return np.arange(T)
    if layout == "zigzag":
        if T % (2 * n):
            raise ValueError(f"zigzag needs the sequence length ({T}) divisible by 2 x the context axis ({n})")
        chunks = np.arange(T).reshape(2 * n, T // (2 * n))
        return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])
    if layout == "striped":
        if T % n:
            raise ValueError(f"striped needs the sequence length ({T}) divisible by the context axis ({n})")
        return np.arange(T).reshape(T // n, n).T.reshape(-1)
    raise ValueError(f"layout must be contiguous, zigzag or striped, got {layout!r}")


def context_attention(
    q_BTHK: Array,
    k_BSGK: Array,
    v_BSGK: Array,
    *,
    mesh: jax.sharding.Mesh | None = None,
    axis: str = "context",
    strategy: Literal["ring", "allgather"] = "ring",
    causal: bool = False,
    q_index_BT: Array | None = None,
    kv_index_BS: Array | None = None,
    q_segments_BT: Array | None = None,
    kv_segments_BS: Array | None = None,
    kv_lengths_B: Array | None = None,
    q_lengths_B: Array | None = None,
    scale: float | None = None,
    spec_BTHK: tuple = (),
    kernel: Literal["dense", "cudnn", "splash", "reference"] | BlockKernel = "dense",
    window: int = 0,
) -> Array:
    """Attention with T and S sharded over mesh axis `axis` of `mesh` (default: the mesh in context).

    The arrays hold the sequence in its laid-out order (see `layout_order`); `q_index_BT` and
    `kv_index_BS` give each token's position in the sequence (default: 0..T-1, contiguous).
    `spec_BTHK`: the mesh axes of the batch and heads dimensions (its length entry is ignored), so
    that each device attends only its rows and heads, as data and tensor parallelism lay them out
    (an axis that does not divide them is left out).
    Raises ValueError when the axis does not divide T or S.

    Args:
        q_BTHK: [B, T, H, K] queries, the whole (global) arrays sharded over `axis`.
        k_BSGK: [B, S, G, K] keys.
        v_BSGK: [B, S, G, K] values.
        mesh: the mesh (None: the one in context).
        axis: the mesh axis the sequence is split over.
        strategy: "ring" (pass key/value blocks around) or "allgather" (gather them first).
        causal: query t sees keys s <= t by position.
        q_index_BT: [B, T] the queries' positions, or None (0..T-1).
        kv_index_BS: [B, S] the keys' positions, or None (0..S-1).
        q_segments_BT: [B, T] packed documents of the queries, or None.
        kv_segments_BS: [B, S] packed documents of the keys (0 = padding), or None.
        kv_lengths_B: [B] key lengths, or None.
        q_lengths_B: [B] query lengths, or None.
        scale: the logits' factor, None: 1/sqrt(K).
        spec_BTHK: the PartitionSpec of [B, T, H, K] activations.
        kernel: what attends each block inside the ring: "dense" (XLA's einsums, any dtype and mask),
            "cudnn" (cuDNN's fused attention, bfloat16/float16 on NVIDIA GPUs: see `cudnn_unservable`),
            "splash" (TPUs; blocks of whole tiles: `splash_unservable`), "reference" (the fused
            kernels' contract in XLA), or a `BlockKernel` of your own (`fused_kernel` makes one from a
            fused attention's two calls).
        window: with causal, > 0: query t sees only the `window` latest positions, t - window < s <= t
            (sliding-window attention); the ring skips a visiting block wholly outside the window and
            masks one the window cuts (`block_kind` reads both off the visibility).

    Returns:
        [B, T, H, K] in q's dtype, sharded as q.

    Raises:
        ValueError: the axis does not divide T or S, only one of the segment arrays is given, a
            window without causal attention, or a fused kernel with the all-gather strategy or with
            blocks it cannot attend.
    """
    mesh_shape = (mesh or jax.sharding.get_abstract_mesh()).shape
    n = mesh_shape[axis]
    B, T, H, K = q_BTHK.shape
    S, G = k_BSGK.shape[1:3]
    for what, length in (("queries", T), ("keys", S)):
        if length % n:
            raise ValueError(f"{what}: length {length} is not divisible by the context axis ({axis}={n})")
    if window and not causal:
        raise ValueError(f"a sliding window ({window}) is said over causal attention, not bidirectional")
    if kernel != "dense" and strategy != "ring":
        raise ValueError(f"kernel={kernel!r} attends the ring's blocks: the all-gather strategy is dense")
    if kernel in UNSERVABLE and (why := UNSERVABLE[kernel](q_BTHK, k_BSGK, n)):
        raise ValueError(why)
    if isinstance(kernel, str) and kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {sorted(KERNELS)} or a BlockKernel, got {kernel!r}")
    block_kernel = KERNELS[kernel]() if isinstance(kernel, str) else kernel
    q_index_BT = jnp.broadcast_to(jnp.arange(T), (B, T)) if q_index_BT is None else q_index_BT
    kv_index_BS = jnp.broadcast_to(jnp.arange(S), (B, S)) if kv_index_BS is None else kv_index_BS
    if (q_segments_BT is None) != (kv_segments_BS is None):
        raise ValueError("segments need both q_segments_BT and kv_segments_BS")
    where = Where(q_index_BT.astype(jnp.int32), kv_index_BS.astype(jnp.int32), q_segments_BT, kv_segments_BS,
                  kv_lengths_B, q_lengths_B)  # fmt: skip
    scale = K**-0.5 if scale is None else scale
    b_axes, h_axes = _row_and_head_axes(mesh_shape, spec_BTHK, B, H, G)
    x_spec, ids_spec = P(b_axes, axis, h_axes, None), P(b_axes, axis)
    given = lambda x, spec: None if x is None else spec
    where_specs = Where(
        ids_spec,
        ids_spec,
        given(q_segments_BT, ids_spec),
        given(kv_segments_BS, ids_spec),
        given(kv_lengths_B, P(b_axes)),
        given(q_lengths_B, P(b_axes)),
    )

    def local(q, k, v, where):
        if strategy == "ring":
            return ring_attention(q, k, v, where, axis, n, causal, scale, block_kernel, window)
        return allgather_attention(q, k, v, where, axis, causal, scale, window)

    specs = dict(in_specs=(x_spec, x_spec, x_spec, where_specs), out_specs=x_spec)
    f = jax.shard_map(local, mesh=mesh, check_vma=block_kernel.vma, **specs)
    return f(q_BTHK, k_BSGK, v_BSGK, where)
