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
device sees is skipped there (`lax.cond`), in both passes.

Inside the ring, a `BlockKernel` attends the queries to each visiting block: `DENSE` (XLA's
einsums, a float32 [B, H, T, S] score block a step; any mask) or a fused kernel (`fused_kernel`:
cuDNN's forward and backward calls on NVIDIA GPUs, `KERNELS["cudnn"]`), told each block's mask by
its kind (`block_kind`: skipped, full, causal, zig-zag's half blocks, or a bias for the rest).

The functions below run inside `jax.shard_map` with the sequence axis named `axis_name`;
`context_attention` wraps them for arrays sharded over a mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxformer.config import SPLASH_TILE, ring_blocks_unfit

Array = jax.Array
Layout = Literal["contiguous", "zigzag", "striped"]
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


def _visible(where: Where, kv: tuple, causal: bool) -> Array:
    """[B, 1, 1, T, S]: which visiting keys (`kv`: index, segments, lengths of the block) each query sees."""
    kv_index_BS, kv_segments_BS = kv
    q_BT1, k_B1S = where.q_index_BT[:, :, None], kv_index_BS[:, None, :]
    vis = jnp.ones(q_BT1.shape[:2] + k_B1S.shape[2:], bool)
    if causal:
        vis = k_B1S <= q_BT1
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


def _shift(tree, axis_name: str, n: int):
    """Every device's `tree` to the next device of the ring (device i's block goes to i + 1)."""
    return jax.lax.ppermute(tree, axis_name, [(i, (i + 1) % n) for i in range(n)])


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

    Returns:
        [B, T, H, K] in q's dtype.
    """
    return _ring(q_BTHK, k_BSGK, v_BSGK, where, axis_name, axis_size, causal, scale, kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _ring(q_BTHK, k_BSGK, v_BSGK, where, axis_name, n, causal, scale, kernel):
    return _ring_forward(q_BTHK, k_BSGK, v_BSGK, where, axis_name, n, causal, scale, kernel)[0]


def _kind(kernel: BlockKernel, vis: Array, causal: bool) -> Array:
    return block_kind(vis, causal) if kernel.classify else jnp.where(vis.any(), MASKED, SKIP)


def _ring_forward(q_BTHK, k_BSGK, v_BSGK, where, axis_name, n, causal, scale, kernel):
    q = kernel.enter(q_BTHK, k_BSGK.shape[2])  # in the kernel's layout

    def fold(carry, kv):  # one visiting block into the running output and log-sum-exp
        o, lse = carry
        k, v, meta = kv
        vis = _visible(where, meta, causal)
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


def _ring_fwd(q_BTHK, k_BSGK, v_BSGK, where, axis_name, n, causal, scale, kernel):
    out, lse = _ring_forward(q_BTHK, k_BSGK, v_BSGK, where, axis_name, n, causal, scale, kernel)
    return out, (q_BTHK, k_BSGK, v_BSGK, where, out, lse)


def _ring_bwd(axis_name, n, causal, scale, kernel, res, dout_BTHK):
    """A second trip around the ring: each visiting block's share of the gradients from the whole
    attention's output and log-sum-exp (`BlockKernel.bwd`); dK and dV travel with their block."""
    q_BTHK, k_BSGK, v_BSGK, where, out_BTHK, lse = res
    q, out, do = (kernel.enter(x, k_BSGK.shape[2]) for x in (q_BTHK, out_BTHK, dout_BTHK))
    seen = kernel.seen(out, do)

    def step(_, state):
        dq, (k, v, meta, dk, dv) = state
        vis = _visible(where, meta, causal)
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
    q_BTHK: Array, k_BSGK: Array, v_BSGK: Array, where: Where, axis_name: str, causal: bool, scale
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

    Returns:
        [B, T, H, K] in q's dtype.
    """
    gather = lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
    k, v = gather(k_BSGK), gather(v_BSGK)
    meta = tuple(gather(x) for x in _kv_meta(where))
    q = _grouped(q_BTHK, k.shape[2])
    vis = _visible(where, meta, causal)
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
        vis = _visible(Where(q_index_BT, slots_BS, kv_lengths_B=kv_lengths_B), (slots_BS, None), causal)
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

    Returns:
        [B, T, H, K] in q's dtype, sharded as q.

    Raises:
        ValueError: the axis does not divide T or S, only one of the segment arrays is given, or a
            fused kernel with the all-gather strategy or with blocks it cannot attend.
    """
    mesh_shape = (mesh or jax.sharding.get_abstract_mesh()).shape
    n = mesh_shape[axis]
    B, T, H, K = q_BTHK.shape
    S, G = k_BSGK.shape[1:3]
    for what, length in (("queries", T), ("keys", S)):
        if length % n:
            raise ValueError(f"{what}: length {length} is not divisible by the context axis ({axis}={n})")
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
            return ring_attention(q, k, v, where, axis, n, causal, scale, block_kernel)
        return allgather_attention(q, k, v, where, axis, causal, scale)

    specs = dict(in_specs=(x_spec, x_spec, x_spec, where_specs), out_specs=x_spec)
    f = jax.shard_map(local, mesh=mesh, check_vma=block_kernel.vma, **specs)
    return f(q_BTHK, k_BSGK, v_BSGK, where)
