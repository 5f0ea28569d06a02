"""Mixture of experts against NumPy transcriptions of the published equations, a naive per-token loop
over experts, and invariants: capacity with room for all == dropless, dropped tokens pass through the
residual, scanned == unrolled, training lowers the loss in each mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer import config as C
from jaxformer import moe
from jaxformer.checkpoint import check_compatible
from jaxformer.layers import Residual
from jaxformer.models import build_model, unrolled
from jaxformer.state import init_state
from jaxformer.train import make_steps


def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_routing_and_losses_equal_the_papers_equations():
    rng = np.random.default_rng(0)
    M, E = 12, 4
    logits = rng.normal(size=(M, E)).astype(np.float32)
    live = rng.random(M) > 0.25
    probs = np_softmax(logits.astype(np.float64))

    # Switch (Fedus et al. 2021): p = softmax(logits), one expert, gate = its probability;
    # aux = E * sum_e f_e P_e, f_e the fraction of tokens sent to e, P_e the mean probability.
    w, e, p = moe.route(jnp.asarray(logits), 1, "softmax_topk")
    np.testing.assert_array_equal(e[:, 0], probs.argmax(-1))
    np.testing.assert_allclose(w[:, 0], probs.max(-1), rtol=1e-6)
    f = np.array([(probs[live].argmax(-1) == i).mean() for i in range(E)])
    np.testing.assert_allclose(
        moe.load_balance_loss(p, e, jnp.asarray(live)), E * np.sum(f * probs[live].mean(0)), rtol=1e-5
    )

    # Mixtral (Jiang et al. 2024): the 2 largest logits, softmax over those two.
    w, e, p = moe.route(jnp.asarray(logits), 2, "topk_softmax")
    top2 = np.argsort(-logits, axis=-1)[:, :2]
    np.testing.assert_array_equal(e, top2)
    np.testing.assert_allclose(w, np_softmax(np.take_along_axis(logits, top2, -1).astype(np.float64)), rtol=1e-5)
    # top-k balance: each of a token's k choices counts (f sums to k, as in Mixtral's and MaxText's loss)
    f2 = np.array([(top2 == i).any(-1).mean() for i in range(E)])
    np.testing.assert_allclose(moe.load_balance_loss(p, e), E * np.sum(f2 * probs.mean(0)), rtol=1e-5)
    # observability: the tokens that chose each expert (every choice counts: they sum to k per token)
    # and the router's entropy, against a NumPy count on this fixed routing
    np.testing.assert_array_equal(
        moe.expert_load(e, E, jnp.asarray(live)), np.bincount(top2[live].ravel(), minlength=E)
    )
    entropy = -(probs * np.log(probs)).sum(-1)
    np.testing.assert_allclose(moe.router_entropy(p, jnp.asarray(live)), entropy[live].sum(), rtol=1e-5)
    # ST-MoE (Zoph et al. 2022): z-loss = mean over tokens of log(sum_e exp logits)^2
    log_z = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(
        moe.router_z_loss(jnp.asarray(logits), jnp.asarray(live)), np.mean(log_z[live] ** 2), rtol=1e-5
    )


def test_ties_route_to_the_lower_expert_and_the_aux_losses_have_their_finite_difference_gradients():
    # ties: top-k keeps the lower expert index first, as a stable sort of -logits does, in both orders
    logits = np.array([[1.0, 2.0, 2.0, 0.5], [0.0, 0.0, 0.0, 0.0], [3.0, -1.0, 3.0, 3.0]], np.float32)
    want = np.argsort(-logits, axis=-1, kind="stable")[:, :2]
    route = jax.jit(moe.route, static_argnums=(1, 2))
    for order in ("softmax_topk", "topk_softmax"):
        np.testing.assert_array_equal(route(jnp.asarray(logits), 2, order)[1], want)
    # the router losses' gradients w.r.t. the logits (through the softmax; the top-k choice is piecewise
    # constant, and these logits are apart by far more than eps) against central finite differences
    from jax.test_util import check_grads

    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(6, 4)) * 2, jnp.float32)
    live = jnp.asarray([1, 1, 0, 1, 1, 1], bool)

    def balance(logits_ME):
        _, experts_MA, probs_ME = moe.route(logits_ME, 2, "softmax_topk")
        return moe.load_balance_loss(probs_ME, experts_MA, live)

    for loss in (balance, lambda l: moe.router_z_loss(l, live)):
        check_grads(jax.jit(loss), (logits,), order=1, modes=("rev",), eps=1e-2, atol=2e-3, rtol=2e-3)


def naive_moe(x_MD, weights_MA, experts_MA, w, activation):
    """Every token through every expert, kept where the router chose it: sum_a w_a * FFN_{e_a}(x)."""
    E = w["wi"].shape[0]
    gates_ME = jnp.einsum("MA,MAE->ME", weights_MA, jax.nn.one_hot(experts_MA, E))
    out = 0.0
    for e in range(E):
        up = x_MD @ w["wi"][e] + w["wi_bias"][e][None]
        if "wi_gate" in w:
            h = moe._activate(activation, up, x_MD @ w["wi_gate"][e] + w["wi_gate_bias"][e][None])
        else:
            h = moe._activate(activation, up, None)
        out = out + gates_ME[:, e : e + 1] * (h @ w["wo"][e] + w["wo_bias"][e][None])
    return out


def random_experts(rng, E, D, Fw, gated):
    w = {"wi": rng.normal(size=(E, D, Fw)), "wo": rng.normal(size=(E, Fw, D)) / Fw**0.5}
    w |= {"wi_bias": rng.normal(size=(E, Fw)), "wo_bias": rng.normal(size=(E, D))}
    if gated:
        w |= {"wi_gate": rng.normal(size=(E, D, Fw)), "wi_gate_bias": rng.normal(size=(E, Fw))}
    return {k: jnp.asarray(v, jnp.float32) for k, v in w.items()}


def test_dropless_and_capacity_dispatch_equal_a_naive_loop(activation="swiglu"):
    """A gated activation with biases: every kernel of an expert (the ungated path is the models' below)."""
    rng = np.random.default_rng(1)
    B, T, D, Fw, E, k = 2, 6, 8, 16, 4, 2
    w = random_experts(rng, E, D, Fw, activation == "swiglu")
    x_BTD = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    route = jax.jit(moe.route, static_argnums=(1, 2))
    weights, experts, _ = route(jnp.asarray(rng.normal(size=(B, T, E)), jnp.float32), k, "topk_softmax")
    flat = lambda a: a.reshape(B * T, *a.shape[2:])

    @jax.jit
    def outputs(x_BTD, weights, w):  # one compile: dropless (sort + ragged_dot) and the naive loop, with
        # gradients w.r.t. the input, the router weights and the kernels; capacity with room for every pair
        dropless = lambda x, g, w: moe.moe_dropless(flat(x), flat(g), flat(experts), w, activation)
        naive = lambda x, g, w: naive_moe(flat(x), flat(g), flat(experts), w, activation)
        probe = jax.random.normal(jax.random.key(0), (B * T, D))
        grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * probe), argnums=(0, 1, 2))(x_BTD, weights, w)
                 for f in (dropless, naive)]  # fmt: skip
        dispatch, combine, dropped, assigned = moe.dispatch_capacity(weights, experts, E, T * k)  # P = T * k
        roomy = moe.moe_capacity(x_BTD, dispatch, combine, w, activation)
        return dropless(x_BTD, weights, w), naive(x_BTD, weights, w), grads, flat(roomy), dropped, assigned

    got, want, (grads, want_grads), roomy, dropped, assigned = outputs(x_BTD, weights, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), grads, want_grads)
    assert (float(dropped), float(assigned)) == (0.0, B * T * k)  # capacity with room for all == dropless
    np.testing.assert_allclose(roomy, want, rtol=1e-5, atol=1e-5)

    # two slots per expert: pairs past them are dropped. A causal stack serves tokens in order, a token's
    # k pairs together; a bidirectional one first choices first, then in token order (GShard)
    P = 2
    kept_by_order = {}
    order = {True: [(t, a) for t in range(T) for a in range(k)], False: [(t, a) for a in range(k) for t in range(T)]}
    for causal, pairs in order.items():
        kept = np.zeros((B, T, k), bool)
        for b in range(B):
            used = np.zeros(E, int)
            for t, a in pairs:
                e = int(experts[b, t, a])
                kept[b, t, a] = used[e] < P
                used[e] += 1
        kept_by_order[causal] = kept

    @jax.jit
    def tight(x_BTD, weights, w, kept_by_order):  # one compile: both orders, and the naive loop on the pairs kept
        out = {}
        for causal, kept in kept_by_order.items():
            dispatch, combine, dropped, assigned = moe.dispatch_capacity(weights, experts, E, P, causal=causal)
            kept_weights = jnp.where(kept, weights, 0.0)  # a dropped pair adds nothing
            got = moe.moe_capacity(x_BTD, dispatch, combine, w, activation)
            naive = naive_moe(flat(x_BTD), flat(kept_weights), flat(experts), w, activation)
            out[causal] = dropped, assigned, flat(got), naive
        return out

    for causal, (dropped, assigned, got, naive) in tight(x_BTD, weights, w, kept_by_order).items():
        kept = kept_by_order[causal]
        assert float(dropped) == (~kept).sum() > 0 and float(assigned) == B * T * k, causal
        np.testing.assert_allclose(got, naive, rtol=1e-5, atol=1e-5, err_msg=f"{causal=}")
    assert not np.array_equal(*kept_by_order.values())  # this routing tells the two orders apart


