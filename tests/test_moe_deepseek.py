"""DeepSeek-V3's mixture of experts (sigmoid routing with a balance bias, group-limited top-k,
aux-loss-free balancing, first-k dense layers) and multi-token prediction, against a NumPy
transcription of Hugging Face's `DeepseekV3TopkRouter` (transformers 4.57), the paper's update
rule on counted loads, and a hand-written loop over the MTP modules' parts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer import config as C
from jaxformer import functional as F
from jaxformer import moe
from jaxformer.checkpoint import Checkpointer, check_compatible
from jaxformer.models import build_model, unrolled
from jaxformer.state import init_state
from jaxformer.train import loss_sums, make_steps


def hf_topk_router(logits, bias, k, n_group, topk_group, norm_topk_prob, scaling):
    """DeepseekV3TopkRouter.forward after its linear layer, line by line in NumPy (float64)."""
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    choice = scores + bias[None, :]
    M, E = choice.shape
    group_scores = np.sort(choice.reshape(M, n_group, E // n_group), axis=-1)[..., -2:].sum(-1)
    group_idx = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
    group_mask = np.zeros_like(group_scores)
    np.put_along_axis(group_mask, group_idx, 1, axis=1)
    score_mask = np.repeat(group_mask, E // n_group, axis=-1).astype(bool)
    choice = np.where(score_mask, choice, 0.0)  # masked_fill(~score_mask, 0.0)
    idx = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, idx, axis=-1)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * scaling, idx


@pytest.mark.parametrize(
    "E, k, groups, per_token, normalize, scaling",
    [(8, 2, 1, 1, True, 1.0), (16, 4, 4, 2, True, 2.5), (12, 3, 3, 1, False, 1.5)],
)
def test_sigmoid_router_equals_hugging_faces(E, k, groups, per_token, normalize, scaling):
    rng = np.random.default_rng(E + k)
    logits = rng.normal(size=(64, E)).astype(np.float32)
    # a bias large enough to change choices, negative ones included (a masked group's 0.0 may then win)
    bias = (rng.normal(size=E) * 0.6).astype(np.float32)
    want_w, want_e = hf_topk_router(logits, bias.astype(np.float64), k, groups, per_token, normalize, scaling)
    w, e, p = moe.route_sigmoid(jnp.asarray(logits), jnp.asarray(bias), k, num_groups=groups,
                                groups_per_token=per_token, normalize=normalize, scaling=scaling)  # fmt: skip
    order = np.argsort(np.asarray(e), axis=-1)  # the sets, whatever the order within a token
    want_order = np.argsort(want_e, axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(e), order, -1), np.sort(want_e, -1))
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(w), order, -1), np.take_along_axis(want_w, want_order, -1), rtol=1e-5
    )
    np.testing.assert_allclose(np.asarray(p).sum(-1), 1.0, rtol=1e-5)
    if groups > 1:  # the groups matter here: some token's choice differs from a plain top-k's
        _, plain = hf_topk_router(logits, bias.astype(np.float64), k, 1, 1, normalize, scaling)
        assert (np.sort(plain, -1) != np.sort(want_e, -1)).any()


def test_balance_rule_moves_each_bias_towards_the_mean_load():
    bias = jnp.asarray([[0.0, 0.5, -0.5, 0.0]])
    load = jnp.asarray([[3.0, 1.0, 2.0, 2.0]])  # mean 2
    np.testing.assert_allclose(moe.balance_biases(bias, load, 0.1), [[-0.1, 0.6, -0.5, 0.0]], rtol=1e-6)


def deepseek_model(**kw):
    """A small DeepSeek-style decoder: sigmoid routing in groups, a shared expert, a dense first layer."""
    moe_kw = dict(num_experts=8, experts_per_token=2, router="sigmoid_topk", num_groups=4, groups_per_token=2,
                  routed_scaling=2.5, shared_experts=1, expert_d_ff=8, first_dense=1) | kw.pop("moe", {})  # fmt: skip
    base = dict(mode="decoder_only", vocab_size=32, d_model=16, num_heads=2, d_ff=32, num_decoder_layers=3, max_len=16,
                dropout_rate=0.0, activation="swiglu", norm="rmsnorm", norm_position="pre", position="rope",
                use_bias=False, moe=C.MoEConfig(**moe_kw))  # fmt: skip
    return C.ModelConfig(**(base | kw))


@pytest.mark.parametrize("every, layers", [(1, 3), (2, 5)])
def test_first_dense_layers_are_dense_and_scanned_equals_unrolled(every, layers):
    cfg = deepseek_model(num_decoder_layers=layers, scan_layers=True, moe={"every": every})
    model = build_model(cfg, seed=1)
    flat = unrolled(model)
    ffns = [type(layer.ffn).__name__ for layer in flat.decoder.stack.layers]
    assert ffns == ["FeedForward" if i == 0 or i % every != every - 1 else "MoEFeedForward" for i in range(layers)]
    assert flat.decoder.stack.layers[0].ffn.wi.shape == (16, 32)  # model.d_ff, not the experts' width
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 7)))

    @jax.jit
    def run(ids):  # logits and expert loads of both forms, one compile
        out = []
        for m in (model, flat):
            with moe.collect() as reports:
                out.append((m(ids), moe.totals(reports)[0]["load"]))
        return out

    (scanned, scanned_load), (want, want_load) = run(ids)
    np.testing.assert_allclose(scanned, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(scanned_load, want_load)


def lm_config(model, **train):
    return C.Config(model=model, data=C.DataConfig(max_len=8), train=C.TrainConfig(
        objective="lm", batch_size=4, learning_rate=1e-2, warmup_steps=0, schedule="constant", **train))  # fmt: skip


def lm_batch(seed=0, B=4, T=8):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 32, (B, T + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((B, T), np.float32)}


def router_biases(params):
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(params) if p[-1] == "router_bias"}


def test_a_step_moves_each_bias_by_the_rule_on_the_counted_loads_and_the_optimizer_never_does(tmp_path):
    """Two micro-batches, scanned layers after a dense one, weight decay on: the bias after one step is
    exactly rate * sign(mean load - load) of the loads counted here by a forward pass per micro-batch;
    a checkpoint of the state gives it back bitwise, and the next step from it is the same step."""
    rate = 0.125  # a power of two: the expected bias is exact in float32
    model = deepseek_model(num_decoder_layers=3, scan_layers=True, moe={"balance_rate": rate})
    cfg = lm_config(model, grad_accum=2, weight_decay=0.1)
    graphdef, state, optimizer = init_state(cfg)
    batch = lm_batch()
    loads = []
    for half in (slice(0, 2), slice(2, 4)):
        with moe.collect() as reports:
            nnx.merge(graphdef, state.params)(jnp.asarray(batch["inputs"][half]))
        loads.append(np.asarray(moe.totals(reports)[0]["load"]))
    load_LE = loads[0] + loads[1]  # [2 MoE layers, 8 experts]
    assert load_LE.sum() == 2 * 2 * 4 * 8  # k = 2 choices of 32 tokens, per layer
    step = jax.jit(make_steps(graphdef, cfg, optimizer)[0])  # one compile for the three steps below
    before = router_biases(state.params)
    state, metrics = step(state, batch)
    after = router_biases(state.params)
    (path,) = after  # one stacked bias [2 blocks, 8]: the scanned MoE layers 1 and 2
    want = rate * np.sign(load_LE.mean(-1, keepdims=True) - load_LE)
    np.testing.assert_array_equal(after[path] - before[path], want)
    assert np.abs(want).sum() > 0
    # the step's own loads are the ones counted: metrics expert_load/<layer>/<expert> = load / tokens
    np.testing.assert_allclose(metrics["expert_load/1/3"], load_LE[1, 3] / 32, rtol=1e-6)
    # the bias is state: saved, restored, and the next step from the restored state moves it alike
    saver = Checkpointer(tmp_path, cfg)
    saver.save(state)
    saver.wait()
    restored = Checkpointer(tmp_path, cfg, read_only=True).restore_latest(state)
    np.testing.assert_array_equal(router_biases(restored.params)[path], after[path])
    again, resumed = step(state, lm_batch(seed=1))[0], step(restored, lm_batch(seed=1))[0]
    np.testing.assert_array_equal(router_biases(again.params)[path], router_biases(resumed.params)[path])


@pytest.fixture(scope="module")
def mtp_model():
    """Depth 2 over a one-layer MoE decoder (the modules' layers MoE too, as in DeepSeek-V3)."""
    cfg = deepseek_model(num_decoder_layers=1, mtp_depth=2, moe={"first_dense": 0})
    return cfg, build_model(cfg, seed=3)


def naive_mtp_loss(model, inputs, targets, k_max):
    """The MTP loss by hand: module k on the truncated sequences, positions 0..T-1-k, from its parts."""
    h = model.hidden(inputs)
    T, total = inputs.shape[1], 0.0
    for k in range(1, k_max + 1):
        m, n = model.mtp[k - 1], T - k
        h = h[:, :n]
        e = model.decoder.embed(inputs[:, k:])  # rope: no positions in the embedding
        x = jnp.concatenate([m.enorm(e), m.hnorm(h)], -1) @ m.eh_proj[...]
        positions = jnp.broadcast_to(jnp.arange(n), (inputs.shape[0], n))
        h = m.stack.layers[0](x, mask=F.Mask(causal=True), positions_BT=positions)
        logits = model.head(m.final_norm(h)).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, -1)
        total += -jnp.take_along_axis(logp, targets[:, k:, None], -1).sum()
    return total / k_max


