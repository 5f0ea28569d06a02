"""Flax NNX layers of the Transformer. Each holds its parameters and calls `functional`.

Parameters are float32 and carry logical axis names (`vocab`, `embed`, `heads`, `kv`,
`mlp`, `layers`) in their `out_sharding` metadata; `jaxformer.sharding` maps them to a
mesh. Computation runs in `ModelConfig.dtype`. Dropout is driven by an explicit
`dropout_rng` argument (None = deterministic), so a model's state is its parameters only.

`MultiHeadAttention` lives in `jaxformer.attention.layer`, the token ids' checks in
`jaxformer.token_ids`, a kernel's application (int8, LoRA) in `jaxformer.projections`; their
names are re-exported here, so `layers.MultiHeadAttention` and the rest import as before.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxformer import functional as F
from jaxformer import moe as M
from jaxformer import pipeline, pipeline_1f1b, quant
from jaxformer.attention.cache import CACHE  # noqa: F401  (re-exported)
from jaxformer.attention.layer import MultiHeadAttention
from jaxformer.attention.mla_layer import MultiHeadLatentAttention
from jaxformer.config import ModelConfig
from jaxformer.projections import adapted, project
from jaxformer.sharding import constrain, param
from jaxformer.token_ids import (  # noqa: F401  (re-exported: the token ids' checks live there)
    as_token_ids,
    check_batch_ids,
    check_token_ids,
    checked,
)

Array = jax.Array
init = nnx.initializers


@jax.custom_vjp
def materialized_grad(x: Array) -> Array:
    """Identity whose gradient XLA:CPU computes once into a buffer of its own.

    XLA:CPU fuses elementwise gradient chains into their consumers, among them the transposed
    copies feeding weight gradients, which then recompute the chain while reading its inputs in
    transposed order: in a pre-norm stack the residual stream's gradient (a sum over every later
    sublayer, ~10% of a small decoder's step), and the FFN activation's backward when no bias
    gradient materialises it (~17%). An optimization barrier does not survive to the fusion pass,
    but no fusion crosses a conditional: the gradient passes through one whose two branches are
    the identity. Other backends get the gradient unchanged.

    Args:
        x: any array.

    Returns:
        `x` unchanged.
    """
    return x


def _materialized_grad_bwd(_, g):
    through_cond = lambda g: jax.lax.cond(jnp.isfinite(g.reshape(-1)[0]), lambda g: g, lambda g: g * 1.0, g)
    return (jax.lax.platform_dependent(g, cpu=through_cond, default=lambda g: g),)


materialized_grad.defvjp(lambda x: (x, None), _materialized_grad_bwd)


def split_rng(rng: Array | None, n: int) -> list[Array | None]:
    """n independent keys from `rng`, or n Nones when running deterministically.

    Args:
        rng: a PRNG key, or None.
        n: the number of keys.

    Returns:
        A list of n keys (or n Nones).
    """
    return [None] * n if rng is None else list(jax.random.split(rng, n))


# ----------------------------------------------------------------------------- token ids


def without_id_checks(model: nnx.Module) -> nnx.Module:
    """`model` with its embeddings' id checks off, for jitted code whose ids were checked on the
    host (training batches) or come from the model itself (generation): no host callback per call.

    Args:
        model: a model (or any module holding `Embed`s).

    Returns:
        The same model, its embeddings' checks off.
    """
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Embed):
            module.cfg = dataclasses.replace(module.cfg, check_token_ids=False)
    return model


# ----------------------------------------------------------------------------- embeddings


class Embed(nnx.Module):
    """Token embedding, times sqrt(D) as in the paper; `attend` gives tied output logits.

    Args:
        cfg: the model's config (V, D, scale_embeddings, dtypes).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        # Paper scaling: N(0, 1/D) times sqrt(D) gives unit-variance inputs; GPT/BERT use 0.02.
        std = cfg.d_model**-0.5 if cfg.scale_embeddings else 0.02
        self.embedding = param(rngs, init.normal(std), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))

    def __call__(self, ids_BT: Array) -> Array:
        """Looks up the ids' rows (plus the LoRA adapter's), times sqrt(D) with `scale_embeddings`.

        Args:
            ids_BT: [B, T] token ids in [0, V).

        Returns:
            [B, T, D] embeddings in the compute dtype.

        Raises:
            ValueError: an id outside [0, V) with `check_token_ids` (see `check_token_ids` under jit).
        """
        cfg = self.cfg
        if cfg.check_token_ids:
            check_token_ids(ids_BT, cfg.vocab_size)
        x_BTD = jnp.take(self.embedding[...], ids_BT, axis=0).astype(cfg.dtype)
        if (adapter := getattr(self, "embedding_lora", None)) is not None:  # LoRA (jaxformer.lora): its rows
            x_BTD = x_BTD + adapter.lookup(ids_BT, cfg.dtype)
        x_BTD = constrain(x_BTD, ("batch", "length", None))
        return x_BTD * math.sqrt(cfg.d_model) if cfg.scale_embeddings else x_BTD

    def attend(self, x_BTD: Array) -> Array:
        """Logits against the embedding matrix: [B, T, D] -> [B, T, V] (vocab-parallel under TP).

        Args:
            x_BTD: [B, T, D] hidden states.

        Returns:
            [B, T, V] logits.
        """
        logits_BTV = jnp.einsum("BTD,VD->BTV", x_BTD, self.embedding[...].astype(self.cfg.dtype))
        if (adapter := getattr(self, "embedding_lora", None)) is not None:  # the adapted embedding, transposed
            logits_BTV = logits_BTV + adapter.attend(x_BTD.astype(self.cfg.dtype))
        return constrain(logits_BTV, ("batch", "length", "vocab"))