@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_experts_with_the_dense_ffns_weights_equal_the_dense_ffn(activation):
    """Every expert a copy of one dense `FeedForward` (biases too): the layer's output is g(x) * FFN(x),
    g the sum of the token's combine weights. Mixtral's router (softmax over the top k) makes g = 1, so
    the MoE layer equals the dense FFN, for top-1 and top-2. Switch's (top k of the full softmax, kept as
    they are) makes g = the chosen experts' probabilities, which sum to less than 1 (unless k = E): the
    layer equals the dense FFN scaled by them, with g read off a NumPy softmax of the router logits.
    Both dispatches: dropless, and capacity with room for every pair (P = T * k)."""
    from jaxformer.layers import FeedForward

    E, B, T = 4, 2, 6
    base = C.tiny("decoder_only", activation=activation, use_bias=True)
    dense = FeedForward(base, rngs=nnx.Rngs(0))
    for name in ("wi_bias", "wi_gate_bias", "wo_bias"):  # non-zero biases: they are copied too
        if hasattr(dense, name):
            b = getattr(dense, name)
            b[...] = jax.random.normal(jax.random.key(len(name)), b.shape)
    x_BTD = jax.random.normal(jax.random.key(1), (B, T, base.d_model))
    cases, layers = [], []
    for router in ("topk_softmax", "softmax_topk"):
        for k in (1, 2):
            for factor in (0.0, float(E)):  # dropless; capacity ceil(E * T * k / E) = T * k slots
                cfg = base.replace(moe=C.MoEConfig(num_experts=E, experts_per_token=k, router=router,
                                                   capacity_factor=factor))  # fmt: skip
                layer = moe.MoEFeedForward(cfg, rngs=nnx.Rngs(2))
                for name in ("wi", "wi_gate", "wo", "wi_bias", "wi_gate_bias", "wo_bias"):
                    if hasattr(dense, name):
                        kernel = getattr(dense, name)[...]
                        getattr(layer, name)[...] = jnp.asarray(np.broadcast_to(kernel, (E, *kernel.shape)))
                cases.append((router, k, factor))
                layers.append(layer)
    # one compile: the dense FFN and the 8 MoE layers
    want, outs = nnx.jit(lambda dense, layers: (dense(x_BTD), [layer(x_BTD) for layer in layers]))(dense, layers)
    want = np.asarray(want)
    for (router, k, factor), layer, (got, aux) in zip(cases, layers, outs, strict=True):
        assert float(aux["dropped"]) == 0 and float(aux["assigned"]) == B * T * k
        probs = np_softmax(np.einsum("BTD,DE->BTE", x_BTD, layer.router[...]).astype(np.float64))
        g = 1.0 if router == "topk_softmax" else np.sort(probs, -1)[..., -k:].sum(-1, keepdims=True)
        assert router == "topk_softmax" or (g < 1 - 1e-3).all()  # Switch's gates do not sum to 1 here
        np.testing.assert_allclose(got, g * want, rtol=0, atol=1e-6, err_msg=f"{router} k={k} {factor=}")


