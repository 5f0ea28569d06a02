"""LoRA: adapters start as a no-op, only they train, merge folds them in, and the state holds no more
than they need (optimizer state of the adapters, the base in the compute dtype)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer import config as C
from jaxformer import lora
from jaxformer.checkpoint import Checkpointer, check_compatible
from jaxformer.decode import decodable
from jaxformer.models import Transformer
from jaxformer.plan import plan
from jaxformer.state import init_state
from jaxformer.train import loss_sums, make_steps

ALL = ("q", "k", "v", "o", "wi", "wo")
OBJECTIVE = {"decoder_only": "lm", "encoder_decoder": "seq2seq", "encoder_only": "mlm"}


def config(mode="decoder_only", rank=4, **model) -> C.Config:
    return C.Config(
        model=C.tiny(mode, **model),
        data=C.DataConfig(max_len=8),
        train=C.TrainConfig(objective=OBJECTIVE[mode], batch_size=4, learning_rate=1e-2, schedule="constant"),
        lora=C.LoRAConfig(rank=rank, targets=ALL),
    )


def logits(model, mode, ids):
    if mode == "encoder_only":
        return model(ids)
    return model(ids, ids) if mode == "encoder_decoder" else model(ids)


def batch(mode, B=4, T=8, seed=0):
    ids = jax.random.randint(jax.random.key(seed), (B, T), 2, 32)
    weights = jnp.ones((B, T), jnp.float32)
    if mode == "decoder_only":
        return {"inputs": ids, "targets": jnp.roll(ids, -1, 1), "weights": weights}
    if mode == "encoder_decoder":
        return {
            "src": ids,
            "src_lengths": jnp.full((B,), T),
            "inputs": ids,
            "targets": ids[:, ::-1],
            "weights": weights,
        }
    return {"inputs": ids, "targets": ids[:, ::-1], "weights": weights}


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("mode", ["decoder_only", "encoder_decoder", "encoder_only"])
def test_zero_initialised_adapters_give_exactly_the_base_models_logits(mode, scan):
    mcfg = C.tiny(mode, scan_layers=scan)
    base = Transformer(mcfg, rngs=nnx.Rngs(params=0))
    adapted = lora.add_adapters(Transformer(mcfg, rngs=nnx.Rngs(params=0)), C.LoRAConfig(rank=2, targets=ALL))
    # the base draws the same numbers with adapters added (they have a stream of their own)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(base, nnx.Param), nnx.state(adapted, lora.FROZEN))
    attentions = {"decoder_only": 2, "encoder_only": 2, "encoder_decoder": 6}[mode] // (2 if scan else 1)
    ffns = {"decoder_only": 2, "encoder_only": 2, "encoder_decoder": 4}[mode] // (2 if scan else 1)
    names = sorted(name for _, name, _ in lora.adapters(adapted))
    assert names == sorted(["q", "k", "v", "o"] * attentions + ["wi", "wo"] * ffns)
    ids = jax.random.randint(jax.random.key(1), (2, 8), 2, 32)
    np.testing.assert_array_equal(logits(adapted, mode, ids), logits(base, mode, ids))


def train(cfg, steps=3):
    """(graphdef, the state at step 0, the state after `steps` steps, their losses)."""
    graphdef, state, optimizer = init_state(cfg)
    step = jax.jit(make_steps(graphdef, cfg, optimizer)[0])
    start, losses = state, []
    for _ in range(steps):
        state, metrics = step(state, batch(cfg.model.mode))  # one batch, learnt
        losses.append(float(metrics["loss"]))
    return graphdef, start, state, losses


@pytest.mark.parametrize("mode", ["decoder_only", "encoder_decoder"])
def test_only_the_adapters_train_and_merge_gives_the_adapted_logits(mode):
    cfg = config(mode)
    graphdef, start, state, losses = train(cfg)
    assert losses[-1] < losses[0]
    jax.tree.map(np.testing.assert_array_equal, state.frozen, start.frozen)  # the base, bitwise unchanged
    b_leaves = [v[...] for path, v in nnx.to_flat_state(state.params) if path[-1] == "b"]
    assert b_leaves and all(bool(jnp.any(b != 0)) for b in b_leaves)
    adapted = nnx.merge(graphdef, state.weights)
    ids = batch(mode)["inputs"]
    expected = logits(adapted, mode, ids)
    merged = lora.merge(nnx.merge(graphdef, state.weights))
    assert not list(lora.adapters(merged)) and nnx.state(merged, nnx.LoRAParam) == nnx.State({})
    np.testing.assert_allclose(logits(merged, mode, ids), expected, atol=1e-5, rtol=1e-5)
    # the merged parameters are a plain model's: they load into one built without LoRA
    plain = nnx.merge(nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(0)), nnx.Param)[0], nnx.state(merged, nnx.Param))
    np.testing.assert_allclose(logits(plain, mode, ids), expected, atol=1e-5, rtol=1e-5)


def test_the_optimizer_state_covers_only_the_adapters_and_the_base_is_in_the_compute_dtype():
    cfg = config("decoder_only", dtype="bfloat16")
    _, state, _ = init_state(cfg)
    adapters = sum(x.size for x in jax.tree.leaves(state.params))
    total = sum(x.size for x in jax.tree.leaves(state.weights))
    D, F, L, V = 16, 32, 2, 32
    assert adapters == L * 4 * (4 * (D + D)) + L * 4 * ((D + F) + (F + D))  # rank 4: A [in, R] + B [R, out]
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(state.frozen)} == {jnp.dtype("bfloat16")}
    base = nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(0)), nnx.Param)
    assert total - adapters == sum(x.size for x in jax.tree.leaves(base))
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * adapters  # Adam's two moments, of the adapters alone
    assert total - adapters > V * D  # the embedding alone outweighs the adapters here: a frozen base


def test_scanned_equals_unrolled_with_lora_and_remat():
    _, _, unrolled_state, unrolled = train(config("encoder_decoder", scan_layers=False), steps=2)
    _, _, scanned_state, scanned = train(config("encoder_decoder", scan_layers=True, remat="full"), steps=2)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5)
    flat = dict(nnx.to_flat_state(unrolled_state.params))
    for path, var in nnx.to_flat_state(scanned_state.params):  # layer i of the stack is the unrolled layer i
        at = path.index("layers") + 1
        for i in range(var[...].shape[0]):
            np.testing.assert_allclose(var[...][i], flat[(*path[:at], i, *path[at:])][...], atol=1e-6)


def test_lora_dropout_acts_on_the_adapters_while_training_only():
    def grads(dropout, rng):
        cfg = dataclasses.replace(config(), lora=C.LoRAConfig(rank=4, targets=ALL, dropout=dropout))
        graphdef, state, _ = init_state(cfg)
        loss = lambda p, frozen: loss_sums(nnx.merge(graphdef, p, frozen), cfg.train, batch("decoder_only"), rng)[0]
        return jax.jit(jax.value_and_grad(loss))(state.params, state.frozen)  # one program, where op by op

    key = jax.random.key(3)
    (loss_on, g_on), (loss_eval, g_eval), (loss_off, g_off) = grads(0.5, key), grads(0.5, None), grads(0.0, key)
    assert float(loss_on) == float(loss_off)  # B = 0: the adapters add nothing, dropped or not
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), g_on, g_off))
    assert any(changed), "dropout on the adapters' input changes their gradients"
    jax.tree.map(np.testing.assert_array_equal, g_eval, g_off)  # no key (evaluation): no dropout
    assert float(loss_eval) == float(loss_off)


@pytest.mark.parametrize("rank", [4, 0])
def test_a_lora_run_resumed_from_its_checkpoint_equals_the_uninterrupted_run(tmp_path, rank):
    cfg = dataclasses.replace(
        config("decoder_only", rank=rank, dtype="bfloat16"), checkpoint=C.CheckpointConfig(async_save=False)
    )
    graphdef, state, optimizer = init_state(cfg)
    step = jax.jit(make_steps(graphdef, cfg, optimizer)[0])
    run = lambda s, steps: [s := step(s, batch("decoder_only", seed=i))[0] for i in steps][-1]
    uninterrupted = run(state, range(3))
    ckpt = Checkpointer(tmp_path, cfg)
    ckpt.save(run(state, range(1)))
    ckpt.wait()
    restored = ckpt.restore_latest(init_state(cfg)[1])
    ckpt.close()
    assert (restored.frozen is None) == (rank == 0)
    resumed = run(restored, range(1, 3))
    jax.tree.map(np.testing.assert_array_equal, resumed, uninterrupted)
    assert int(resumed.step) == 3


def test_resuming_with_another_adapter_layout_is_refused_naming_the_fields():
    lora_run, full = config(rank=4), config(rank=0)
    with pytest.raises(C.ConfigError, match=r"lora\.rank: checkpoint 4, config 0"):
        check_compatible(lora_run, full, "ckpt")
    with pytest.raises(C.ConfigError, match=r"lora\.targets: checkpoint \('q', 'k'"):
        check_compatible(lora_run, dataclasses.replace(lora_run, lora=C.LoRAConfig(rank=4, targets=("q",))), "ckpt")
    check_compatible(lora_run, dataclasses.replace(lora_run, lora=C.LoRAConfig(rank=4, targets=ALL, alpha=2.0)), "c")


def test_plan_reports_the_frozen_base_adapters_and_their_optimizer_state():
    model = dict(d_model=64, num_heads=4, d_ff=256, vocab_size=512, dtype="bfloat16")
    full_cfg = config(rank=0, **model)
    lora_cfg = dataclasses.replace(full_cfg, lora=C.LoRAConfig(rank=2, targets=("q", "v")))
    full, adapted = plan(full_cfg, largest=False), plan(lora_cfg, largest=False)
    base = sum(x.size for x in jax.tree.leaves(nnx.state(Transformer(full_cfg.model, rngs=nnx.Rngs(0)), nnx.Param)))
    adapters = 2 * 2 * 2 * (64 + 64)  # layers x (q, v) x rank x (in + out)
    assert full.frozen == 0 and full.parameters == 4 * base
    assert adapted.frozen == 2 * base  # bfloat16, no float32 master copy
    assert adapted.parameters == 4 * adapters
    assert adapted.optimizer_state < 0.01 * full.optimizer_state
    assert "frozen base" in adapted.table() and "frozen base" not in full.table()


def test_decoding_unrolls_a_scanned_adapted_model_with_its_adapters_folded_in():
    model = lora.add_adapters(
        Transformer(C.tiny("decoder_only", scan_layers=True), rngs=nnx.Rngs(0)), C.LoRAConfig(rank=2, targets=ALL)
    )
    for i, (_, _, adapter) in enumerate(lora.adapters(model)):
        adapter.b[...] = jax.random.normal(jax.random.key(i), adapter.b.shape)
    ids = jax.random.randint(jax.random.key(9), (2, 8), 2, 32)
    expected = model(ids)
    assert not np.allclose(expected, Transformer(C.tiny("decoder_only", scan_layers=True), rngs=nnx.Rngs(0))(ids))
    np.testing.assert_allclose(decodable(model)(ids), expected, atol=1e-5, rtol=1e-5)
    assert list(lora.adapters(model)), "the model itself keeps its adapters"


@pytest.mark.parametrize("mode, tied", [("decoder_only", False), ("encoder_decoder", True), ("encoder_only", False)])
def test_embedding_and_output_adapters_act_as_their_merged_kernels(mode, tied):
    """`embed` adapts the token embedding, looked up by id and, tied, as the output projection too;
    `head` an untied output kernel. Zero B is the base; random B gives the merged kernels' logits.

    Held to 1e-5 of the logits' largest size (~13 here): adapted and merged, each logit is a different sum
    of float32 products of that size, and how XLA:CPU rounds them depends on its emitters and the
    processor (1.4e-5 apart at a logit of 0.08 on an Intel Xeon, 1.7e-5 under the elemental emitters);
    a merge that drops the adapters' scale or transposes B moves them by 0.1 or more."""
    mcfg = C.tiny(mode, tie_output=tied)
    targets = ("embed", "q") if tied else ("embed", "head", "q")
    cfg = config(mode, rank=2, tie_output=tied)
    C.Config(model=mcfg, data=cfg.data, train=cfg.train, lora=C.LoRAConfig(rank=2, targets=targets))  # valid
    model = lora.add_adapters(Transformer(mcfg, rngs=nnx.Rngs(0)), C.LoRAConfig(rank=2, targets=targets))
    names = [name for _, name, _ in lora.adapters(model)]
    assert names.count("embedding") == 1 and names.count("kernel") == (0 if tied else 1)  # a shared embedding: one
    ids = jax.random.randint(jax.random.key(1), (2, 8), 2, 32)
    np.testing.assert_array_equal(logits(model, mode, ids), logits(Transformer(mcfg, rngs=nnx.Rngs(0)), mode, ids))
    for i, (_, _, adapter) in enumerate(lora.adapters(model)):
        adapter.b[...] = jax.random.normal(jax.random.key(i), adapter.b.shape)
    expected = logits(model, mode, ids)
    merged = lora.merge(nnx.clone(model))
    np.testing.assert_allclose(logits(merged, mode, ids), expected, atol=1e-5 * np.abs(expected).max(), rtol=0)
    assert not np.allclose(expected, logits(Transformer(mcfg, rngs=nnx.Rngs(0)), mode, ids))


def test_a_tied_output_is_adapted_through_the_embedding():
    with pytest.raises(C.ConfigError, match=r"lora.targets.*'head'.*tie_output.*'embed'"):
        C.Config(
            model=C.tiny("decoder_only", tie_output=True), data=C.DataConfig(max_len=8),
            lora=C.LoRAConfig(rank=2, targets=("head",)),
        )  # fmt: skip
