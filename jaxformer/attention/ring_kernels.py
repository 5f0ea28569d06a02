"""The kernel inside each block of ring attention (`jaxformer.attention.ring`).

Inside the ring, a `BlockKernel` attends the queries to each visiting block: `DENSE` (XLA's
einsums, a float32 [B, H, T, S] score block a step; any mask) or a fused kernel (`fused_kernel`:
cuDNN's forward and backward calls on NVIDIA GPUs, `KERNELS["cudnn"]`; splash's on TPUs), told each
block's mask by its kind (`block_kind`: skipped, full, causal, zig-zag's half blocks, or a bias for
the rest). `reference_fwd_call`/`reference_bwd_call` are the fused kernels' contract written in XLA,
which serves tests on any backend; `UNSERVABLE` says why a fused kernel cannot take a ring's blocks.

`Where` says which tokens a device's block holds; the functions run inside `jax.shard_map`.
Plain `jax.numpy`, no Flax.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.config import SPLASH_TILE, ring_blocks_unfit

Array = jax.Array
NEG = -1e30  # a masked score: finite, so a block with nothing visible gives exp(NEG - m) = 0, never NaN
FUSED_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.bfloat16).max)  # a fused kernel's masked score (cuDNN's, bf16)


class Where(NamedTuple):
    """Which tokens a device's block holds, and what masks them (int arrays; no gradient).

    q_index_BT, kv_index_BS: each local token's position in the whole sequence.
    q_segments_BT, kv_segments_BS: packed documents (0 = padding key); None: one document a row.
    kv_lengths_B: keys at positions >= length are padding; None: none are.
    q_lengths_B: queries at positions >= length see nothing (their output is zero); None: all see.

    Attributes:
        q_index_BT: [B, T] each local query's position in the whole sequence.
        kv_index_BS: [B, S] each local key's position in the whole sequence.
        q_segments_BT: [B, T] the queries' packed documents, or None.
        kv_segments_BS: [B, S] the keys' packed documents (0 = padding), or None.
        kv_lengths_B: [B] key lengths, or None.
        q_lengths_B: [B] query lengths, or None.
    """

    q_index_BT: Array
    kv_index_BS: Array
    q_segments_BT: Array | None = None
    kv_segments_BS: Array | None = None
    kv_lengths_B: Array | None = None
    q_lengths_B: Array | None = None


def _visible(where: Where, kv: tuple, causal: bool, window: int = 0) -> Array:
    """[B, 1, 1, T, S]: which visiting keys (`kv`: index, segments, lengths of the block) each query
    sees; `window` > 0 (causal): only the `window` latest positions, t - window < s <= t."""
    kv_index_BS, kv_segments_BS = kv
    q_BT1, k_B1S = where.q_index_BT[:, :, None], kv_index_BS[:, None, :]
    vis = jnp.ones(q_BT1.shape[:2] + k_B1S.shape[2:], bool)
    if causal:
        vis = k_B1S <= q_BT1
        if window:  # a block wholly before the window is then SKIP, one it cuts MASKED (`block_kind`)
            vis = vis & (k_B1S > q_BT1 - window)
    if where.kv_lengths_B is not None:
        vis = vis & (k_B1S < where.kv_lengths_B[:, None, None])
    if where.q_lengths_B is not None:
        vis = vis & (q_BT1 < where.q_lengths_B[:, None, None])
    if where.q_segments_BT is not None:
        same_BTS = where.q_segments_BT[:, :, None] == kv_segments_BS[:, None, :]
        vis = vis & same_BTS & (kv_segments_BS != 0)[:, None, :]
    return vis[:, None, None]


def _grouped(q_BTHK: Array, G: int) -> Array:
    """[B, T, H, K] -> [B, G, R, T, K]: the R = H / G query heads that share key/value head g."""
    B, T, H, K = q_BTHK.shape
    return q_BTHK.reshape(B, T, G, H // G, K).transpose(0, 2, 3, 1, 4)


def _ungrouped(x_BGRTK: Array) -> Array:
    B, G, R, T, K = x_BGRTK.shape
    return x_BGRTK.transpose(0, 3, 1, 2, 4).reshape(B, T, G * R, K)


def _scores(q_BGRTK, k_BSGK, vis, scale) -> Array:
    s = jnp.einsum("BGRTK,BSGK->BGRTS", q_BGRTK, k_BSGK, preferred_element_type=jnp.float32) * scale
    return jnp.where(vis, s, NEG)


def _kv_meta(where: Where) -> tuple:
    segments = where.kv_segments_BS if where.q_segments_BT is not None else jnp.zeros_like(where.kv_index_BS)
    return where.kv_index_BS, segments


# ----------------------------------------------------------------------------- the kernel inside each block

# What a visiting block's mask is, as a fused kernel can be told it (`block_kind`).
SKIP, FULL, CAUSAL, KV_FRONT, Q_BACK, MASKED = range(6)


def block_kind(vis: Array, causal: bool) -> Array:
    """The kind of a visiting block's mask `vis` ([B, 1, 1, T, S], the same for every row): SKIP (no
    query sees a key), FULL (all see all), CAUSAL (T = S and query t sees keys s <= t: a block on the
    diagonal of a contiguous, zig-zag or striped layout), KV_FRONT (every query sees the first S/2 keys
    and no other: zig-zag's blocks from earlier devices), Q_BACK (the last T/2 queries see every key,
    the first none: zig-zag's blocks from later devices), else MASKED. Read off `vis` itself, so any
    layout, padding or packing is classified exactly; only MASKED needs the mask as an array.

    Args:
        vis: [B, 1, 1, T, S] bool, which keys each query sees.
        causal: whether the attention is causal (CAUSAL is looked for only then).

    Returns:
        int32 scalar, one of SKIP, FULL, CAUSAL, KV_FRONT, Q_BACK, MASKED.
    """
    T, S = vis.shape[-2:]
    lead = (1,) * (vis.ndim - 2)
    t_T1, s_1S = np.arange(T).reshape(*lead, T, 1), np.arange(S).reshape(*lead, 1, S)
    tests = [(~vis.any(), SKIP), (vis.all(), FULL)]
    if causal and T == S:
        tests.append(((vis == (s_1S <= t_T1)).all(), CAUSAL))
    if S % 2 == 0:
        tests.append(((vis == (s_1S < S // 2)).all(), KV_FRONT))
    if T % 2 == 0:
        tests.append(((vis == (t_T1 >= T // 2)).all(), Q_BACK))
    kind = jnp.int32(MASKED)
    for test, k in reversed(tests):  # the first test that holds decides
        kind = jnp.where(test, k, kind)
    return kind


class BlockKernel(NamedTuple):
    """How the ring attends its queries to one visiting block, forward and backward.

    `enter(x_BTHK, G)` puts queries (and the output and its gradient) into the kernel's layout once,
    before the ring; `leave` takes the kernel's layout back to [B, T, H, K]. `fwd` and `bwd` take
    (q, k_BSGK, v_BSGK, vis, kind, causal, scale): the device's queries in that layout, the visiting
    keys and values, which keys each query sees (`vis`, [B, 1, 1, T, S]), its `block_kind` (never
    SKIP) and whether the attention is causal (else the kind is never CAUSAL).
    `fwd` returns (o, lse) in float32: the block's attention normalised over the keys each query sees
    there, and its log-sum-exp (o's shape without its last dim); a query that sees none gets o = 0
    and lse <= NEG / 2. `bwd` takes also (`seen(out, do)`, lse, do), from the whole attention's output,
    log-sum-exp and output gradient, and returns this block's share of (dq, dk_BSGK, dv_BSGK),
    float32: flash attention's backward told the final statistics rather than the block's own.

    Attributes:
        fwd: the forward of one block.
        bwd: the backward of one block.
        classify: whether the kernel needs the block's kind (else only SKIP is told apart).
        enter: [B, T, H, K] -> the kernel's layout, given G key/value heads.
        leave: the kernel's layout -> [B, T, H, K].
        seen: what `bwd` is told of the whole output, once before the ring (out, do) -> ...: the output
            itself, or what the kernel reads of it (XLA's: the rows' dO . O).
        vma: whether the kernel's calls type the mesh axes their outputs vary over (`shard_map`'s
            `check_vma`); Pallas calls do not.
    """

    fwd: Callable
    bwd: Callable
    classify: bool
    enter: Callable = lambda x_BTHK, G: x_BTHK
    leave: Callable = lambda x_BTHK: x_BTHK
    seen: Callable = lambda out, do: out
    vma: bool = True


def _dense_fwd(q_BGRTK, k_BSGK, v_BSGK, vis, kind, causal, scale):
    s = _scores(q_BGRTK, k_BSGK, vis, scale)  # [B, G, R, T, S]
    m = s.max(-1)  # [B, G, R, T]
    p = jnp.where(vis, jnp.exp(s - m[..., None]), 0.0)
    l = p.sum(-1)
    o = jnp.einsum("BGRTS,BSGK->BGRTK", p.astype(v_BSGK.dtype), v_BSGK, preferred_element_type=jnp.float32)
    seen = l > 0
    l = jnp.where(seen, l, 1.0)
    return jnp.where(seen[..., None], o / l[..., None], 0.0), jnp.where(seen, m + jnp.log(l), NEG)


def _dense_bwd(q_BGRTK, k_BSGK, v_BSGK, vis, kind, causal, scale, d_BGRT, lse_BGRT, do_BGRTK):
    """P = exp(S - lse), dV = P^T dO, dS = P (dO V^T - D) with D = rowsum(dO * O) (`d_BGRT`, from
    `_rows_do_o` once before the ring), dQ = dS K scale, dK = dS^T Q scale."""
    do, d = do_BGRTK.astype(jnp.float32), d_BGRT
    s = _scores(q_BGRTK, k_BSGK, vis, scale)
    p = jnp.where(vis, jnp.exp(s - lse_BGRT[..., None]), 0.0)  # [B, G, R, T, S]
    dv = jnp.einsum("BGRTS,BGRTK->BSGK", p, do)
    dp = jnp.einsum("BGRTK,BSGK->BGRTS", do, v_BSGK.astype(jnp.float32))
    ds = p * (dp - d[..., None]) * scale
    dq = jnp.einsum("BGRTS,BSGK->BGRTK", ds, k_BSGK.astype(jnp.float32))
    dk = jnp.einsum("BGRTS,BGRTK->BSGK", ds, q_BGRTK.astype(jnp.float32))
    return dq, dk, dv


def _rows_do_o(out_BGRTK, do_BGRTK) -> Array:
    return jnp.sum(do_BGRTK.astype(jnp.float32) * out_BGRTK.astype(jnp.float32), -1)  # [B, G, R, T]


DENSE = BlockKernel(
    _dense_fwd, _dense_bwd, classify=False, enter=lambda x, G: _grouped(x, G), leave=_ungrouped, seen=_rows_do_o
)
"""Each block attended by XLA's einsums, the query heads grouped by the key/value head they share
([B, G, R, T, K]): scores [B, H, T, S] in float32 a step; any mask, any dtype."""


def fused_kernel(fwd_call: Callable, bwd_call: Callable, tile: int = 1, vma: bool = True) -> BlockKernel:
    """A `BlockKernel` from a fused attention's two calls, each block told its mask by kind: no mask
    (FULL), the kernel's causal mask (CAUSAL), half the keys or half the queries sliced off (KV_FRONT,
    Q_BACK), and only for MASKED a bias [B, 1, T, S]: 0 where a key is seen, a large negative number
    where not (so a query that sees nothing in the block gets the mean of its values, and a
    log-sum-exp far below NEG / 2, which `fwd` turns into o = 0, lse = NEG).

    fwd_call(q_BTHK, k_BSGK, v_BSGK, bias_B1TS | None, causal, scale) -> (o_BTHK, lse_BHT)
    bwd_call(q_BTHK, k_BSGK, v_BSGK, bias_B1TS | None, causal, scale, out_BTHK, lse_BHT, do_BTHK)
        -> (dq_BTHK, dk_BSGK, dv_BSGK)

    Args:
        fwd_call: the kernel's forward, returning the output and log-sum-exp (natural log).
        bwd_call: the kernel's backward from a given output and log-sum-exp.
        tile: lengths the kernel needs multiples of: a half block that is not one is MASKED instead.
        vma: whether the calls type the mesh axes their outputs vary over (Pallas calls do not).

    Returns:
        The BlockKernel.
    """

    def bias(vis, dtype):
        return jnp.where(vis[:, 0], 0.0, FUSED_MASK_VALUE).astype(dtype)  # [B, 1, T, S]

    def fwd(q_BTHK, k_BSGK, v_BSGK, vis, kind, causal, scale):
        B, T, H, K = q_BTHK.shape
        S = k_BSGK.shape[1]

        def back(q_BTHK, k_BSGK, v_BSGK):  # the last T/2 queries; the first see nothing
            o, lse = fwd_call(q_BTHK[:, T // 2 :], k_BSGK, v_BSGK, None, False, scale)
            o = jnp.concatenate([jnp.zeros((B, T // 2, H, K), o.dtype), o], axis=1)
            return o, jnp.concatenate([jnp.full((B, H, T // 2), NEG, lse.dtype), lse], axis=2)

        branches = {
            FULL: lambda q, k, v: fwd_call(q, k, v, None, False, scale),
            CAUSAL: lambda q, k, v: fwd_call(q, k, v, None, True, scale),
            KV_FRONT: lambda q, k, v: fwd_call(q, k[:, : S // 2], v[:, : S // 2], None, False, scale),
            Q_BACK: back,
            MASKED: lambda q, k, v: fwd_call(q, k, v, bias(vis, q.dtype), False, scale),
        }
        o, lse_BHT = jax.lax.switch(
            kind - FULL, [branches[k] for k in _kinds(T, S, causal, tile)], q_BTHK, k_BSGK, v_BSGK
        )
        lse = lse_BHT.astype(jnp.float32).transpose(0, 2, 1)  # [B, T, H]
        seen = lse > NEG / 2
        return jnp.where(seen[..., None], o.astype(jnp.float32), 0.0), jnp.where(seen, lse, NEG)

    def bwd(q_BTHK, k_BSGK, v_BSGK, vis, kind, causal, scale, out_BTHK, lse_BTH, do_BTHK):
        B, T, H, K = q_BTHK.shape
        S, G = k_BSGK.shape[1:3]
        out_BTHK, do_BTHK = out_BTHK.astype(q_BTHK.dtype), do_BTHK.astype(q_BTHK.dtype)
        lse_BHT = lse_BTH.transpose(0, 2, 1)
        call = lambda q, k, v, b, causal, o, lse, do: bwd_call(q, k, v, b, causal, scale, o, lse, do)

        def front(q, k, v, o, lse, do):  # gradients of the first S/2 keys; the rest get none
            dq, dk, dv = call(q, k[:, : S // 2], v[:, : S // 2], None, False, o, lse, do)
            pad = lambda x: jnp.concatenate([x, jnp.zeros((B, S - S // 2, G, K), x.dtype)], axis=1)
            return dq, pad(dk), pad(dv)

        def back(q, k, v, o, lse, do):  # gradients of the last T/2 queries; the first get none
            h = T // 2
            dq, dk, dv = call(q[:, h:], k, v, None, False, o[:, h:], lse[:, :, h:], do[:, h:])
            return jnp.concatenate([jnp.zeros((B, h, H, K), dq.dtype), dq], axis=1), dk, dv

        branches = {
            FULL: lambda q, k, v, o, lse, do: call(q, k, v, None, False, o, lse, do),
            CAUSAL: lambda q, k, v, o, lse, do: call(q, k, v, None, True, o, lse, do),
            KV_FRONT: front,
            Q_BACK: back,
            MASKED: lambda q, k, v, o, lse, do: call(q, k, v, bias(vis, q.dtype), False, o, lse, do),
        }
        grads = jax.lax.switch(
            kind - FULL,
            [branches[k] for k in _kinds(T, S, causal, tile)],
            q_BTHK,
            k_BSGK,
            v_BSGK,
            out_BTHK,
            lse_BHT,
            do_BTHK,
        )
        return tuple(g.astype(jnp.float32) for g in grads)

    return BlockKernel(fwd, bwd, classify=True, vma=vma)


def _kinds(T: int, S: int, causal: bool, tile: int) -> list[int]:
    """The kinds from FULL on, in order, those a block of T queries and S keys cannot be (`block_kind`
    never gives them) or whose halves are not whole tiles served as MASKED, so that `lax.switch`
    indexes them all."""
    halves = lambda L: L % (2 * tile) == 0
    can = {FULL: True, CAUSAL: causal and T == S, KV_FRONT: halves(S), Q_BACK: halves(T), MASKED: True}
    return [k if can[k] else MASKED for k in (FULL, CAUSAL, KV_FRONT, Q_BACK, MASKED)]


def reference_fwd_call(
    q_BTHK: Array, k_BSGK: Array, v_BSGK: Array, bias: Array | None, causal: bool, scale: float
) -> tuple[Array, Array]:
    """A fused attention's forward as `fused_kernel` calls it, in XLA's einsums, with cuDNN's
    conventions: a masked score is `FUSED_MASK_VALUE` (a query that sees nothing gets the mean of the
    values) and the log-sum-exp is [B, H, T] in float32. The contract's reference in tests, and what
    attends the MASKED blocks of kernels that take no bias (splash).

    Args:
        q_BTHK: [B, T, H, K] queries.
        k_BSGK: [B, S, G, K] keys.
        v_BSGK: [B, S, G, K] values.
        bias: [B, 1, T, S] added to the scores, or None.
        causal: query t sees keys s <= t (T = S).
        scale: the scores' factor.

    Returns:
        (o_BTHK in q's dtype, lse_BHT float32).
    """
    H = q_BTHK.shape[2]
    k, v = _to_query_heads(k_BSGK, H), _to_query_heads(v_BSGK, H)  # [B, S, H, K]
    s = _reference_scores(q_BTHK, k, bias, causal, scale)  # [B, H, T, S]
    lse = jax.nn.logsumexp(s, axis=-1)
    o = jnp.einsum("BHTS,BSHK->BTHK", jnp.exp(s - lse[..., None]), v.astype(jnp.float32))
    return o.astype(q_BTHK.dtype), lse


def reference_bwd_call(
    q_BTHK: Array,
    k_BSGK: Array,
    v_BSGK: Array,
    bias: Array | None,
    causal: bool,
    scale: float,
    out_BTHK: Array,
    lse_BHT: Array,
    do_BTHK: Array,
) -> tuple[Array, Array, Array]:
    """A fused attention's backward from the output and log-sum-exp it is given, in XLA's einsums
    (`reference_fwd_call`'s conventions).

    Args:
        q_BTHK: [B, T, H, K] queries.
        k_BSGK: [B, S, G, K] keys.
        v_BSGK: [B, S, G, K] values.
        bias: [B, 1, T, S] added to the scores, or None.
        causal: query t sees keys s <= t (T = S).
        scale: the scores' factor.
        out_BTHK: [B, T, H, K] the whole attention's output.
        lse_BHT: [B, H, T] its log-sum-exp.
        do_BTHK: [B, T, H, K] the output's gradient.

    Returns:
        (dq_BTHK, dk_BSGK, dv_BSGK) in the inputs' dtypes.
    """
    H, G = q_BTHK.shape[2], k_BSGK.shape[2]
    f32 = lambda x: x.astype(jnp.float32)
    k, v = _to_query_heads(f32(k_BSGK), H), _to_query_heads(f32(v_BSGK), H)
    p = jnp.exp(_reference_scores(q_BTHK, k, bias, causal, scale) - lse_BHT[..., None])  # [B, H, T, S]
    d = jnp.sum(f32(do_BTHK) * f32(out_BTHK), -1).transpose(0, 2, 1)  # [B, H, T]
    dv = jnp.einsum("BHTS,BTHK->BSHK", p, f32(do_BTHK))
    ds = p * (jnp.einsum("BTHK,BSHK->BHTS", f32(do_BTHK), v) - d[..., None]) * scale
    dq = jnp.einsum("BHTS,BSHK->BTHK", ds, k)
    dk = jnp.einsum("BHTS,BTHK->BSHK", ds, f32(q_BTHK))
    return dq.astype(q_BTHK.dtype), _per_kv_head(dk, G).astype(k_BSGK.dtype), _per_kv_head(dv, G).astype(v_BSGK.dtype)


def _to_query_heads(x_BSGK: Array, H: int) -> Array:
    """Keys or values [B, S, G, K] repeated to the H query heads that share them: [B, S, H, K]."""
    return jnp.repeat(x_BSGK, H // x_BSGK.shape[2], axis=2)


def _per_kv_head(x_BSHK: Array, G: int) -> Array:
    """Gradients [B, S, H, K] of `_to_query_heads`' copies, summed back to their G heads: [B, S, G, K]."""
    B, S, H, K = x_BSHK.shape
    return x_BSHK.reshape(B, S, G, H // G, K).sum(3)


def _reference_scores(q_BTHK, k_BSHK, bias, causal, scale) -> Array:
    T, S = q_BTHK.shape[1], k_BSHK.shape[1]
    s = jnp.einsum("BTHK,BSHK->BHTS", q_BTHK, k_BSHK, preferred_element_type=jnp.float32) * scale
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    return jnp.where(jnp.tri(T, S, dtype=bool), s, FUSED_MASK_VALUE) if causal else s


MASKED_CHUNK = 128  # queries a step when XLA attends a masked block for a kernel that takes no bias


def _chunks(x, n: int, axis: int) -> Array:
    """x's `axis` split into n chunks, the chunk index first."""
    return jnp.moveaxis(x.reshape(*x.shape[:axis], n, x.shape[axis] // n, *x.shape[axis + 1 :]), axis, 0)


def _unchunked(x, axis: int) -> Array:
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])


def _query_chunks(T: int) -> int:
    """How many MASKED_CHUNK-query chunks T queries make (1: T is not a multiple of it)."""
    return max(1, T // MASKED_CHUNK) if T % MASKED_CHUNK == 0 else 1


def _by_query_chunks_fwd(q_BTHK, k_BSGK, v_BSGK, bias_B1TS, scale):
    """`reference_fwd_call` of a masked block, MASKED_CHUNK queries at a time: scores of [B, H, chunk, S]
    a step, not [B, H, T, S] (which a compiler reserves even when the branch is never taken)."""
    n = _query_chunks(q_BTHK.shape[1])
    step = lambda qb: reference_fwd_call(qb[0], k_BSGK, v_BSGK, qb[1], False, scale)
    o, lse = jax.lax.map(step, (_chunks(q_BTHK, n, 1), _chunks(bias_B1TS, n, 2)))
    return _unchunked(o, 1), _unchunked(lse, 2)


def _by_query_chunks_bwd(q_BTHK, k_BSGK, v_BSGK, bias_B1TS, scale, out_BTHK, lse_BHT, do_BTHK):
    """`reference_bwd_call` of a masked block, MASKED_CHUNK queries at a time (dK and dV summed)."""
    n = _query_chunks(q_BTHK.shape[1])

    def step(dkv, chunk):
        q, bias, out, lse, do = chunk
        dq, dk, dv = reference_bwd_call(q, k_BSGK, v_BSGK, bias, False, scale, out, lse, do)
        return (dkv[0] + dk.astype(jnp.float32), dkv[1] + dv.astype(jnp.float32)), dq

    chunks = (_chunks(q_BTHK, n, 1), _chunks(bias_B1TS, n, 2), _chunks(out_BTHK, n, 1), _chunks(lse_BHT, n, 2))
    zeros = jnp.zeros_like(k_BSGK, jnp.float32)
    (dk, dv), dq = jax.lax.scan(step, (zeros, zeros), (*chunks, _chunks(do_BTHK, n, 1)))
    return _unchunked(dq, 1), dk.astype(k_BSGK.dtype), dv.astype(v_BSGK.dtype)


def _splash_calls(interpret: bool = False) -> tuple[Callable, Callable]:
    """Splash attention's forward (its `save_residuals` mode: the output and log-sum-exp) and
    backward (its dq/dkv kernels told a given output and log-sum-exp), per row under `vmap`, the key
    heads repeated to the query heads. Splash takes masks as static structure only: blocks with a
    bias (MASKED) go to `reference_fwd_call` / `reference_bwd_call`. Private JAX API, compiled for a
    TPU slice in `tests/test_tpu.py`; `interpret`: Pallas's interpreter (any backend), for tests."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    def kernel(T: int, S: int, H: int, causal: bool):  # made in each trace: its mask tables are staged there
        one = sm.CausalMask((T, S)) if causal else sm.FullMask((T, S))
        return sk.make_splash_mha(
            sm.MultiHeadMask([one] * H), block_sizes=sk.BlockSizes(*(SPLASH_TILE,) * 8), head_shards=1,
            q_seq_shards=1, save_residuals=True, interpret=interpret,
        )  # fmt: skip

    def heads(q_BTHK, k_BSGK, v_BSGK, scale):  # [B, H, ., K], the queries scaled (splash takes no scale)
        H = q_BTHK.shape[2]
        q = jnp.swapaxes(q_BTHK * jnp.asarray(scale, q_BTHK.dtype), 1, 2)
        return (q, *(jnp.swapaxes(_to_query_heads(x, H), 1, 2) for x in (k_BSGK, v_BSGK)))

    def fwd(q_BTHK, k_BSGK, v_BSGK, bias, causal, scale):
        if bias is not None:
            return _by_query_chunks_fwd(q_BTHK, k_BSGK, v_BSGK, bias, scale)
        (T, H), S = q_BTHK.shape[1:3], k_BSGK.shape[1]
        with jax.default_matmul_precision("default"):  # Mosaic multiplies bfloat16 tiles at their own
            out_BHTK, (lse_BHT,) = jax.vmap(kernel(T, S, H, causal))(*heads(q_BTHK, k_BSGK, v_BSGK, scale))
        return jnp.swapaxes(out_BHTK, 1, 2), lse_BHT

    def bwd(q_BTHK, k_BSGK, v_BSGK, bias, causal, scale, out_BTHK, lse_BHT, do_BTHK):
        if bias is not None:
            return _by_query_chunks_bwd(q_BTHK, k_BSGK, v_BSGK, bias, scale, out_BTHK, lse_BHT, do_BTHK)
        (T, H), (S, G) = q_BTHK.shape[1:3], k_BSGK.shape[1:3]
        splash = kernel(T, S, H, causal)
        kw = splash.kwargs

        def row(q, k, v, o, lse, do):
            res = (q, k, v, None, None, o, lse, _collapsed(splash.dq_mask_info), _collapsed(splash.dkv_mask_info))
            grads = sk._splash_attention_bwd(
                False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None, kw["mask_function"],
                kw["attn_logits_soft_cap"], kw["interpret"], res, do,
            )  # fmt: skip
            return grads[3:6]

        q, k, v = heads(q_BTHK, k_BSGK, v_BSGK, scale)
        with jax.default_matmul_precision("default"):
            dq, dk, dv = jax.vmap(row)(q, k, v, jnp.swapaxes(out_BTHK, 1, 2), lse_BHT, jnp.swapaxes(do_BTHK, 1, 2))
        per_group = lambda x_BHSK: _per_kv_head(jnp.swapaxes(x_BHSK, 1, 2), G)
        dq_BTHK = jnp.swapaxes(dq, 1, 2) * jnp.asarray(scale, dq.dtype)
        return dq_BTHK, per_group(dk).astype(k_BSGK.dtype), per_group(dv).astype(v_BSGK.dtype)

    return fwd, bwd


def _collapsed(info):
    """A mask info's partial mask blocks with their leading dims collapsed, as splash's kernels read
    them (its jitted entry point does this before its forward; its backward is called here directly)."""
    if info is None or info.partial_mask_blocks is None:
        return info
    blocks = info.partial_mask_blocks
    return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))


def splash_unservable(q_BTHK: Array | jax.ShapeDtypeStruct, k_BSGK: Array | jax.ShapeDtypeStruct, n: int) -> str | None:
    """Why splash attention cannot attend the ring's blocks of these (global) queries and keys over
    `n` devices (None: it can): each block's lengths must be whole tiles.

    Args:
        q_BTHK: [B, T, H, K] the queries (arrays or shape-dtype structs).
        k_BSGK: [B, S, G, K] the keys.
        n: the devices on the context axis.

    Returns:
        The reason, or None.
    """
    return ring_blocks_unfit("splash", q_BTHK.dtype, q_BTHK.shape[3], q_BTHK.shape[1] // n, k_BSGK.shape[1] // n)


def _cudnn_calls() -> tuple[Callable, Callable]:
    """cuDNN's fused attention forward and backward primitives, as JAX binds them for
    `jax.nn.dot_product_attention(implementation="cudnn")`: the backward takes the output and
    log-sum-exp it is given, which the public function's gradient cannot be told (it also stops the
    gradient of the log-sum-exp it returns). Private JAX API: `tests/test_gpu.py` compiles it for
    H100s in CI, and `cudnn_unservable` says why it cannot serve a call instead of failing mid-trace."""
    from jax._src.cudnn import fused_attention_stablehlo as cf

    layout = cf.AttentionLayout.BTNH.value

    def operands(q, k, v, bias):
        unused = jnp.zeros(0, q.dtype)
        return (q, k, v, unused if bias is None else bias) + (unused,) * 6

    def params(bias, causal, scale):
        return dict(
            scale=scale, seed=0, dropout_rate=0.0, variadic_args=(bias is not None, False),
            mask_type=cf.MaskType.CAUSAL if causal else cf.MaskType.NO_MASK, layout=layout,
            sliding_window_length=None,
        )  # fmt: skip

    def fwd(q, k, v, bias, causal, scale):
        out, lse_BHT = cf._dot_product_attention_fwd_p_wrapper.bind(
            *operands(q, k, v, bias), **params(bias, causal, scale), is_training=True
        )
        return out, lse_BHT

    def bwd(q, k, v, bias, causal, scale, out, lse_BHT, do):
        grads = cf._dot_product_attention_bwd_p_wrapper.bind(
            *operands(q, k, v, bias), lse_BHT, out, do, **params(bias, causal, scale)
        )
        return tuple(grads[:3])

    return fwd, bwd


def cudnn_unservable(q_BTHK: Array | jax.ShapeDtypeStruct, k_BSGK: Array | jax.ShapeDtypeStruct, n: int) -> str | None:
    """Why cuDNN's fused attention cannot attend the ring's blocks of these (global) queries and keys
    over `n` devices (None: it can): its dtypes, head dims and even block lengths, and a cuDNN JAX
    can find.

    Args:
        q_BTHK: [B, T, H, K] the queries (arrays or shape-dtype structs).
        k_BSGK: [B, S, G, K] the keys.
        n: the devices on the context axis.

    Returns:
        The reason, or None.
    """
    why = ring_blocks_unfit("cudnn", q_BTHK.dtype, q_BTHK.shape[3], q_BTHK.shape[1] // n, k_BSGK.shape[1] // n)
    if why is not None:  # what the shapes tell (Config asks the same); then JAX's checks of this machine
        return why
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cf

        B, T, H, K = q_BTHK.shape
        S, G = k_BSGK.shape[1:3]
        q = jax.ShapeDtypeStruct((B, T // n, H, K), q_BTHK.dtype)
        k = jax.ShapeDtypeStruct((B, S // n, G, K), k_BSGK.dtype)
        bias = jax.ShapeDtypeStruct((B, 1, T // n, S // n), q_BTHK.dtype)
        layout = cf.AttentionLayout.BTNH
        cf.check_layout(q, k, k, bias, None, None, None, None, None, None, layout)
        cf.check_is_flash_attention(q, k, k, layout.value, cf.check_cudnn_version(), True, True)
    except (NotImplementedError, ValueError, RuntimeError, ImportError, AttributeError) as e:
        return f"cuDNN flash attention cannot attend the ring's blocks: {e}"
    return None


KERNELS = {
    "dense": lambda: DENSE,
    "cudnn": lambda: fused_kernel(*_cudnn_calls()),
    "splash": lambda: fused_kernel(*_splash_calls(), tile=SPLASH_TILE, vma=False),
    "reference": lambda: fused_kernel(reference_fwd_call, reference_bwd_call),
}
"""The ring's kernels by name: XLA's einsums, cuDNN's and splash's fused attention, and the fused
kernels' contract in XLA (`reference_fwd_call`), which serves tests on any backend."""

UNSERVABLE = {"cudnn": cudnn_unservable, "splash": splash_unservable}
"""Why a named fused kernel cannot attend the ring's blocks of (q_BTHK, k_BSGK) over n devices."""
