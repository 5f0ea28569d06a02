"""A decoding step's attention over a paged pool by JAX's Pallas paged-attention kernels, which read
each row's pages where they lie, where the reference path gathers them into a dense cache first
(`attention.cache.read_pages`): on TPU `jax.experimental.pallas.ops.tpu.paged_attention` (Mosaic, the
pages by DMA), on NVIDIA GPUs `jax.experimental.pallas.ops.gpu.paged_attention` (Triton: flash decoding,
each row's pages split into up to 16 partitions attended side by side and combined).

Both take one query position per row ([B, H, K]), pools [G, N, page, K] (the engine's layout), each
row's key length and its page table, and serve under `attention_impl` "auto" (and "splash" on TPU), and
only what they can say: a key length per row (no logits bias, sliding window or segments), products at
the default precision (bfloat16 passes on TPU, TF32 on GPU: float32 pools under a "highest" request are
gathered instead; Mosaic fails to compile the TPU kernel there). Both soft-cap the logits where the
layer does. The TPU kernel needs a head dim that fills the TPU's 128 lanes (Mosaic refuses a block of
64); Triton's blocks are powers of two of at least 16 values, so the GPU kernel needs a head dim and a
page size of such.
Elsewhere the layer gathers the pages and attends as over a dense cache, and says once why
(`log_fallback`). Plain `jax.numpy` and Pallas, no Flax.
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


def paged_kernel_meant(implementation: str) -> bool:
    """Whether a decoding step is meant for a Pallas paged kernel here: on TPU under `attention_impl`
    "auto" or "splash", on an NVIDIA GPU under "auto" (it may still fall back: `paged_kernel_unservable`).

    Args:
        implementation: the config's `attention_impl`.

    Returns:
        True where the platform has a paged kernel and `implementation` lets it run.
    """
    return implementation in {"tpu": ("auto", "splash"), "gpu": ("auto",)}.get(_platform(), ())


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
    page_size: int,
) -> str | None:
    """Why the Pallas paged kernel does not run this call (None: it does). Off TPU and GPU, or for a
    prefill chunk (several positions a row) or an `attention_impl` that names another path, the reason
    is "" (not a fallback worth saying: the gather is the path meant there).

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
        page_size: positions per page of the pools.

    Returns:
        None where the kernel serves; "" where it is not meant to; else the reason.
    """
    B, T, H, K = shape_BTHK
    platform = _platform()
    if not paged_kernel_meant(implementation) or T != 1:
        return ""
    if bias is not None:
        return "the Pallas paged kernel takes no logits bias"
    if window:
        return f"the Pallas paged kernel has no sliding window (window={window})"
    if not isinstance(mask, Mask) or mask.kv_lengths is None or mask.causal or mask.window:
        return "the Pallas paged kernel takes a key length per row only"
    if any(x is not None for x in (mask.q_lengths, mask.q_segments, mask.kv_segments, mask.q_offset)):
        return "the Pallas paged kernel takes a key length per row only"
    if platform == "tpu" and K % LANES:
        return f"the Pallas paged kernel needs a head dim that is a multiple of {LANES}, not {K}"
    if platform == "gpu" and not (_power_of_two(K) and K >= 16 and _power_of_two(page_size) and page_size >= 16):
        why = f"not {K} and {page_size}"
        return f"Triton's paged kernel needs a head dim and a page size that are powers of two of 16 or more, {why}"
    precision = jax.config.jax_default_matmul_precision  # the one in context
    precision = str(getattr(precision, "name", precision)).lower()
    if jnp.dtype(dtype) == jnp.float32 and precision not in ("none", "default", "bfloat16", "fastest"):
        passes = "TF32" if platform == "gpu" else "bfloat16 passes"
        return f"the Pallas paged kernel multiplies float32 in {passes} only, not at precision {precision!r}"
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        ways = lambda axes: math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
        b_axes, t_axes, h_axes, k_axes = tuple(spec_BTHK) + (None,) * (4 - len(spec_BTHK))
        if t_axes is not None or k_axes is not None:
            return "the Pallas paged kernel runs per shard of rows and heads: the head dim is split"
        if B % ways(b_axes) or H % ways(h_axes) or G % ways(h_axes):
            return f"B={B}, H={H} or G={G} does not divide over the mesh axes {b_axes} and {h_axes}"
    return None


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def gpu_splits(pages: int, page_size: int) -> tuple[int, int]:
    """The GPU kernel's (`k_splits`, `pages_per_compute_block`): each row's P pages split into the most
    partitions dividing P, up to 16 (attended side by side, then combined), each partition read in blocks
    of the most pages that divide it and make a power of two of at most 128 positions (Triton's blocks).

    Args:
        pages: P, the pages of each row's table in this call.
        page_size: positions per page (a power of two).

    Returns:
        (k_splits, pages_per_compute_block).
    """
    splits = max(d for d in range(1, min(pages, 16) + 1) if pages % d == 0)
    partition = pages // splits
    block = max(1, 128 // page_size)
    while partition % block:
        block //= 2
    return splits, block


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
    softcap: float = 0.0,
    spec_BTHK: tuple = (),
    interpret: bool = False,
) -> Array:
    """One query position per row attending over its pages by the Pallas kernel of the platform in
    context (TPU's, or an NVIDIA GPU's): row b sees positions 0..lengths[b] - 1, position p at page
    table[b, p // page], offset p % page. Pallas kernels are not partitioned by the compiler, so under a
    mesh it runs in `shard_map`, once per shard of rows and heads (the pools split by heads as the
    model's heads are). On TPU megacore is left off (v5e has one TensorCore a chip; the kernel may hang
    where megacore is asked for and absent).

    Args:
        q_BHK: [B, H, K] the queries.
        k_GNPK: [G, N, page, K] the keys' pool (the new position already written), in the queries' dtype.
        v_GNPK: [G, N, page, K] the values' pool.
        lengths_B: [B] int, each row's key length (at least 1).
        table_BP: [B, P] int, each row's pages.
        scale: the logits' scale (None: 1 / sqrt(K)).
        softcap: the logits' soft cap, c * tanh(logits / c) (0: none).
        spec_BTHK: the queries' PartitionSpec as [B, T, H, K] over the mesh in context.
        interpret: run the GPU kernel by Pallas's interpreter (a test's, on any machine).

    Returns:
        [B, H, K] in the queries' dtype.
    """
    from jax.sharding import PartitionSpec as P

    K, page = q_BHK.shape[-1], k_GNPK.shape[2]
    q_BHK = q_BHK * jnp.asarray(1 / math.sqrt(K) if scale is None else scale, q_BHK.dtype)  # the kernels take none
    if interpret or _platform() == "gpu":
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as gpu_kernel

        splits, block = gpu_splits(table_BP.shape[1], page)
        kernel = lambda q, k, v, lengths, table: gpu_kernel(
            q, k, v, table, lengths, pages_per_compute_block=block, k_splits=splits, interpret=interpret,
            attn_logits_soft_cap=softcap or None,
        )  # fmt: skip
    else:
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_kernel

        block = pages_per_block(table_BP.shape[1], page)
        kernel = lambda q, k, v, lengths, table: tpu_kernel(
            q, k, v, lengths, table, pages_per_compute_block=block, attn_logits_soft_cap=softcap or None
        )

    def attend(q, k, v, lengths, table):  # one shard: its rows and heads
        # Mosaic compiles the TPU kernel's products at the default precision only (bfloat16 passes): a float32
        # request in context (a config's "highest") fails there. The GPU kernel runs alike (float32 in TF32).
        # bfloat16 pages lose nothing by it; float32 pools reach here only where the default is in force
        # (`paged_kernel_unservable`).
        with jax.default_matmul_precision("default"):
            return kernel(q, k, v, lengths, table)

    args = (q_BHK, k_GNPK, v_GNPK, lengths_B.astype(jnp.int32), table_BP.astype(jnp.int32))
    if not jax.sharding.get_abstract_mesh().empty:
        b_axes, _, h_axes, _ = tuple(spec_BTHK) + (None,) * (4 - len(spec_BTHK))
        q_spec, pool_spec = P(b_axes, h_axes, None), P(h_axes, None, None, None)
        in_specs = (q_spec, pool_spec, pool_spec, P(b_axes), P(b_axes, None))
        attend = jax.shard_map(attend, in_specs=in_specs, out_specs=q_spec, check_vma=False)
    return attend(*args)