def test_mtp_loss_equals_a_hand_written_loop_and_weight_zero_leaves_the_main_loss_and_grads(mtp_model):
    cfg, model = mtp_model
    plain = build_model(cfg.replace(mtp_depth=0), seed=3)  # the same main parameters: the modules' keys come last
    batch = {k: jnp.asarray(v) for k, v in lm_batch(seed=4).items()}
    (graphdef, params), (plain_def, plain_params) = nnx.split(model, nnx.Param), nnx.split(plain, nnx.Param)

    def loss(graphdef, params, weight):
        return loss_sums(nnx.merge(graphdef, params), C.TrainConfig(objective="lm", mtp_weight=weight), batch, None)

    @jax.jit
    def run(params, plain_params):  # one compile for every quantity compared
        _, sums = loss(graphdef, params, 0.3)
        naive = naive_mtp_loss(nnx.merge(graphdef, params), batch["inputs"], batch["targets"], 2)
        grad = lambda g, p: jax.value_and_grad(lambda q: loss(g, q, 0.0)[0])(p)
        logits = [nnx.merge(g, p)(batch["inputs"]) for g, p in ((graphdef, params), (plain_def, plain_params))]
        return sums, naive, grad(graphdef, params), grad(plain_def, plain_params), logits

    sums, want, (loss0, g0), (loss_plain, g_plain), logits = run(params, plain_params)
    np.testing.assert_array_equal(*logits)  # generation's forward never runs the modules
    np.testing.assert_allclose(sums["mtp_loss"], want, rtol=1e-5)
    np.testing.assert_allclose(sums["mtp_nll"], want, rtol=1e-5)  # no smoothing: the loss is the NLL
    assert sums["moe_load"].shape == (3, 8)  # the decoder's MoE layer, then each module's
    np.testing.assert_allclose(sums["loss"], sums["nll"] + 0.3 * want, rtol=1e-5)  # + mtp_weight * the mean
    # weight 0: the main loss and its gradients, bitwise; the modules get no gradient
    assert float(loss0) == float(loss_plain)
    flat0 = {p: v[...] for p, v in nnx.to_flat_state(g0)}
    for path, g in nnx.to_flat_state(g_plain):
        np.testing.assert_array_equal(flat0[path], g[...])
    assert all(not np.asarray(v[...]).any() for p, v in nnx.to_flat_state(g0) if p[0] == "mtp")


