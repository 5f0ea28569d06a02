"""The training step against formulas and invariants: schedules, losses, accumulation, determinism."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import config as C
from jaxformer.layers import check_batch_ids
from jaxformer.models import build_model
from jaxformer.state import init_state, learning_rate_schedule
from jaxformer.train import loss_chunk, make_steps


def run_config(**train):
    model = C.tiny("decoder_only", vocab_size=16, dropout_rate=0.1)
    return C.Config(model=model, data=C.DataConfig(max_len=8), train=C.TrainConfig(objective="lm", **train))


def lm_batch(seed=0, B=8, T=8, V=16, pad_from=None):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, V, (B, T + 1)).astype(np.int32)
    if pad_from is not None:
        tokens[:, pad_from:] = 0
    targets = tokens[:, 1:]
    return {"inputs": tokens[:, :-1], "targets": targets, "weights": (targets != 0).astype(np.float32)}


def test_noam_and_cosine_schedules_equal_their_formulas():
    D, w = 512, 4000
    noam = learning_rate_schedule(C.TrainConfig(schedule="noam", warmup_steps=w, learning_rate=1.0), D)
    for step in (0, 99, 3999, 4000, 20_000):
        t = step + 1  # the paper counts steps from 1
        np.testing.assert_allclose(noam(step), D**-0.5 * min(t**-0.5, t * w**-1.5), rtol=1e-6)
    cfg = C.TrainConfig(schedule="cosine", warmup_steps=100, learning_rate=3e-4, steps=1100)
    cosine = learning_rate_schedule(cfg, D)
    for step in (0, 50, 100, 600, 1100):
        want = 3e-4 * step / 100 if step < 100 else 3e-4 * 0.5 * (1 + np.cos(np.pi * (step - 100) / 1000))
        np.testing.assert_allclose(cosine(step), want, rtol=1e-5, atol=1e-12)


def test_pad_tokens_contribute_zero_loss_and_gradient():
    cfg = run_config()
    graphdef, state, optimizer = init_state(cfg)
    eval_step = jax.jit(make_steps(graphdef, cfg, optimizer)[1])  # one program for both batches
    batch = lm_batch(pad_from=5)
    garbage = dict(batch, targets=np.where(batch["weights"] > 0, batch["targets"], 7))
    garbage["weights"] = batch["weights"]
    a, b = eval_step(state, batch), eval_step(state, garbage)
    assert float(a["count"]) == 8 * 4
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-6)

    from flax import nnx

    from jaxformer.train import loss_sums

    @jax.jit  # one program for both batches
    def grads(params, batch):
        return jax.grad(lambda p: loss_sums(nnx.merge(graphdef, p), cfg.train, batch, None)[0])(params)

    g1, g2 = grads(state.params, batch), grads(state.params, garbage)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-7), g1, g2)


def test_gradient_accumulation_equals_one_big_batch():
    """k micro-batches of size b give the same update as one batch of k*b (no dropout: same maths)."""
    base = run_config(batch_size=8, clip_norm=0.0)
    base = dataclasses.replace(base, model=base.model.replace(dropout_rate=0.0))
    batch = lm_batch(pad_from=6)
    batch["weights"][:4, :3] = 0  # uneven token counts across micro-batches
    results = []
    for k in (1, 4):
        cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, grad_accum=k))
        graphdef, state, optimizer = init_state(cfg)
        step, _ = make_steps(graphdef, cfg, optimizer)
        new_state, metrics = jax.jit(step)(state, batch)
        results.append((new_state, metrics))
    (s1, m1), (s4, m4) = results
    np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), s1.params, s4.params)


def train_losses(cfg, batch, steps):
    graphdef, state, optimizer = init_state(cfg)
    step = jax.jit(make_steps(graphdef, cfg, optimizer)[0], donate_argnums=0)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(np.asarray(metrics["loss"]))
    return np.array(losses)


def test_overfit_one_batch():
    cfg = run_config(learning_rate=1e-2, warmup_steps=10, steps=250)  # cosine to 0 at step 250
    cfg = dataclasses.replace(cfg, model=cfg.model.replace(dropout_rate=0.0, d_model=32, d_ff=64))
    batch = lm_batch()
    batch["inputs"][:, 0] = np.arange(1, 9)  # distinct first tokens: every next token is determined
    losses = train_losses(cfg, batch, 250)
    assert losses[0] > 2.0 and losses[-1] < 0.05, (losses[0], losses[-1])


def test_same_seed_gives_bitwise_identical_losses():
    cfg = run_config(learning_rate=3e-3, warmup_steps=2)  # dropout 0.1: keys from (seed, step)
    a, b = train_losses(cfg, lm_batch(), 6), train_losses(cfg, lm_batch(), 6)
    np.testing.assert_array_equal(a, b)
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=1))
    assert not np.array_equal(a, train_losses(other, lm_batch(), 6))


def test_dropout_masks_depend_on_step_only():
    cfg = run_config()
    graphdef, state, optimizer = init_state(cfg)
    step = jax.jit(make_steps(graphdef, cfg, optimizer)[0])
    batch = lm_batch()
    _, m_a = step(state, batch)
    _, m_b = step(state, batch)
    _, m_c = step(state.replace(step=state.step + 1), batch)
    assert float(m_a["loss"]) == float(m_b["loss"]) != float(m_c["loss"])


def test_steps_need_no_host_callback_and_host_batches_are_checked():
    """Ids are checked on the host, so the compiled step has no callback (which would also keep it
    out of JAX's persistent compilation cache); a bad id is named with its key."""
    cfg = run_config()
    assert cfg.model.check_token_ids
    graphdef, state, optimizer = init_state(cfg)
    train_step, eval_step = make_steps(graphdef, cfg, optimizer)
    for fn in (train_step, eval_step):
        assert "callback" not in jax.jit(fn).lower(state, lm_batch()).as_text()
    batch = lm_batch()
    check_batch_ids(batch, cfg.model)
    batch["targets"] = batch["targets"].copy()  # a view of the inputs in lm_batch
    batch["targets"][3, 2] = 16
    with pytest.raises(ValueError, match=r"batch\['targets'\]: token id 16 at index \(3, 2\) is outside"):
        check_batch_ids(batch, cfg.model)
    check_batch_ids(batch, cfg.model.replace(check_token_ids=False))  # the documented way out


def test_weight_decay_skips_norms_and_biases():
    cfg = run_config(weight_decay=0.5, learning_rate=1.0, warmup_steps=0, schedule="constant", clip_norm=0.0)
    _graphdef, state, optimizer = init_state(cfg)
    zero_grads = jax.tree.map(jnp.zeros_like, state.params)
    updates, _ = optimizer.update(zero_grads, state.opt_state, state.params)
    for path, u in jax.tree_util.tree_leaves_with_path(updates):
        name = jax.tree_util.keystr(path)
        decayed = bool(np.any(np.asarray(u) != 0))
        assert decayed == ("bias" not in name and "scale" not in name), name


@pytest.mark.parametrize("objective, mode", [("seq2seq", "encoder_decoder"), ("mlm", "encoder_only")])
def test_objectives_train_steps(objective, mode):
    model = C.tiny(mode, vocab_size=260, max_len=32)
    cfg = C.Config(
        model=model,
        data=C.DataConfig(source="shakespeare" if objective == "mlm" else "en_de", max_len=32, max_examples=600),
        train=C.TrainConfig(objective=objective, batch_size=8, steps=3),
    )
    from jaxformer.data import build_dataset

    data = build_dataset(cfg)
    graphdef, state, optimizer = init_state(cfg)
    step = jax.jit(make_steps(graphdef, cfg, optimizer)[0])
    for i in range(3):
        state, metrics = step(state, data.train.get(i))
        assert np.isfinite(float(metrics["loss"]))
    assert int(state.step) == 3


def test_skip_mode_leaves_state_unchanged_on_a_non_finite_step_and_counts_it():
    cfg = run_config(on_nonfinite="skip")
    graphdef, state, optimizer = init_state(cfg)
    train_step = jax.jit(make_steps(graphdef, cfg, optimizer)[0])
    bad = lm_batch(seed=1)
    bad["weights"] = bad["weights"] * np.float32(np.nan)  # a NaN loss, and so NaN gradients
    skipped, m = train_step(state, bad)
    assert not np.isfinite(float(m["loss"])) and int(m["skipped_steps"]) == 1
    assert int(skipped.step) == 1, "the step counts (the data moves on)"
    jax.tree.map(np.testing.assert_array_equal, skipped.params, state.params)
    jax.tree.map(np.testing.assert_array_equal, skipped.opt_state.inner_state, state.opt_state.inner_state)
    # The next finite step is applied as if the skipped batch had never been seen.
    after, m = train_step(skipped, lm_batch(seed=2))
    assert np.isfinite(float(m["loss"])) and int(m["skipped_steps"]) == 1
    stop_cfg = run_config()
    g2, plain, opt2 = init_state(stop_cfg)
    want, _ = jax.jit(make_steps(g2, stop_cfg, opt2)[0])(plain.replace(step=plain.step + 1), lm_batch(seed=2))
    jax.tree.map(np.testing.assert_array_equal, after.params, want.params)


def test_on_nonfinite_is_validated_and_lists_its_choices():
    with pytest.raises(C.ConfigError, match=r"train\.on_nonfinite: 'maybe' is not one of the choices: 'stop', 'skip'"):
        C.TrainConfig(on_nonfinite="maybe")
    with pytest.raises(C.ConfigError, match=r"model\.mode: 'gpt' is not one of the choices: 'encoder_only'"):
        C.apply_overrides(C.load_experiment("experiments/copy_task.py"), ["model.mode=gpt"])


# ----------------------------------------------------------------------------- the chunked loss


def test_chunked_loss_equals_the_plain_loss_in_every_mode():
    """loss_sums chunked (3 positions of T = 7, the last chunk padded) against the plain loss: loss, NLL,
    correct count, token count and every parameter's gradient, with label smoothing, z-loss and zero
    weights; an untied head with a logits bias (lm), a tied scaled one (seq2seq), the masked-LM head
    chunked by "auto" under a tiny max_logits_mib (mlm)."""
    from flax import nnx

    from jaxformer.train import loss_sums

    @functools.partial(jax.jit, static_argnums=(2, 3, 4))  # one compile per mode for the two losses
    def both(params, batch, graphdef, *cfgs):
        grads = lambda cfg: jax.grad(lambda p: loss_sums(nnx.merge(graphdef, p), cfg, batch, None), has_aux=True)
        return [grads(cfg)(params) for cfg in cfgs]

    B, T, V = 3, 7, 37
    cases = {  # objective: (model, chunked train config's loss fields)
        "lm": (C.tiny("decoder_only", V, tie_output=False, logits_bias=True), {"loss_chunk": 9}),
        "seq2seq": (C.tiny("encoder_decoder", V, scale_tied_logits=True), {"loss_chunk": 9}),
        "mlm": (C.tiny("encoder_only", V, tie_output=False), {"max_logits_mib": B * 3 * V * 4 / 2**20}),
    }
    rng = np.random.default_rng(0)
    for objective, (model_cfg, chunking) in cases.items():
        model_cfg = model_cfg.replace(num_encoder_layers=min(model_cfg.num_encoder_layers, 1), num_decoder_layers=1)
        graphdef, params = nnx.split(build_model(model_cfg))
        batch = {k: rng.integers(1, V, (B, T)).astype(np.int32) for k in ("inputs", "targets", "src")}
        batch["weights"] = (rng.random((B, T)) < 0.7).astype(np.float32)
        plain = C.TrainConfig(objective=objective, label_smoothing=0.1, z_loss=1e-3, loss_chunk=0)
        chunked = dataclasses.replace(plain, **{"loss_chunk": "auto"} | chunking)
        assert loss_chunk(chunked, B, T, V) == 3 and loss_chunk(plain, B, T, V) is None

        (g_plain, s_plain), (g_chunked, s_chunked) = both(params, batch, graphdef, plain, chunked)
        for k in ("loss", "nll", "correct", "count"):
            np.testing.assert_allclose(s_chunked[k], s_plain[k], rtol=1e-6, err_msg=f"{objective}: {k}")
        scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(g_plain))
        for (path, got), want in zip(
            jax.tree_util.tree_leaves_with_path(g_chunked), jax.tree.leaves(g_plain), strict=True
        ):
            np.testing.assert_allclose(got, want, atol=1e-6 * scale, rtol=1e-6, err_msg=f"{objective}: {path}")


