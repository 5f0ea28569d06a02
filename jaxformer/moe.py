"""Mixture of experts: routing, capacity-based and dropless dispatch, the auxiliary losses, the module.

A router scores each token against E experts (feed-forward networks of their own) and sends it to
the best k; the token's output is the weighted sum of those experts' outputs (Shazeer et al. 2017).
Two dispatches compute the same thing when nothing is dropped:

  capacity  (GShard, Switch) each expert takes at most P tokens of a row; a token past them skips
            that expert (a token that all its experts refuse gets zeros: only the residual carries it).
            Dense one-hot einsums of fixed shapes, [B, T, E, P].
  dropless  (MegaBlocks, MaxText's "sparse matmul") token-expert pairs sorted by expert and a
            grouped matmul (`jax.lax.ragged_dot`): nothing is dropped, no slot is wasted.

Legend (beside `functional`'s): E experts, A experts chosen per token (top-k; K is the head dim),
P slots per expert (capacity; C is classes), M tokens of a flattened batch (B * T), X token-expert
pairs (M * A) sorted by expert. Routing runs in float32 whatever the compute dtype (Switch's
"selective precision": a bfloat16 softmax over experts flips top-k choices).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer import functional as F
from jaxformer.config import ModelConfig
from jaxformer.sharding import constrain, param

Array = jax.Array
RouterOrder = Literal["softmax_topk", "topk_softmax"]


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
    weights_BTA: Array, experts_BTA: Array, num_experts: int, slots: int, live_BT: Array | None = None
) -> tuple[Array, Array, Array, Array]:
    """Place each row's token-expert pairs in their expert's `slots` (P) slots, first come first served:
    every token's first choice before any second choice, in token order (GShard, Switch). A pair
    past its expert's P slots is dropped; padding (`live_BT` False) takes no slot.

    Returns:
      (dispatch [B, T, E, P] 0/1 float32: token t fills slot p of expert e, combine [B, T, E, P]:
      the same times the router weight, dropped pairs (a count), assigned pairs (a count)).

    Args:
        weights_BTA: [B, T, A] router weights.
        experts_BTA: [B, T, A] int experts.
        num_experts: E.
        slots: P.
        live_BT: [B, T] True for real tokens, or None (all).
    """
    B, T, A = experts_BTA.shape
    E, P = num_experts, slots
    chose_BTAE = (
        jax.nn.one_hot(experts_BTA, E, dtype=jnp.int32)
        * _live_or_ones(live_BT, (B, T)).astype(jnp.int32)[:, :, None, None]
    )
    # Priority: choice rank first, then token position: a running count over (A, T) per expert.
    chose_BXE = jnp.swapaxes(chose_BTAE, 1, 2).reshape(B, A * T, E)  # X = (a, t) in that order
    taken_BXE = jnp.cumsum(chose_BXE, axis=1) - 1  # the slot each pair would take in its expert
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


def _activate(activation: str, up: Array, gate: Array | None) -> Array:
    if activation in F.GATED_ACTIVATIONS:
        return F.GATED_ACTIVATIONS[activation](gate, up)
    return F.ACTIVATIONS[activation](up)


SLOTS = ("expert_batch", "expert", None, None)  # [B, E, P, D]: rows over data/fsdp, experts over `expert`


def moe_capacity(x_BTD: Array, dispatch_BTEP: Array, combine_BTEP: Array, w: dict, activation: str) -> Array:
    """The experts over their slots: gather [B, E, P, D], each expert's FFN, and the weighted sum back
    to [B, T, D]. A token no expert kept gets zeros. `w`: wi [E, D, F], wo [E, F, D], wi_gate for
    gated activations, and optionally wi_bias, wi_gate_bias [E, F], wo_bias [E, D].

    Args:
        x_BTD: [B, T, D] inputs.
        dispatch_BTEP: [B, T, E, P] 0/1 dispatch.
        combine_BTEP: [B, T, E, P] combine weights.
        w: the experts' kernels (above).
        activation: the FFN's activation ("relu", "gelu", "swiglu", ...).

    Returns:
        [B, T, D].
    """
    dt = x_BTD.dtype
    # Under expert parallelism the slots move to their expert's devices (an all-to-all) and back.
    x_BEPD = constrain(jnp.einsum("BTEP,BTD->BEPD", dispatch_BTEP.astype(dt), x_BTD), SLOTS)

    def dense(x_BEPI, name, spec):
        y = jnp.einsum(spec, x_BEPI, w[name].astype(dt))
        bias = w.get(f"{name}_bias")
        return y if bias is None else y + bias.astype(dt)[None, :, None, :]

    up_BEPF = dense(x_BEPD, "wi", "BEPD,EDF->BEPF")
    gate_BEPF = dense(x_BEPD, "wi_gate", "BEPD,EDF->BEPF") if "wi_gate" in w else None
    out_BEPD = constrain(dense(_activate(activation, up_BEPF, gate_BEPF), "wo", "BEPF,EFD->BEPD"), SLOTS)
    return constrain(jnp.einsum("BTEP,BEPD->BTD", combine_BTEP.astype(dt), out_BEPD), ("batch", "length", None))


def dense_ffn(x_BTD: Array, w: dict, activation: str) -> Array:
    """One dense FFN (the shared experts): wi [D, F], wo [F, D], wi_gate for gated activations.

    Args:
        x_BTD: [B, T, D] inputs.
        w: the kernels (above).
        activation: the FFN's activation.

    Returns:
        [B, T, D].
    """
    dt = x_BTD.dtype
    up_BTF = jnp.einsum("BTD,DF->BTF", x_BTD, w["wi"].astype(dt))
    gate_BTF = jnp.einsum("BTD,DF->BTF", x_BTD, w["wi_gate"].astype(dt)) if "wi_gate" in w else None
    return jnp.einsum("BTF,FD->BTD", _activate(activation, up_BTF, gate_BTF), w["wo"].astype(dt))


# ----------------------------------------------------------------------------- dropless dispatch


def moe_dropless(x_MD: Array, weights_MA: Array, experts_MA: Array, w: dict, activation: str) -> Array:
    """Every token through its k experts: token-expert pairs sorted by expert, each expert's rows
    multiplied by its own kernel in one grouped matmul (`jax.lax.ragged_dot`), the outputs put back
    in token order and summed with the router weights. [M, D] -> [M, D]; `w` as in `moe_capacity`.

    Args:
        x_MD: [M, D] tokens.
        weights_MA: [M, A] router weights.
        experts_MA: [M, A] int experts.
        w: the experts' kernels.
        activation: the FFN's activation.

    Returns:
        [M, D].
    """
    M, A = experts_MA.shape
    dt = x_MD.dtype
    E = w["wi"].shape[0]
    experts_X = experts_MA.reshape(-1)
    order_X = jnp.argsort(experts_X, stable=True)  # pairs grouped by expert
    sorted_experts_X = experts_X[order_X]
    group_sizes_E = jnp.bincount(experts_X, length=E).astype(jnp.int32)
    x_XD = jnp.take(x_MD, order_X // A, axis=0)

    def dense(x_XI, name):
        y = jax.lax.ragged_dot(x_XI, w[name].astype(dt), group_sizes_E)
        bias = w.get(f"{name}_bias")
        return y if bias is None else y + jnp.take(bias.astype(dt), sorted_experts_X, axis=0)

    up_XF = dense(x_XD, "wi")
    gate_XF = dense(x_XD, "wi_gate") if "wi_gate" in w else None
    out_XD = dense(_activate(activation, up_XF, gate_XF), "wo")
    inverse_X = jnp.zeros_like(order_X).at[order_X].set(jnp.arange(order_X.shape[0], dtype=order_X.dtype))
    out_MAD = jnp.take(out_XD, inverse_X, axis=0).reshape(M, A, -1)
    return jnp.einsum("MAD,MA->MD", out_MAD, weights_MA.astype(dt))


# ----------------------------------------------------------------------------- the module


def live_tokens(mask, T: int) -> Array | None:
    """[B, T] True for tokens that are not padding, read off a self-attention `Mask` (packed rows'
    segments, or key lengths, which for self-attention are the row lengths); None: all are live.

    Args:
        mask (functional.Mask | Array | None): the self-attention mask.
        T: the length.

    Returns:
        [B, T] boolean, or None.
    """
    if not isinstance(mask, F.Mask):
        return None
    if mask.q_segments is not None:
        return mask.q_segments > 0
    if mask.kv_lengths is not None and mask.q_offset is None:
        return jnp.arange(T)[None, :] < mask.kv_lengths[:, None]
    return None


class MoEFeedForward(nnx.Module):
    """A router and E expert FFNs (D -> F -> D each, the activation of the dense FFN), optionally beside
    `shared_experts` dense ones every token takes. Kernels are stacked on a leading `expert` axis.

    Args:
        cfg: the model's config (its `moe` section, D, F, activation).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        moe = cfg.moe
        E, D, Fw = moe.num_experts, cfg.d_model, moe.expert_d_ff or cfg.d_ff
        self.gated = cfg.activation in F.GATED_ACTIVATIONS
        # Switch's router initialisation: truncated normal of variance 0.1 / D (small logits, near-uniform start).
        self.router = param(rngs, nnx.initializers.variance_scaling(0.1, "fan_in", "truncated_normal"), (D, E),
                            ("embed", None))  # fmt: skip
        kernel = nnx.initializers.xavier_uniform(in_axis=-2, out_axis=-1, batch_axis=(0,))  # per expert
        self.wi = param(rngs, kernel, (E, D, Fw), ("expert", "embed", "mlp"))
        if self.gated:
            self.wi_gate = param(rngs, kernel, (E, D, Fw), ("expert", "embed", "mlp"))
        self.wo = param(rngs, kernel, (E, Fw, D), ("expert", "mlp", "embed"))
        if cfg.use_bias:
            self.wi_bias = param(rngs, nnx.initializers.zeros, (E, Fw), ("expert", "mlp"))
            if self.gated:
                self.wi_gate_bias = param(rngs, nnx.initializers.zeros, (E, Fw), ("expert", "mlp"))
            self.wo_bias = param(rngs, nnx.initializers.zeros, (E, D), ("expert", "embed"))
        if moe.shared_experts:  # one dense FFN as wide as the shared experts together
            S, dense_kernel = Fw * moe.shared_experts, nnx.initializers.xavier_uniform()
            self.shared_wi = param(rngs, dense_kernel, (D, S), ("embed", "mlp"))
            if self.gated:
                self.shared_wi_gate = param(rngs, dense_kernel, (D, S), ("embed", "mlp"))
            self.shared_wo = param(rngs, dense_kernel, (S, D), ("mlp", "embed"))

    def kernels(self, prefix: str = "") -> dict:
        """The experts' kernels by name (wi, wi_gate, wo and biases); with prefix="shared_", the shared FFN's.

        Args:
            prefix: "" for the experts, "shared_" for the shared FFN.

        Returns:
            name -> array.
        """
        names = ("wi", "wi_gate", "wo", "wi_bias", "wi_gate_bias", "wo_bias")
        return {name: getattr(self, prefix + name)[...] for name in names if hasattr(self, prefix + name)}

    def __call__(
        self, x_BTD: Array, dropout_rng: Array | None = None, live_BT: Array | None = None
    ) -> tuple[Array, dict]:
        """Routes each token to its experts and sums their outputs, weighted by the router.

        Args:
            x_BTD: [B, T, D] activations.
            dropout_rng: the router noise's key (training), or None for no noise.
            live_BT: [B, T] False marks padding, which the losses skip and which takes no expert slot;
                None: every token is live.

        Returns:
            (y [B, T, D], aux), aux holding this layer's router z-loss and load-balancing loss (means
                over live tokens), its dropped and assigned token-expert pairs (counts), the tokens each
                expert was chosen by (`load`, [E]), the router entropy summed over live tokens and the
                live tokens (`tokens`).
        """
        cfg, moe = self.cfg, self.cfg.moe
        B, T, D = x_BTD.shape
        E, k = moe.num_experts, moe.experts_per_token
        x_router_BTD = x_BTD.astype(jnp.float32)
        if moe.router_noise and dropout_rng is not None:  # Switch's jitter, training only
            eps = moe.router_noise
            noise_rng = jax.random.fold_in(dropout_rng, 0x6E6F6973)
            x_router_BTD = x_router_BTD * jax.random.uniform(noise_rng, x_BTD.shape, jnp.float32, 1 - eps, 1 + eps)
        logits_BTE = jnp.einsum("BTD,DE->BTE", x_router_BTD, self.router[...])
        weights_BTA, experts_BTA, probs_BTE = route(logits_BTE, k, moe.router)
        aux = {
            "router_z_loss": router_z_loss(logits_BTE, live_BT),
            "load_balance_loss": load_balance_loss(probs_BTE, experts_BTA, live_BT),
            "load": expert_load(experts_BTA, E, live_BT),  # [E] token counts
            "entropy": router_entropy(probs_BTE, live_BT),  # summed over tokens
            "tokens": jnp.asarray(B * T if live_BT is None else jnp.sum(live_BT), jnp.float32),
        }
        w = self.kernels()
        if moe.capacity_factor or moe.expert_capacity:
            # expert_capacity: fixed slots per row (an expert gets at most T pairs of a row: more is waste)
            slots = min(moe.expert_capacity, T) if moe.expert_capacity else capacity(T, k, E, moe.capacity_factor)
            dispatch_BTEP, combine_BTEP, dropped, assigned = dispatch_capacity(
                weights_BTA, experts_BTA, E, slots, live_BT
            )
            y_BTD = moe_capacity(x_BTD, dispatch_BTEP, combine_BTEP, w, cfg.activation)
        else:
            y_MD = moe_dropless(
                x_BTD.reshape(B * T, D), weights_BTA.reshape(B * T, k), experts_BTA.reshape(B * T, k), w, cfg.activation
            )
            y_BTD = y_MD.reshape(B, T, D)
            live = B * T if live_BT is None else jnp.sum(live_BT)
            dropped, assigned = jnp.zeros((), jnp.float32), jnp.asarray(k * live, jnp.float32)
        if moe.shared_experts:
            y_BTD = y_BTD + dense_ffn(x_BTD, self.kernels("shared_"), cfg.activation)
        aux |= {"dropped": dropped, "assigned": assigned}
        return y_BTD.astype(cfg.dtype), aux


