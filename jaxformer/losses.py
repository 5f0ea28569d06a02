"""Losses per objective as pure functions of (model, batch): the hidden states each objective reads,
its layout (token-major or sequence-major rows), the chunked cross-entropy over the vocabulary, the summed
metrics a step returns (`loss_sums`) and their means (`summarize`). The train step (`jaxformer.train`)
differentiates `loss_sums`; post-training's objectives bring their own (`jaxformer.post_train`).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer import functional as F
from jaxformer import moe, mtp, pipeline, pipeline_1f1b, ring, sharding
from jaxformer.config import TrainConfig
from jaxformer.models import Transformer

Array = jax.Array


def classify_logits(model: Transformer, batch: dict, dropout_rng: Array | None) -> Array:
    """Class logits [B, C] ([B, N, C] for packed rows, one per segment).

    Args:
        model: an encoder_only Transformer with classes.
        batch: the device batch ("src" [B, S], lengths or segments).
        dropout_rng: the dropout key, or None.

    Returns:
        [B, C] (or [B, N, C]) logits.
    """
    packed = "src_segments" in batch  # labels [B, N]: N, the segments a row may hold, is static
    return model.classify(
        batch["src"], src_lengths=batch.get("src_lengths"), src_segments=batch.get("src_segments"),
        src_positions=batch.get("src_positions"), num_segments=batch["label"].shape[1] if packed else None,
        dropout_rng=dropout_rng,
    )  # fmt: skip


def hidden_states(model: Transformer, objective: str, batch: dict, dropout_rng: Array | None) -> Array:
    """The final hidden states [B, T, D] of a token objective (lm, seq2seq, mlm), which `model.head`
    maps to its logits [B, T, V].

    Args:
        model: the Transformer.
        objective: "lm", "seq2seq" or "mlm".
        batch: the device batch.
        dropout_rng: the dropout key, or None.

    Returns:
        [B, T, D].
    """
    if objective == "seq2seq":  # padding is said by the data, never read off a token id
        return model.hidden(
            batch["src"], batch["inputs"], lengths=batch.get("src_lengths"), segments=batch.get("src_segments"),
            positions=batch.get("src_positions"), tgt_segments=batch.get("tgt_segments"),
            tgt_positions=batch.get("tgt_positions"), dropout_rng=dropout_rng,
        )  # fmt: skip
    # Packed rows: several documents, each its own segment with its own positions.
    return model.hidden(
        batch["inputs"], segments=batch.get("segments"), positions=batch.get("positions"), dropout_rng=dropout_rng
    )


# The arrays of a causal sequence (lm; seq2seq's target side), and the positions that say its order.
CAUSAL_SIDE = {"lm": (("inputs", "targets", "weights", "segments"), "positions"),
               "seq2seq": (("inputs", "targets", "weights", "tgt_segments"), "tgt_positions")}  # fmt: skip


def laid_out(batch: dict, objective: str, layout: str) -> dict:
    """`batch` with its causal sequence in the order `model.context_layout` lays it over the mesh's
    context axis (see `ring.layout_order`), its positions moved with it (made 0..T-1 where the data
    gave none), so that attention masks and positional encodings are the unpermuted sequence's. The
    summed loss and metrics do not depend on the order; contiguous (or no context axis) is `batch`.

    Args:
        batch: the device batch.
        objective: the training objective.
        layout: "contiguous", "zigzag" or "striped".

    Returns:
        The batch, reordered.
    """
    n = sharding.context_ways()
    if n == 1 or layout == "contiguous" or objective not in CAUSAL_SIDE:
        return batch
    keys, positions = CAUSAL_SIDE[objective]
    B, T = batch["inputs"].shape
    order = jnp.asarray(ring.layout_order(T, n, layout))
    out = dict(batch)
    if positions not in batch:
        out[positions] = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    for key in (*keys, positions):
        if key in out:
            out[key] = jnp.take(out[key], order, axis=1)
    return out


def loss_chunk(
    cfg: TrainConfig, B: int, T: int, V: int, shards: tuple[int, int] = (1, 1), length_ways: int = 1
) -> int | None:
    """Positions per chunk of the chunked loss for a [B, T] (micro-)batch and V classes, split
    `shards` = (batch, vocabulary) ways over the devices and T `length_ways` ways (`mesh.context`);
    `train.loss_chunk`, `train.max_logits_mib` count what one device holds. None: the plain loss.
    Chunks are made equal, so the last pads little; over a split length a chunk takes as many
    positions of each device's block (`functional.chunked_cross_entropy`'s `blocks`), so the
    chunk is a multiple of `length_ways`.

    Args:
        cfg: the train section (loss_chunk, max_logits_mib).
        B: batch rows.
        T: positions (divisible by `length_ways`).
        V: classes.
        shards: (batch, vocabulary) ways the logits are split.
        length_ways: ways the positions are split (the context axis).

    Returns:
        Positions per chunk, or None.
    """
    # one device's rows, positions and vocabulary columns
    rows, positions, columns = -(-B // shards[0]), T // length_ways, -(-V // shards[1])
    if cfg.loss_chunk == "auto":
        if cfg.max_logits_mib * 2**20 >= rows * positions * columns * 4:
            return None
        per_chunk = int(cfg.max_logits_mib * 2**20 // (rows * columns * 4))  # positions whose float32 logits fit
    elif cfg.loss_chunk == 0:
        return None
    else:
        per_chunk = cfg.loss_chunk // rows
    n = -(-positions // max(per_chunk, 1))
    return None if n == 1 else -(-positions // n) * length_ways


def stack_loss(model: Transformer, batch: dict, smoothing: dict) -> contextlib.AbstractContextManager:
    """Under a 1F1B pipeline (`jaxformer.pipeline_1f1b`), the per-micro-batch loss its last stage runs:
    the stack's final norm, the head and the summed cross-entropy (decoder_only's or encoder_only's
    stack; Config refuses the other cases); elsewhere a context that changes nothing.

    Args:
        model: the Transformer.
        batch: the laid-out device batch (targets, weights).
        smoothing: cross_entropy_sums' label_smoothing and z_loss.

    Returns:
        tail (contextlib.AbstractContextManager): a context manager giving the `pipeline_1f1b.Tail`
            (None without 1F1B).
    """
    plan = pipeline.active()
    if plan is None or plan.kind != "1f1b":
        return contextlib.nullcontext(None)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    stack = "encoder" if model.cfg.mode == "encoder_only" else "decoder"

    def tail(params, y_bTD, rows):  # the micro-batch's summed loss, as the loss below sums it
        m = nnx.merge(graphdef, params, rest)
        final = getattr(m, stack)
        h_bTD = final.final_norm(y_bTD) if m.cfg.norm_position != "post" else y_bTD
        return F.cross_entropy_sums(m.head(h_bTD), rows[0], rows[1], **smoothing)

    return pipeline_1f1b.tail(tail, params, (batch["targets"], batch["weights"]))


def loss_sums(model: Transformer, cfg: TrainConfig, batch: dict, dropout_rng: Array | None) -> tuple[Array, dict]:
    """Summed loss (to be divided by the token count) and summed metrics of one (micro-)batch.

    Token objectives go through `functional.chunked_cross_entropy`: the plain loss on `model.head` of
    the hidden states, or, as `loss_chunk` says, that loss a chunk of positions at a time.

    With MoE layers the loss adds, per counted token, the router z-loss and the load-balancing loss
    (each a mean over the MoE layers) times their weights in `model.moe`; the metrics add both
    (token-weighted, as the loss), the dropped and assigned token-expert pairs, the router entropy and
    each MoE layer's tokens per expert (`summarize` makes them fractions). With multi-token prediction
    (`model.mtp_depth`) the loss adds `train.mtp_weight` times the modules' mean summed loss
    (`mtp.mtp_sums`), logged as mtp_loss and mtp_nll. Under `grad_accum`
    each micro-batch routes on its own: its router losses are its own means, weighted by the tokens
    it counts (the load-balancing loss, a product of two batch means, has no exact split).

    Args:
        model: the Transformer.
        cfg: the train section.
        batch: the device batch.
        dropout_rng: the dropout key, or None.

    Returns:
        (summed loss, summed metrics).
    """
    smoothing = {"label_smoothing": cfg.label_smoothing, "z_loss": cfg.z_loss}
    with moe.collect() as reports:
        if cfg.objective == "classify":  # packed: labels [B, N], weights 1 for the segments a row holds
            labels = batch["label"]
            weights = batch["weights"] if "weights" in batch else jnp.ones(labels.shape, jnp.float32)
            sums = F.cross_entropy_sums(classify_logits(model, batch, dropout_rng), labels, weights, **smoothing)
        else:
            batch = laid_out(batch, cfg.objective, model.cfg.context_layout)
            with stack_loss(model, batch, smoothing) as pipelined:
                h_BTD = hidden_states(model, cfg.objective, batch, dropout_rng)
            piped = None if pipelined is None else pipeline_1f1b.summed(pipelined)
            labels_BT = batch["targets"]
            # the ways the logits' rows, positions and columns are split over the devices
            rows, blocks, columns = sharding.shard_counts(("batch", "length", "vocab"))
            blocks = blocks if labels_BT.shape[1] % blocks == 0 else 1  # (a length the axis does not divide is whole)
            chunk = loss_chunk(cfg, *labels_BT.shape, model.cfg.vocab_size, (rows, columns), blocks)
            if piped is not None:  # 1F1B: its last stage ran the head and loss once a micro-batch, with gradients
                sums = piped
            else:
                sums = F.chunked_cross_entropy(
                    h_BTD, model.head, labels_BT, batch["weights"], chunk=chunk, blocks=blocks, **smoothing
                )
            if model.cfg.mtp_depth:  # multi-token prediction: mtp_weight / depth * its modules' summed loss
                loss_kw = dict(chunk=chunk, blocks=blocks, **smoothing)
                mtp_loss, mtp_nll = mtp.mtp_sums(model, batch, h_BTD, dropout_rng, **loss_kw)
                sums["loss"] = sums["loss"] + cfg.mtp_weight / model.cfg.mtp_depth * mtp_loss
                sums |= {"mtp_loss": mtp_loss / model.cfg.mtp_depth, "mtp_nll": mtp_nll / model.cfg.mtp_depth}
    per_layer, layers = moe.totals(reports)
    if layers:  # a micro-batch's MoE losses weigh as many tokens as it counts: accumulation stays a token mean
        aux = jax.tree.map(lambda a: a.sum(0), per_layer)  # summed over the MoE layers
        mcfg = model.cfg.moe
        z, balance = (aux[name] / layers * sums["count"] for name in ("router_z_loss", "load_balance_loss"))
        sums["loss"] = sums["loss"] + mcfg.z_loss_weight * z + mcfg.aux_loss_weight * balance
        sums |= {"router_z_loss": z, "load_balance_loss": balance, "moe_dropped": aux["dropped"],
                 "moe_assigned": aux["assigned"], "moe_entropy": aux["entropy"], "moe_tokens": aux["tokens"],
                 "moe_load": per_layer["load"], "moe_layer_tokens": per_layer["tokens"]}  # fmt: skip
    return sums["loss"], sums


def summarize(sums: dict) -> dict:
    """Means from summed metrics: loss, accuracy, perplexity (from the unsmoothed NLL).

    Args:
        sums: summed metrics ("loss", "nll", "correct", "weight", ...).

    Returns:
        Mean metrics.
    """
    count = jnp.maximum(sums["count"], 1.0)
    if "nll" not in sums:  # preference pairs: each metric a mean over the pairs
        return {name: value / count for name, value in sums.items() if name != "count"} | {"pairs": sums["count"]}
    nll = sums["nll"] / count
    means = {
        "loss": sums["loss"] / count,
        "nll": nll,
        "accuracy": sums["correct"] / count,
        "perplexity": jnp.exp(nll),
        "tokens": sums["count"],
    }
    if "mtp_loss" in sums:  # multi-token prediction: its modules' mean loss and NLL per counted token
        means |= {name: sums[name] / count for name in ("mtp_loss", "mtp_nll")}
    if "moe_assigned" in sums:  # MoE: router losses (means over MoE layers) and the share of pairs dropped
        means |= {name: sums[name] / count for name in ("router_z_loss", "load_balance_loss")}
        means["dropped_fraction"] = sums["moe_dropped"] / jnp.maximum(sums["moe_assigned"], 1.0)
        means["router_entropy"] = sums["moe_entropy"] / jnp.maximum(sums["moe_tokens"], 1.0)  # nats per token
        # expert_load/<MoE layer>/<expert>: the fraction of the layer's tokens that chose the expert (each
        # of a token's k choices counts: a layer's fractions sum to k), layers numbered in the order they
        # run, the encoder's first
        load_LE = sums["moe_load"] / jnp.maximum(sums["moe_layer_tokens"], 1.0)[:, None]
        means |= {
            f"expert_load/{l}/{e}": load_LE[l, e] for l in range(load_LE.shape[0]) for e in range(load_LE.shape[1])
        }
    return means
