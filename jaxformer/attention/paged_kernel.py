"""A decoding step's attention over a paged pool by TPU's Pallas paged-attention kernel
(`jax.experimental.pallas.ops.tpu.paged_attention`), which reads each row's pages by DMA where the
reference path gathers them into a dense cache first (`attention.cache.read_pages`).

The kernel takes one query position per row ([B, H, K]), pools [G, N, page, K] (the engine's layout),
each row's key length and its page table. It serves on TPU only, under `attention_impl` "auto" or
"splash", and only what it can say: a key length per row (no logits bias, sliding window, soft cap or
segments), a head dim that fills the TPU's 128 lanes (Mosaic refuses a block of 64), and products
at the default precision (bfloat16 passes; Mosaic fails to compile the kernel at "highest" in float32,
so float32 pools under a "highest" request are gathered instead). Elsewhere the
layer gathers the pages and attends as over a dense cache, and says once why (`log_fallback`).
Plain `jax.numpy` and Pallas, no Flax.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxformer.attention.kernels import _platform
from jaxformer.attention.masks import Mask

Array = jax.Array
LANES = 128  # the kernel's head dim must be a multiple of the TPU's lane width
BLOCK_POSITIONS = 512  # positions a kernel block reads at most (pages_per_compute_block * page)


def paged_kernel_unservable(
    implementation: str,
    mask: Mask | Array | None,
    bias: Array | None,
    window: int,
    softcap: float,
    shape_BTHK: tuple,
    G: int,
    dtype: jnp.dtype,
    spec_BTHK: tuple,
) -> str | None:
    """Why the Pallas paged kernel does not run this call (None: it does). Off TPU, or for a prefill
    chunk (several positions a row) or an `attention_impl` that names another path, the reason is
    "" (not a fallback worth saying: the gather is the path meant there).

    Args:
        implementation: the config's `attention_impl`.
        mask: the call's mask (a decoding step's is `Mask(kv_lengths=position + 1)`).
        bias: a logits bias, or None.
        window: the layer's sliding window (0: none).
        softcap: the layer's logits soft cap (0: none).
        shape_BTHK: the queries' shape (B, T, H, K).
        G: key and value heads.
        dtype: the pools' (and queries') dtype.
        spec_BTHK: the queries' PartitionSpec over the mesh in context.

    Returns:
        None where the kernel serves; "" where it is not meant to; else the reason.
    """
    B, T, H, K = shape_BTHK
    if implementation not in ("auto", "splash") or T != 1 or _platform() != "tpu":
        return ""
    if bias is not None:
        return "the Pallas paged kernel takes no logits bias"
    if window:
        return f"the Pallas paged kernel has no sliding window (window={window})"
    if softcap:
        return "the Pallas paged kernel is not wired for soft-capped logits"
    if not isinstance(mask, Mask) or mask.kv_lengths is None or mask.causal or mask.window:
        return "the Pallas paged kernel takes a key length per row only"
    if any(x is not None for x in (mask.q_lengths, mask.q_segments, mask.kv_segments, mask.q_offset)):
        return "the Pallas paged kernel takes a key length per row only"
    if K % LANES:
        return f"the Pallas paged kernel needs a head dim that is a multiple of {LANES}, not {K}"
    precision = jax.config.jax_default_matmul_precision  # the one in context
    precision = str(getattr(precision, "name", precision)).lower()
    if jnp.dtype(dtype) == jnp.float32 and precision not in ("none", "default", "bfloat16", "fastest"):
        return f"the Pallas paged kernel multiplies float32 in bfloat16 passes only, not at precision {precision!r}"
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        ways = lambda axes: math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
        b_axes, t_axes, h_axes, k_axes = tuple(spec_BTHK) + (None,) * (4 - len(spec_BTHK))
        if t_axes is not None or k_axes is not None:
            return "the Pallas paged kernel runs per shard of rows and heads: the head dim is split"
        if B % ways(b_axes) or H % ways(h_axes) or G % ways(h_axes):
            return f"B={B}, H={H} or G={G} does not divide over the mesh axes {b_axes} and {h_axes}"
    return None


def pages_per_block(pages: int, page_size: int) -> int:
    """The kernel's `pages_per_compute_block`: the most pages dividing `pages` that hold at most
    `BLOCK_POSITIONS` positions (one page at least).

    Args:
        pages: P, the pages of each row's table in this call.
        page_size: positions per page.

    Returns:
        A divisor of `pages`.
    """
    most = max(1, BLOCK_POSITIONS // page_size)
    return max(d for d in range(1, min(pages, most) + 1) if pages % d == 0)


def paged_attention(
    q_BHK: Array,
    k_GNPK: Array,
    v_GNPK: Array,
    lengths_B: Array,
    table_BP: Array,
    *,
    scale: float | None,
    spec_BTHK: tuple = (),
) -> Array:
    """One query position per row attending over its pages by the Pallas kernel: row b sees positions
    0..lengths[b] - 1, position p at page table[b, p // page], offset p % page. Mosaic kernels are not
    partitioned by the compiler, so under a mesh it runs in `shard_map`, once per shard of rows and
    heads (the pools split by heads as the model's heads are). Megacore is left off (v5e has one
    TensorCore a chip; the kernel may hang where megacore is asked for and absent).

    Args:
        q_BHK: [B, H, K] the queries.
        k_GNPK: [G, N, page, K] the keys' pool (the new position already written), in the queries' dtype.
        v_GNPK: [G, N, page, K] the values' pool.
        lengths_B: [B] int, each row's key length (at least 1).
        table_BP: [B, P] int, each row's pages.
        scale: the logits' scale (None: 1 / sqrt(K)).
        spec_BTHK: the queries' PartitionSpec as [B, T, H, K] over the mesh in context.

    Returns:
        [B, H, K] in the queries' dtype.
    """
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel
    from jax.sharding import PartitionSpec as P

    K = q_BHK.shape[-1]
    q_BHK = q_BHK * jnp.asarray(1 / math.sqrt(K) if scale is None else scale, q_BHK.dtype)  # the kernel takes none
    block = pages_per_block(table_BP.shape[1], k_GNPK.shape[2])

    def attend(q, k, v, lengths, table):  # one shard: its rows and heads
        # Mosaic compiles this kernel's products at the default precision only (bfloat16 passes): a float32
        # request in context (a config's "highest") fails there. bfloat16 pages lose nothing by it; float32
        # pools reach here only where the default is in force (`paged_kernel_unservable`).
        with jax.default_matmul_precision("default"):
            return kernel(q, k, v, lengths, table, pages_per_compute_block=block)

    args = (q_BHK, k_GNPK, v_GNPK, lengths_B.astype(jnp.int32), table_BP.astype(jnp.int32))
    if not jax.sharding.get_abstract_mesh().empty:
        b_axes, _, h_axes, _ = tuple(spec_BTHK) + (None,) * (4 - len(spec_BTHK))
        q_spec, pool_spec = P(b_axes, h_axes, None), P(h_axes, None, None, None)
        in_specs = (q_spec, pool_spec, pool_spec, P(b_axes), P(b_axes, None))
        attend = jax.shard_map(attend, in_specs=in_specs, out_specs=q_spec, check_vma=False)
    return attend(*args)