def test_sigmoid_routing_in_each_dispatch_gives_the_same_layer():
    """A capacity with room for every pair (causal or GShard's order) equals dropless, with a nonzero bias."""
    x = jnp.asarray(np.random.default_rng(6).normal(size=(2, 6, 16)), jnp.float32)
    outs = []
    for capacity_factor, causal in ((0.0, True), (4.0, True), (4.0, False)):
        cfg = deepseek_model(moe={"capacity_factor": capacity_factor})
        layer = moe.MoEFeedForward(cfg, causal=causal, rngs=nnx.Rngs(params=7))
        layer.router_bias[...] = jnp.linspace(-0.3, 0.3, 8)
        y, aux = layer(x)
        assert float(aux["dropped"]) == 0
        outs.append(y)
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[2], outs[0], rtol=1e-5, atol=1e-6)


def test_resuming_may_change_the_routing_but_not_the_parameters_it_adds():
    cfg = lm_config(deepseek_model(moe={"balance_rate": 1e-3}))
    routing = ["model.moe.routed_scaling=1.0", "model.moe.num_groups=2", "model.moe.balance_rate=0"]
    check_compatible(cfg, C.apply_overrides(cfg, routing), "ckpt")
    softmax = ["model.moe.router=topk_softmax", "model.moe.routed_scaling=1.0", "model.moe.num_groups=1",
               "model.moe.groups_per_token=1", "model.moe.balance_rate=0"]  # fmt: skip
    for changes, message in (
        (softmax, r"model\.moe\.router: checkpoint 'sigmoid_topk', config 'softmax_topk or topk_softmax'"),
        (["model.moe.first_dense=0"], r"model\.moe\.first_dense: checkpoint 1, config 0"),
        (["model.mtp_depth=1"], r"model\.mtp_depth: checkpoint 0, config 1"),
    ):
        with pytest.raises(C.ConfigError, match=message):
            check_compatible(cfg, C.apply_overrides(cfg, changes), "ckpt")
