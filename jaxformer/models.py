"""The Transformer of the three modes, built from the stacks (`stacks.py`) and the heads (`heads.py`).

    encoder_only     Encoder -> masked-LM head (and a classification head if num_classes > 0)
    decoder_only     Decoder without cross-attention -> LM head (causal LM)
    encoder_decoder  Encoder -> Decoder with cross-attention -> LM head (translation)

Padding is structure, never a token id: per-row `lengths` of right-padded rows, or, for packed
batches, `segments` (ids > 0 per packed sequence, 0 = padding) with their `positions`. A decoder
needs none (causal attention never looks past a query); a source given without lengths is taken
as right-padded with `ModelConfig.pad_id`. Positions default to 0..T-1.

The stacks (`TransformerStack`, `Encoder`, `Decoder`) and their masks live in `jaxformer.stacks`,
the output heads in `jaxformer.heads`; their names are re-exported here, so `models.Encoder`,
`models.LMHead` and the rest import as before.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from jaxformer.config import ModelConfig
from jaxformer.heads import ClassificationHead, LMHead, MaskedLMHead
from jaxformer.layers import Embed, as_token_ids, split_rng
from jaxformer.mtp import MTPModule
from jaxformer.sharding import context_ways
from jaxformer.stacks import (  # noqa: F401  (re-exported: the stacks and their masks live there)
    Decoder,
    Encoder,
    TransformerStack,
    default_positions,
    memory_mask,
    self_attention_mask,
    trailing_padding_lengths,
)

Array = jax.Array


# ----------------------------------------------------------------------------- the model


def in_precision(method):
    """Trace a Transformer method under its `cfg.matmul_precision` ("default": JAX's own setting).

    Args:
        method (Callable): a method of `Transformer`.

    Returns:
        method (Callable): the method, wrapped.
    """

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        if self.cfg.matmul_precision == "default":
            return method(self, *args, **kwargs)
        with jax.default_matmul_precision(self.cfg.matmul_precision):
            return method(self, *args, **kwargs)

    return wrapped


class Transformer(nnx.Module):
    """The Transformer in the mode `cfg.mode` selects.

    Call forms (all return logits in the compute dtype):
      encoder_only:    model(src_ids) -> masked-LM logits [B, S, V];  model.classify(src_ids) -> [B, C]
                       (packed rows: model.classify(src_ids, src_segments=, src_positions=, num_segments=N)
                       -> [B, N, C])
      decoder_only:    model(tgt_ids) -> next-token logits [B, T, V]
      encoder_decoder: model(src_ids, tgt_ids) -> logits [B, T, V];
                       or memory = model.encode(src_ids); model.decode(memory, src_ids, tgt_ids)
    `model(...)` is `model.head(model.hidden(...))`: the final hidden states [B, T, D], then the output
    layer, which the chunked loss applies a few positions at a time.

    Args:
        cfg: the model's config.
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        mode = cfg.mode
        if mode in ("encoder_only", "encoder_decoder"):
            self.src_embed = Embed(cfg, rngs=rngs)
            self.encoder = Encoder(cfg, self.src_embed, rngs=rngs)
        if mode == "encoder_only":
            self.mlm_head = MaskedLMHead(cfg, self.src_embed if cfg.tie_output else None, rngs=rngs)
            if cfg.num_classes:
                self.classifier = ClassificationHead(cfg, rngs=rngs)
            return
        if mode == "encoder_decoder" and cfg.share_embeddings:
            self.tgt_embed = self.src_embed  # one matrix for source, target (and output if tied)
        else:
            self.tgt_embed = Embed(cfg, rngs=rngs)
        self.decoder = Decoder(cfg, self.tgt_embed, cross=mode == "encoder_decoder", rngs=rngs)
        self.lm_head = LMHead(cfg, self.tgt_embed if cfg.tie_output else None, bias=cfg.logits_bias, rngs=rngs)
        if cfg.mtp_depth:  # multi-token prediction's modules (training only), after the rest: its keys come last
            self.mtp = nnx.List([MTPModule(cfg, k, rngs=rngs) for k in range(1, cfg.mtp_depth + 1)])

    def src_lengths(self, src_ids_BS: Array, src_lengths: Array | None, src_segments: Array | None = None):
        """[B] source lengths: as given, or the rows taken as right-padded with `pad_id`; None for
        packed rows (their segments say the padding).

        Args:
            src_ids_BS: [B, S] source ids.
            src_lengths: [B] lengths, or None.
            src_segments: [B, S] segments of packed rows, or None.

        Returns:
            lengths (Array | None): [B] int32, or None.
        """
        if src_segments is not None or src_lengths is not None:
            return src_lengths
        return trailing_padding_lengths(as_token_ids(src_ids_BS, "src_ids"), self.cfg.pad_id)

    @in_precision
    def encode(
        self,
        src_ids_BS: Array,
        *,
        src_lengths: Array | None = None,
        src_segments: Array | None = None,
        src_positions: Array | None = None,
        src_token_types: Array | None = None,
        dropout_rng: Array | None = None,
    ) -> Array:
        """Source ids [B, S] -> memory [B, S, D]. Padding: `src_lengths` [B] or `src_segments` [B, S]
        (packed rows); with neither, trailing `pad_id`s are padding. `src_token_types` [B, S]: BERT's
        sentence A/B ids (type_vocab_size > 0; zeros when not given).

        Args:
            src_ids_BS: [B, S] source ids.
            src_lengths: [B] source lengths, or None.
            src_segments: [B, S] segment ids of packed rows, or None.
            src_positions: [B, S] positions, or None (0..S-1).
            src_token_types: [B, S] token types, or None.
            dropout_rng: the dropout key, or None (evaluation).

        Returns:
            [B, S, D] memory in the compute dtype.
        """
        src_lengths = self.src_lengths(src_ids_BS, src_lengths, src_segments)
        return self.encoder(
            src_ids_BS, lengths=src_lengths, segments=src_segments, positions=src_positions,
            token_types=src_token_types, dropout_rng=dropout_rng,
        )  # fmt: skip

    @in_precision
    def decode(
        self,
        memory_BSD: Array | None,
        src_ids_BS: Array | None,
        tgt_ids_BT: Array,
        *,
        log_softmax: bool = False,
        **kwargs,
    ) -> Array:
        """Decoder input ids [B, T] (and the memory in encoder_decoder mode) -> logits [B, T, V]:
        `decoder_states`, with its keywords (src_lengths, src_segments, tgt_lengths, tgt_segments,
        tgt_positions, dropout_rng), then the output layer (log-probabilities with `log_softmax`).

        The target needs no padding mask (causal attention never looks past a query); `tgt_lengths`
        only lets a fused kernel skip padded keys. The memory's padding is `src_lengths` (or
        `src_segments`; with neither, trailing `pad_id`s of `src_ids_BS`).

        Args:
            memory_BSD: [B, S, D] the encoder's output (encoder_decoder), or None (decoder_only).
            src_ids_BS: [B, S] source ids (for the source padding), or None.
            tgt_ids_BT: [B, T] decoder input ids.
            log_softmax: return log-probabilities instead of logits.
            **kwargs (object): `decoder_states`' keywords.

        Returns:
            [B, T, V].
        """
        h_BTD = self.decoder_states(memory_BSD, src_ids_BS, tgt_ids_BT, **kwargs)
        return self.lm_head(h_BTD, log_softmax=log_softmax)

    @in_precision
    def decoder_states(
        self,
        memory_BSD: Array | None,
        src_ids_BS: Array | None,
        tgt_ids_BT: Array,
        *,
        src_lengths: Array | None = None,
        src_segments: Array | None = None,
        tgt_lengths: Array | None = None,
        tgt_segments: Array | None = None,
        tgt_positions: Array | None = None,
        dropout_rng: Array | None = None,
    ) -> Array:
        """`decode` up to the output layer: the decoder's final hidden states [B, T, D].

        Args:
            memory_BSD: [B, S, D] the encoder's output, or None (decoder_only).
            src_ids_BS: [B, S] source ids, or None.
            tgt_ids_BT: [B, T] decoder input ids.
            src_lengths: [B] source lengths, or None.
            src_segments: [B, S] source segments of packed rows, or None.
            tgt_lengths: [B] target lengths (lets a fused kernel skip padding), or None.
            tgt_segments: [B, T] target segments of packed rows, or None.
            tgt_positions: [B, T] target positions, or None (0..T-1).
            dropout_rng: the dropout key, or None.

        Returns:
            [B, T, D].
        """
        cross_mask = None
        if memory_BSD is not None:
            cross_mask = memory_mask(
                self.src_lengths(src_ids_BS, src_lengths, src_segments), tgt_segments, src_segments
            )
        return self.decoder(
            tgt_ids_BT,
            lengths=tgt_lengths,
            segments=tgt_segments,
            positions=tgt_positions,
            dropout_rng=dropout_rng,
            memory_BSD=memory_BSD,
            memory_mask=cross_mask,
        )

    @in_precision
    def init_cache(
        self,
        batch: int,
        length: int,
        memory_BSD: Array | None = None,
        src_ids_BS: Array | None = None,
        src_lengths: Array | None = None,
    ):
        """An empty decoding cache for `length` target positions; with an encoder memory
        (encoder_decoder), also each layer's cross-attention keys and values of it, computed once.

        {"layers": per layer {"self": {"k", "v"}: [B, G, length, K], "memory": {"k", "v"}: [B, G, S, K]},
         "memory_mask": a `Mask` of the source lengths}, "layers" a list (see `LayerStack.extend`).

        Under a mesh with a context axis of n devices both are split by position (`layers.CACHE`), the
        self-attention's `length` rounded up to a multiple of n.

        Args:
            batch: B.
            length: the target positions the cache holds.
            memory_BSD: [B, S, D] the encoder's output (encoder_decoder), or None.
            src_ids_BS: [B, S] source ids (for the source padding), or None.
            src_lengths: [B] source lengths, or None.

        Returns:
            cache (dict): the cache (above).

        Raises:
            ValueError: an encoder_only model, or a memory given to (or missing from) the wrong mode.
        """
        cfg = self.cfg
        if cfg.mode == "encoder_only":
            raise ValueError("mode='encoder_only' has no decoder to cache")
        if (memory_BSD is None) != (cfg.mode == "decoder_only"):
            raise ValueError(f"mode={cfg.mode} {'takes no' if memory_BSD is not None else 'needs a'} memory")

        n = context_ways()
        slots = -(-length // n) * n  # split by position over a context axis: whole blocks (the last few unused)

        def layer_cache(layer):
            cache = {"self": layer.self_attn.empty_cache(batch, slots)}
            return cache if memory_BSD is None else cache | {"memory": layer.cross_attn.memory_cache(memory_BSD)}

        cache = {"layers": self.decoder.stack.map_layers(layer_cache)}
        if memory_BSD is not None:
            cache["memory_mask"] = memory_mask(self.src_lengths(src_ids_BS, src_lengths), None, None)
        return cache

    @in_precision
    def decode_step(
        self, cache: dict, ids_BT: Array, positions_BT: Array | None, *, logits_at_B: Array | None = None
    ) -> tuple[Array, dict]:
        """Logits [B, T, V] of new decoder positions and the updated cache: a prompt from position 0
        (`positions_BT` None, a prefill), or new tokens at `positions_BT` [B, T] (one per row per step).

        Args:
            cache: the decoding cache.
            ids_BT: [B, T] new ids.
            positions_BT: [B, T] their positions, or None (a prefill).
            logits_at_B: [B] int, the one new position (index into T) of each row whose logits are
                wanted: the output head runs on those alone (a prefill chunk needs its last one), and
                the logits are [B, 1, V]; None: every position's.

        Returns:
            (logits [B, T, V] (or [B, 1, V]), the updated cache).
        """
        h_BTD, layers = self.decoder.extend(ids_BT, positions_BT, cache["layers"], memory_mask=cache.get("memory_mask"))
        if logits_at_B is not None:
            h_BTD = jax.numpy.take_along_axis(h_BTD, logits_at_B[:, None, None], axis=1)
        return self.lm_head(h_BTD), {**cache, "layers": layers}

    def reorder_cache(self, cache: dict, rows_B: Array) -> dict:
        """Beam search: row i of the decoding cache takes row rows_B[i]'s history.

        Args:
            cache: the decoding cache.
            rows_B: [B] int, the row each row takes.

        Returns:
            The reordered cache.
        """
        return {**cache, "layers": self.decoder.stack.reorder_cache(cache["layers"], rows_B)}

    @in_precision
    def classify(
        self,
        src_ids_BS: Array,
        *,
        src_lengths: Array | None = None,
        src_segments: Array | None = None,
        src_positions: Array | None = None,
        src_token_types: Array | None = None,
        num_segments: int | None = None,
        dropout_rng: Array | None = None,
    ) -> Array:
        """encoder_only with num_classes > 0: class logits [B, C]; for packed rows (`src_segments`,
        ids 1..N, with `src_positions` from 0 in each) the logits of each segment [B, N, C],
        N = `num_segments`; a segment a row does not hold is pooled as zeros (give its label no weight).

        Args:
            src_ids_BS: [B, S] source ids.
            src_lengths: [B] source lengths, or None.
            src_segments: [B, S] segment ids of packed rows (1..N), or None.
            src_positions: [B, S] positions, or None.
            src_token_types: [B, S] token types, or None.
            num_segments: N, with `src_segments`.
            dropout_rng: the dropout key, or None.

        Returns:
            [B, C] (or [B, N, C] for packed rows) logits.

        Raises:
            ValueError: the model has no classes, or only one of `src_segments` and `num_segments` is given.
        """
        if self.cfg.num_classes == 0:
            raise ValueError("classify() needs model.num_classes > 0 (mode='encoder_only')")
        if (src_segments is None) != (num_segments is None):
            raise ValueError("classify() of packed rows takes src_segments and num_segments together")
        r_enc, r_head = split_rng(dropout_rng, 2)
        src_lengths = self.src_lengths(src_ids_BS, src_lengths, src_segments)
        x_BSD = self.encode(
            src_ids_BS, src_lengths=src_lengths, src_segments=src_segments, src_positions=src_positions,
            src_token_types=src_token_types, dropout_rng=r_enc,
        )  # fmt: skip
        return self.classifier(
            x_BSD, src_lengths, dropout_rng=r_head, segments_BS=src_segments, num_segments=num_segments or 0
        )

    @in_precision
    def head(self, h_BTD: Array) -> Array:
        """The mode's language-model output layer: final hidden states [B, T, D] -> logits [B, T, V]
        (the masked-LM head in encoder_only mode, with its transform). Token-wise, so a chunked loss
        (`functional.chunked_cross_entropy`) applies it to a few positions at a time.

        Args:
            h_BTD: [B, T, D] final hidden states.

        Returns:
            [B, T, V] logits.
        """
        return self.mlm_head(h_BTD) if self.cfg.mode == "encoder_only" else self.lm_head(h_BTD)

    @in_precision
    def __call__(self, ids: Array, tgt_ids: Array | None = None, **kwargs) -> Array:
        """Logits of the mode's language-model objective (see the class docstring): `head(hidden(...))`.

        Args:
            ids: [B, S] source ids (encoder modes) or [B, T] decoder ids (decoder_only).
            tgt_ids: [B, T] decoder input ids (encoder_decoder), or None.
            **kwargs (object): `hidden`'s keywords (lengths, segments, positions, token types, the target's,
                dropout_rng).

        Returns:
            [B, T, V] logits (encoder_only: [B, S, V]) in the compute dtype.
        """
        return self.head(self.hidden(ids, tgt_ids, **kwargs))

    @in_precision
    def hidden(
        self,
        ids: Array,
        tgt_ids: Array | None = None,
        *,
        lengths: Array | None = None,
        segments: Array | None = None,
        positions: Array | None = None,
        token_types: Array | None = None,
        tgt_lengths: Array | None = None,
        tgt_segments: Array | None = None,
        tgt_positions: Array | None = None,
        dropout_rng: Array | None = None,
    ) -> Array:
        """The final hidden states [B, T, D] (encoder_only: [B, S, D]) that `head` maps to the logits of
        the mode's language-model objective (see the class docstring).

        `lengths` [B] (or `segments`) say which of `ids` are padding: the source's in encoder
        modes, where they default to trailing `pad_id`s; a decoder-only model needs none.
        `token_types` [B, S]: the source's token types (encoder modes with type_vocab_size > 0).

        Args:
            ids: [B, S] source ids (encoder modes) or [B, T] decoder ids (decoder_only).
            tgt_ids: [B, T] decoder input ids (encoder_decoder), or None.
            lengths: [B] lengths of `ids`, or None.
            segments: segment ids of `ids` (packed rows), or None.
            positions: positions of `ids`, or None.
            token_types: token types of `ids`, or None.
            tgt_lengths: [B] target lengths, or None.
            tgt_segments: [B, T] target segments, or None.
            tgt_positions: [B, T] target positions, or None.
            dropout_rng: the dropout key, or None.

        Returns:
            [B, T, D] (encoder_only: [B, S, D]).

        Raises:
            ValueError: the mode's inputs are not those given (token types to decoder_only, batch sizes
                that differ, a missing or extra `tgt_ids`).
        """
        if token_types is not None and self.cfg.mode == "decoder_only":
            raise ValueError("mode='decoder_only' takes no token types")
        mode = self.cfg.mode
        if (mode == "encoder_decoder") != (tgt_ids is not None):
            raise ValueError(
                f"mode={mode} takes {'(src_ids, tgt_ids)' if mode == 'encoder_decoder' else 'one id array'}"
            )
        if tgt_ids is not None:
            ids, tgt_ids = as_token_ids(ids, "src_ids"), as_token_ids(tgt_ids, "tgt_ids")
            if ids.shape[0] != tgt_ids.shape[0]:
                raise ValueError(f"batch sizes differ: src_ids has {ids.shape[0]} rows, tgt_ids {tgt_ids.shape[0]}")
        r_enc, r_dec = split_rng(dropout_rng, 2)
        if mode == "decoder_only":
            return self.decoder_states(
                None, None, ids, tgt_lengths=lengths, tgt_segments=segments, tgt_positions=positions,
                dropout_rng=r_dec,
            )  # fmt: skip
        lengths = self.src_lengths(ids, lengths, segments)  # once, for the encoder and the cross-attention
        memory_BSD = self.encode(ids, src_lengths=lengths, src_segments=segments, src_positions=positions,
                                 src_token_types=token_types, dropout_rng=r_enc)  # fmt: skip
        if mode == "encoder_only":
            return memory_BSD
        return self.decoder_states(
            memory_BSD,
            ids,
            tgt_ids,
            src_lengths=lengths,
            src_segments=segments,
            tgt_lengths=tgt_lengths,
            tgt_segments=tgt_segments,
            tgt_positions=tgt_positions,
            dropout_rng=r_dec,
        )


def unrolled(model: Transformer) -> Transformer:
    """`model` with its scanned layer stacks unrolled: the same parameters, each layer's sliced out.

    Decoding runs the layers one by one; slicing them here, before a decoding loop, does it once,
    where slicing inside the loop would copy every weight at every step.

    Args:
        model: a Transformer.

    Returns:
        A Transformer sharing its parameters.

    Raises:
        ValueError: the model still holds LoRA adapters or an int8 base.
    """
    if not model.cfg.scan_layers:
        return model
    if any(str(k).endswith(("_lora", "_scale")) for p, _ in nnx.to_flat_state(nnx.state(model)) for k in p):
        raise ValueError("unrolled: fold LoRA adapters and an int8 base in first (lora.merge), as decoding does")
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(model.cfg.replace(scan_layers=False), rngs=nnx.Rngs(0))))
    flat = []
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if "dense_layers" in path:  # a scanned stack's unrolled dense layers (moe.first_dense): layers 0..H-1
            at = path.index("dense_layers")
            flat.append(((*path[:at], "layers", *path[at + 1 :]), var))
            continue
        if "layers" not in path or path[0] == "mtp":  # (multi-token prediction's one layer is never scanned)
            flat.append((path, var))
            continue
        at = path.index("layers") + 1  # (..., "stack", "layers", *rest) -> (..., "stack", "layers", i, *rest)
        N = model.cfg.scan_block  # in blocks of N layers: (..., "layers", j, *rest) holds layers H + b * N + j
        H = model.cfg.dense_head(path[0])
        j, at_rest = (0, at) if N == 1 else (path[at], at + 1)
        names = var.get_metadata()["out_sharding"][1:]  # the leading "layers" axis is gone
        flat += [((*path[:at], H + b * N + j, *path[at_rest:]), var.replace(var[...][b], out_sharding=names))
                 for b in range(var[...].shape[0])]  # fmt: skip
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def build_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A freshly initialised Transformer for `cfg` (parameters on the default device).

    Args:
        cfg: the model's config (`jaxformer.tiny()`, `paper_base()`, ...).
        seed: the initialisation seed.

    Returns:
        The model.

    Raises:
        TypeError: `cfg` is not a ModelConfig.
    """
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"build_model takes a ModelConfig (e.g. jaxformer.tiny()), got {type(cfg).__name__}")
    return Transformer(cfg, rngs=nnx.Rngs(params=seed))


def count_params(model: nnx.Module) -> int:
    """Number of parameters; a shared embedding counts once.

    Args:
        model: any module.

    Returns:
        The count.
    """
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
