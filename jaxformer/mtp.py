"""Multi-token prediction (DeepSeek-V3, section 2.2): D modules after a decoder, module k predicting
token i + k + 1 at position i, a training objective only (generation never runs them).

Module k combines the previous depth's states h^{k-1} (h^0: the decoder's final hidden states) and the
embedding of token i + k, each RMS-normed, by a linear 2D -> D; one decoder layer; the shared output
head after a norm of its own:

    h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])      (the released checkpoints' order)
    h^k  = DecoderLayer(h')                                       (causal over positions 0..T-1-k)
    loss_k = sum_i CE(head(final_norm(h^k_i)), t_{i+k+1})         (positions with a token i + k + 1)

The training loss adds `train.mtp_weight` / D * sum_k loss_k (each a sum over positions, divided like
the main loss by the batch's counted tokens: the paper's 1/T). Parameter names follow the Hugging Face
checkpoint's layer 61 (`enorm`, `hnorm`, `eh_proj`, the decoder layer, `shared_head.norm`):
`mtp.{k-1}.enorm`, `.hnorm`, `.eh_proj` [2D, D], `.stack.layers.0` (a `DecoderLayer`, MoE where the
decoder's pattern puts layer L + k - 1) and `.final_norm`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer import functional as F
from jaxformer.config import ModelConfig
from jaxformer.layers import DecoderLayer, LayerStack, Norm
from jaxformer.sharding import param
from jaxformer.stacks import default_positions, self_attention_mask

Array = jax.Array


class MTPModule(nnx.Module):
    """One depth of multi-token prediction: two norms, the 2D -> D projection, one decoder layer and the
    norm before the shared output head.

    Args:
        cfg: the model's config.
        depth: k, from 1.
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, depth: int, *, rngs: nnx.Rngs):
        D = cfg.d_model
        self.enorm = Norm(cfg, rngs=rngs)
        self.hnorm = Norm(cfg, rngs=rngs)
        self.eh_proj = param(rngs, nnx.initializers.xavier_uniform(), (2 * D, D), (None, "embed"))
        index = cfg.num_decoder_layers + depth - 1  # the layer after the decoder's last (DeepSeek-V3: an MoE one)
        layer = lambda r, i: DecoderLayer(
            cfg, cross=False, moe=cfg.moe.is_moe_layer("decoder", index), local=cfg.is_local_layer(index), rngs=r
        )
        # one layer, never scanned (a stack for its remat policy and its MoE statistics)
        self.stack = LayerStack(cfg.replace(scan_layers=False) if cfg.scan_layers else cfg, layer, 1, rngs=rngs)
        self.final_norm = Norm(cfg, rngs=rngs)

    def __call__(self, h_BTD: Array, e_BTD: Array, **layer_inputs) -> Array:
        """The depth's states h^k [B, T, D] (before `final_norm`) from h^{k-1} and the shifted tokens' embeddings.

        Args:
            h_BTD: [B, T, D] the previous depth's states.
            e_BTD: [B, T, D] the embeddings of tokens i + k.
            **layer_inputs (object): the decoder layer's mask, positions_BT, dropout_rng, position_bias.

        Returns:
            [B, T, D].
        """
        x_BTE = jnp.concatenate([self.enorm(e_BTD), self.hnorm(h_BTD)], axis=-1)
        x_BTD = jnp.einsum("BTE,ED->BTD", x_BTE, self.eh_proj[...].astype(x_BTE.dtype))
        return self.stack(x_BTD, **layer_inputs)


def shift(a_BT: Array, k: int, fill) -> Array:
    """[B, T] -> [B, T]: position i holds a[i + k], the last k positions `fill`.

    Args:
        a_BT: [B, T].
        k: the shift.
        fill (int | float): the value past the end.

    Returns:
        [B, T].
    """
    return jnp.concatenate([a_BT[:, k:], jnp.full((a_BT.shape[0], k), fill, a_BT.dtype)], axis=1)


def mtp_sums(model, batch: dict, h_BTD: Array, dropout_rng: Array | None, **loss_kw) -> tuple[Array, Array]:
    """The multi-token prediction modules' summed losses on a language-model batch.

    Module k reads the embedding of inputs[i + k] (token i + k) and predicts targets[i + k] (token
    i + k + 1) at position i; the last k positions of a row, and in packed rows the positions whose
    token i + k lies in another segment, count for nothing.

    Args:
        model (models.Transformer): a decoder_only Transformer with `mtp` modules.
        batch: the laid-out device batch (inputs, targets, weights; segments, positions when packed).
        h_BTD: [B, T, D] the decoder's final hidden states (h^0).
        dropout_rng: the step's dropout key, or None.
        **loss_kw (object): `functional.chunked_cross_entropy`'s chunk, blocks, label_smoothing, z_loss.

    Returns:
        (the summed loss over the modules, their summed unsmoothed NLL).
    """
    inputs_BT, targets_BT, weights_BT = batch["inputs"], batch["targets"], batch["weights"]
    segments_BT = batch.get("segments")
    positions_BT = batch.get("positions")
    positions_BT = default_positions(inputs_BT) if positions_BT is None else positions_BT
    layer_inputs = dict(mask=self_attention_mask(None, segments_BT, causal=True), positions_BT=positions_BT)
    layer_inputs |= model.decoder.position_bias(positions_BT, positions_BT)
    loss, nll = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
    for k, module in enumerate(model.mtp, start=1):
        weights_k = shift(weights_BT, k, 0)
        if segments_BT is not None:  # token i + k of another document predicts nothing here
            weights_k = weights_k * (shift(segments_BT, k, 0) == segments_BT)
        e_BTD = model.decoder.embed_inputs(shift(inputs_BT, k, model.cfg.pad_id), positions_BT, None)
        rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, 0x6D7470 + k)
        h_BTD = module(h_BTD, e_BTD, dropout_rng=rng, **layer_inputs)
        head = lambda h, m=module: model.head(m.final_norm(h))
        sums = F.chunked_cross_entropy(h_BTD, head, shift(targets_BT, k, 0), weights_k, **loss_kw)
        loss, nll = loss + sums["loss"], nll + sums["nll"]
    return loss, nll