def test_loss_chunk_sizes_and_validation():
    """loss_chunk "auto" chunks only logits above max_logits_mib, into equal chunks whose logits fit in it,
    both counted on one device; a token count is a device's rows times positions; 0 never chunks; bad
    values name their field."""
    auto = C.TrainConfig()
    assert loss_chunk(auto, 8, 128, 8000) is None  # 31 MiB of logits: the plain loss
    assert loss_chunk(auto, 64, 1024, 50257, shards=(64, 1)) is None  # 196 MiB a device over 64 batch shards
    # one 8k row of GPT-2's 50304 classes: 1.65 GB of logits whole, 0.21 GB a device over a context axis
    # of 8 (the plain loss, as the long-context guide's plan says); over 4, 0.41 GB: chunks of 1024
    # positions a device (2 chunks), 4 x 1024 of the split length
    assert loss_chunk(auto, 1, 8192, 50304, length_ways=8) is None
    assert loss_chunk(auto, 1, 8192, 50304) == 1171 and loss_chunk(auto, 1, 8192, 50304, length_ways=4) == 4 * 1024
    assert loss_chunk(C.TrainConfig(loss_chunk=8), 8, 16, 50, shards=(2, 1), length_ways=4) == 8  # 2 a device
    for B, T, V, (rows, cols) in (
        (8, 1024, 50257, (1, 1)),
        (1, 32768, 128256, (1, 1)),
        (64, 2048, 32000, (8, 2)),  # a device holds 8 rows of 16000 columns
    ):
        c = loss_chunk(auto, B, T, V, shards=(rows, cols))
        n = -(-T // c)
        assert (B // rows) * c * (V // cols) * 4 <= auto.max_logits_mib * 2**20, (B, T, V, c)
        assert (B // rows) * 2 * c * (V // cols) * 4 > auto.max_logits_mib * 2**20, "chunks no smaller than needed"
        assert (n - 1) * c < T <= n * c and n * c - T < n, "equal chunks: under a position of padding each"
    assert loss_chunk(C.TrainConfig(loss_chunk=0), 64, 2048, 32000) is None
    assert loss_chunk(C.TrainConfig(loss_chunk=4096), 8, 1024, 50) == 512
    assert loss_chunk(C.TrainConfig(loss_chunk=4096), 64, 1024, 50, shards=(8, 1)) == 512  # tokens a device
    assert loss_chunk(C.TrainConfig(loss_chunk=5), 8, 16, 50) == 1  # fewer tokens than rows: a position each
    assert loss_chunk(C.TrainConfig(loss_chunk=8 * 16), 8, 16, 50) is None  # one chunk: the plain loss
    overrides = ["train.loss_chunk=4096", "train.max_logits_mib=64"]
    cfg = C.apply_overrides(C.load_experiment("experiments/copy_task.py"), overrides)
    assert (cfg.train.loss_chunk, cfg.train.max_logits_mib) == (4096, 64.0)
    assert C.apply_overrides(cfg, ["train.loss_chunk=auto"]).train.loss_chunk == "auto"
    for field, value in (("loss_chunk", -1), ("loss_chunk", "big"), ("loss_chunk", 1.5), ("max_logits_mib", 0)):
        with pytest.raises(C.ConfigError, match=rf"train\.{field}: "):
            C.TrainConfig(**{field: value})


def test_host_offload_options_train_exactly_as_without_them():
    """remat "offload_dots" / "offload_inputs" and train.offload_optimizer change where values wait
    between uses, never a value: three steps give the same losses and parameters as the on-device
    policies they stand for ("dots_saveable", "full"). With offload_optimizer the optimizer state lives
    in pinned host memory between steps. (CPU moves no bytes; tests/test_tpu.py shows the TPU compiler's.)"""
    from jaxformer import sharding
    from jaxformer.train import jit_steps

    def run(remat, offload_optimizer=False):
        model = C.tiny("decoder_only", vocab_size=16, scan_layers=True, remat=remat)
        train = C.TrainConfig(objective="lm", batch_size=8, offload_optimizer=offload_optimizer)
        cfg = C.Config(model=model, data=C.DataConfig(max_len=8), train=train)
        mesh = sharding.make_mesh(cfg.mesh)
        with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
            graphdef, state, optimizer = init_state(cfg, mesh)
            step, _ = jit_steps(*make_steps(graphdef, cfg, optimizer), state, mesh)
            # "never a value", to the bit, for XLA:CPU as it compiles by default: its fusion emitters, not the
            # suite's quicker-compiling elemental ones (tests/conftest.py), which round the two policies apart
            step = step.lower(state, lm_batch(seed=0)).compile({"xla_cpu_use_fusion_emitters": True})
            losses = []
            for i in range(3):
                state, metrics = step(state, lm_batch(seed=i))
                losses.append(float(metrics["loss"]))
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)}
        return losses, jax.tree.map(np.asarray, state.params), kinds

    for offloaded, on_device in [(("offload_dots",), ("dots_saveable",)), (("offload_inputs", True), ("full",))]:
        (losses, params, kinds), (ref_losses, ref_params, ref_kinds) = run(*offloaded), run(*on_device)
        assert losses == ref_losses, offloaded
        jax.tree.map(np.testing.assert_array_equal, params, ref_params)
        assert ref_kinds == {"device"} and kinds == ({"pinned_host"} if offloaded[1:] else {"device"})
