"""Mixture of experts: capacity-based and dropless dispatch, expert parallelism, the module (routing and
the routers' losses are `jaxformer.routing`'s).

A router scores each token against E experts (feed-forward networks of their own) and sends it to
the best k; the token's output is the weighted sum of those experts' outputs (Shazeer et al. 2017).
Two dispatches compute the same thing when nothing is dropped:

  capacity  (GShard, Switch) each expert takes at most P tokens of a row; a token past them skips
            that expert (a token that all its experts refuse gets zeros: only the residual carries it).
            Dense one-hot einsums of fixed shapes, [B, T, E, P]. Tokens are served in order, a token's
            k choices together, in a decoder (causal: no token's routing depends on a later token);
            first choices before second ones in an encoder (GShard's order).
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

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxformer import functional as F
from jaxformer.config import ModelConfig
from jaxformer.routing import (  # noqa: F401  (routing lives there; its names stay importable from here)
    RouterBias,
    RouterOrder,
    balance_biases,
    capacity,
    dispatch_capacity,
    expert_load,
    load_balance_loss,
    route,
    route_sigmoid,
    router_entropy,
    router_z_loss,
)
from jaxformer.sharding import activation_spec, constrain, param

Array = jax.Array


def _activate(activation: str, up: Array, gate: Array | None) -> Array:
    if activation in F.GATED_ACTIVATIONS:
        return F.GATED_ACTIVATIONS[activation](gate, up)
    return F.ACTIVATIONS[activation](up)


SLOTS = ("expert_batch", "expert", None, None)  # [B, E, P, D]: rows over data/fsdp, experts over `expert`


def _expert_ffn(x_EPD: Array, w: dict, activation: str, reduce=lambda y: y) -> Array:
    """Each expert's FFN on its own slots: [..., E, P, D] -> [..., E, P, D]. `reduce` sums the
    partial outputs of an `mlp` split over devices (before the output bias, which is added once)."""
    dt = x_EPD.dtype

    def bias(y, name):
        b = w.get(f"{name}_bias")
        return y if b is None else y + b.astype(dt).reshape((1,) * (y.ndim - 3) + (b.shape[0], 1, b.shape[1]))

    up_EPF = bias(jnp.einsum("...EPD,EDF->...EPF", x_EPD, w["wi"].astype(dt)), "wi")
    gate_EPF = (
        bias(jnp.einsum("...EPD,EDF->...EPF", x_EPD, w["wi_gate"].astype(dt)), "wi_gate") if "wi_gate" in w else None
    )
    out_EPD = jnp.einsum("...EPF,EFD->...EPD", _activate(activation, up_EPF, gate_EPF), w["wo"].astype(dt))
    return bias(reduce(out_EPD), "wo")


def moe_capacity(x_BTD: Array, dispatch_BTEP: Array, combine_BTEP: Array, w: dict, activation: str) -> Array:
    """The experts over their slots: gather [B, E, P, D], each expert's FFN, and the weighted sum back
    to [B, T, D]. A token no expert kept gets zeros. `w`: wi [E, D, F], wo [E, F, D], wi_gate for
    gated activations, and optionally wi_bias, wi_gate_bias [E, F], wo_bias [E, D].

    With the experts split over devices (`mesh.expert` > 1) the slots travel to their experts'
    devices by an explicit all-to-all and back (`capacity_expert_parallel`).

    Args:
        x_BTD: [B, T, D] inputs.
        dispatch_BTEP: [B, T, E, P] 0/1 dispatch.
        combine_BTEP: [B, T, E, P] combine weights.
        w: the experts' kernels (above).
        activation: the FFN's activation ("relu", "gelu", "swiglu", ...).

    Returns:
        [B, T, D].
    """
    plan = expert_parallel_plan(x_BTD.shape[:2])
    if plan is not None:
        return capacity_expert_parallel(x_BTD, dispatch_BTEP, combine_BTEP, w, activation, plan)
    dt = x_BTD.dtype
    x_BEPD = constrain(jnp.einsum("BTEP,BTD->BEPD", dispatch_BTEP.astype(dt), x_BTD), SLOTS)
    out_BEPD = constrain(_expert_ffn(x_BEPD, w, activation), SLOTS)
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


def _expert_rows(x_XD: Array, group_sizes_E: Array, expert_X: Array, w: dict, activation: str, reduce=lambda y: y):
    """Each expert's FFN on its rows of `x_XD`, grouped by expert (`group_sizes_E` rows each, in
    expert order; rows past their sum come out as zeros): one `jax.lax.ragged_dot` per kernel.
    `expert_X` is each row's expert (for the biases); `reduce` as in `_expert_ffn`."""
    dt = x_XD.dtype
    E = w["wi"].shape[0]

    def bias(y, name):
        b = w.get(f"{name}_bias")
        return y if b is None else y + jnp.take(b.astype(dt), jnp.minimum(expert_X, E - 1), axis=0)

    def dense(x_XI, name):
        return jax.lax.ragged_dot(x_XI, w[name].astype(dt), group_sizes_E)

    up_XF = bias(dense(x_XD, "wi"), "wi")
    gate_XF = bias(dense(x_XD, "wi_gate"), "wi_gate") if "wi_gate" in w else None
    return bias(reduce(dense(_activate(activation, up_XF, gate_XF), "wo")), "wo")


