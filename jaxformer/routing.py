"""Routing for a mixture of experts: which of E experts each token goes to, with what weight, and,
for the capacity dispatch, which of an expert's P slots it takes; the routers' auxiliary losses and
statistics, and DeepSeek-V3's balance bias. Pure functions of arrays (`jaxformer.moe` holds the
experts' computation and the module that calls these).

Legend (beside `functional`'s): E experts, A experts chosen per token (top-k; K is the head dim),
P slots per expert (capacity; C is classes), M tokens of a flattened batch (B * T). Routing runs in
float32 whatever the compute dtype (Switch's "selective precision": a bfloat16 softmax over experts
flips top-k choices).
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array
RouterOrder = Literal["softmax_topk", "topk_softmax"]


class RouterBias(nnx.Param):
    """DeepSeek-V3's balance bias [E] of a sigmoid router (Hugging Face `e_score_correction_bias`): added
    to the scores that choose the experts, never to the weights. Not trained by the gradient (it has
    none: it moves only a top-k's choice) but by the train step's balancing rule (`balance_biases`);
    a `Param` so that it lives in the parameters' state, the checkpoint and the weight maps, like
    `lora.QuantScale`."""


# ----------------------------------------------------------------------------- routing


def route(logits_ME: Array, k: int, order: RouterOrder = "softmax_topk") -> tuple[Array, Array, Array]:
    """The k experts of each token and their weights, from router logits [..., E].

    softmax_topk (Switch, GShard): p = softmax(logits); the k largest p, as they are (they sum to
    less than 1). topk_softmax (Mixtral): the k largest logits, softmaxed among themselves (they
    sum to 1; the same as softmax_topk renormalised).

    Returns:
      (weights [..., A] float32, experts [..., A] int32, probs [..., E] float32: the full softmax,
      which the load-balancing loss reads).

    Args:
        logits_ME: router logits [..., E] (M tokens).
        k: A, experts per token.
        order: "softmax_topk" or "topk_softmax".

    Raises:
        ValueError: an unknown `order`.
    """
    logits_ME = logits_ME.astype(jnp.float32)
    probs_ME = jax.nn.softmax(logits_ME, axis=-1)
    if order == "softmax_topk":
        weights_MA, experts_MA = jax.lax.top_k(probs_ME, k)
    elif order == "topk_softmax":
        top_MA, experts_MA = jax.lax.top_k(logits_ME, k)
        weights_MA = jax.nn.softmax(top_MA, axis=-1)
    else:
        raise ValueError(f"router order {order!r} is not 'softmax_topk' or 'topk_softmax'")
    return weights_MA, experts_MA.astype(jnp.int32), probs_ME


def route_sigmoid(
    logits_ME: Array,
    bias_E: Array,
    k: int,
    *,
    num_groups: int = 1,
    groups_per_token: int = 1,
    normalize: bool = True,
    scaling: float = 1.0,
) -> tuple[Array, Array, Array]:
    """DeepSeek-V3's router (Hugging Face `DeepseekV3TopkRouter`): scores s = sigmoid(logits); the k
    experts of the largest s + bias; their weights the chosen s themselves (the bias steers the choice
    alone), divided by their sum (+1e-20) when `normalize`, times `scaling`.

    Group-limited: the E experts fall in `num_groups` groups of consecutive experts, a group scored by
    the sum of its two largest biased scores; the experts outside a token's best `groups_per_token`
    groups have their biased score set to 0.0 before the top-k (as Hugging Face masks them: with a
    negative bias a masked expert can still outrank a kept one).

    Args:
        logits_ME: router logits [..., E].
        bias_E: [E] the balance bias (`RouterBias`).
        k: A, experts per token.
        num_groups: groups of experts (1: plain top-k).
        groups_per_token: groups a token may choose from.
        normalize: divide the k weights by their sum.
        scaling: multiply the weights by this.

    Returns:
        (weights [..., A] float32, experts [..., A] int32, probs [..., E] float32: the scores normalised
        to sum to 1, which the load-balancing loss and the router entropy read).
    """
    scores_ME = jax.nn.sigmoid(logits_ME.astype(jnp.float32))
    bias_E = jax.lax.stop_gradient(bias_E.astype(jnp.float32))
    choice_ME = scores_ME + bias_E.reshape((1,) * (scores_ME.ndim - 1) + bias_E.shape)
    if num_groups > 1:
        E = choice_ME.shape[-1]
        grouped = choice_ME.reshape(*choice_ME.shape[:-1], num_groups, E // num_groups)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [..., G]
        _, best = jax.lax.top_k(group_score, groups_per_token)
        keep_G = jax.nn.one_hot(best, num_groups, dtype=jnp.bool_).any(-2)  # [..., G]
        keep_ME = jnp.repeat(keep_G, E // num_groups, axis=-1)
        choice_ME = jnp.where(keep_ME, choice_ME, 0.0)
    _, experts_MA = jax.lax.top_k(choice_ME, k)
    weights_MA = jnp.take_along_axis(scores_ME, experts_MA, axis=-1)
    if normalize:
        weights_MA = weights_MA / (weights_MA.sum(-1, keepdims=True) + 1e-20)
    probs_ME = scores_ME / scores_ME.sum(-1, keepdims=True)
    return weights_MA * scaling, experts_MA.astype(jnp.int32), probs_ME


def balance_biases(bias_LE: Array, load_LE: Array, rate: float) -> Array:
    """DeepSeek-V3's auxiliary-loss-free balancing (section 2.1.2): each layer's bias moves by `rate`
    towards its under-loaded experts, bias_e + rate * sign(mean_e load - load_e).

    Args:
        bias_LE: [..., E] the routers' biases.
        load_LE: [..., E] the tokens each expert was sent in the step (all micro-batches and shards).
        rate: the update speed (`model.moe.balance_rate`).

    Returns:
        [..., E] the new biases.
    """
    load_LE = load_LE.astype(jnp.float32)
    return bias_LE + rate * jnp.sign(load_LE.mean(-1, keepdims=True) - load_LE)


def _live_or_ones(live_M: Array | None, shape: tuple[int, ...]) -> Array:
    return jnp.ones(shape, jnp.float32) if live_M is None else live_M.astype(jnp.float32)


def router_z_loss(logits_ME: Array, live_M: Array | None = None) -> Array:
    """ST-MoE's router z-loss (Zoph et al. 2022): the mean over (live) tokens of log(sum_e exp l_e)^2,
    which keeps router logits small (a softmax of large logits rounds badly).

    Args:
        logits_ME: router logits [M, E].
        live_M: [M] True for real tokens, or None (all).

    Returns:
        A float32 scalar.
    """
    log_z_M = jax.nn.logsumexp(logits_ME.astype(jnp.float32), axis=-1)
    live_M = _live_or_ones(live_M, log_z_M.shape)
    return jnp.sum(jnp.square(log_z_M) * live_M) / jnp.maximum(live_M.sum(), 1.0)


def load_balance_loss(probs_ME: Array, experts_MA: Array, live_M: Array | None = None) -> Array:
    """Switch's load-balancing loss (Fedus et al. 2021, eq. 4): E * sum_e f_e * P_e, with f_e the
    fraction of (live) tokens sent to expert e (each of a token's k choices counts, as in Mixtral's
    and MaxText's; the f_e sum to k) and P_e the mean router probability of e. Its minimum under
    uniform routing is k (1 for Switch's top-1).

    Args:
        probs_ME: router probabilities [M, E].
        experts_MA: [M, A] int, each token's experts.
        live_M: [M] True for real tokens, or None (all).

    Returns:
        A float32 scalar.
    """
    E = probs_ME.shape[-1]
    live_M = _live_or_ones(live_M, probs_ME.shape[:-1])
    n = jnp.maximum(live_M.sum(), 1.0)
    sent_ME = jax.nn.one_hot(experts_MA, E, dtype=jnp.float32).sum(-2)  # [..., E]: 1 where a token chose e
    f_E = jnp.einsum("...E,...->E", sent_ME, live_M) / n
    P_E = jnp.einsum("...E,...->E", probs_ME.astype(jnp.float32), live_M) / n
    return E * jnp.sum(f_E * P_E)


def expert_load(experts_MA: Array, num_experts: int, live_M: Array | None = None) -> Array:
    """How many (live) tokens chose each expert, each of a token's k choices counted.

    The counts sum to k times the live tokens; dropped pairs are included: this is the router's choice.

    Args:
        experts_MA: [..., A] the chosen experts of each token (M: any leading token dims).
        num_experts: E.
        live_M: [...] 1 for a real token, 0 for padding (None: all real).

    Returns:
        [E] token counts.
    """
    live_M = _live_or_ones(live_M, experts_MA.shape[:-1])
    sent_ME = jax.nn.one_hot(experts_MA, num_experts, dtype=jnp.float32).sum(-2)  # [..., E]
    return jnp.einsum("...E,...->E", sent_ME, live_M)


def router_entropy(probs_ME: Array, live_M: Array | None = None) -> Array:
    """The summed entropy -sum_e p_e log p_e (nats) of the (live) tokens' router probabilities.

    A uniform router gives log E per token, one sure of its expert 0.

    Args:
        probs_ME: [..., E] router probabilities.
        live_M: [...] 1 for a real token, 0 for padding (None: all real).

    Returns:
        [] the sum over live tokens.
    """
    entropy_M = -jnp.sum(jax.scipy.special.xlogy(probs_ME, probs_ME), axis=-1)
    return jnp.sum(entropy_M * _live_or_ones(live_M, entropy_M.shape))


# ----------------------------------------------------------------------------- capacity dispatch


def capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Slots per expert for a group of `tokens`: ceil(factor * tokens * k / E), at least 1.

    Args:
        tokens: tokens in a group (T of a row).
        k: experts per token.
        num_experts: E.
        factor: the capacity factor.

    Returns:
        P, slots per expert.
    """
    return max(1, math.ceil(factor * tokens * k / num_experts))


def dispatch_capacity(
    weights_BTA: Array,
    experts_BTA: Array,
    num_experts: int,
    slots: int,
    live_BT: Array | None = None,
    *,
    causal: bool = True,
) -> tuple[Array, Array, Array, Array]:
    """Place each row's token-expert pairs in their expert's `slots` (P) slots, first come first served.
    A pair past its expert's P slots is dropped; padding (`live_BT` False) takes no slot.

    The order of service:

      causal (token-major): token by token, a token's k pairs together (they go to k different
          experts, so their order among themselves does not matter): whether a pair of token t gets
          a slot depends on the pairs of tokens 0..t alone. Required in a causal stack (a decoder):
          no token's routing may depend on a later token, or the model sees the future through the
          router during training.
      not causal (choice-major, GShard, Switch): every token's first choice, in token order, before
          any second choice. Under pressure it keeps the pairs of larger router weight, but a later
          token's first choice can take the slot an earlier token's second choice would have had:
          for bidirectional stacks (an encoder), where every token sees every other anyway.

    With k = 1 the two orders are the same.

    Returns:
      (dispatch [B, T, E, P] 0/1 float32: token t fills slot p of expert e, combine [B, T, E, P]:
      the same times the router weight, dropped pairs (a count), assigned pairs (a count)).

    Args:
        weights_BTA: [B, T, A] router weights.
        experts_BTA: [B, T, A] int experts.
        num_experts: E.
        slots: P.
        live_BT: [B, T] True for real tokens, or None (all).
        causal: token-major order (a causal stack); False: choice-major (GShard's, a bidirectional one).
    """
    B, T, A = experts_BTA.shape
    E, P = num_experts, slots
    chose_BTAE = (
        jax.nn.one_hot(experts_BTA, E, dtype=jnp.int32)
        * _live_or_ones(live_BT, (B, T)).astype(jnp.int32)[:, :, None, None]
    )
    # Priority: a running count per expert over the pairs in order of service, X = (t, a) or (a, t).
    if causal:
        taken_BXE = jnp.cumsum(chose_BTAE.reshape(B, T * A, E), axis=1) - 1  # the slot each pair would take
        position_BTAE = taken_BXE.reshape(B, T, A, E)
    else:
        chose_BXE = jnp.swapaxes(chose_BTAE, 1, 2).reshape(B, A * T, E)
        taken_BXE = jnp.cumsum(chose_BXE, axis=1) - 1
        position_BTAE = jnp.swapaxes(taken_BXE.reshape(B, A, T, E), 1, 2)
    position_BTA = jnp.sum(position_BTAE * chose_BTAE, axis=-1)
    assigned_BTA = chose_BTAE.sum(-1) > 0
    kept_BTA = assigned_BTA & (position_BTA < P)
    slot_BTAP = jax.nn.one_hot(jnp.where(kept_BTA, position_BTA, P), P, dtype=jnp.float32)  # index P: no slot
    chose_f = chose_BTAE.astype(jnp.float32)
    dispatch_BTEP = jnp.einsum("BTAE,BTAP->BTEP", chose_f, slot_BTAP)
    combine_BTEP = jnp.einsum("BTAE,BTAP,BTA->BTEP", chose_f, slot_BTAP, weights_BTA.astype(jnp.float32))
    dropped = jnp.sum(assigned_BTA & ~kept_BTA).astype(jnp.float32)
    return dispatch_BTEP, combine_BTEP, dropped, jnp.sum(assigned_BTA).astype(jnp.float32)
