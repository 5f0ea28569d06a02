"""Preference losses (the DPO family) as pure functions of per-sequence log-probabilities.

Each loss takes, per pair b of a batch, the policy's log-probability of the chosen and of the
rejected completion (and for DPO and IPO the reference model's), and returns the per-pair losses with
the implicit rewards, as Hugging Face TRL's `DPOTrainer.dpo_loss`, `CPOTrainer.cpo_loss` (SimPO) and
`ORPOTrainer.odds_ratio_loss` compute them (tests/golden/dpo holds their values on fixed inputs).
What a log-probability is differs by loss, as in TRL: DPO and IPO sum a completion's token log-probs
(IPO divides each log-ratio by the completion's tokens); SimPO and ORPO take their mean over its
tokens (`sequence_logprobs` gives sums and counts).

Legend: B pairs, T completion positions, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def sequence_logprobs(logp_BT: Array, weights_BT: Array) -> tuple[Array, Array]:
    """Per-sequence sums of the token log-probs where `weights` is 1 (the completion, prompt masked),
    and the number of tokens summed.

    Args:
        logp_BT: [B, T] token log-probabilities.
        weights_BT: [B, T] 1 on the completion's tokens, 0 on the prompt and padding.

    Returns:
        (sums [B], token counts [B]).
    """
    return (logp_BT * weights_BT).sum(-1), weights_BT.sum(-1)


def _logsigmoid(x: Array) -> Array:
    return jax.nn.log_sigmoid(x)


def log1mexp(x: Array) -> Array:
    """log(1 - exp(x)) for x < 0, without the cancellation of either form alone (branch at -log 2).

    Args:
        x: [...] negative values.

    Returns:
        [...].
    """
    near = x >= -0.6931471805599453  # exp(x) near 1: log(-expm1(x)); far: log1p(-exp(x))
    return jnp.where(near, jnp.log(-jnp.expm1(jnp.minimum(x, -1e-30))), jnp.log1p(-jnp.exp(jnp.minimum(x, 0.0))))


def dpo_sigmoid_loss(
    chosen: Array, rejected: Array, ref_chosen: Array, ref_rejected: Array, beta: float, label_smoothing: float = 0.0
) -> tuple[Array, Array, Array]:
    """DPO (Rafailov et al. 2023): -log sigmoid(beta * margin), margin the policy's log-ratio of chosen over
    rejected less the reference's; with label smoothing eps (cDPO), (1 - eps) of that plus eps of the
    flipped pair's.

    Args:
        chosen: [B] the policy's log p(chosen | prompt) (summed over the completion).
        rejected: [B] the policy's log p(rejected | prompt).
        ref_chosen: [B] the reference's log p(chosen | prompt).
        ref_rejected: [B] the reference's log p(rejected | prompt).
        beta: the reward's inverse temperature.
        label_smoothing: eps, the probability a pair is flipped.

    Returns:
        (losses [B], chosen rewards [B], rejected rewards [B]): a reward is beta * (policy - reference).
    """
    logits = (chosen - rejected) - (ref_chosen - ref_rejected)
    losses = -_logsigmoid(beta * logits) * (1 - label_smoothing) - _logsigmoid(-beta * logits) * label_smoothing
    return losses, beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)


def ipo_loss(
    chosen: Array,
    rejected: Array,
    ref_chosen: Array,
    ref_rejected: Array,
    beta: float,
    chosen_tokens: Array,
    rejected_tokens: Array,
) -> tuple[Array, Array, Array]:
    """IPO (Azar et al. 2023): (margin - 1 / (2 beta))^2, the margin DPO's with each completion's
    log-ratio divided by its token count (as TRL, which the paper's authors confirmed).

    Args:
        chosen: [B] the policy's log p(chosen | prompt) (summed over the completion).
        rejected: [B] the policy's log p(rejected | prompt).
        ref_chosen: [B] the reference's.
        ref_rejected: [B] the reference's.
        beta: the regularisation tau.
        chosen_tokens: [B] the chosen completion's tokens.
        rejected_tokens: [B] the rejected completion's tokens.

    Returns:
        (losses [B], chosen rewards [B], rejected rewards [B]): rewards from the summed log-ratios, as DPO's.
    """
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    margin = chosen_ratio / jnp.maximum(chosen_tokens, 1.0) - rejected_ratio / jnp.maximum(rejected_tokens, 1.0)
    return (margin - 1 / (2 * beta)) ** 2, beta * chosen_ratio, beta * rejected_ratio


def simpo_loss(
    chosen: Array, rejected: Array, beta: float, gamma: float, label_smoothing: float = 0.0
) -> tuple[Array, Array, Array]:
    """SimPO (Meng et al. 2024): -log sigmoid(beta * (chosen - rejected) - gamma) on length-normalised
    log-probs, with no reference; label smoothing as DPO's.

    Args:
        chosen: [B] the policy's mean token log-prob of the chosen completion.
        rejected: [B] the policy's mean token log-prob of the rejected completion.
        beta: the reward scale.
        gamma: the target reward margin.
        label_smoothing: eps, the probability a pair is flipped.

    Returns:
        (losses [B], chosen rewards [B], rejected rewards [B]): a reward is beta * the mean log-prob.
    """
    logits = (chosen - rejected) - gamma / beta
    losses = -_logsigmoid(beta * logits) * (1 - label_smoothing) - _logsigmoid(-beta * logits) * label_smoothing
    return losses, beta * chosen, beta * rejected


def orpo_loss(chosen: Array, rejected: Array, beta: float) -> tuple[Array, Array, Array, Array, Array]:
    """ORPO's odds-ratio term (Hong et al. 2024): -beta * log sigmoid(log odds(chosen) - log odds(rejected)),
    odds(y) = p / (1 - p) of the mean token log-prob; the full loss adds the chosen completion's NLL.

    Args:
        chosen: [B] the policy's mean token log-prob of the chosen completion (< 0).
        rejected: [B] the policy's mean token log-prob of the rejected completion (< 0).
        beta: lambda, the weight of the term.

    Returns:
        (losses [B], chosen rewards [B], rejected rewards [B], log sigmoid of the log-odds ratio [B],
        the log-odds ratio [B]).
    """
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = _logsigmoid(log_odds)
    return -beta * ratio, beta * chosen, beta * rejected, ratio, log_odds


def preference_loss(
    loss: str,
    chosen: Array,
    rejected: Array,
    ref_chosen: Array | None = None,
    ref_rejected: Array | None = None,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    chosen_nll: Array | None = None,
    tokens: tuple[Array, Array] | None = None,
) -> dict[str, Array]:
    """One loss of the family by name, with TRL's metrics, per pair.

    Args:
        loss: "sigmoid", "ipo", "simpo" or "orpo".
        chosen: [B] the policy's log-probs of the chosen completions (sums for sigmoid and ipo, means for
            simpo and orpo).
        rejected: [B] the policy's log-probs of the rejected completions.
        ref_chosen: [B] the reference's (sigmoid, ipo), else None.
        ref_rejected: [B] the reference's (sigmoid, ipo), else None.
        beta: the loss's beta.
        label_smoothing: sigmoid and simpo's eps.
        simpo_gamma: SimPO's gamma.
        chosen_nll: [B] ORPO's SFT term, the chosen completion's NLL per token.
        tokens: ([B], [B]) the chosen and rejected completions' token counts (IPO).

    Returns:
        Per pair [B]: "loss", "rewards/chosen", "rewards/rejected", "rewards/margins",
        "rewards/accuracies" (1 where the chosen reward is the larger), "logps/chosen", "logps/rejected";
        ORPO adds "nll_loss", "log_odds_ratio" and "log_odds_chosen".

    Raises:
        ValueError: an unknown loss, or one without the inputs it reads.
    """
    extra = {}
    if loss in ("sigmoid", "ipo"):
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(f"loss {loss!r} reads the reference's log-probabilities: pass ref_chosen, ref_rejected")
        if loss == "sigmoid":
            losses, rc, rr = dpo_sigmoid_loss(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing)
        else:
            if tokens is None:
                raise ValueError("loss 'ipo' divides each log-ratio by its completion's tokens: pass tokens")
            losses, rc, rr = ipo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, *tokens)
    elif loss == "simpo":
        losses, rc, rr = simpo_loss(chosen, rejected, beta, simpo_gamma, label_smoothing)
    elif loss == "orpo":
        if chosen_nll is None:
            raise ValueError("loss 'orpo' adds the chosen completion's NLL: pass chosen_nll")
        odds, rc, rr, ratio, log_odds = orpo_loss(chosen, rejected, beta)
        losses = chosen_nll + odds
        extra = {"nll_loss": chosen_nll, "log_odds_ratio": ratio, "log_odds_chosen": log_odds}
    else:
        raise ValueError(f"unknown preference loss {loss!r} (sigmoid, ipo, simpo, orpo)")
    return {
        "loss": losses,
        "rewards/chosen": rc,
        "rewards/rejected": rr,
        "rewards/margins": rc - rr,
        "rewards/accuracies": (rc > rr).astype(jnp.float32),
        "logps/chosen": chosen,
        "logps/rejected": rejected,
        **extra,
    }