def test_dropped_tokens_pass_through_the_residual_and_padding_takes_no_slot():
    cfg = C.tiny("decoder_only", norm_position="pre", moe=C.MoEConfig(num_experts=2, experts_per_token=1,
                 capacity_factor=0.25, router_noise=0.1))  # fmt: skip
    layer, residual = moe.MoEFeedForward(cfg, rngs=nnx.Rngs(0)), Residual(cfg, rngs=nnx.Rngs(1))
    x_BTD = jax.random.normal(jax.random.key(0), (2, 8, cfg.d_model))
    live_BT = jnp.arange(8)[None, :] < jnp.array([[8], [3]])

    @nnx.jit
    def run(layer, residual, x_BTD):  # one compile
        # T=8, k=1, E=2, factor 0.25: one slot per expert and row, so at least 6 of 8 tokens of a row are dropped
        y_BTD, aux = residual(x_BTD, lambda h: layer(h), None, has_aux=True)
        _, experts, _ = moe.route(jnp.einsum("BTD,DE->BTE", residual.norm(x_BTD), layer.router[...]), 1)
        padded = layer(x_BTD, None, live_BT)[1]  # padding takes no slot and is not counted
        noisy = [layer(x_BTD, key)[0] for key in (None, jax.random.key(3))]  # router noise only when training
        return y_BTD, aux, experts, padded, noisy

    y_BTD, aux, experts, padded, (quiet, noisy) = run(layer, residual, x_BTD)
    served = np.zeros((2, 8), bool)
    for b in range(2):
        for e in range(2):
            first = np.flatnonzero(np.asarray(experts[b, :, 0]) == e)
            served[b, first[:1]] = True
    np.testing.assert_array_equal(np.asarray(y_BTD)[~served], np.asarray(x_BTD)[~served])  # unchanged
    assert not np.allclose(np.asarray(y_BTD)[served], np.asarray(x_BTD)[served])
    assert float(aux["dropped"]) == 16 - served.sum() and float(aux["assigned"]) == 16
    assert float(padded["assigned"]) == 11
    assert not np.allclose(quiet, noisy)


