"""Attention masks: which keys each query may attend to.

Said as structure (`Mask`: causal, lengths, segments, a cache position), which fused kernels take;
only the reference path (and cases no kernel serves) builds the dense boolean array, True = may
attend, broadcast to [B, H, T, S]. The dense helpers (`padding_mask`, `causal_mask`, ...) are for
code of one's own. Plain `jax.numpy`, no Flax.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

Array = jax.Array


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q_lengths", "kv_lengths", "q_segments", "kv_segments", "q_offset"],
    meta_fields=["causal", "window"],
)
@dataclasses.dataclass(frozen=True)
class Mask:
    """Which keys each query may attend to, said as structure rather than a dense [B, H, T, S] array.

    Fused kernels (cuDNN flash attention, TPU splash attention) take structure: a causal flag and
    per-row lengths, never a dense mask. Only the reference path ("naive") and cases no kernel
    serves build `dense()`. Padding is always said here, never inferred from a token id.

    Attributes:
      causal: query t sees keys s <= t (+ q_offset).
      q_lengths: [B] queries t >= q_lengths[b] are padding: their output is zero.
      kv_lengths: [B] keys s >= kv_lengths[b] are padding: never attended.
      q_segments: [B, T] packed rows: a query sees only keys of its own segment; segment 0 is
        padding.
      kv_segments: [B, S] the keys' segments, read as q_segments.
      q_offset: [B] with causal: the key index of query 0 (decoding against a KV cache whose
        slot s holds position s).
      window: with causal, > 0: query t sees only the `window` latest keys, t - window < s <= t
        (+ q_offset): sliding-window attention (Mistral, Gemma's local layers); 0: no window.
    """

    causal: bool = False
    q_lengths: Array | None = None
    kv_lengths: Array | None = None
    q_segments: Array | None = None
    kv_segments: Array | None = None
    q_offset: Array | None = None
    window: int = 0

    def dense(self, T: int, S: int) -> Array | None:
        """The boolean mask [B or 1, 1, T, S] this structure means (None: everything is visible).

        Args:
            T: number of queries.
            S: number of keys.

        Returns:
            The boolean mask [B or 1, 1, T, S] (True = may attend), or None when nothing is masked.

        Raises:
            ValueError: only one of q_segments and kv_segments is given.
        """
        t_1T1, s_11S = jnp.arange(T)[None, :, None], jnp.arange(S)[None, None, :]
        parts = []  # each [B or 1, T or 1, S or 1]
        if self.causal:
            offset = 0 if self.q_offset is None else self.q_offset[:, None, None]
            parts.append(s_11S <= t_1T1 + offset)
            if self.window:
                parts.append(s_11S > t_1T1 + offset - self.window)
        if self.q_lengths is not None:
            parts.append(t_1T1 < self.q_lengths[:, None, None])
        if self.kv_lengths is not None:
            parts.append(s_11S < self.kv_lengths[:, None, None])
        if self.q_segments is not None or self.kv_segments is not None:
            if self.q_segments is None or self.kv_segments is None:
                raise ValueError("segments need both q_segments and kv_segments")
            same_BTS = self.q_segments[:, :, None] == self.kv_segments[:, None, :]
            parts.append(same_BTS & (self.kv_segments != 0)[:, None, :])
        if not parts:
            return None
        out = parts[0]
        for p in parts[1:]:
            out = jnp.logical_and(out, p)
        return jnp.broadcast_to(out, (out.shape[0], T, S))[:, None]

    def live_queries(self, T: int) -> Array | None:
        """[B, T] False where a query sees no key (padding rows; their output is zero), from the
        lengths alone; None when every query sees a key or segments decide it (see `dense`).

        Args:
            T: number of queries.

        Returns:
            [B, T] boolean, or None.
        """
        live = None
        if self.q_lengths is not None:
            live = jnp.arange(T)[None, :] < self.q_lengths[:, None]
        if self.kv_lengths is not None:
            has_keys_B1 = (self.kv_lengths > 0)[:, None]
            live = has_keys_B1 if live is None else live & has_keys_B1
        return live


def as_mask(mask: Mask | Array | None) -> Mask | Array | None:
    """A dense boolean array passes as it is; a Mask with nothing in it becomes None.

    Args:
        mask: a `Mask`, a dense boolean array broadcastable to [B, H, T, S], or None.

    Returns:
        The array unchanged, the Mask, or None for an empty Mask or None.
    """
    if isinstance(mask, Mask) and not mask.causal and not jax.tree.leaves(mask):
        return None
    return mask


def windowed(mask: Mask | Array | None, window: int, positions_BT: Array | None = None) -> Mask | Array | None:
    """`mask` with a sliding window: each query sees only the `window` latest keys (itself included).

    A causal `Mask` takes the window as it is; a cache step's mask of key lengths (`causal_cache_mask`
    of one position) becomes the causal mask at the queries' positions, which says the same keys.

    Args:
        mask: the self-attention mask of a causal stack.
        window: the window (0: `mask` unchanged).
        positions_BT: [B, T] the queries' positions (a cache step's), or None.

    Returns:
        The windowed `Mask` (or `mask` itself when window is 0).

    Raises:
        ValueError: a mask that is not causal structure, which a window cannot be said over.
    """
    if not window:
        return mask
    if isinstance(mask, Mask) and not mask.causal and positions_BT is not None and mask.q_offset is None:
        mask = dataclasses.replace(mask, causal=True, q_offset=positions_BT[:, 0].astype(jnp.int32))
    if not isinstance(mask, Mask) or not mask.causal:
        raise ValueError(f"a sliding window of {window} is said over a causal Mask, not {type(mask).__name__}")
    return dataclasses.replace(mask, window=window)


def causal_cache_mask(positions_BT: Array | None) -> Mask:
    """Self-attention over a KV cache whose slot s holds position s: the query at position p sees
    slots 0..p. `positions_BT` None means a prefill from position 0 (the plain causal mask, which
    fused kernels take); one new position per row ([B, 1]) is a per-row key length.

    Args:
        positions_BT: [B, T] positions of the queries, or None for a prefill from position 0.

    Returns:
        The `Mask` (causal, with a per-row key length or offset).
    """
    if positions_BT is None:
        return Mask(causal=True)
    if positions_BT.shape[1] == 1:
        return Mask(kv_lengths=positions_BT[:, 0].astype(jnp.int32) + 1)
    return Mask(causal=True, q_offset=positions_BT[:, 0].astype(jnp.int32))


def padding_mask(tokens_BS: Array, pad_id: int = 0) -> Array:
    """Key mask from token ids: [B, 1, 1, S], True where the key is not padding.

    Args:
        tokens_BS: [B, S] token ids.
        pad_id: the id that marks padding.

    Returns:
        [B, 1, 1, S] boolean.
    """
    return (tokens_BS != pad_id)[:, None, None, :]


def causal_mask(T: int, S: int | None = None, offset: int = 0) -> Array:
    """[1, 1, T, S] lower-triangular mask: query t sees keys s <= t + offset.

    Args:
        T: number of queries.
        S: number of keys (None: T).
        offset: the key index of query 0.

    Returns:
        [1, 1, T, S] boolean.
    """
    S = T if S is None else S
    q_pos = jnp.arange(T)[:, None] + offset
    return (jnp.arange(S)[None, :] <= q_pos)[None, None]


def cross_attention_mask(q_tokens_BT: Array, kv_tokens_BS: Array, pad_id: int = 0) -> Array:
    """[B, 1, T, S]: True where neither the query nor the key is padding.

    Args:
        q_tokens_BT: [B, T] query token ids.
        kv_tokens_BS: [B, S] key token ids.
        pad_id: the id that marks padding.

    Returns:
        [B, 1, T, S] boolean.
    """
    q_live = (q_tokens_BT != pad_id)[:, None, :, None]
    kv_live = (kv_tokens_BS != pad_id)[:, None, None, :]
    return q_live & kv_live


def segment_mask(q_segments_BT: Array, kv_segments_BS: Array) -> Array:
    """[B, 1, T, S] for packed sequences: attend only within the same segment (0 = padding).

    Args:
        q_segments_BT: [B, T] segment ids of the queries (0 = padding).
        kv_segments_BS: [B, S] segment ids of the keys.

    Returns:
        [B, 1, T, S] boolean.
    """
    same = q_segments_BT[:, None, :, None] == kv_segments_BS[:, None, None, :]
    return same & (kv_segments_BS != 0)[:, None, None, :]


def combine_masks(*masks: Array | None) -> Array | None:
    """Logical AND of the masks that are not None (None if all are).

    Args:
        *masks: boolean arrays broadcastable to one another, or None.

    Returns:
        Their AND, or None.
    """
    present = [m for m in masks if m is not None]
    if not present:
        return None
    out = present[0]
    for m in present[1:]:
        out = jnp.logical_and(out, m)
    return out