class PositionalEncoding(nnx.Module):
    """Adds absolute positions: `sinusoidal` (paper), `learned` (position p at table row
    p + `position_offset`); `rope`, `relative` and `none` act inside attention and add nothing.

    Args:
        cfg: the model's config (position, max_len, position_offset, D).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        if cfg.position == "learned":
            rows = cfg.max_len + cfg.position_offset
            self.table = param(rngs, init.normal(0.02), (rows, cfg.d_model), (None, "embed"))

    def __call__(self, x_BTD: Array, positions_BT: Array) -> Array:
        """Adds the encoding of each position (nothing for `rope`, `relative`, `none`).

        Args:
            x_BTD: [B, T, D] embeddings.
            positions_BT: [B, T] each token's position in its sequence (restarting per packed segment).

        Returns:
            [B, T, D] x plus the positions' rows.
        """
        cfg = self.cfg
        if cfg.position == "sinusoidal":
            table_TD = F.sinusoidal_positions(cfg.max_len, cfg.d_model)
        elif cfg.position == "learned":
            table_TD, positions_BT = self.table[...], positions_BT + cfg.position_offset
        else:
            return x_BTD
        return x_BTD + jnp.take(table_TD, positions_BT, axis=0).astype(x_BTD.dtype)


class RelativePositionBias(nnx.Module):
    """T5's attention logits bias: a learned [buckets, H] table read at bucketed key - query distances.

    Args:
        cfg: the model's config (relative_buckets, relative_max_distance, H).
        bidirectional: keys after the query get buckets of their own (an encoder's self-attention).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, bidirectional: bool, rngs: nnx.Rngs):
        self.cfg = cfg
        self.bidirectional = bidirectional
        self.table = param(rngs, init.normal(0.02), (cfg.relative_buckets, cfg.num_heads), (None, "heads"))

    def __call__(self, q_positions_BT: Array, kv_positions_BS: Array) -> Array:
        """The bias of each query-key pair from their distance.

        Args:
            q_positions_BT: [B, T] the queries' positions.
            kv_positions_BS: [B, S] the keys' positions.

        Returns:
            [B, H, T, S] logits bias in float32.
        """
        bias_BHTS = F.relative_position_bias(
            q_positions_BT, kv_positions_BS, self.table[...],
            bidirectional=self.bidirectional, max_distance=self.cfg.relative_max_distance,
        )  # fmt: skip
        return constrain(bias_BHTS, ("batch", "heads", None, None))


# ----------------------------------------------------------------------------- sublayers


class Norm(nnx.Module):
    """LayerNorm or RMSNorm over D, statistics in float32.

    Args:
        cfg: the model's config (norm, norm_eps, D).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.scale = param(rngs, init.zeros if cfg.norm_plus_one else init.ones, (cfg.d_model,), ("embed",))
        if cfg.norm == "layernorm":
            self.bias = param(rngs, init.zeros, (cfg.d_model,), ("embed",))

    def __call__(self, x_BTD: Array) -> Array:
        """Normalises each position over D.

        Args:
            x_BTD: [B, T, D] activations.

        Returns:
            [B, T, D] normalised and scaled (and shifted, for layernorm), in x's dtype.
        """
        if self.cfg.norm == "rmsnorm":
            return F.rms_norm(x_BTD, self.scale[...], self.cfg.norm_eps, plus_one=self.cfg.norm_plus_one)
        return F.layer_norm(x_BTD, self.scale[...], self.bias[...], self.cfg.norm_eps)


class FeedForward(nnx.Module):
    """Position-wise feed-forward D -> F -> D with ReLU (paper), GELU, or gated SwiGLU.

    Args:
        cfg: the model's config (D, F, activation, use_bias, dropout).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, Fw = cfg.d_model, cfg.d_ff
        self.gated = cfg.activation in F.GATED_ACTIVATIONS
        kernel = init.xavier_uniform()
        self.wi = param(rngs, kernel, (D, Fw), ("embed", "mlp"))
        if self.gated:
            self.wi_gate = param(rngs, kernel, (D, Fw), ("embed", "mlp"))
        self.wo = param(rngs, kernel, (Fw, D), ("mlp", "embed"))
        if cfg.use_bias:
            self.wi_bias = param(rngs, init.zeros, (Fw,), ("mlp",))
            if self.gated:
                self.wi_gate_bias = param(rngs, init.zeros, (Fw,), ("mlp",))
            self.wo_bias = param(rngs, init.zeros, (D,), ("embed",))

    def _dense(self, x: Array, name: str, spec: str, dropout_rng: Array | None) -> Array:
        dt = self.cfg.dtype
        y = adapted(self, name, x, project(self, name, spec, x), dropout_rng)
        return y + F.lift(getattr(self, f"{name}_bias")[...].astype(dt), y) if self.cfg.use_bias else y

    def __call__(self, x_BTD: Array, dropout_rng: Array | None = None) -> Array:
        """D -> F -> D at every position.

        Args:
            x_BTD: [B, T, D] activations.
            dropout_rng: the LoRA adapters' dropout key (nothing else here drops out), or None.

        Returns:
            [B, T, D].
        """
        # The activation's backward gets a buffer of its own: without a bias gradient to force one,
        # XLA:CPU fuses it into the transposed copy feeding wi's weight gradient (+17% step time).
        up_BTF = materialized_grad(self._dense(x_BTD, "wi", "BTD,DF->BTF", dropout_rng))
        if self.gated:
            gate_BTF = materialized_grad(self._dense(x_BTD, "wi_gate", "BTD,DF->BTF", dropout_rng))
            h_BTF = F.GATED_ACTIVATIONS[self.cfg.activation](gate_BTF, up_BTF)
        else:
            h_BTF = F.ACTIVATIONS[self.cfg.activation](up_BTF)
        h_BTF = constrain(h_BTF, ("batch", "length", "mlp"))
        return constrain(self._dense(h_BTF, "wo", "BTF,FD->BTD", dropout_rng), ("batch", "length", None))


# ----------------------------------------------------------------------------- layers


class Residual(nnx.Module):
    """Residual + norm + dropout around a sublayer.

    post (paper):  LayerNorm(x + Dropout(Sublayer(x)))
    pre (Annotated Transformer, GPT-2):  x + Dropout(Sublayer(LayerNorm(x)))
    sandwich (Gemma 2, 3):  x + Dropout(PostNorm(Sublayer(Norm(x))))

    Args:
        cfg: the model's config (norm_position, norm, dropout_rate).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.norm = Norm(cfg, rngs=rngs)
        if cfg.norm_position == "sandwich":
            self.post_norm = Norm(cfg, rngs=rngs)

    def __call__(
        self, x_BTD: Array, sublayer: Callable, dropout_rng: Array | None, has_aux: bool = False
    ) -> Array | tuple[Array, object]:
        """The sublayer wrapped in its residual connection, norm and dropout.

        Args:
            x_BTD: [B, T, D] the residual stream.
            sublayer: maps [B, T, D] to [B, T, D], or to ([B, T, D], aux) with `has_aux`.
            dropout_rng: the key of the dropout on the sublayer's output, or None for none.
            has_aux: the sublayer returns (y, aux).

        Returns:
            [B, T, D]; with `has_aux`, ([B, T, D], aux).
        """

        def run(h_BTD):
            y = sublayer(h_BTD)
            y_BTD, aux = y if has_aux else (y, None)
            if self.cfg.norm_position == "sandwich":
                y_BTD = self.post_norm(y_BTD)
            return F.dropout(y_BTD, self.cfg.dropout_rate, dropout_rng), aux

        if self.cfg.norm_position != "post":
            x_BTD = materialized_grad(x_BTD)
            y_BTD, aux = run(self.norm(x_BTD))
            x_BTD = x_BTD + y_BTD
        else:
            y_BTD, aux = run(x_BTD)
            x_BTD = self.norm(x_BTD + y_BTD)
        return (x_BTD, aux) if has_aux else x_BTD


def feed_forward(cfg: ModelConfig, moe: bool, rngs: nnx.Rngs, *, causal: bool) -> nnx.Module:
    """A layer's feed-forward: the mixture of experts (`jaxformer.moe`) if `moe`, else the dense one.

    Args:
        cfg: the model's config (its `moe` section for the experts).
        moe: whether this layer is a mixture of experts.
        rngs: the initialisation keys.
        causal: the layer is a decoder's: the experts' capacity must not let a later token take an
            earlier one's slot (`moe.dispatch_capacity`).

    Returns:
        A `FeedForward` or a `moe.MoEFeedForward`.
    """
    return M.MoEFeedForward(cfg, causal=causal, rngs=rngs) if moe else FeedForward(cfg, rngs=rngs)


def _ffn_sublayer(layer: nnx.Module, x_BTD: Array, mask, r_ffn: Array | None) -> tuple[Array, dict | None]:
    """The feed-forward sublayer with its residual: (x, the MoE layer's statistics or None)."""
    if not isinstance(layer.ffn, M.MoEFeedForward):
        return layer.ffn_res(x_BTD, lambda h_BTD: layer.ffn(h_BTD, r_ffn), r_ffn), None
    live_BT = M.live_tokens(mask, x_BTD.shape[1])  # padding takes no expert slot and is not in the losses
    return layer.ffn_res(x_BTD, lambda h_BTD: layer.ffn(h_BTD, r_ffn, live_BT), r_ffn, has_aux=True)


def self_attention(cfg: ModelConfig, *, window: int = 0, rngs: nnx.Rngs) -> nnx.Module:
    """A layer's self-attention: latent attention with `model.mla`, else `MultiHeadAttention`.

    Args:
        cfg: the model's config.
        window: a local layer's sliding window (0: none; `model.mla` refuses one).
        rngs: the initialisation keys.

    Returns:
        The attention module.
    """
    if cfg.mla.enabled:
        return MultiHeadLatentAttention(cfg, rngs=rngs)
    return MultiHeadAttention(cfg, window=window, rngs=rngs)


class EncoderLayer(nnx.Module):
    """Self-attention then feed-forward (dense, or a mixture of experts with `moe`), each wrapped in `Residual`.

    Args:
        cfg: the model's config.
        moe: the feed-forward is a mixture of experts.
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, moe: bool = False, rngs: nnx.Rngs):
        self.self_attn = self_attention(cfg, rngs=rngs)
        self.self_attn_res = Residual(cfg, rngs=rngs)
        self.ffn = feed_forward(cfg, moe, rngs, causal=False)  # bidirectional: GShard's order of service
        self.ffn_res = Residual(cfg, rngs=rngs)

    def __call__(
        self,
        x_BTD: Array,
        *,
        mask: F.Mask | Array | None,
        positions_BT: Array,
        position_bias: Array | None = None,
        dropout_rng: Array | None = None,
        with_aux: bool = False,
    ) -> Array | tuple[Array, dict | None]:
        """Self-attention then feed-forward, each with its residual.

        Args:
            x_BTD: [B, T, D] the residual stream.
            mask: which keys each query sees (`functional.Mask` or a boolean array), or None for all.
            positions_BT: [B, T] the tokens' positions.
            position_bias: [B, H, T, T] added to the self-attention logits (T5), or None.
            dropout_rng: the layer's dropout key, or None for no dropout.
            with_aux: also return the layer's MoE statistics.

        Returns:
            [B, T, D]; with `with_aux`, ([B, T, D], the MoE statistics, None if the feed-forward is dense).
        """
        r_attn, r_attn_res, r_ffn = split_rng(dropout_rng, 3)

        def attend(h_BTD):
            return self.self_attn(h_BTD, mask=mask, positions_BT=positions_BT, bias=position_bias, dropout_rng=r_attn)

        x_BTD = self.self_attn_res(x_BTD, attend, r_attn_res)
        x_BTD, aux = _ffn_sublayer(self, x_BTD, mask, r_ffn)
        return (x_BTD, aux) if with_aux else x_BTD


class DecoderLayer(nnx.Module):
    """Masked self-attention, cross-attention over the encoder memory (when `cross`), feed-forward.

    Args:
        cfg: the model's config.
        cross: with cross-attention over the encoder memory (encoder_decoder).
        moe: the feed-forward is a mixture of experts.
        local: the self-attention sees the `sliding_window` latest positions alone (`cfg.is_local_layer`).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, cross: bool, moe: bool = False, local: bool = False, rngs: nnx.Rngs):
        self.self_attn = self_attention(cfg, window=cfg.sliding_window if local else 0, rngs=rngs)
        self.self_attn_res = Residual(cfg, rngs=rngs)
        if cross:
            self.cross_attn = MultiHeadAttention(cfg, cross=True, rngs=rngs)
            self.cross_attn_res = Residual(cfg, rngs=rngs)
        self.ffn = feed_forward(cfg, moe, rngs, causal=True)  # no token's routing may depend on a later one
        self.ffn_res = Residual(cfg, rngs=rngs)
        self.cross = cross

    def __call__(
        self,
        x_BTD: Array,
        *,
        mask: F.Mask | Array | None,
        positions_BT: Array,
        memory_BSD: Array | None = None,
        memory_mask: F.Mask | Array | None = None,
        position_bias: Array | None = None,
        dropout_rng: Array | None = None,
        cache: dict | None = None,
        with_aux: bool = False,
    ) -> Array | tuple[Array, dict | None]:
        """Masked self-attention, cross-attention over the memory (with `cross`), feed-forward.

        Args:
            x_BTD: [B, T, D] the residual stream (decoding: only the new positions).
            mask: which keys each query sees in self-attention, or None for all.
            positions_BT: [B, T] the tokens' positions.
            memory_BSD: [B, S, D] the encoder's output (cross-attention), or None.
            memory_mask: which memory positions each query sees, or None for all.
            position_bias: [B, H, T, S] added to the self-attention logits (T5), or None.
            dropout_rng: the layer's dropout key, or None for no dropout.
            cache: decoding: {"self": this layer's KV cache, "memory": the memory's projected keys and
                values}; None when training.
            with_aux: also return the layer's MoE statistics (without a cache).

        Returns:
            [B, T, D]; with `cache`, ([B, T, D], the updated self-attention cache); with `with_aux`,
                ([B, T, D], the MoE statistics, None if the feed-forward is dense).
        """
        r_self, r_self_res, r_cross, r_cross_res, r_ffn = split_rng(dropout_rng, 5)
        kw = dict(mask=mask, positions_BT=positions_BT, bias=position_bias)

        def attend(h_BTD):
            if cache is None:
                return self.self_attn(h_BTD, dropout_rng=r_self, **kw), None
            return self.self_attn.extend(h_BTD, cache["self"], **kw)

        x_BTD, self_cache = self.self_attn_res(x_BTD, attend, r_self_res, has_aux=True)
        if self.cross:
            memory_kv = None if cache is None else (cache["memory"]["k"], cache["memory"]["v"])

            def cross_attend(h_BTD):
                return self.cross_attn(h_BTD, memory_BSD, mask=memory_mask, memory_kv=memory_kv, dropout_rng=r_cross)

            x_BTD = self.cross_attn_res(x_BTD, cross_attend, r_cross_res)
        x_BTD, aux = _ffn_sublayer(self, x_BTD, mask, r_ffn)
        if cache is not None:
            return x_BTD, self_cache
        return (x_BTD, aux) if with_aux else x_BTD


# ----------------------------------------------------------------------------- stacks

LAYER_INPUT = "layer_input"  # the name of each layer's input in a stack, which "offload_inputs" keeps on the host
_TO_HOST = dict(offload_src="device", offload_dst="pinned_host")
REMAT_POLICIES = {
    "full": None,  # save nothing, recompute the whole layer in the backward pass
    "dots_saveable": jax.checkpoint_policies.save_from_both_policies(  # keep matmul outputs (int8 kernels' too)
        jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.save_only_these_names(quant.PROJECTION)
    ),
    # The values "dots_saveable" keeps, moved to host memory in the forward pass and back for the backward.
    "offload_dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims(**_TO_HOST),
    # "full", but each layer's input (what a recomputation starts from) waits in host memory, not the device's.
    "offload_inputs": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT], **_TO_HOST
    ),
}
"""`model.remat` -> the `jax.checkpoint` policy of each layer ("none" and "auto" are resolved by `LayerStack`)."""


