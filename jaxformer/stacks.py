"""The layer stacks: embeddings, L layers and a final norm (`TransformerStack`), built as the
`Encoder` or the `Decoder`, and the masks they are told as structure.

Padding is structure, never a token id: per-row `lengths` of right-padded rows, or, for packed
batches, `segments` (ids > 0 per packed sequence, 0 = padding) with their `positions`. A decoder
needs none (causal attention never looks past a query). Positions default to 0..T-1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer import functional as F
from jaxformer.config import ModelConfig
from jaxformer.layers import (
    DecoderLayer,
    Embed,
    EncoderLayer,
    LayerStack,
    Norm,
    PositionalEncoding,
    RelativePositionBias,
    as_token_ids,
    param,
    split_rng,
)

Array = jax.Array
init = nnx.initializers


def default_positions(ids_BT: Array) -> Array:
    """Positions 0..T-1 for every row: [B, T].

    Args:
        ids_BT: [B, T] token ids.

    Returns:
        [B, T] int32.
    """
    return jnp.broadcast_to(jnp.arange(ids_BT.shape[1]), ids_BT.shape)


def trailing_padding_lengths(ids_BT: Array, pad_id: int) -> Array:
    """[B] tokens before each row's trailing run of `pad_id`: the lengths of right-padded rows.

    Only a source given without lengths is read this way (a convenience for `model(ids)`); a
    pad id inside a row stays a token. The data pipeline passes lengths, and a decoder never
    needs them: causal attention never looks past a query.

    Args:
        ids_BT: [B, T] token ids.
        pad_id: the padding id.

    Returns:
        [B] int32.
    """
    index_BT = default_positions(ids_BT) + 1
    return jnp.max(jnp.where(ids_BT != pad_id, index_BT, 0), axis=1).astype(jnp.int32)


def self_attention_mask(lengths_B: Array | None, segments_BT: Array | None, causal: bool) -> F.Mask:
    """Self-attention: causal for a decoder; padding from segments (packed rows) or key lengths.

    Args:
        lengths_B: [B] row lengths, or None.
        segments_BT: [B, T] segment ids of packed rows, or None.
        causal: a decoder's mask.

    Returns:
        The `functional.Mask`.
    """
    if segments_BT is not None:
        return F.Mask(causal=causal, q_segments=segments_BT, kv_segments=segments_BT)
    return F.Mask(causal=causal, kv_lengths=lengths_B)


def memory_mask(src_lengths_B: Array | None, tgt_segments_BT: Array | None, src_segments_BS: Array | None) -> F.Mask:
    """Cross-attention: which source positions each target position may attend to.

    Args:
        src_lengths_B: [B] source lengths, or None.
        tgt_segments_BT: [B, T] target segments of packed rows, or None.
        src_segments_BS: [B, S] source segments of packed rows, or None.

    Returns:
        The `functional.Mask`.
    """
    if src_segments_BS is not None:
        return F.Mask(q_segments=tgt_segments_BT, kv_segments=src_segments_BS)
    return F.Mask(kv_lengths=src_lengths_B)


class TransformerStack(nnx.Module):
    """Embeddings (token, position, token type; a norm if `embed_norm`) + dropout, a LayerStack,
    and a final norm if pre-norm. T5's relative-position bias is computed once here for every layer.

    The encoder and the decoder are this with their own layer and mask (see `Encoder`, `Decoder`).

    Args:
        cfg: the model's config.
        embed: the token embedding (shared between stacks when `share_embeddings`).
        make_layer (Callable[[nnx.Rngs, int], nnx.Module]): (rngs, i) -> layer i.
        num_layers: L.
        causal: a decoder's self-attention.
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, embed: Embed, make_layer, num_layers: int, *, causal: bool, rngs: nnx.Rngs):
        self.cfg = cfg
        self.causal = causal
        self.embed = embed
        self.positions = PositionalEncoding(cfg, rngs=rngs)
        if cfg.type_vocab_size and not causal:
            self.token_types = param(rngs, init.normal(0.02), (cfg.type_vocab_size, cfg.d_model), (None, "embed"))
        if cfg.embed_norm:
            self.embed_norm = Norm(cfg, rngs=rngs)
        if cfg.position == "relative":
            self.relative_bias = RelativePositionBias(cfg, bidirectional=not causal, rngs=rngs)
        head = cfg.dense_head("decoder" if causal else "encoder")  # a scanned stack's unrolled dense layers
        self.stack = LayerStack(cfg, make_layer, num_layers, head=head, rngs=rngs)
        if cfg.norm_position != "post":
            self.final_norm = Norm(cfg, rngs=rngs)

    def embed_inputs(self, ids_BT: Array, positions_BT: Array, token_types_BT: Array | None) -> Array:
        """Token embeddings + absolute positions + token types, normed if `embed_norm`: [B, T, D].

        Args:
            ids_BT: [B, T] token ids.
            positions_BT: [B, T] positions.
            token_types_BT: [B, T] token types, or None.

        Returns:
            [B, T, D] in the compute dtype.

        Raises:
            ValueError: token types given to a model without them.
        """
        x_BTD = self.positions(self.embed(ids_BT), positions_BT)
        if hasattr(self, "token_types"):
            types_BT = jnp.zeros_like(ids_BT) if token_types_BT is None else token_types_BT
            x_BTD = x_BTD + jnp.take(self.token_types[...], types_BT, axis=0).astype(x_BTD.dtype)
        elif token_types_BT is not None:
            raise ValueError("token types given, but the model has none (model.type_vocab_size=0)")
        return self.embed_norm(x_BTD) if self.cfg.embed_norm else x_BTD

    def position_bias(self, q_positions_BT: Array, kv_positions_BS: Array) -> dict:
        """The layers' `position_bias` keyword: T5's relative bias [B, H, T, S], or nothing.

        Args:
            q_positions_BT: [B, T] query positions.
            kv_positions_BS: [B, S] key positions.

        Returns:
            {"position_bias": [B, H, T, S]} or {}.
        """
        if self.cfg.position != "relative":
            return {}
        return {"position_bias": self.relative_bias(q_positions_BT, kv_positions_BS)}

    def __call__(
        self,
        ids_BT: Array,
        *,
        lengths: Array | None = None,
        segments: Array | None = None,
        positions: Array | None = None,
        token_types: Array | None = None,
        dropout_rng: Array | None = None,
        **layer_inputs,
    ) -> Array:
        """Ids [B, T] -> hidden states [B, T, D] through the embedding and the L layers.

        Args:
            ids_BT: [B, T] token ids.
            lengths: [B] lengths of right-padded rows, or None.
            segments: [B, T] segment ids of packed rows (0 = padding), or None.
            positions: [B, T] positions; None: 0, 1, ... along each row.
            token_types: [B, T] token types (0 where not given); need `type_vocab_size` > 0.
            dropout_rng: the dropout key, or None for no dropout.
            **layer_inputs (object): go to every layer (the decoder's memory_BSD and memory_mask).

        Returns:
            [B, T, D] hidden states (after the final norm in the pre-norm arrangement).

        Raises:
            ValueError: more than `max_len` positions with a sinusoidal or learned table, or token types
                for a model without them.
        """
        cfg, ids_BT = self.cfg, as_token_ids(ids_BT)
        if positions is None and cfg.position in ("sinusoidal", "learned") and ids_BT.shape[1] > cfg.max_len:
            # The position table would be read past its end (JAX clamps, the logits go wrong): refuse.
            raise ValueError(f"{ids_BT.shape[1]} positions exceed model.max_len={cfg.max_len}")
        positions_BT = default_positions(ids_BT) if positions is None else positions
        r_embed, r_layers = split_rng(dropout_rng, 2)
        x_BTD = F.dropout(self.embed_inputs(ids_BT, positions_BT, token_types), cfg.dropout_rate, r_embed)
        mask = self_attention_mask(lengths, segments, causal=self.causal)
        layer_inputs |= self.position_bias(positions_BT, positions_BT)
        x_BTD = self.stack(x_BTD, mask=mask, positions_BT=positions_BT, dropout_rng=r_layers, **layer_inputs)
        return self.final_norm(x_BTD) if cfg.norm_position != "post" else x_BTD

    def extend(
        self, ids_BT: Array, positions_BT: Array | None, cache: list, lengths_B: Array | None = None, **layer_inputs
    ) -> tuple[Array, list]:
        """Decoding: new ids [B, T] at `positions_BT` (per row; None: a prefill from position 0)
        against the layers' KV `cache`.

        Cache slot s holds position s, so a position sees the slots up to itself. Returns
        (hidden states [B, T, D], the layers' caches with their self-attention entries updated).

        Args:
            ids_BT: [B, T] new token ids.
            positions_BT: [B, T] their positions, or None.
            cache: the layers' caches.
            lengths_B: [B] a prefill's real lengths (its keys past them are padding), or None.
            **layer_inputs (object): passed to every layer (memory keys and mask).

        Returns:
            (h_BTD, the updated caches).
        """
        mask = F.causal_cache_mask(positions_BT)
        if lengths_B is not None and positions_BT is None:  # a padded prompt, masked as training masks it
            mask = F.Mask(causal=True, kv_lengths=jnp.asarray(lengths_B, jnp.int32))
        positions_BT = default_positions(ids_BT) if positions_BT is None else positions_BT
        x_BTD = self.embed_inputs(ids_BT, positions_BT, None)
        first, B = cache[0]["self"], ids_BT.shape[0]
        paged = "table" in first  # a paged cache: each row's P pages of `page` slots
        if paged:  # pools [G, N, page, K], or latent attention's [N, page, C]
            S = first["table"].shape[1] * (first["k"].shape[2] if "k" in first else first["c"].shape[1])
        else:  # a KV cache [B, G, S, K], or latent attention's {"c": [B, S, C], ...}
            S = first["k"].shape[2] if "k" in first else first["c"].shape[1]
        slots_BS = jnp.broadcast_to(jnp.arange(S), (B, S))
        layer_inputs |= self.position_bias(positions_BT, slots_BS)  # slot s holds position s
        x_BTD, cache = self.stack.extend(x_BTD, cache, mask=mask, positions_BT=positions_BT, **layer_inputs)
        return (self.final_norm(x_BTD) if self.cfg.norm_position != "post" else x_BTD), cache


