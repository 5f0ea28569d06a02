"""`MultiHeadLatentAttention`: the NNX module of multi-head latent attention (`model.mla`, DeepSeek-V2/V3).

It holds the projections and calls the maths of `jaxformer.attention.mla`: the plain form when training
and for a prefill, the absorbed form over the latent cache ({"c": [B, S, C], "r": [B, S, R]}) when
decoding. Self-attention only (a decoder_only or encoder stack's; cross-attention stays
`MultiHeadAttention`). Its parameters, with the layouts of `MultiHeadAttention`'s kernels:

    q_down [D, Cq], q_norm [Cq], q_up [Cq, H, N + R]   (model.mla.q_lora_rank > 0), or query [D, H, N + R]
    kv_down [D, C + R] (the latent's C, then the rope key's R), kv_norm [C], kv_up [C, H, N + V]
    out [H, V, D]

each head's N + R query dims being its N, then its R rope dims (RoPE's rotate-half layout).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer.attention.cache import page_slots, read_pages, write_pages, write_rows, write_valid_rows
from jaxformer.attention.masks import Mask
from jaxformer.attention.mla import absorbed_attention, plain_attention, split_latent
from jaxformer.config import ModelConfig
from jaxformer.functional import apply_rope, rms_norm
from jaxformer.projections import project
from jaxformer.sharding import activation_spec, constrain, context_ways, param

Array = jax.Array
init = nnx.initializers


class MultiHeadLatentAttention(nnx.Module):
    """Multi-head latent attention (self-attention): keys and values from a cached low-rank latent.

    Args:
        cfg: the model's config (D, H, `mla`, rope_base, norm_eps, attention_impl, dropout).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        m = cfg.mla
        D, H, C, Cq = cfg.d_model, cfg.num_heads, m.kv_lora_rank, m.q_lora_rank
        N, R, V = m.nope_head_dim, m.rope_head_dim, m.v_head_dim
        gain = init.zeros if cfg.norm_plus_one else init.ones  # Gemma-style (1 + w) starts at w = 0
        down = init.xavier_uniform(in_axis=0, out_axis=1)
        up = init.xavier_uniform(in_axis=0, out_axis=(1, 2))
        if Cq:
            self.q_down = param(rngs, down, (D, Cq), ("embed", None))
            self.q_norm = param(rngs, gain, (Cq,), (None,))
            self.q_up = param(rngs, up, (Cq, H, N + R), ("latent", "heads", "kv"))
        else:
            self.query = param(rngs, up, (D, H, N + R), ("embed", "heads", "kv"))
        self.kv_down = param(rngs, down, (D, C + R), ("embed", None))
        self.kv_norm = param(rngs, gain, (C,), (None,))
        self.kv_up = param(rngs, up, (C, H, N + V), ("latent", "heads", "kv"))
        self.out = param(rngs, init.xavier_uniform(in_axis=(0, 1), out_axis=2), (H, V, D), ("heads", "kv", "embed"))

    @property
    def scale(self) -> float:
        """The logits' factor: `model.attention_scale` if set, 1 without `scale_attention`, else (N + R)^-0.5;
        times the RoPE scaling's `logits_factor` (DeepSeek's yarn mscale_all_dim)."""
        cfg = self.cfg
        if cfg.attention_scale is not None or not cfg.scale_attention:
            return cfg.logits_scale
        return cfg.mla.qk_head_dim**-0.5 * cfg.rope_scaling.logits_factor

    def _norm(self, x: Array, name: str) -> Array:
        return rms_norm(x, getattr(self, name)[...], self.cfg.norm_eps, plus_one=self.cfg.norm_plus_one)

    def queries(self, x_BTD: Array, positions_BT: Array) -> tuple[Array, Array]:
        """The queries' dims without positions [B, T, H, N] and their rope dims [B, T, H, R], rotated.

        Args:
            x_BTD: [B, T, D] the queries' inputs.
            positions_BT: [B, T] their positions.

        Returns:
            (q_nope_BTHN, q_rope_BTHR).
        """
        if self.cfg.mla.q_lora_rank:
            cq_BTC = self._norm(project(self, "q_down", "BTD,DC->BTC", x_BTD), "q_norm")
            q_BTHK = project(self, "q_up", "BTC,CHK->BTHK", cq_BTC)
        else:
            q_BTHK = project(self, "query", "BTD,DHK->BTHK", x_BTD)
        q_BTHK = constrain(q_BTHK, ("batch", "length", "heads", None))  # column-parallel under TP
        N = self.cfg.mla.nope_head_dim
        return q_BTHK[..., :N], apply_rope(q_BTHK[..., N:], positions_BT, self.cfg.rope_base, self.cfg.rope_scaling)

    def latent(self, x_BSD: Array, positions_BS: Array) -> tuple[Array, Array]:
        """What the cache holds of each input: the normalised latent [B, S, C] and the rotated rope key [B, S, R].

        Args:
            x_BSD: [B, S, D] the inputs attended to.
            positions_BS: [B, S] their positions.

        Returns:
            (c_BSC, r_BSR).
        """
        c_BSC, r_BSR = split_latent(project(self, "kv_down", "BSD,DX->BSX", x_BSD), self.cfg.mla.kv_lora_rank)
        r_BSR = apply_rope(r_BSR[:, :, None, :], positions_BS, self.cfg.rope_base, self.cfg.rope_scaling)[:, :, 0, :]
        return self._norm(c_BSC, "kv_norm"), r_BSR

    def _plain(self, x_BTD, c_BSC, r_BSR, positions_BT, mask, dropout_rng, return_weights):
        cfg = self.cfg
        q_nope_BTHN, q_rope_BTHR = self.queries(x_BTD, positions_BT)
        kv_BSHX = constrain(project(self, "kv_up", "BSC,CHX->BSHX", c_BSC), ("batch", "length", "heads", None))
        N = cfg.mla.nope_head_dim
        result = plain_attention(
            q_nope_BTHN, q_rope_BTHR, kv_BSHX[..., :N], r_BSR, kv_BSHX[..., N:],
            mask=mask, scale=self.scale, dropout_rate=cfg.attention_dropout_rate, dropout_rng=dropout_rng,
            return_weights=return_weights, implementation=cfg.attention_impl,
            spec_BTHK=activation_spec(("batch", None, "heads", None)),
        )  # fmt: skip
        out_BTHV, weights = result if return_weights else (result, None)
        y_BTD = self._out(out_BTHV)
        return (y_BTD, weights) if return_weights else y_BTD

    def __call__(
        self,
        x_BTD: Array,
        memory_BSD: Array | None = None,
        *,
        mask: Mask | Array | None = None,
        positions_BT: Array | None = None,
        bias: Array | None = None,
        dropout_rng: Array | None = None,
        return_weights: bool = False,
        **unused,
    ) -> Array | tuple[Array, Array]:
        """Self-attention of x in the plain form (training, evaluation).

        Args:
            x_BTD: [B, T, D] the inputs.
            memory_BSD: must be None (MLA is self-attention only).
            mask: which keys each query sees (`Mask` or a boolean array), or None for all.
            positions_BT: [B, T] the tokens' positions (RoPE).
            bias: must be None (no relative position bias with RoPE).
            dropout_rng: the attention dropout key, or None.
            return_weights: also return the attention weights [B, H, T, T].
            **unused (object): `MultiHeadAttention`'s cross-attention arguments, None here.

        Returns:
            [B, T, D]; with `return_weights`, ([B, T, D], weights [B, H, T, T]).

        Raises:
            ValueError: a memory or a logits bias (which MLA does not take).
        """
        if memory_BSD is not None or bias is not None or any(v is not None for v in unused.values()):
            raise ValueError("multi-head latent attention (model.mla) is self-attention with no logits bias")
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(x_BTD.shape[1]), x_BTD.shape[:2])
        c_BSC, r_BSR = self.latent(x_BTD, positions_BT)
        return self._plain(x_BTD, c_BSC, r_BSR, positions_BT, mask, dropout_rng, return_weights)

    def empty_cache(self, batch: int, length: int) -> dict:
        """A latent cache of `length` slots: {"c": zeros [B, length, C], "r": zeros [B, length, R]}.

        Args:
            batch: B.
            length: the slots, S_max.

        Returns:
            The cache, in the compute dtype.

        Raises:
            ValueError: under a context axis (the latent cache is not split by position).
        """
        self._refuse_context()
        m, dt = self.cfg.mla, self.cfg.dtype
        return {
            "c": jnp.zeros((batch, length, m.kv_lora_rank), dt),
            "r": jnp.zeros((batch, length, m.rope_head_dim), dt),
        }

    def extend(
        self, x_BTD: Array, cache: dict, *, mask: Mask, positions_BT: Array, bias: Array | None = None
    ) -> tuple[Array, dict]:
        """Self-attention of new positions over the latent cache (slot s holds position s).

        Their latents and rope keys are written at their slots. A prefill from position 0 (`mask`
        causal with no offset, `masks.causal_cache_mask(None)`) attends over its own positions in the
        plain form; any other step (one new token per row, or several at an offset) in the absorbed form
        over the whole cache.

        A paged cache (the engine's: {"c": [N, page, C], "r": [N, page, R] pools, "table": [B, P] page
        tables, "valid": [B, T] the real positions}, `attention.cache`) is read in place: the new
        positions' latents and rope keys go into their pages (the padding's into scratch page 0), then
        each row attends over its own pages, gathered as [B, P * page, C] and [B, P * page, R], in the
        absorbed form (a prefill chunk too: the latents are never projected up). With "rows" (the rows'
        pages gathered once before a call's decoding steps, `engine.paged.gather_rows`) the new positions
        are written there too and attended over it instead of gathering the pages again.

        Args:
            x_BTD: [B, T, D] the new positions.
            cache: {"c": [B, S_max, C], "r": [B, S_max, R]}; or a paged cache (above).
            mask: which cache slots each query sees.
            positions_BT: [B, T] the new positions.
            bias: must be None.

        Returns:
            (y_BTD, the updated cache).

        Raises:
            ValueError: a logits bias, or a context axis.
        """
        if bias is not None:
            raise ValueError("multi-head latent attention (model.mla) takes no logits bias")
        self._refuse_context()
        c_BTC, r_BTR = self.latent(x_BTD, positions_BT)
        if "table" in cache:  # paged: B * T positions written into the pools, each row's pages read from them
            table_BP = cache["table"]
            page_BT, offset_BT = page_slots(table_BP, positions_BT, cache["valid"], cache["c"].shape[1])
            pools = {n: write_pages(cache[n], new, page_BT, offset_BT) for n, new in (("c", c_BTC), ("r", r_BTR))}
            if "rows" in cache:  # the rows' pages gathered once for a call's decoding steps: written alike
                start_B, valid_BT = positions_BT[:, 0], cache["valid"]
                rows = {
                    n: write_valid_rows(cache["rows"][n], new, start_B, valid_BT)
                    for n, new in (("c", c_BTC), ("r", r_BTR))
                }
                y_BTD = self._absorbed(x_BTD, rows["c"], rows["r"], positions_BT, mask)
                return y_BTD, {**cache, **pools, "rows": rows}
            return self._absorbed(x_BTD, read_pages(pools["c"], table_BP), read_pages(pools["r"], table_BP),
                                  positions_BT, mask), {**cache, **pools}  # fmt: skip
        start_B = positions_BT[:, 0]
        cache = {
            "c": constrain(write_rows(cache["c"], c_BTC, start_B), ("batch", None, None)),
            "r": constrain(write_rows(cache["r"], r_BTR, start_B), ("batch", None, None)),
        }
        if isinstance(mask, Mask) and mask.causal and mask.q_offset is None:  # a prefill: its own keys alone
            return self._plain(x_BTD, c_BTC, r_BTR, positions_BT, mask, None, False), cache
        return self._absorbed(x_BTD, cache["c"], cache["r"], positions_BT, mask), cache

    def _absorbed(self, x_BTD, c_BSC, r_BSR, positions_BT, mask) -> Array:
        """The queries of x attended over cached latents [B, S, C] and rope keys [B, S, R], absorbed form."""
        q_nope_BTHN, q_rope_BTHR = self.queries(x_BTD, positions_BT)
        kv_up_CHX = self.kv_up[...].astype(self.cfg.dtype)
        out_BTHV = absorbed_attention(q_nope_BTHN, q_rope_BTHR, c_BSC, r_BSR, kv_up_CHX, mask=mask, scale=self.scale)
        return self._out(out_BTHV)

    def _refuse_context(self) -> None:
        if context_ways() > 1:
            raise ValueError("multi-head latent attention (model.mla) has no context-parallel path (mesh.context)")

    def _out(self, out_BTHV: Array) -> Array:
        """The heads' output projection: [B, T, H, V] -> [B, T, D] (row-parallel under TP)."""
        return constrain(project(self, "out", "BTHV,HVD->BTD", out_BTHV), ("batch", "length", None))