class LayerStack(nnx.Module):
    """L layers, scanned (parameters stacked on a leading `layers` axis, one compiled body, compile
    time flat in depth) or unrolled (a list); same outputs.

    Layer i draws its dropout keys from fold_in(dropout_rng, i) in both forms. `make_layer(rngs, i)`
    builds layer i. Scanned, a stack whose layers are alike (no MoE, or MoE in every layer) is built
    as layer 0 and stacked over L; MoE on every N-th layer (`model.moe.every` = N > 1) makes blocks of
    N layers (N - 1 dense and the MoE one, at the stack's offset; `ModelConfig.scan_block`, the least
    common multiple of the stacks' N when they differ): `layers` is then a list of N stacks, the j-th
    holding layer j of every block [L / N, ...] (layer i is block i // N, position i % N), and the scan
    runs over blocks. A stack that starts with `head` dense layers (`model.moe.first_dense`) keeps
    them unrolled in `dense_layers` when scanned and scans the layers after them: layer i >= head is then
    block (i - head) // N, position (i - head) % N. The statistics of the MoE layers, one row per
    layer (`jaxformer.moe`), go to `moe.collect` at each call.

    Args:
        cfg: the model's config (scan_layers, remat, moe.every).
        make_layer: (rngs, i) -> layer i.
        num_layers: L.
        head: the leading layers a scanned stack runs unrolled (its dense ones, `ModelConfig.dense_head`).
        rngs: the initialisation keys.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        make_layer: Callable[[nnx.Rngs, int], nnx.Module],
        num_layers: int,
        *,
        head: int = 0,
        rngs: nnx.Rngs,
    ):
        self.cfg = cfg
        self.num_layers = num_layers
        self.block = cfg.scan_block if cfg.scan_layers else 1  # N layers per scanned block
        keys = jax.random.split(rngs.params(), num_layers)
        self.head_layers = head if cfg.scan_layers else 0
        if cfg.scan_layers:
            H = self.head_layers
            if H:  # the dense layers before the scanned blocks, unrolled
                self.dense_layers = nnx.List([make_layer(nnx.Rngs(params=keys[i]), i) for i in range(H)])
            make = lambda j: nnx.vmap(  # layer j of a block, once per block, from unrolled layer i's key
                lambda k: make_layer(nnx.Rngs(params=k), H + j),
                in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"},
            )  # fmt: skip
            N, tail = self.block, keys[H:]
            self.layers = make(0)(tail) if N == 1 else nnx.List([make(j)(tail[j::N]) for j in range(N)])
        else:
            self.layers = nnx.List([make_layer(nnx.Rngs(params=k), i) for i, k in enumerate(keys)])

    def __call__(self, x_BTD: Array, *, dropout_rng: Array | None = None, **kwargs) -> Array:
        """Runs x through every layer; the MoE layers' statistics go to `moe.collect`.

        Args:
            x_BTD: [B, T, D] the residual stream.
            dropout_rng: the stack's dropout key (layer i folds in i), or None for no dropout.
            **kwargs (object): the layers' other arguments (mask, positions, memory), the same for each.

        Returns:
            [B, T, D] after the L layers.
        """

        def apply(graphdef, state, x_BTD, index, kwargs, stack_rng=dropout_rng):  # -> (x, MoE statistics or None)
            x_BTD = checkpoint_name(x_BTD, LAYER_INPUT)
            rng = None if stack_rng is None else jax.random.fold_in(stack_rng, index)
            return nnx.merge(graphdef, state)(x_BTD, dropout_rng=rng, with_aux=True, **kwargs)

        remat = self.cfg.remat if self.cfg.remat != "auto" else "dots_saveable" if self.cfg.scan_layers else "none"
        if remat != "none":
            apply = jax.checkpoint(
                apply, policy=REMAT_POLICIES[remat], prevent_cse=not self.cfg.scan_layers, static_argnums=(0,)
            )
        plan = pipeline.active()  # a batch the micro-batches do not divide (an odd evaluation batch) runs whole
        if self.cfg.scan_layers and plan is not None and x_BTD.shape[0] % plan.microbatches == 0:
            return self._pipelined(apply, x_BTD, dropout_rng, kwargs)
        if self.cfg.scan_layers:
            N, H = self.block, self.head_layers
            for index in range(H):  # the dense head (no MoE statistics)
                x_BTD, _ = apply(*nnx.split(self.dense_layers[index]), x_BTD, index, kwargs)
            splits = [nnx.split(self.layers)] if N == 1 else [nnx.split(stack) for stack in self.layers]
            graphdefs, states = [g for g, _ in splits], [s for _, s in splits]

            def body(x_BTD, block):  # layers H + b * N .. H + b * N + N - 1; the MoE ones' statistics, in order
                states_b, b = block
                auxes = []
                for j in range(N):
                    x_BTD, aux = apply(graphdefs[j], states_b[j], x_BTD, H + b * N + j, kwargs)
                    auxes += [] if aux is None else [aux]
                return x_BTD, jax.tree.map(lambda *xs: jnp.stack(xs), *auxes) if auxes else None

            x_BTD, aux = jax.lax.scan(body, x_BTD, (states, jnp.arange((self.num_layers - H) // N)))
            if aux is not None:  # the MoE layers' statistics, one row per layer: [blocks, per block] -> rows
                M.report(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), aux))
            return x_BTD
        sums = []
        for index, layer in enumerate(self.layers):
            graphdef, state = nnx.split(layer)
            x_BTD, aux = apply(graphdef, state, x_BTD, index, kwargs)
            sums += [] if aux is None else [aux]
        if sums:
            M.report(jax.tree.map(lambda *xs: jnp.stack(xs), *sums))
        return x_BTD

    def _pipelined(self, apply, x_BTD: Array, dropout_rng: Array | None, kwargs: dict) -> Array:
        """The scanned layers as a pipeline over the mesh's stages (`jaxformer.pipeline`); dense layers
        only (Config refuses MoE layers with mesh.stage > 1)."""
        graphdef, state = nnx.split(self.layers)
        variables = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        treedef = jax.tree.structure(state)
        names = [v.get_metadata()["out_sharding"] for v in variables]

        def stage_fn(chunk, x_bTD, first, rng, kw):  # one stage's run of layers, in order
            def body(x_bTD, xs):
                layer, i = xs
                return apply(graphdef, jax.tree.unflatten(treedef, layer), x_bTD, first + i, kw, rng)[0], None

            return jax.lax.scan(body, x_bTD, (chunk, jnp.arange(chunk[0].shape[0])))[0]

        params, plan, tail = [v[...] for v in variables], pipeline.active(), pipeline_1f1b.current_tail()
        if plan.kind == "1f1b" and tail is not None:  # without a loss to run per micro-batch: GPipe's
            return pipeline_1f1b.run_1f1b(stage_fn, params, names, x_BTD, kwargs, dropout_rng=dropout_rng,
                                          plan=plan, loss=tail)  # fmt: skip
        return pipeline.run(stage_fn, params, names, x_BTD, kwargs, dropout_rng=dropout_rng, plan=plan)

    # Decoding runs the layers one by one, scanned or not, each with a cache of its own that a step
    # writes in place: a list of {"self": the layer's KV cache, "memory": the memory's keys and
    # values (cross-attention)}. (Scanning would restack every layer's cache at every step.)

    def unstacked(self) -> list[nnx.Module]:
        """The layers as a list; scanned layers are sliced out of their stacked parameters, here at
        every call (XLA does not hoist the slices out of a decoding loop: `generate` and `translate`
        slice once, before it, with `models.unrolled`).

        Returns:
            The L layers.
        """
        if not self.cfg.scan_layers:
            return list(self.layers)
        N, H = self.block, self.head_layers
        splits = [nnx.split(self.layers)] if N == 1 else [nnx.split(stack) for stack in self.layers]
        return [self.dense_layers[i] for i in range(H)] + [
            nnx.merge(splits[i % N][0], jax.tree.map(lambda a, b=i // N: a[b], splits[i % N][1]))
            for i in range(self.num_layers - H)
        ]

    def moe_rows(self) -> list[tuple[M.MoEFeedForward, np.ndarray]]:
        """The stack's MoE feed-forwards, each with the rows its statistics take in the stack's report
        (`moe.report`, one row per MoE layer in the order they run): a layer of an unrolled stack has
        one row; a scanned one, stacked over B blocks, has B rows (block b's at b * per_block + m, the
        m-th MoE layer of its block), its parameters a leading [B] axis in the same order.

        Returns:
            [(the MoE feed-forward, its rows)], in the order of the report.
        """
        if not self.cfg.scan_layers:
            ffns = [layer.ffn for layer in self.layers if isinstance(layer.ffn, M.MoEFeedForward)]
            return [(ffn, np.array([r])) for r, ffn in enumerate(ffns)]
        stacks = [self.layers] if self.block == 1 else list(self.layers)
        ffns = [stack.ffn for stack in stacks if isinstance(stack.ffn, M.MoEFeedForward)]
        blocks = (self.num_layers - self.head_layers) // self.block
        return [(ffn, m + len(ffns) * np.arange(blocks)) for m, ffn in enumerate(ffns)]

    def map_layers(self, fn: Callable[[nnx.Module], object]) -> list:
        """[fn(layer) for every layer].

        Args:
            fn: a function of one layer.

        Returns:
            The L results.
        """
        return [fn(layer) for layer in self.unstacked()]

    def extend(self, x_BTD: Array, cache: list, **kwargs) -> tuple[Array, list]:
        """Decoding: x (new positions) through every layer with its entry of `cache`; returns
        (x, the caches with every layer's "self" entry updated).

        Args:
            x_BTD: [B, T, D] the new positions.
            cache: one dict per layer ({"self": {"k", "v"}, and "cross" with memory}).
            **kwargs (object): passed to each layer's `extend` (mask, positions_BT, bias, ...).

        Returns:
            (x_BTD, the updated caches).
        """
        updated = []
        for layer, layer_cache in zip(self.unstacked(), cache, strict=True):
            x_BTD, self_cache = layer(x_BTD, cache=layer_cache, **kwargs)
            updated.append({**layer_cache, "self": self_cache})
        return x_BTD, updated

    def reorder_cache(self, cache: list, rows_B: Array) -> list:
        """Row i of every layer's self-attention cache takes row rows_B[i]'s (beam search); the
        memory's keys and values, the same for every beam of a source, stay.

        Args:
            cache: one dict per layer, as `extend` takes.
            rows_B: [B] int, the row each row takes.

        Returns:
            The reordered caches.
        """
        return [{**c, "self": jax.tree.map(lambda a: jnp.take(a, rows_B, axis=0), c["self"])} for c in cache]