CAUSAL_DISPATCH = {  # tight: T=12, E=4 gives 3 slots per expert for k=1 (6 for k=2) and 2: pairs are dropped
    "capacity": dict(capacity_factor=1.0),
    "expert_capacity": dict(expert_capacity=2),
    "dropless": dict(),
}


@pytest.mark.parametrize("mode", ["decoder_only", "encoder_decoder"])
def test_no_position_sees_a_later_token_through_the_router(mode):
    """Causality through the experts: the tokens from position t on are replaced, and the logits at the
    positions before t must not move, for each router x k (1, 2) x dispatch (a capacity factor, a
    fixed expert capacity, dropless), with capacities tight enough that pairs are dropped (checked: a
    capacity that drops nothing could not leak). In the encoder-decoder the edited tokens are the
    decoder's (the targets) and the source is the same. Before the decoder's capacity served tokens
    in order, a later token's first choice took the slot of an earlier token's second choice: k = 2
    with a capacity moved earlier logits by up to 0.95 on these models. Every row is routed on its
    own, so the original and the edited rows go in one batch; the 12 models in one compile."""
    V, E, B, T, t = 16, 4, 4, 12, 6
    cases = [(r, k, d) for r in ("softmax_topk", "topk_softmax") for k in (1, 2) for d in CAUSAL_DISPATCH]
    depth = dict(num_encoder_layers=0 if mode == "decoder_only" else 1, num_decoder_layers=1)
    models = [
        build_model(C.tiny(mode, vocab_size=V, **depth, moe=C.MoEConfig(num_experts=E, experts_per_token=k, router=r,
                                                                         **CAUSAL_DISPATCH[d])), seed=i)
        for i, (r, k, d) in enumerate(cases)
    ]  # fmt: skip
    rng = np.random.default_rng(0)
    ids = rng.integers(2, V, (B, T)).astype(np.int32)
    edited = ids.copy()
    edited[:, t:] = (ids[:, t:] - 2 + rng.integers(1, V - 2, (B, T - t))) % (V - 2) + 2  # every later token differs
    rows = jnp.asarray(np.concatenate([ids, edited]))
    src = jnp.asarray(np.tile(rng.integers(2, V, (B, 7)).astype(np.int32), (2, 1)))  # the same source for both

    @nnx.jit
    def run(models, rows):
        out = []
        for m in models:
            with moe.collect() as reports:
                logits = m(rows) if mode == "decoder_only" else m(src, rows)
            out.append((logits, reports[-1]["dropped"].sum()))  # the decoder's report is the last
        return out

    leaks = {}
    for (router, k, dispatch), (logits, dropped) in zip(cases, run(models, rows), strict=True):
        name = f"{router} k={k} {dispatch}"
        assert (float(dropped) > 0) == (dispatch != "dropless"), name
        logits = np.asarray(logits)
        assert np.abs(logits[B:, t:] - logits[:B, t:]).max() > 0.1, name  # the edit reached the later ones
        leaks[name] = float(np.abs(logits[B:, :t] - logits[:B, :t]).max())
    assert not {name: diff for name, diff in leaks.items() if diff > 1e-6}  # float noise at most (measured: 0)
    if mode == "encoder_decoder":  # the encoder keeps GShard's order: first choices first
        assert not models[0].encoder.stack.layers[0].ffn.causal and models[0].decoder.stack.layers[0].ffn.causal