def _inverse(order_X: Array) -> Array:
    return jnp.zeros_like(order_X).at[order_X].set(jnp.arange(order_X.shape[0], dtype=order_X.dtype))


def moe_dropless(x_MD: Array, weights_MA: Array, experts_MA: Array, w: dict, activation: str) -> Array:
    """Every token through its k experts: token-expert pairs sorted by expert, each expert's rows
    multiplied by its own kernel in one grouped matmul (`jax.lax.ragged_dot`), the outputs put back
    in token order and summed with the router weights. [M, D] -> [M, D]; `w` as in `moe_capacity`.

    With the experts split over devices (`mesh.expert` > 1) the pairs travel to their experts'
    devices by an explicit all-to-all and back (`dropless_expert_parallel`).

    Args:
        x_MD: [M, D] tokens.
        weights_MA: [M, A] router weights.
        experts_MA: [M, A] int experts.
        w: the experts' kernels.
        activation: the FFN's activation.

    Returns:
        [M, D].
    """
    plan = expert_parallel_plan(x_MD.shape[:1])
    if plan is not None:
        return dropless_expert_parallel(x_MD, weights_MA, experts_MA, w, activation, plan)
    M, A = experts_MA.shape
    E = w["wi"].shape[0]
    experts_X = experts_MA.reshape(-1)
    order_X = jnp.argsort(experts_X, stable=True)  # pairs grouped by expert
    group_sizes_E = jnp.bincount(experts_X, length=E).astype(jnp.int32)
    x_XD = jnp.take(x_MD, order_X // A, axis=0)
    out_XD = _expert_rows(x_XD, group_sizes_E, experts_X[order_X], w, activation)
    out_MAD = jnp.take(out_XD, _inverse(order_X), axis=0).reshape(M, A, -1)
    return jnp.einsum("MAD,MA->MD", out_MAD, weights_MA.astype(x_MD.dtype))


# ----------------------------------------------------------------------------- expert parallelism
#
# Under `mesh.expert` > 1 both dispatches run in a `jax.shard_map` over the whole mesh (MaxText's and
# MegaBlocks' layout): each device routes its own tokens (the batch is split over data x fsdp x
# expert, the length over context), sends each token-expert pair to the device holding its expert
# with `jax.lax.all_to_all` over the expert axis, runs its E / N local experts, and sends the
# outputs back with the inverse all-to-all. The kernels enter the shard_map split by expert and by
# `mlp` (tensor parallelism: the partial outputs are summed over `tensor`), gathered over `embed`
# (FSDP gathers them as it gathers a dense layer's). Shapes must be static, which sets each
# dispatch's buffers (see each function). `jax.lax.ragged_all_to_all` would send only the pairs
# there are, but XLA:CPU does not implement it (jax 0.10.2: "HLO opcode ragged-all-to-all is not
# supported"), so the padded all-to-all serves every backend.


def _mesh_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


_PLAN_NAMES = ("expert", "batch", "length", "mlp")


def expert_parallel_plan(token_shape: tuple[int, ...]) -> dict | None:
    """How the mesh and rules in effect split the experts and tokens of shape `token_shape`
    ([B, T] or [M]), or None where the experts are not split (or the tokens do not divide over the
    devices, as a few decoding rows may not: XLA's partitioner takes those).

    Args:
        token_shape: the tokens' leading dimensions, [B, T] (capacity) or [M] (dropless).

    Returns:
        {"expert": mesh axes of the experts, "ways": how many ways, "tokens": a PartitionSpec
        entry per token dimension, "mlp": mesh axes of the experts' hidden width (summed over),
        "length": mesh axes of more than one device that split a row's positions}.
    """
    mesh = jax.sharding.get_abstract_mesh()
    # one name at a time: a spec of several names never repeats a mesh axis (batch holds `expert` too)
    expert, batch, length, mlp = (_mesh_axes((*activation_spec((name,)), None)[0]) for name in _PLAN_NAMES)
    ways = math.prod(mesh.shape[a] for a in expert)
    if ways == 1:
        return None
    # [B, T]: rows over the batch axes, positions over context; [M]: the flattened tokens over both.
    tokens = (batch, length) if len(token_shape) == 2 else (batch + length,)
    used = {a for t in tokens for a in t}
    if not set(expert) <= used or any(
        n % math.prod(mesh.shape[a] for a in t) for n, t in zip(token_shape, tokens, strict=True)
    ):
        return None
    # Sums run over axes of more than one device only (XLA:CPU keeps an all-reduce over groups of one).
    mlp = tuple(a for a in mlp if a not in used and a not in expert and mesh.shape[a] > 1)  # else gathered
    split = tuple(a for a in length if mesh.shape[a] > 1)
    return {"expert": expert, "ways": ways, "tokens": tokens, "mlp": mlp, "length": split}


def _kernel_specs(w: dict, plan: dict) -> dict:
    """The kernels' PartitionSpecs inside the shard_map: experts split, the hidden width split over
    `plan["mlp"]`, D whole."""
    E, F = plan["expert"] or None, plan["mlp"] or None
    layout = {"wi": (E, None, F), "wi_gate": (E, None, F), "wo": (E, F, None),
              "wi_bias": (E, F), "wi_gate_bias": (E, F), "wo_bias": (E, None)}  # fmt: skip
    return {name: PartitionSpec(*layout[name]) for name in w}


def _spec(*entries) -> PartitionSpec:
    return PartitionSpec(*(e or None for e in entries))


def capacity_expert_parallel(
    x_BTD: Array, dispatch_BTEP: Array, combine_BTEP: Array, w: dict, activation: str, plan: dict
) -> Array:
    """`moe_capacity` with the experts split N ways: each device fills its rows' [B/n, E, P, D] slots
    (summed over the context axis when a row's positions are split: a row's slots take tokens from
    all of them), an all-to-all over the expert axis sends expert e's slots to e's device, which
    runs its E/N experts on [B/n * N, E/N, P, D], and the inverse all-to-all brings them back for
    the weighted sum. The buffers are the slots themselves (capacity sets their size: P * E =
    factor * k * T per row, the capacity layout's own memory); with a context axis its devices all
    run the same slots (the slots of a row are as large as the row's).

    Args:
        x_BTD: [B, T, D] inputs.
        dispatch_BTEP: [B, T, E, P] 0/1 dispatch.
        combine_BTEP: [B, T, E, P] combine weights.
        w: the experts' kernels, as in `moe_capacity`.
        activation: the FFN's activation.
        plan: from `expert_parallel_plan(x_BTD.shape[:2])`.

    Returns:
        [B, T, D].
    """
    expert, (batch, length), mlp, split = plan["expert"], plan["tokens"], plan["mlp"], plan["length"]
    reduce = (lambda y: jax.lax.psum(y, mlp)) if mlp else (lambda y: y)

    def local(x_BTD, dispatch_BTEP, combine_BTEP, w):
        dt = x_BTD.dtype
        x_BEPD = jnp.einsum("BTEP,BTD->BEPD", dispatch_BTEP.astype(dt), x_BTD)
        if split:  # a row's slots are filled from all its position shards
            x_BEPD = jax.lax.psum(x_BEPD, split)
        x_BEPD = jax.lax.all_to_all(x_BEPD, expert, 1, 0, tiled=True)  # [B*N, E/N, P, D]: my experts' slots
        out_BEPD = _expert_ffn(x_BEPD, w, activation, reduce)
        out_BEPD = jax.lax.all_to_all(out_BEPD, expert, 0, 1, tiled=True)  # [B, E, P, D]: my rows' slots
        return jnp.einsum("BTEP,BEPD->BTD", combine_BTEP.astype(dt), out_BEPD)

    rows = _spec(batch, length, None, None)
    return jax.shard_map(
        local,
        in_specs=(_spec(batch, length, None), rows, rows, _kernel_specs(w, plan)),
        out_specs=_spec(batch, length, None),
    )(x_BTD, dispatch_BTEP, combine_BTEP, w)


def dropless_expert_parallel(
    x_MD: Array, weights_MA: Array, experts_MA: Array, w: dict, activation: str, plan: dict
) -> Array:
    """`moe_dropless` with the experts split N ways. Each device sorts its X = M/n * k token-expert
    pairs by expert and sends device j the pairs for j's experts; nothing is dropped, so any one
    destination may get all X pairs, and with static shapes each device sends an [N, X, D] buffer
    (block j: the pairs for device j, zero-padded) and receives one as large. It regroups the
    received rows by its E/N experts for one grouped matmul over N * X rows (the padding rows
    last, outside every group: `ragged_dot` gives them zeros), and the inverse all-to-all returns
    the outputs to their tokens' devices.

    Memory: per device, the send and receive buffers [N, X, D] and the hidden [N * X, F] are N times
    the one-device layout's [X, D] and [X, F] (N = 4, k = 2: 8 rows of D per local token in each
    buffer) - the price of dropping nothing with static shapes (MaxText sizes its ragged buffers the
    same way). A capacity (`moe.capacity_factor`) bounds them instead, at the cost of drops.

    Args:
        x_MD: [M, D] tokens.
        weights_MA: [M, A] router weights.
        experts_MA: [M, A] int experts.
        w: the experts' kernels, as in `moe_capacity`.
        activation: the FFN's activation.
        plan: from `expert_parallel_plan(x_MD.shape[:1])`.

    Returns:
        [M, D].
    """
    expert, (tokens,), mlp, N = plan["expert"], plan["tokens"], plan["mlp"], plan["ways"]
    reduce = (lambda y: jax.lax.psum(y, mlp)) if mlp else (lambda y: y)
    E = w["wi"].shape[0]

    def local(x_MD, weights_MA, experts_MA, w):
        M, A = experts_MA.shape
        X, D, El = M * A, x_MD.shape[-1], E // N  # pairs, width, local experts
        experts_X = experts_MA.reshape(-1)
        order_X = jnp.argsort(experts_X, stable=True)  # my pairs grouped by expert, hence by device
        sorted_experts_X = experts_X[order_X]
        counts_E = jnp.bincount(experts_X, length=E).astype(jnp.int32)
        sent_N = counts_E.reshape(N, El).sum(-1)
        start_N = jnp.cumsum(sent_N) - sent_N
        # send block j, row p: my sorted pair start_j + p (p < sent_j), else zeros
        p_X = jnp.arange(X, dtype=jnp.int32)
        valid_NX = p_X[None, :] < sent_N[:, None]
        source_NX = jnp.where(valid_NX, start_N[:, None] + p_X[None, :], 0)
        x_XD = jnp.take(x_MD, order_X // A, axis=0)
        send_NXD = jnp.where(valid_NX[..., None], jnp.take(x_XD, source_NX, axis=0), 0)
        recv_NXD = jax.lax.all_to_all(send_NXD, expert, 0, 0, tiled=True)  # block i: from device i
        recv_counts_NE = jax.lax.all_to_all(counts_E.reshape(N, El), expert, 0, 0, tiled=True)
        # each received row's local expert (El: padding), and the rows regrouped by it
        ends_NE = jnp.cumsum(recv_counts_NE, axis=-1)
        expert_R = jnp.sum(p_X[None, :, None] >= ends_NE[:, None, :], axis=-1).reshape(N * X)
        order_R = jnp.argsort(expert_R, stable=True)
        rows_RD = jnp.take(recv_NXD.reshape(N * X, D), order_R, axis=0)
        out_RD = _expert_rows(rows_RD, recv_counts_NE.sum(0), expert_R[order_R], w, activation, reduce)
        out_NXD = jnp.take(out_RD, _inverse(order_R), axis=0).reshape(N, X, D)
        back_NXD = jax.lax.all_to_all(out_NXD, expert, 0, 0, tiled=True)  # block j: my pairs, from device j
        device_X = sorted_experts_X // El
        out_XD = jnp.take(back_NXD.reshape(N * X, D), device_X * X + p_X - start_N[device_X], axis=0)
        out_MAD = jnp.take(out_XD, _inverse(order_X), axis=0).reshape(M, A, D)
        return jnp.einsum("MAD,MA->MD", out_MAD, weights_MA.astype(x_MD.dtype))

    rows = _spec(tokens, None)
    return jax.shard_map(local, in_specs=(rows, rows, rows, _kernel_specs(w, plan)), out_specs=rows)(
        x_MD, weights_MA, experts_MA, w
    )


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
        causal: the layer is in a causal stack (a decoder): a capacity serves tokens in order, each
            token's k choices together, so no token's routing depends on a later token; False (an
            encoder's layer): GShard's order, every first choice before any second (`dispatch_capacity`).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, causal: bool = True, rngs: nnx.Rngs):
        self.cfg = cfg
        self.causal = causal
        moe = cfg.moe
        E, D, Fw = moe.num_experts, cfg.d_model, moe.expert_d_ff or cfg.d_ff
        self.gated = cfg.activation in F.GATED_ACTIVATIONS
        # Switch's router initialisation: truncated normal of variance 0.1 / D (small logits, near-uniform start).
        self.router = param(rngs, nnx.initializers.variance_scaling(0.1, "fan_in", "truncated_normal"), (D, E),
                            ("embed", None))  # fmt: skip
        if moe.router == "sigmoid_topk":  # the balance bias: zeros, moved by the train step, not the gradient
            zeros = nnx.with_partitioning(nnx.initializers.zeros, (None,), eager_sharding=False)
            self.router_bias = RouterBias(zeros(rngs.params(), (E,), jnp.float32))
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
        if moe.router == "sigmoid_topk":
            weights_BTA, experts_BTA, probs_BTE = route_sigmoid(
                logits_BTE, self.router_bias[...], k, num_groups=moe.num_groups,
                groups_per_token=moe.groups_per_token, normalize=moe.normalize_topk, scaling=moe.routed_scaling,
            )  # fmt: skip
        else:
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
                weights_BTA, experts_BTA, E, slots, live_BT, causal=self.causal
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
