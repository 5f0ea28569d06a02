"""GRPO's maths as pure functions of arrays (no Flax): group-normalised advantages, the clipped
token-level surrogate with an optional KL penalty to a reference, and the ways the per-token losses
are summed into one (GRPO, DAPO, Dr. GRPO).

Shapes: P prompts, G samples per prompt (a group), B = P x G rows, T positions of a row.
References: Shao et al. 2024 (DeepSeekMath, GRPO), Yu et al. 2025 (DAPO: clip-higher, dynamic
sampling, token-level loss), Liu et al. 2025 (Dr. GRPO: no std division, a constant normaliser).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

AGGREGATIONS = ("sequence", "token", "constant")


def group_advantages(rewards_PG: Array, *, scale: bool = True, eps: float = 1e-4) -> Array:
    """Each sample's advantage within its group: (r - mean(group)) / (std(group) + eps), or, with
    `scale=False` (Dr. GRPO), r - mean(group). The std is the sample one (ddof = 1), as TRL's
    `torch.std` over a group (the paper does not say).

    Args:
        rewards_PG: [P, G] rewards, one row per prompt.
        scale: divide by the group's standard deviation (GRPO); False: do not (Dr. GRPO).
        eps: added to the std so a group of equal rewards gives 0, not NaN.

    Returns:
        [P, G] float32 advantages.
    """
    r = rewards_PG.astype(jnp.float32)
    centred = r - jnp.mean(r, axis=1, keepdims=True)
    if not scale:
        return centred
    return centred / (jnp.std(r, axis=1, keepdims=True, ddof=1) + eps)


def informative_groups(rewards_PG: Array) -> Array:
    """DAPO's dynamic sampling: the groups whose rewards are not all equal (a group of equal rewards has
    zero advantage everywhere and only dilutes the batch).

    Args:
        rewards_PG: [P, G] rewards.

    Returns:
        [P] bool, True for the groups kept.
    """
    return jnp.max(rewards_PG, axis=1) > jnp.min(rewards_PG, axis=1)


def kl_k3(logp_BT: Array, ref_logp_BT: Array) -> Array:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token, as the GRPO paper writes it:
    pi_ref / pi - log(pi_ref / pi) - 1 (unbiased, always >= 0).

    Args:
        logp_BT: [B, T] log-probabilities under the policy.
        ref_logp_BT: [B, T] the same tokens' under the reference.

    Returns:
        [B, T] per-token estimates.
    """
    d = ref_logp_BT - logp_BT
    return jnp.exp(d) - d - 1.0


def surrogate_loss(
    logp_BT: Array,
    old_logp_BT: Array,
    advantages_B: Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    ref_logp_BT: Array | None = None,
    kl_coef: float = 0.0,
) -> tuple[Array, dict]:
    """GRPO's per-token loss: -(min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) - kl_coef KL_k3), with
    r = pi / pi_old = exp(logp - old_logp) and A the row's advantage (DAPO's clip-higher: eps_high >
    eps_low lets unlikely tokens that pay rise further).

    Args:
        logp_BT: [B, T] log-probabilities of the sampled tokens under the policy being trained.
        old_logp_BT: [B, T] the same under the policy that sampled them (no gradient flows through it).
        advantages_B: [B] each row's advantage.
        eps_low: the ratio's clip below 1.
        eps_high: the ratio's clip above 1.
        ref_logp_BT: [B, T] the reference's log-probabilities (needed when kl_coef > 0).
        kl_coef: beta, the KL penalty's weight (0: none).

    Returns:
        result (tuple[Array, dict]): ([B, T] per-token losses, {"kl": [B, T], "clipped": [B, T] bool where
        the clipped term was the smaller}).
    """
    ratio_BT = jnp.exp(logp_BT - jax.lax.stop_gradient(old_logp_BT))
    a_B1 = advantages_B[:, None].astype(jnp.float32)
    unclipped_BT = ratio_BT * a_B1
    clipped_BT = jnp.clip(ratio_BT, 1.0 - eps_low, 1.0 + eps_high) * a_B1
    objective_BT = jnp.minimum(unclipped_BT, clipped_BT)
    kl_BT = jnp.zeros_like(objective_BT)
    if kl_coef:
        kl_BT = kl_k3(logp_BT, jax.lax.stop_gradient(ref_logp_BT))
        objective_BT = objective_BT - kl_coef * kl_BT
    return -objective_BT, {"kl": kl_BT, "clipped": clipped_BT < unclipped_BT}


def aggregate(loss_BT: Array, mask_BT: Array, how: str, max_len: int | None = None) -> tuple[Array, Array]:
    """(sum, count): the per-token losses summed as `how` says, and what to divide by, so that sums
    and counts of micro-batches add up to the whole batch's (gradient accumulation stays exact).

    - "sequence" (GRPO): each row's mean over its tokens, then the mean over rows: (sum of row means,
      rows with a token).
    - "token" (DAPO): every token weighs the same: (sum over all tokens, tokens).
    - "constant" (Dr. GRPO): (sum over all tokens, rows x max_len): no length bias either way.

    Args:
        loss_BT: [B, T] per-token losses.
        mask_BT: [B, T] 1 where a position is a sampled token that counts, else 0.
        how: "sequence", "token" or "constant".
        max_len: the constant's length (the most tokens a row may sample); "constant" only.

    Returns:
        result (tuple[Array, Array]): (summed loss, count), float32 scalars.

    Raises:
        ValueError: an unknown `how`, or "constant" without max_len.
    """
    m = mask_BT.astype(jnp.float32)
    tokens_B = m.sum(axis=1)
    rows = jnp.sum(tokens_B > 0).astype(jnp.float32)
    if how == "sequence":
        return jnp.sum(jnp.sum(loss_BT * m, axis=1) / jnp.maximum(tokens_B, 1.0)), rows
    if how == "token":
        return jnp.sum(loss_BT * m), jnp.sum(tokens_B)
    if how == "constant":
        if max_len is None:
            raise ValueError("aggregate: how='constant' needs max_len")
        return jnp.sum(loss_BT * m), rows * max_len
    raise ValueError(f"aggregate: how must be one of {AGGREGATIONS}, got {how!r}")