def Encoder(cfg: ModelConfig, embed: Embed, *, rngs: nnx.Rngs) -> TransformerStack:
    """Bidirectional self-attention layers over the source: ids [B, S] -> memory [B, S, D].

    Args:
        cfg: the model's config.
        embed: the token embedding.
        rngs: the initialisation keys.

    Returns:
        The encoder's `TransformerStack`.
    """
    return TransformerStack(
        cfg,
        embed,
        lambda r, i: EncoderLayer(cfg, moe=cfg.moe.is_moe_layer("encoder", i), rngs=r),
        cfg.num_encoder_layers,
        causal=False,
        rngs=rngs,
    )


def Decoder(cfg: ModelConfig, embed: Embed, *, cross: bool, rngs: nnx.Rngs) -> TransformerStack:
    """Causal layers; with `cross`, each also attends to the encoder memory (pass memory_BSD, memory_mask).

    Args:
        cfg: the model's config.
        embed: the token embedding.
        cross: with cross-attention (encoder_decoder).
        rngs: the initialisation keys.

    Returns:
        The decoder's `TransformerStack`.
    """
    return TransformerStack(
        cfg,
        embed,
        lambda r, i: DecoderLayer(
            cfg, cross=cross, moe=cfg.moe.is_moe_layer("decoder", i), local=cfg.is_local_layer(i), rngs=r
        ),
        cfg.num_decoder_layers,
        causal=True,
        rngs=rngs,
    )
