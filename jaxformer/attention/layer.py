"""`MultiHeadAttention`: the NNX module that holds attention's projections and calls the pure parts.

Queries, keys and values are einsums over kernels shaped [D, H, K] and [D, G, K] (heads a real axis
that tensor parallelism shards); the attention itself is `kernels.dot_product_attention` (reference
or fused), `ring.context_attention` when the sequence is split on the mesh's context axis, and the
KV cache of decoding is read and written here (`empty_cache`, `memory_cache`, `extend`; `cache`).
The one module of `jaxformer.attention` that imports Flax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.attention import ring
from jaxformer.attention.cache import (
    CACHE,
    page_slots,
    read_pages,
    ring_positions,
    write_pages,
    write_ring,
    write_rows,
    write_valid_rows,
)
from jaxformer.attention.kernels import choose_backend, dot_product_attention, log_fallback
from jaxformer.attention.masks import Mask, windowed
from jaxformer.attention.paged_kernel import paged_attention, paged_kernel_unservable
from jaxformer.config import ConfigError, ModelConfig
from jaxformer.functional import apply_rope, lift, rms_norm
from jaxformer.projections import adapted, project
from jaxformer.sharding import activation_spec, constrain, context_ways, param

Array = jax.Array
init = nnx.initializers


class MultiHeadAttention(nnx.Module):
    """Multi-head (or grouped-query) attention; self-attention, or cross-attention over memory.

    Projections are einsums over kernels shaped [D, H, K] (queries), [D, G, K] (keys,
    values) and [H, K, D] (output), so heads are a real axis that tensor parallelism shards.

    Args:
        cfg: the model's config (D, H, G, K, position, attention_impl, dropout).
        cross: cross-attention: keys and values from the memory, no positions applied to them.
        window: > 0: a local layer's self-attention, each query seeing the `window` latest positions
            (`masks.windowed`), its RoPE at `cfg.rope_local_base` when set.
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, cross: bool = False, window: int = 0, rngs: nnx.Rngs):
        self.cfg = cfg
        self.cross = cross
        self.window = window
        self.use_rope = cfg.position == "rope" and not cross
        local_base = cfg.rope_local_base if window else None
        self.rope_base = cfg.rope_base if local_base is None else local_base
        # a RoPE scaling stretches every layer's frequencies, or with layers="global" (Gemma 3) the global ones'
        scaled = cfg.rope_scaling.enabled and not (window and cfg.rope_scaling.layers == "global")
        self.rope_scaling = cfg.rope_scaling if scaled else None
        D, H, G, K = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
        in_init = init.xavier_uniform(in_axis=0, out_axis=(1, 2))
        self.q = param(rngs, in_init, (D, H, K), ("embed", "heads", "kv"))
        self.k = param(rngs, in_init, (D, G, K), ("embed", "heads", "kv"))
        self.v = param(rngs, in_init, (D, G, K), ("embed", "heads", "kv"))
        self.o = param(rngs, init.xavier_uniform(in_axis=(0, 1), out_axis=2), (H, K, D), ("heads", "kv", "embed"))
        if cfg.use_bias or cfg.qkv_bias:  # qkv_bias: Qwen 2's biases on q, k, v and none on the output
            self.q_bias = param(rngs, init.zeros, (H, K), ("heads", "kv"))
            self.k_bias = param(rngs, init.zeros, (G, K), ("heads", "kv"))
            self.v_bias = param(rngs, init.zeros, (G, K), ("heads", "kv"))
        if cfg.use_bias:
            self.o_bias = param(rngs, init.zeros, (D,), ("embed",))
        if cfg.qk_norm:  # Qwen 3: one [K] gain shared by the heads, for queries and for keys
            gain = init.zeros if cfg.norm_plus_one else init.ones  # Gemma's (1 + w) starts at w = 0
            self.q_norm = param(rngs, gain, (K,), ("kv",))
            self.k_norm = param(rngs, gain, (K,), ("kv",))

    def _project(self, x_BTD: Array, name: str, dropout_rng: Array | None = None) -> Array:
        dt = self.cfg.dtype
        y_BTHK = project(self, name, "BTD,DHK->BTHK", x_BTD)
        y_BTHK = adapted(self, name, x_BTD, y_BTHK, dropout_rng)
        if self.cfg.use_bias or self.cfg.qkv_bias:
            y_BTHK = y_BTHK + lift(getattr(self, f"{name}_bias")[...].astype(dt), y_BTHK)
        if self.cfg.qk_norm and name in "qk":  # per head over K, before RoPE
            scale = getattr(self, f"{name}_norm")[...]
            y_BTHK = rms_norm(y_BTHK, scale, self.cfg.norm_eps, plus_one=self.cfg.norm_plus_one)
        return constrain(y_BTHK, ("batch", "length", "heads", None))  # column-parallel under TP

    def project_kv(
        self, kv_BSD: Array, positions_BS: Array | None = None, dropout_rng: Array | None = None
    ) -> tuple[Array, Array]:
        """Keys and values [B, S, G, K] of the inputs attended to (RoPE applied at `positions_BS`).

        Args:
            kv_BSD: [B, S, D] the inputs attended to.
            positions_BS: [B, S] their positions (for RoPE), or None.
            dropout_rng: the adapters' dropout key, or None.

        Returns:
            (k_BSGK, v_BSGK).
        """
        k_BSGK = self._project(kv_BSD, "k", dropout_rng)
        v_BSGK = self._project(kv_BSD, "v", dropout_rng)
        if self.use_rope:
            k_BSGK = apply_rope(k_BSGK, positions_BS, self.rope_base, self.rope_scaling)
        return k_BSGK, v_BSGK

    def __call__(
        self,
        x_BTD: Array,
        memory_BSD: Array | None = None,
        *,
        mask: Mask | Array | None = None,
        positions_BT: Array | None = None,
        kv_positions_BS: Array | None = None,
        memory_kv: tuple[Array, Array] | None = None,
        bias: Array | None = None,
        dropout_rng: Array | None = None,
        return_weights: bool = False,
    ) -> Array | tuple[Array, Array]:
        """Attend from x to memory (cross) or to x itself (memory None).

        Args:
            x_BTD: [B, T, D] the queries' inputs.
            memory_BSD: [B, S, D] the inputs attended to (cross-attention), or None for x itself.
            mask: which keys each query sees (`functional.Mask`, or a boolean array broadcastable to
                [B, H, T, S]), or None for all.
            positions_BT: [B, T] the queries' positions (RoPE), or None.
            kv_positions_BS: [B, S] the keys' positions; None: `positions_BT`.
            memory_kv: cross-attention keys and values already projected, heads-major [B, G, S, K]
                (`memory_cache` of the memory), as decoding does once per source; or None.
            bias: [B, H, T, S] added to the logits (T5's relative positions), or None.
            dropout_rng: the dropout key (attention weights, adapters), or None for no dropout.
            return_weights: also return the attention weights (the reference path computes them).

        Returns:
            [B, T, D]; with `return_weights`, ([B, T, D], weights [B, H, T, S]).

        Raises:
            ValueError: under context parallelism, a memory masked other than by its lengths.
        """
        if memory_kv is not None:
            return self._attend(x_BTD, *memory_kv, "BGSK", mask, bias, positions_BT, dropout_rng, return_weights)
        kv_BSD = x_BTD if memory_BSD is None else memory_BSD
        kv_positions_BS = positions_BT if kv_positions_BS is None else kv_positions_BS
        mask = windowed(mask, self.window)
        k_BSGK, v_BSGK = self.project_kv(kv_BSD, kv_positions_BS, dropout_rng)
        return self._attend(
            x_BTD, k_BSGK, v_BSGK, "BSGK", mask, bias, positions_BT, dropout_rng, return_weights, kv_positions_BS
        )

    # Decoding caches hold keys and values heads-major, [B, G, S, K]: the attention products read
    # them in place, where [B, S, G, K] would be transposed in full at every step.

    # With a context axis, a cache is split by position: slot s on the device holding block s // (S / n).
    # On one device, a local layer's (`window`) is a ring of min(window, S) slots: position p at slot p % R
    # (`_rings`; T5's relative bias keeps every slot).

    def empty_cache(self, batch: int, length: int) -> dict:
        """A self-attention KV cache of `length` slots: {"k", "v"}: zeros [B, G, length, K]; a local
        layer's (`window` > 0, one device, no relative bias) holds its window alone: min(window, length)
        slots, a ring.

        Args:
            batch: B.
            length: the slots, S_max.

        Returns:
            {"k", "v"}: zeros [B, G, length (or the ring's slots), K] in the compute dtype.
        """
        if self._rings():  # the window's latest positions are all a query sees
            length = min(length, self.window)
        zeros = jnp.zeros((batch, self.cfg.kv_heads, length, self.cfg.dim_per_head), self.cfg.dtype)
        zeros = constrain(zeros, CACHE) if context_ways() > 1 else zeros
        return {"k": zeros, "v": zeros}

    def memory_cache(self, memory_BSD: Array) -> dict:
        """Cross-attention keys and values of the memory, once per source: {"k", "v"}: [B, G, S, K].

        Args:
            memory_BSD: [B, S, D] the encoder's output.

        Returns:
            {"k", "v"}: [B, G, S, K].
        """
        kv = (jnp.swapaxes(a, 1, 2) for a in self.project_kv(memory_BSD))
        return dict(zip("kv", (constrain(a, CACHE) if context_ways() > 1 else a for a in kv), strict=True))

    def extend(
        self, x_BTD: Array, cache: dict, *, mask: Mask, positions_BT: Array, bias: Array | None = None
    ) -> tuple[Array, dict]:
        """Self-attention of new positions over a KV cache.

        x holds T new positions per row, starting at `positions_BT[:, 0]` (per row); their
        keys and values are written into `cache` ({"k", "v"}: [B, G, S_max, K]) at those
        slots, and each query attends to the cache under `mask` (`functional.causal_cache_mask`).
        Returns (y [B, T, D], the updated cache).

        A paged cache ({"k", "v": pools [G, N, page, K], "table": [B, P] page tables, "valid": [B, T]
        the real positions}, see `attention.cache`) is read in place: the new positions' keys and
        values go into their pages (the padding's into scratch page 0), then each row attends over its
        own pages, gathered by its table as [B, G, P * page, K] (slot s holds position s). On a TPU or an
        NVIDIA GPU a decoding step reads them in place by a Pallas paged kernel instead (`_paged_kernel`).
        With "rows" ({"k", "v"}: [B, G, P * page, K], the rows' pages gathered once before a call's
        decoding steps, `engine.paged.gather_rows`) the new positions are written there too (the `valid`
        ones) and attended over it, as over a dense cache, instead of gathering the pages again.

        A local layer's cache on one device is a ring of its window's slots (`_extend_ring`).

        Args:
            x_BTD: [B, T, D] the new positions.
            cache: {"k", "v"}: [B, G, S_max, K]; or a paged cache (above).
            mask: which cache slots each query sees.
            positions_BT: [B, T] the new positions' indices.
            bias: attention logits bias broadcastable to [B, H, T, S_max], or None.

        Returns:
            (y_BTD, the updated cache).
        """
        start_B = positions_BT[:, 0]
        mask = windowed(mask, self.window, positions_BT)
        new = dict(zip("kv", self.project_kv(x_BTD, positions_BT), strict=True))  # [B, T, G, K]
        if "table" in cache:  # paged: B * T rows written into the pool, each row's pages read from it
            table_BP = cache["table"]
            page_BT, offset_BT = page_slots(table_BP, positions_BT, cache["valid"], cache["k"].shape[2])
            pools = {name: write_pages(cache[name], new[name], page_BT, offset_BT) for name in "kv"}
            if "rows" in cache:  # the rows' pages gathered once for a call's decoding steps: written alike
                valid_BT = cache["valid"]
                rows = {
                    n: write_valid_rows(cache["rows"][n], jnp.swapaxes(new[n], 1, 2), start_B, valid_BT, 2)
                    for n in "kv"
                }
                y_BTD = self._attend(x_BTD, rows["k"], rows["v"], "BGSK", mask, bias, positions_BT, None, False)
                return y_BTD, {**cache, **pools, "rows": rows}
            if (y_BTD := self._paged_kernel(x_BTD, pools, table_BP, mask, bias, positions_BT)) is not None:
                return y_BTD, {**cache, **pools}
            k_BGSK, v_BGSK = (read_pages(pools[name], table_BP) for name in "kv")
            y_BTD = self._attend(x_BTD, k_BGSK, v_BGSK, "BGSK", mask, bias, positions_BT, None, False)
            return y_BTD, {**cache, **pools}
        if context_ways() > 1:  # the cache's slots are split over the mesh's context axis
            return self._extend_context(x_BTD, cache, new, mask, positions_BT)
        if self._rings():  # a local layer: a ring of the window's slots
            return self._extend_ring(x_BTD, cache, new, mask, positions_BT)
        cache = {
            name: constrain(write_rows(cache[name], jnp.swapaxes(new[name], 1, 2), start_B, axis=2),
                            ("batch", "heads", None, None))
            for name in "kv"
        }  # fmt: skip
        return self._attend(x_BTD, cache["k"], cache["v"], "BGSK", mask, bias, positions_BT, None, False), cache

    def _paged_kernel(self, x_BTD, pools, table_BP, mask, bias, positions_BT) -> Array | None:
        """A decoding step over the pages by the Pallas paged kernel of a TPU or an NVIDIA GPU
        (`attention.paged_kernel`), where `attention_impl` ("auto"; TPU: "splash" too) and the call let it;
        None where the pages are gathered instead (said once by `log_fallback` where the kernel was meant
        to serve)."""
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        spec_BTHK = activation_spec(("batch", None, "heads", None))
        shape_BTHK = (B, T, cfg.num_heads, cfg.dim_per_head)
        why = paged_kernel_unservable(
            cfg.attention_impl, mask, bias, self.window, cfg.attention_softcap, shape_BTHK, cfg.kv_heads,
            pools["k"].dtype, spec_BTHK, pools["k"].shape[2],
        )  # fmt: skip
        if why is not None:
            if why:
                log_fallback(f"{why}: the pages are gathered and attended by XLA")
            return None
        q_BTHK = self._queries(x_BTD, positions_BT, None)
        out_BHK = paged_attention(
            q_BTHK[:, 0], pools["k"], pools["v"], mask.kv_lengths, table_BP, scale=cfg.logits_scale,
            softcap=cfg.attention_softcap, spec_BTHK=spec_BTHK,
        )  # fmt: skip
        return self._out(out_BHK[:, None], None)

    def _rings(self) -> bool:
        """Whether this layer decodes over a ring of its window's slots: a local layer on one device, its
        logits free of T5's relative bias (read at the slots as positions, it keeps every slot)."""
        return bool(self.window) and context_ways() == 1 and self.cfg.position != "relative"

    def _extend_ring(self, x_BTD, cache, new, mask, positions_BT) -> tuple[Array, dict]:
        """`extend` over a local layer's ring of R = min(window, S_max) slots, position p at slot p % R
        (`cache.write_ring`). A prefill from position 0 attends over its own keys under the causal
        window, as training does, then each row keeps its R latest real positions (`mask.kv_lengths`:
        the prompt's length); one new position a step is written in place and attends to the filled
        slots; a few new positions attend over the ring and their own keys, each key seen by its position."""
        R, T = cache["k"].shape[2], x_BTD.shape[1]
        first_B = positions_BT[:, 0].astype(jnp.int32)
        new_BGTK = {name: jnp.swapaxes(new[name], 1, 2) for name in "kv"}
        constrained = lambda c: {name: constrain(c[name], ("batch", "heads", None, None)) for name in "kv"}
        if mask.q_offset is None:  # a prefill from position 0
            y_BTD = self._attend(x_BTD, new["k"], new["v"], "BSGK", mask, None, positions_BT, None, False)
            ring = {name: write_ring(cache[name], new_BGTK[name], first_B, mask.kv_lengths) for name in "kv"}
            return y_BTD, constrained(ring)
        if T == 1:  # a decoding step: one slot written in place; slots 0..p are filled until the ring is
            ring = constrained({name: write_rows(cache[name], new_BGTK[name], first_B % R, axis=2) for name in "kv"})
            filled = Mask(kv_lengths=jnp.minimum(first_B + 1, R))
            return self._attend(x_BTD, ring["k"], ring["v"], "BGSK", filled, None, positions_BT, None, False), ring
        kv_positions_BS = jnp.concatenate([ring_positions(first_B - 1, R), positions_BT], axis=1)  # [B, R + T]
        q_BT1, kv_B1S = positions_BT[:, :, None], kv_positions_BS[:, None, :]
        seen_B1TS = ((kv_B1S >= 0) & (kv_B1S <= q_BT1) & (kv_B1S > q_BT1 - self.window))[:, None]
        keys = {name: jnp.concatenate([cache[name], new_BGTK[name].astype(cache[name].dtype)], 2) for name in "kv"}
        y_BTD = self._attend(x_BTD, keys["k"], keys["v"], "BGSK", seen_B1TS, None, positions_BT, None, False)
        return y_BTD, constrained({name: write_ring(cache[name], new_BGTK[name], first_B) for name in "kv"})

    def _extend_context(self, x_BTD, cache, new, mask, positions_BT) -> tuple[Array, dict]:
        """`extend` with the cache's slots split over the context axis (`cache_spec`). A prompt the axis
        divides, from position 0 (a prefill), runs as training does: ring (or all-gather) attention
        over its own keys, which then fill the cache's first slots (one reshard). Fewer new positions
        (a decoding step) are on every device: each attends to the slots it holds, the partial softmaxes
        combined by log-sum-exp (`ring.cache_attention`), and the device holding their slots writes them.
        A local layer's cache stays whole here, its slots outside the window masked (`window`)."""
        self._refuse_in_context()
        q_BTHK = self._queries(x_BTD, positions_BT, None)
        T, n = x_BTD.shape[1], context_ways()
        if mask.causal and mask.q_offset is None and T % n == 0 and T > 1:  # a prefill the axis divides
            out_BTHK = self._context_attention(q_BTHK, new["k"], new["v"], mask, None, positions_BT, positions_BT)
            write = lambda c, x: jax.lax.dynamic_update_slice_in_dim(c, jnp.swapaxes(x, 1, 2).astype(c.dtype), 0, 2)
            cache = {name: constrain(write(cache[name], new[name]), CACHE) for name in "kv"}
            return self._out(out_BTHK, None), cache
        out_BTHK, k, v = ring.cache_attention(
            q_BTHK, cache["k"], cache["v"], q_index_BT=positions_BT, causal=True, new_kv=(new["k"], new["v"]),
            scale=self.cfg.logits_scale, spec_BTHK=activation_spec(("batch", None, "heads", None)), window=self.window,
        )  # fmt: skip
        return self._out(out_BTHK, None), {"k": constrain(k, CACHE), "v": constrain(v, CACHE)}

    def _queries(self, x_BTD: Array, positions_BT: Array, dropout_rng: Array | None) -> Array:
        q_BTHK = self._project(x_BTD, "q", dropout_rng)
        return apply_rope(q_BTHK, positions_BT, self.rope_base, self.rope_scaling) if self.use_rope else q_BTHK

    def _attend(
        self, x_BTD, k, v, kv_layout, mask, bias, positions_BT, dropout_rng, return_weights, kv_positions_BS=None
    ):
        cfg = self.cfg
        q_BTHK = self._queries(x_BTD, positions_BT, dropout_rng)
        if kv_layout == "BSGK" and context_ways() > 1:  # the sequence is split over the mesh's context axis
            return self._out(
                self._context_attention(q_BTHK, k, v, mask, bias, positions_BT, kv_positions_BS), dropout_rng
            )
        if context_ways() > 1:  # decoding's cross-attention: the source's keys and values split by position
            self._refuse_in_context()
            if bias is not None or not isinstance(mask, Mask) or mask.causal or mask.kv_segments is not None:
                raise ValueError("context parallelism decodes over a memory masked by its lengths only")
            out_BTHK, _, _ = ring.cache_attention(
                q_BTHK, k, v, q_index_BT=positions_BT, causal=False, kv_lengths_B=mask.kv_lengths,
                scale=cfg.logits_scale, spec_BTHK=activation_spec(("batch", None, "heads", None)),
            )  # fmt: skip
            return self._out(out_BTHK, dropout_rng)
        result = dot_product_attention(
            q_BTHK, k, v,
            kv_layout=kv_layout,
            mask=mask,
            bias=bias,
            scale=cfg.logits_scale,
            dropout_rate=cfg.attention_dropout_rate,
            dropout_rng=dropout_rng,
            return_weights=return_weights,
            implementation=cfg.attention_impl,
            spec_BTHK=activation_spec(("batch", None, "heads", None)),  # splash runs per shard of it
            softcap=cfg.attention_softcap,
        )  # fmt: skip
        out_BTHK, weights = result if return_weights else (result, None)
        y_BTD = self._out(out_BTHK, dropout_rng)
        return (y_BTD, weights) if return_weights else y_BTD

    def _context_attention(self, q_BTHK, k_BSGK, v_BSGK, mask, bias, positions_BT, kv_positions_BS) -> Array:
        """Attention over sequences split on the context axis (`jaxformer.ring`): masks from the tokens'
        positions (as packed rows number them: causal within a segment is causal by position)."""
        if bias is not None or not (mask is None or isinstance(mask, Mask)) or (mask and mask.q_offset is not None):
            raise ValueError("context parallelism takes a structural mask only (no logits bias or q_offset)")
        self._refuse_in_context()
        mask = mask or Mask()
        return ring.context_attention(
            q_BTHK, k_BSGK, v_BSGK, strategy=self.cfg.context_attention, causal=mask.causal,
            kernel=self._ring_kernel(q_BTHK, k_BSGK),
            q_index_BT=positions_BT, kv_index_BS=kv_positions_BS,
            q_segments_BT=mask.q_segments, kv_segments_BS=mask.kv_segments,
            kv_lengths_B=mask.kv_lengths, q_lengths_B=mask.q_lengths,
            scale=self.cfg.logits_scale, spec_BTHK=activation_spec(("batch", None, "heads", None)),
            window=mask.window,
        )  # fmt: skip

    def _refuse_in_context(self) -> None:
        """What the context-parallel paths cannot do yet: soft-capped logits."""
        if self.cfg.attention_softcap:
            raise ValueError(
                f"context parallelism has no soft-capped logits (model.attention_softcap={self.cfg.attention_softcap})"
            )

    def _ring_kernel(self, q_BTHK: Array, k_BSGK: Array) -> str:
        """What attends each block inside the ring: the fused kernel `attention_impl` chooses (auto:
        cuDNN on a GPU in bfloat16, splash on a TPU) where it can take the blocks, else XLA's einsums
        ("dense"; the all-gather strategy is dense)."""
        cfg = self.cfg
        backend = choose_backend(cfg.attention_impl, q_BTHK, None)
        if backend not in ring.UNSERVABLE:
            return "dense"
        if cfg.context_attention != "ring":
            why = "the all-gather strategy attends densely"
        else:
            why = ring.UNSERVABLE[backend](q_BTHK, k_BSGK, context_ways())
        if why is None:
            return backend
        if cfg.attention_impl == backend:
            raise ConfigError(f"model.attention_impl={backend!r}: {why}")  # this machine (Config: the shapes)
        log_fallback(f"{why}: each block is attended by XLA's einsums")
        return "dense"

    def _out(self, out_BTHK: Array, dropout_rng: Array | None) -> Array:
        """The heads' output projection: [B, T, H, K] -> [B, T, D] (row-parallel under TP)."""
        y_BTD = project(self, "o", "BTHK,HKD->BTD", out_BTHK)
        y_BTD = adapted(self, "o", out_BTHK, y_BTD, dropout_rng)
        if self.cfg.use_bias:
            y_BTD = y_BTD + lift(self.o_bias[...].astype(self.cfg.dtype), y_BTD)
        return constrain(y_BTD, ("batch", "length", None))
