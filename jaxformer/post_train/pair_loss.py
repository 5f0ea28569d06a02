"""The preference objective of the train step: completion-only log-probabilities of a batch of pairs,
the reference's, and the summed loss and metrics (`jaxformer.train.make_steps` calls them when
`train.objective="preference"`).

A batch of B pairs (`jaxformer.post_train.pairs`) holds inputs, targets, weights [B, 2, T]: row 0 the
chosen completion, row 1 the rejected, each after its prompt (decoder_only: prompt + completion in one
row, weights 1 on the completion's targets only), or, encoder_decoder, src [B, S] and src_lengths [B]
(the prompt, read by the encoder) with the completions as targets. Both rows of every pair go through
the model in one [2B, T] pass.

The reference: with LoRA the same model with its adapters zeroed (their update A @ B is 0: the frozen
base alone, no second copy of it); without LoRA a frozen copy in the train state (`TrainState.reference`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxformer.config import PreferenceConfig
from jaxformer.functional import token_logprobs
from jaxformer.post_train.preference import preference_loss, sequence_logprobs

Array = jax.Array


def pair_logprobs(model, batch: dict, dropout_rng: Array | None) -> tuple[Array, Array]:
    """Completion-only log-probabilities of each pair's two completions.

    Args:
        model (jaxformer.models.Transformer): decoder_only or encoder_decoder.
        batch: inputs, targets, weights [B, 2, T] (src [B, S], src_lengths [B] for encoder_decoder).
        dropout_rng: the dropout key, or None.

    Returns:
        (sums [B, 2], token counts [B, 2]): column 0 the chosen completion, 1 the rejected.
    """
    B, _, T = batch["inputs"].shape
    rows = lambda x: x.reshape(2 * B, T)  # [B, 2, T] -> [2B, T]: pair b's chosen at 2b, rejected at 2b + 1
    if "src" in batch:  # encoder_decoder: the prompt is the source of both completions
        src, lengths = (jnp.repeat(batch[k], 2, axis=0) for k in ("src", "src_lengths"))
        h_BTD = model.hidden(src, rows(batch["inputs"]), lengths=lengths, dropout_rng=dropout_rng)
    else:
        h_BTD = model.hidden(rows(batch["inputs"]), dropout_rng=dropout_rng)
    logp_BT = token_logprobs(model.head(h_BTD), rows(batch["targets"]))
    sums, counts = sequence_logprobs(logp_BT, rows(batch["weights"]))
    return sums.reshape(B, 2), counts.reshape(B, 2)


def normalised(cfg: PreferenceConfig, sums: Array, counts: Array) -> Array:
    """The log-probabilities `cfg.loss` compares: sums for DPO's sigmoid and IPO, means over the
    completion's tokens for SimPO and ORPO (as TRL computes them).

    Args:
        cfg: the preference section.
        sums: [B, 2] summed log-probs.
        counts: [B, 2] completion tokens.

    Returns:
        [B, 2].
    """
    return sums if cfg.loss in ("sigmoid", "ipo") else sums / jnp.maximum(counts, 1.0)


def with_reference(cfg: PreferenceConfig, model_of: Callable, state, batch: dict) -> dict:
    """`batch` with "ref_logps" [B, 2], the reference model's log-probabilities (a constant of the step:
    no gradient, no dropout), for the losses that read them.

    Args:
        cfg: the preference section.
        model_of (Callable): (params, frozen) -> the model.
        state (jaxformer.state.TrainState): the train state (its reference, or LoRA's adapters and base).
        batch: the device batch.

    Returns:
        The batch (unchanged for SimPO and ORPO).
    """
    if not cfg.uses_reference:
        return batch
    if state.reference is not None:  # full fine-tuning: the frozen copy of the starting weights
        model = model_of(state.reference, None)
    else:  # LoRA: the adapters zeroed, their update 0: the frozen base it shares with the policy
        model = model_of(jax.tree.map(jnp.zeros_like, state.params), state.frozen)
    ref = normalised(cfg, *pair_logprobs(model, batch, None))
    return batch | {"ref_logps": jax.lax.stop_gradient(ref)}


def preference_sums(model, cfg: PreferenceConfig, batch: dict, dropout_rng: Array | None) -> tuple[Array, dict]:
    """Summed loss and metrics of a batch of pairs (each a sum over its real pairs; "count" the pairs),
    as `train.loss_sums` gives them for the token objectives: the step divides by the count.

    Args:
        model (jaxformer.models.Transformer): the policy.
        cfg: the preference section.
        batch: the device batch (with "ref_logps" for the losses that read a reference).
        dropout_rng: the dropout key, or None.

    Returns:
        (summed loss, summed metrics).
    """
    sums, counts = pair_logprobs(model, batch, dropout_rng)
    logps = normalised(cfg, sums, counts)
    ref = batch.get("ref_logps")
    per_pair = preference_loss(
        cfg.loss, logps[:, 0], logps[:, 1],
        None if ref is None else ref[:, 0], None if ref is None else ref[:, 1],
        beta=cfg.beta, label_smoothing=cfg.label_smoothing, simpo_gamma=cfg.simpo_gamma,
        chosen_nll=-sums[:, 0] / jnp.maximum(counts[:, 0], 1.0), tokens=(counts[:, 0], counts[:, 1]),
    )  # fmt: skip
    real = (counts > 0).all(-1).astype(jnp.float32)  # [B]: a padded split's filler rows weigh nothing
    out = {name: (value * real).sum() for name, value in per_pair.items()}
    return out["loss"], out | {"count": real.sum()}