MODES = [  # (mode, objective, MoE and model choices): the three modes, scanned and unrolled, both dispatches
    ("decoder_only", "lm", dict(every=2, capacity_factor=1.5, router="topk_softmax"), dict(activation="swiglu")),
    ("encoder_only", "mlm", dict(shared_experts=1, router_noise=0.01), dict(scan_layers=True, remat="full")),
    ("encoder_decoder", "seq2seq", dict(capacity_factor=2.0), dict(scan_layers=True, norm_position="pre")),
]


def toy_batch(objective, B=4, T=8, V=16):
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, V, (B, T)).astype(np.int32)
    batch = {"inputs": tokens, "targets": tokens, "weights": np.ones((B, T), np.float32)}
    if objective == "lm":
        batch["inputs"] = np.concatenate([np.ones((B, 1), np.int32), tokens[:, :-1]], 1)
    if objective == "seq2seq":
        batch |= {"src": tokens[:, ::-1].copy(), "src_lengths": np.array([T, T, 5, 3], np.int32)}
        batch["inputs"] = np.concatenate([np.ones((B, 1), np.int32), tokens[:, :-1]], 1)
    return batch


@pytest.mark.parametrize("mode,objective,moe_kw,model_kw", MODES, ids=[m[0] for m in MODES])
def test_moe_model_trains_in_each_mode(mode, objective, moe_kw, model_kw):
    moe_cfg = C.MoEConfig(num_experts=4, experts_per_token=2, z_loss_weight=1e-3, aux_loss_weight=1e-2, **moe_kw)
    model = C.tiny(mode, vocab_size=16, moe=moe_cfg, **model_kw)
    cfg = C.Config(model=model, data=C.DataConfig(max_len=8), train=C.TrainConfig(
        objective=objective, batch_size=4, learning_rate=1e-2, warmup_steps=0, schedule="constant"))  # fmt: skip
    graphdef, state, optimizer = init_state(cfg)
    step, _ = make_steps(graphdef, cfg, optimizer)
    batch = toy_batch(objective)
    if objective == "seq2seq":  # both stacks scanned and unrolled: the same parameters give the same logits
        args = (batch["src"], batch["inputs"]) if objective == "seq2seq" else (batch["inputs"],)
        kw = {"lengths": batch["src_lengths"]} if objective == "seq2seq" else {}
        logits = jax.jit(
            lambda weights: [f(nnx.merge(graphdef, weights))(*args, **kw) for f in (lambda m: m, unrolled)]
        )
        np.testing.assert_allclose(*logits(state.weights), rtol=1e-5, atol=1e-5)
    step = jax.jit(step)
    losses = []
    for _ in range(5):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.3, losses
    # the loss is the cross-entropy plus the weighted router losses; the metrics say each
    want = metrics["nll"] + 1e-3 * metrics["router_z_loss"] + 1e-2 * metrics["load_balance_loss"]
    np.testing.assert_allclose(metrics["loss"], want, rtol=1e-6)
    assert metrics["load_balance_loss"] >= 2 - 1e-4  # k at best (perfect balance)
    assert metrics["router_z_loss"] > 0
    # each MoE layer's expert load: the share of its tokens that chose each expert, summing to k = 2
    layers = sum(moe_cfg.is_moe_layer(s, i) for s in model.stacks for i in range(getattr(model, f"num_{s}_layers")))
    loads = {key: float(v) for key, v in metrics.items() if key.startswith("expert_load/")}
    assert set(loads) == {f"expert_load/{l}/{e}" for l in range(layers) for e in range(4)}
    for l in range(layers):
        assert sum(loads[f"expert_load/{l}/{e}"] for e in range(4)) == pytest.approx(2.0, abs=1e-5)
    assert 0 < float(metrics["router_entropy"]) <= np.log(4) + 1e-6
    dropped = float(metrics["dropped_fraction"])
    assert dropped == 0.0 if not moe_cfg.capacity_factor else 0.0 <= dropped < 1.0