# ----------------------------------------------------------------------------- collecting the losses

_reports: contextvars.ContextVar[list | None] = contextvars.ContextVar("moe_reports", default=None)


@contextlib.contextmanager
def collect():
    """Gather the MoE statistics of the forward passes traced inside: `with collect() as reports:`.

    Each layer stack with MoE layers reports its layers' statistics once per call (`report`);
    `totals(reports)` stacks them. Nothing is kept on the model (its state stays its parameters),
    and a forward pass outside `collect` reports nothing.

    Returns:
        reports (ContextManager[list]): a context manager yielding the list the reports go to.
    """
    reports: list = []
    token = _reports.set(reports)
    try:
        yield reports
    finally:
        _reports.reset(token)


def report(per_layer: dict) -> None:
    """A stack's statistics, one row per MoE layer, to the `collect` in progress (if any).

    Args:
        per_layer: the statistics (router losses, drop counts, expert loads, entropy, tokens) of the
            stack's MoE layers, each leaf [L, ...].
    """
    reports = _reports.get()
    if reports is not None:
        reports.append(per_layer)


def totals(reports: list) -> tuple[dict, int]:
    """(the reports' statistics stacked over every MoE layer, the number L of MoE layers).

    Args:
        reports: the per-layer dicts from `collect`, in the order the stacks ran (an encoder's before
            its decoder's).

    Returns:
        (stacked, L): each leaf [L, ...], and L.
    """
    if not reports:
        return {}, 0
    stacked = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *reports)
    return stacked, int(stacked["tokens"].shape[0])