SCANNED = [  # (mode, objective, MoE and model choices): MoE every other layer, scanned in blocks of 2 layers
    ("decoder_only", "lm", dict(capacity_factor=1.5, router="topk_softmax"), dict(activation="swiglu")),
    ("encoder_only", "mlm", dict(shared_experts=1), dict()),  # remat "auto": dots_saveable when scanned
    ("encoder_decoder", "seq2seq", dict(capacity_factor=2.0), dict(norm_position="pre", remat="full")),
]


def test_scanned_blocks_of_every_layers_equal_unrolled(tmp_path):
    """model.moe.every=2 with scan_layers: a stack scans blocks of 2 layers (a dense layer, then an MoE one;
    4 layers, 2 blocks, in the decoder-only model, one block in the other modes' stacks).
    Against the unrolled stack built from the same seed (without remat): the same parameters layer by
    layer (each block position stacked over blocks), logits, loss (router losses included) and gradients;
    the MoE statistics in the unrolled layers' order; LoRA adapters on attention keyed as the unrolled
    layers'; a checkpoint of the scanned state restores exactly."""
    from jaxformer import lora
    from jaxformer.checkpoint import Checkpointer
    from jaxformer.models import build_model
    from jaxformer.state import make_optimizer, start_state
    from jaxformer.train import loss_sums

    flat = lambda tree: {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(tree)}
    models = {}
    for mode, objective, moe_kw, model_kw in SCANNED:
        moe_cfg = C.MoEConfig(num_experts=4, experts_per_token=2, every=2, z_loss_weight=1e-3, aux_loss_weight=1e-2,
                              **moe_kw)  # fmt: skip
        L = 4 if mode == "decoder_only" else 2
        depth = dict(num_encoder_layers=0 if mode == "decoder_only" else L,
                     num_decoder_layers=0 if mode == "encoder_only" else L)  # fmt: skip
        model_cfg = C.tiny(mode, vocab_size=16, moe=moe_cfg, scan_layers=True, **depth, **model_kw)
        train_cfg = C.TrainConfig(objective=objective, batch_size=4)
        scanned = build_model(model_cfg, seed=1)
        plain = build_model(model_cfg.replace(scan_layers=False, remat="none"), seed=1)
        stack = (scanned.decoder if mode != "encoder_only" else scanned.encoder).stack
        assert len(stack.layers) == 2 and stack.layers[0].ffn.wi.shape == (L // 2, 16, 32)  # position 0: dense
        assert stack.layers[1].ffn.wi.shape == (L // 2, 4, 16, 32)  # position 1: MoE [blocks, E, D, F]
        want = flat(nnx.state(plain, nnx.Param))
        got = flat(nnx.state(unrolled(scanned), nnx.Param))
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want), mode
        batch = toy_batch(objective)
        args = (batch["src"], batch["inputs"]) if objective == "seq2seq" else (batch["inputs"],)

        def run(model, batch=batch, args=args, train_cfg=train_cfg):  # the loss as training takes it and more
            def mean_loss(model):
                loss, sums = loss_sums(model, train_cfg, batch, None)
                return loss / sums["count"], sums

            (loss, sums), grads = nnx.value_and_grad(mean_loss, has_aux=True)(model)
            return loss, sums, grads, model(*args)

        (loss, sums, grads, logits), (want_loss, want_sums, want_grads, want_logits) = nnx.jit(
            lambda a, b: (run(a), run(b))
        )(scanned, plain)  # one compile
        np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5, err_msg=mode)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6, err_msg=mode)
        assert sums["moe_load"].shape == (L if mode == "encoder_decoder" else L // 2, 4)  # [MoE layers, E]
        models[mode] = scanned, plain
        np.testing.assert_array_equal(sums["moe_load"], want_sums["moe_load"], err_msg=mode)
        got = flat(nnx.state(unrolled(nnx.merge(nnx.graphdef(scanned), grads)), nnx.Param))
        for k, g in flat(want_grads).items():
            np.testing.assert_allclose(got[k], g, rtol=1e-5, atol=1e-6, err_msg=f"{mode} {k}")
    # LoRA on the attention of the decoder-only model's 2 blocks: adapters drawn as the unrolled layers' are
    adapters = lambda m: flat(nnx.state(lora.add_adapters(m, C.LoRAConfig(rank=2, targets=("q", "v"))), nnx.LoRAParam))
    got, want = (adapters(m) for m in models["decoder_only"])
    assert len(got) == len(want) // 2  # a, b of q and v per block position, against per layer
    for path, a in got.items():
        at = path.index("layers")
        for b in range(a.shape[0]):  # (..., "layers", j, ...) holds layer 2 b + j
            np.testing.assert_array_equal(a[b], want[(*path[: at + 1], 2 * b + path[at + 1], *path[at + 2 :])])
    # a checkpoint of the (encoder-decoder's) scanned state, stacks per block position, restores exactly
    cfg = C.Config(model=model_cfg, data=C.DataConfig(max_len=8), train=train_cfg)
    state = start_state(cfg, nnx.state(scanned, nnx.Param), make_optimizer(train_cfg, model_cfg.d_model))
    ckpt = Checkpointer(tmp_path, cfg)
    ckpt.save(state)
    ckpt.wait()
    restored = ckpt.restore_latest(jax.tree.map(jnp.zeros_like, state))
    ckpt.close()
    jax.tree.map(np.testing.assert_array_equal, restored, state)


def test_each_stack_its_own_layout_scanned_equals_unrolled():
    """model.moe.encoder_every=1 (every encoder layer MoE) beside decoder_every=2, decoder_offset=0 (decoder
    layer 0 MoE, the first of its block): the layers built are those `is_moe_layer` names, and scanned in
    blocks of lcm(1, 2) = 2 layers (two MoE layers in the encoder's block, the MoE one first in the
    decoder's) the loss and the MoE statistics (rows in the unrolled layers' order) equal unrolled."""
    from jaxformer.models import build_model
    from jaxformer.train import loss_sums

    moe_cfg = C.MoEConfig(num_experts=4, experts_per_token=2, every=2, encoder_every=1, decoder_offset=0)
    model_cfg = C.tiny("encoder_decoder", vocab_size=16, moe=moe_cfg, scan_layers=True, num_encoder_layers=2,
                       num_decoder_layers=2, remat="none")  # fmt: skip
    assert model_cfg.scan_block == 2
    assert [moe_cfg.is_moe_layer("encoder", i) for i in range(2)] == [True, True]
    assert [moe_cfg.is_moe_layer("decoder", i) for i in range(4)] == [True, False, True, False]  # i % 2 == 0
    scanned = build_model(model_cfg, seed=1)
    plain = build_model(model_cfg.replace(scan_layers=False), seed=1)
    routed = lambda stack: [hasattr(layer.ffn, "router") for layer in stack.stack.layers]
    assert routed(plain.encoder) == [True, True] and routed(plain.decoder) == [True, False]
    assert routed(scanned.decoder) == [True, False]  # block positions: the MoE one first
    train_cfg = C.TrainConfig(objective="seq2seq", batch_size=4)
    batch = toy_batch("seq2seq")
    run = lambda m: loss_sums(m, train_cfg, batch, None)
    (loss, sums), (want_loss, want_sums) = nnx.jit(lambda a, b: (run(a), run(b)))(scanned, plain)
    assert sums["moe_load"].shape == (3, 4)  # 2 encoder + 1 decoder MoE layers, 4 experts
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(sums["moe_load"], want_sums["moe_load"], rtol=1e-6)


def test_moe_config_errors_name_the_field():
    base = C.Config(model=C.tiny("decoder_only"), data=C.DataConfig(max_len=16))
    cases = {
        "model.moe.experts_per_token": ["model.moe.num_experts=4", "model.moe.experts_per_token=5"],
        "model.moe.every": [
            "model.moe.num_experts=4",
            "model.moe.every=2",
            "model.scan_layers=true",
            "model.num_decoder_layers=3",
        ],
        "model.moe.capacity_factor": ["model.moe.capacity_factor=-1"],
        "model.moe.router": ["model.moe.router=mixtral"],
        "model.moe.bogus": ["model.moe.bogus=1"],
        "lora.targets": ["model.moe.num_experts=4", "lora.rank=2", "lora.targets=q,wi"],
    }
    for field, overrides in cases.items():
        with pytest.raises(C.ConfigError, match=field.replace(".", r"\.")):
            C.apply_overrides(base, overrides)
    # a saved config (JSON) reads back with its moe section; an unknown key in it is named
    cfg = C.apply_overrides(base, ["model.moe.num_experts=4", "model.moe.capacity_factor=1.25"])
    assert C.from_dict(cfg.to_dict()) == cfg
    bad = cfg.to_dict()
    bad["model"]["moe"]["experts"] = 3
    with pytest.raises(C.ConfigError, match=r"model\.moe\.experts"):
        C.from_dict(bad)
    # resuming: routing choices may change, the experts' shapes may not
    check_compatible(cfg, C.apply_overrides(cfg, ["model.moe.capacity_factor=0", "model.moe.router_noise=0.1"]), "ckpt")
    with pytest.raises(C.ConfigError, match=r"model\.moe\.num_experts: checkpoint 4, config 8"):
        check_compatible(cfg, C.apply_overrides(cfg, ["model.moe.num_experts=8"]), "ckpt")


def test_flops_count_the_router_and_the_experts_a_token_uses():
    from jaxformer.train import flops_per_example

    dense = C.tiny("encoder_decoder", d_ff=32)
    with_moe = lambda **kw: dense.replace(moe=C.MoEConfig(**kw))
    T, S, L, D = 8, 6, 2, dense.d_model
    base = flops_per_example(dense, "seq2seq", S, T)
    # E experts, k of them per token, each as wide as the dense FFN: the router's 2·D·E and (k - 1) more FFNs
    for E, k, every in ((4, 1, 1), (8, 2, 1), (8, 2, 2)):
        moe_layers = L // every  # per stack
        router, ffn = 2 * D * E, 2 * D * 32 * 2
        extra = 3 * moe_layers * (S + T) * (router + (k - 1) * ffn)  # 3 x forward, encoder (S) and decoder (T)
        got = flops_per_example(with_moe(num_experts=E, experts_per_token=k, every=every), "seq2seq", S, T)
        assert got == base + extra


@pytest.mark.parametrize("mode", ["decoder_only", "encoder_decoder"])
def test_generation_with_moe_layers(mode):
    """Dropless MoE in every layer: greedy decoding with the KV cache gives the tokens and scores of
    recomputing the whole prefix at each step; sampling (decoder-only) and beam search (encoder-decoder)
    run and give valid tokens."""
    from jaxformer import decode
    from jaxformer.models import build_model

    V, BOS, EOS = 20, 1, 2
    moe_cfg = C.MoEConfig(num_experts=4, experts_per_token=2, router="topk_softmax")
    model = build_model(C.tiny(mode, vocab_size=V, max_len=32, moe=moe_cfg, activation="swiglu"), seed=1)
    rows = [[5, 9, 3], [7, 4, 11, 6, 8, 12, 3]]  # of different lengths

    def run(**settings):
        settings = C.DecodeConfig(max_new_tokens=6, extra_len=4, **settings)
        if mode == "decoder_only":
            return decode.generate(model, rows, settings, eos_id=EOS)
        return decode.translate(model, rows, settings, bos_id=BOS, eos_id=EOS)

    cached, recomputed = run(strategy="greedy"), run(strategy="greedy", use_cache=False)
    np.testing.assert_array_equal(cached.tokens, recomputed.tokens)
    np.testing.assert_allclose(cached.scores, recomputed.scores, atol=1e-5)
    # one search more per mode (the compiles are this test's cost): sampling for the LM, beam search for translation
    out, n = (
        (run(strategy="sample", top_k=5, seed=3), 1)
        if mode == "decoder_only"
        else (run(strategy="beam", beam_size=3, num_return=2), 2)
    )
    assert out.tokens.shape[:2] == (2, n) and ((out.tokens >= 0) & (out.tokens < V)).all()
    assert np.isfinite(out.scores).all()
    assert not np.array_equal(cached.tokens[0], cached.tokens[1])


def test_plot_draws_expert_load_when_the_run_has_moe(tmp_path):
    """`jaxformer plot` adds a row of expert-load panels (one per MoE layer) under the curves."""
    import json
    import struct

    from jaxformer.observe import plot_run

    rows = []
    for step in (0, 10, 20):
        loads = {f"expert_load/{l}/{e}": (0.5 + 0.1 * (e - 1.5) * step / 20) for l in range(2) for e in range(4)}
        rows.append({"step": step, "split": "train", "loss": 3.0 - 0.05 * step, "learning_rate": 1e-3, **loads})
    rows.append({"step": 20, "split": "eval", "loss": 2.2, "accuracy": 0.3})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sizes = {}
    for name, keep in (("moe", lambda k: True), ("dense", lambda k: not k.startswith("expert_load/"))):
        workdir = tmp_path / name
        workdir.mkdir()
        (workdir / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if keep(k)}) + "\n"
                                                       for r in rows))  # fmt: skip
        png = plot_run(workdir).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        sizes[name] = struct.unpack(">II", png[16:24])  # the IHDR chunk: width, height
    assert sizes["moe"][0] == sizes["dense"][0] and sizes["moe"][1] == 2 * sizes["dense"][1]  # a second row
