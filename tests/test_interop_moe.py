"""Mixtral and Switch Transformers checkpoints in and out, against transformers' PyTorch models.

CI has no torch: scripts/make_moe_golden.py (run by hand with torch and transformers) wrote tiny
random models as transformers saves them and transformers' logits on fixed inputs
(tests/golden/mixtral, tests/golden/switch). Here `load_hf` must give those logits, `save_hf` must
write back the same tensors and config fields, and one MoE layer of each imported model must equal
a NumPy transcription of its published routing read straight off the checkpoint's tensors. (The
other direction, transformers reading what `save_hf` writes: `make_moe_golden.py export` / `check`.)
"""

import dataclasses
import json
import pathlib

import jax
import numpy as np
import processes
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxformer.interop import hf
from jaxformer.models import Transformer

GOLDEN = pathlib.Path(__file__).parent / "golden"
FAMILIES = {"mixtral": "mixtral", "switch": "switch_transformers"}


@pytest.fixture(scope="module", autouse=True)
def sharded_load():
    """The 8-device sharded loads (tests/sharded_worker.py hf_moe), started first in a process of its
    own (the device count is fixed when JAX starts) so that it runs while the tests below do."""
    proc = processes.sharded_worker("hf_moe", GOLDEN)
    yield proc
    if proc.poll() is None:  # bounded: never leave a worker behind
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def imported():
    """Each golden model loaded by `load_hf` (unrolled), with its reference arrays."""
    return {name: (hf.load_hf(GOLDEN / name), np.load(GOLDEN / name / "logits.npz")) for name in FAMILIES}


def logits_of(model, ref):
    """The model's logits on the golden inputs, compiled (one program; op by op is many times slower)."""
    with jax.default_matmul_precision("highest"):
        if model.cfg.mode == "decoder_only":
            return np.asarray(nnx.jit(lambda m, ids: m(ids))(model, ref["input_ids"]))
        lengths = ref["attention_mask"].sum(1)
        run = nnx.jit(lambda m, src, tgt, lengths: m(src, tgt, lengths=lengths))
        return np.asarray(run(model, ref["input_ids"], ref["decoder_input_ids"], lengths))


def flat_params(model) -> dict:
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_stacks_hold_the_layers(scanned, unrolled, block: int) -> None:
    """Each parameter of the scanned model equals the unrolled model's: outside the stacks as it is,
    inside them stacked over the blocks ([L / block, ...]; with blocks of several layers the stack of
    position j holds layer block * b + j of block b)."""
    layers_of = flat_params(unrolled)
    for path, value in flat_params(scanned).items():
        if ".layers." not in path:
            np.testing.assert_array_equal(value, layers_of[path])
            continue
        head, tail = path.split(".layers.")
        j = 0
        if block > 1:
            j, tail = tail.split(".", 1)
        layers = [layers_of[f"{head}.layers.{block * b + int(j)}.{tail}"] for b in range(value.shape[0])]
        np.testing.assert_array_equal(value, np.stack(layers), err_msg=path)


def test_imported_models_give_transformers_logits(imported):
    """Mixtral (top-2 of 4, dropless) unrolled and scanned; Switch (top-1, layer 1 of each stack sparse,
    padded encoder rows) with expert_capacity 8 (nothing dropped) and 2 (tokens of both stacks dropped,
    where transformers and jaxformer both give an overflowing token no expert output)."""
    mixtral, ref = imported["mixtral"]
    assert mixtral.cfg.moe.router == "topk_softmax" and mixtral.cfg.moe.experts_per_token == 2
    np.testing.assert_allclose(logits_of(mixtral, ref), ref["logits"], atol=1e-5, rtol=0)
    # Scanned: stacks [L, E, ...] filled expert by expert hold the unrolled layers' parameters, stacked
    # (scanned == unrolled forward passes: test_models.py).
    assert_stacks_hold_the_layers(hf.load_hf(GOLDEN / "mixtral", scan_layers=True), mixtral, block=1)

    switch, ref = imported["switch"]
    moe = switch.cfg.moe
    assert (moe.every, moe.experts_per_token, moe.expert_capacity, moe.router) == (2, 1, 8, "softmax_topk")
    np.testing.assert_allclose(logits_of(switch, ref), ref["logits"], atol=1e-5, rtol=0)
    assert ref["dropped"].min() > 0  # the golden's dropping case drops tokens in both stacks
    capacity = int(ref["dropping_capacity"])
    dropping = hf.load_hf(GOLDEN / "switch", moe=dataclasses.replace(moe, expert_capacity=capacity))
    got = logits_of(dropping, ref)
    np.testing.assert_allclose(got, ref["logits_dropping"], atol=1e-5, rtol=0)
    assert np.abs(got - ref["logits"]).max() > 0.1  # the drops matter: a case that compares something
    # Scanned in blocks of 2 layers (a dense one, then the sparse one): transformers' logits, and the
    # same parameters as the unrolled load, each layer at its block and position
    scanned = hf.load_hf(GOLDEN / "switch", scan_layers=True)
    assert isinstance(scanned.encoder.stack.layers, nnx.List) and len(scanned.encoder.stack.layers) == 2
    np.testing.assert_allclose(logits_of(scanned, ref), ref["logits"], atol=1e-5, rtol=0)
    assert_stacks_hold_the_layers(scanned, switch, block=2)


def test_save_hf_writes_back_the_checkpoint(imported, tmp_path):
    """The same tensors (names, shapes, values exactly) and config fields as transformers wrote; the
    scanned Mixtral and Switch (in blocks of 2 layers) write the same tensors as the unrolled ones."""
    models = {name: model for name, (model, _) in imported.items()}
    models["mixtral_scanned"] = hf.load_hf(GOLDEN / "mixtral", scan_layers=True)
    models["switch_scanned"] = hf.load_hf(GOLDEN / "switch", scan_layers=True)
    for name, model in models.items():
        golden = GOLDEN / name.removesuffix("_scanned")
        out = hf.save_hf(model, tmp_path / name)
        theirs, ours = load_file(golden / hf.WEIGHTS), load_file(out / hf.WEIGHTS)
        assert sorted(ours) == sorted(theirs), name
        for tensor, value in theirs.items():
            np.testing.assert_array_equal(ours[tensor], value, err_msg=f"{name}: {tensor}")
        their_config = json.loads((golden / hf.CONFIG).read_text())
        our_config = json.loads((out / hf.CONFIG).read_text())
        assert our_config["model_type"] == FAMILIES[name.removesuffix("_scanned")]
        skip = ("transformers_version", "dtype", "torch_dtype",
                "router_aux_loss_coef" if not their_config.get("output_router_logits", True) else "")  # fmt: skip
        # (Mixtral without output_router_logits adds no load-balancing loss: save_hf writes its weight as 0.)
        differ = {k: (v, our_config[k]) for k, v in their_config.items()
                  if k in our_config and k not in skip and our_config[k] != v}  # fmt: skip
        assert not differ, f"{name}: {differ}"
        moe_keys = {"mixtral": ("num_local_experts", "num_experts_per_tok", "router_jitter_noise"),
                    "switch": ("num_experts", "expert_capacity", "num_sparse_encoder_layers",
                               "num_sparse_decoder_layers", "router_jitter_noise", "router_z_loss_coef")}  # fmt: skip
        assert all(k in our_config for k in moe_keys[name.removesuffix("_scanned")]), name
        assert hf.config_from_hf(our_config) == hf.config_from_hf(their_config)


def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_one_moe_layer_equals_the_published_routing(imported):
    """Layer 1's MoE feed-forward of each imported model on random inputs, against NumPy from the
    checkpoint's own tensors: Mixtral (Jiang et al. 2024): softmax over all E router logits, top-2,
    renormalised, sum of w_e * W2_e (silu(W1_e x) * W3_e x); Switch (Fedus et al. 2021): softmax,
    top-1, the expert's output times its probability, tokens past `expert_capacity` in row order get zeros."""
    rng = np.random.default_rng(0)
    B, T, D = 2, 8, 16
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    silu = lambda a: a / (1 + np.exp(-a))

    t = load_file(GOLDEN / "mixtral" / hf.WEIGHTS)
    m = "model.layers.1.block_sparse_moe"
    probs = np_softmax(np.einsum("BTD,ED->BTE", x.astype(np.float64), t[f"{m}.gate.weight"]))
    top = np.argsort(-probs, axis=-1)[..., :2]
    weights = np.take_along_axis(probs, top, -1)
    weights /= weights.sum(-1, keepdims=True)
    want = np.zeros((B, T, D))
    for b, s, a in np.ndindex(B, T, 2):
        w = {n: t[f"{m}.experts.{top[b, s, a]}.{n}.weight"].astype(np.float64) for n in ("w1", "w2", "w3")}
        want[b, s] += weights[b, s, a] * w["w2"] @ (silu(w["w1"] @ x[b, s]) * (w["w3"] @ x[b, s]))
    model = imported["mixtral"][0]
    with jax.default_matmul_precision("highest"):
        got, _ = nnx.jit(lambda layer, x: layer(x))(model.decoder.stack.layers[1].ffn, x)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)

    t = load_file(GOLDEN / "switch" / hf.WEIGHTS)
    m = "encoder.block.1.layer.1.mlp"
    capacity = 3
    probs = np_softmax(np.einsum("BTD,ED->BTE", x.astype(np.float64), t[f"{m}.router.classifier.weight"]))
    want, dropped = np.zeros((B, T, D)), 0
    for b in range(B):
        taken = np.zeros(probs.shape[-1], int)
        for s in range(T):
            e = probs[b, s].argmax()
            taken[e] += 1
            if taken[e] > capacity:
                dropped += 1
                continue
            wi, wo = (t[f"{m}.experts.expert_{e}.{n}.weight"].astype(np.float64) for n in ("wi", "wo"))
            want[b, s] = probs[b, s, e] * wo @ np.maximum(wi @ x[b, s], 0)
    assert dropped > 0
    model = imported["switch"][0]
    layer = model.encoder.stack.layers[1].ffn
    cfg, layer.cfg = layer.cfg, layer.cfg.replace(moe=dataclasses.replace(layer.cfg.moe, expert_capacity=capacity))
    try:
        with jax.default_matmul_precision("highest"):
            got, aux = nnx.jit(lambda layer, x: layer(x))(layer, x)
    finally:
        layer.cfg = cfg
    assert float(aux["dropped"]) == dropped
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def _golden_config(name: str) -> dict:
    return json.loads((GOLDEN / name / hf.CONFIG).read_text())


REFUSED = [  # (golden, config.json changes, the message naming the field)
    ("mixtral", {"num_experts_per_tok": 5}, r"num_experts_per_tok=5 must be in \[1, num_local_experts=4\]"),
    ("mixtral", {"num_local_experts": 0}, r"num_local_experts=0 must be a positive number of experts"),
    ("mixtral", {"router_jitter_noise": 0.1}, r"router_jitter_noise=0\.1 is not supported"),
    ("mixtral", {"sliding_window": 4}, r"sliding_window=4 \(< max_position_embeddings=32\) is not supported"),
    ("mixtral", {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ("switch", {"router_bias": True}, r"router_bias=True is not supported"),
    ("switch", {"router_dtype": "bfloat16"}, r"router_dtype='bfloat16' is not supported"),
    ("switch", {"expert_capacity": 0}, r"expert_capacity=0 must be a positive number of tokens"),
    ("switch", {"dense_act_fn": "silu"}, r"dense_act_fn='silu' is not supported"),
    ("switch", {"encoder_sparse_step": 1.5}, r"config.json: encoder_sparse_step=1\.5 must be a whole number of layers"),
    ("switch", {"decoder_sparse_step": "2"}, r"config.json: decoder_sparse_step='2' must be a whole number of layers"),
    ("switch", {"encoder_sparse_step": None, "num_sparse_encoder_layers": True},
     r"config.json: num_sparse_encoder_layers=True must be a whole number of layers"),
]  # fmt: skip


def test_what_jaxformer_cannot_express_is_refused_naming_the_field():
    for name, changes, message in REFUSED:
        with pytest.raises(hf.UnsupportedCheckpoint, match=message):
            hf.config_from_hf(_golden_config(name) | changes)
    # Out: a Mixtral-like model with capacity dropping has no family (Mixtral is dropless).
    cfg = hf.config_from_hf(_golden_config("mixtral"))
    with pytest.raises(hf.UnsupportedCheckpoint, match=r"mixtral: moe=MoEConfig\(.*capacity_factor=1\.25"):
        hf.family_of(cfg.replace(moe=dataclasses.replace(cfg.moe, capacity_factor=1.25)))
    # Switch's sparse layers every other one scan in blocks of 2: a stack of an odd depth cannot.
    odd = _golden_config("switch") | {
        "num_layers": 5,
        "num_decoder_layers": 5,
        "num_sparse_encoder_layers": 2,
        "num_sparse_decoder_layers": 2,
    }  # sparse layers 1 and 3 of 5
    message = r"config\.json: encoder_sparse_step=2 and decoder_sparse_step=2 make layers \[1, 3\] \(encoder\)"
    with pytest.raises(hf.UnsupportedCheckpoint, match=message + r".* blocks of 2 layers, and num_layers=5 is not"):
        hf.config_from_hf(odd, scan_layers=True)


def test_a_sharded_load_onto_an_expert_axis_equals_one_device(sharded_load):
    """Mixtral and Switch (unrolled and scanned) loaded straight onto fsdp=2 x expert=4: every parameter
    equal to a one-device load, the experts split by expert (and fsdp), Mixtral's logits transformers'."""
    out, err = processes.communicate(sharded_load, "tests/sharded_worker.py hf_moe")
    assert sharded_load.returncode == 0, err[-4000:]
    r = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert r["mixtral_logits_diff"] < 1e-5
    for name in ("mixtral", "mixtral_scanned", "switch", "switch_scanned"):
        assert r[name]["max_abs_diff"] == 0.0 and r[name]["devices"] == list(range(8)), name
    assert r["mixtral"]["specs"]["decoder.stack.layers.0.ffn.wi"] == "('expert', 'fsdp')"  # [E, D, F]
    assert r["mixtral_scanned"]["specs"]["decoder.stack.layers.ffn.wi"] == "(None, 'expert', 'fsdp', 'tensor')"
    assert r["switch"]["specs"]["encoder.stack.layers.1.ffn.wi"] == "('expert', 'fsdp', 'tensor')"  # sparse
    assert r["switch"]["specs"]["encoder.stack.layers.0.ffn.wi"] == "('fsdp', 'tensor')"  # dense [D, F]
    # scanned in blocks of 2: position 1 stacks the sparse layers [blocks, E, D, F], position 0 the dense ones
    assert r["switch_scanned"]["specs"]["encoder.stack.layers.1.ffn.wi"] == "(None, 'expert', 'fsdp', 'tensor')"
    assert r["switch_scanned"]["specs"]["encoder.stack.layers.0.ffn.wi"] == "(None, 'fsdp', 'tensor')"


def _transformers_sparse_layers(config: dict) -> tuple[set[int], set[int]]:
    """The sparse layers transformers builds for a config.json: the steps as its config class reads them
    (a saved step kept over the one computed from num_sparse_*), and the rule of its modeling code's
    SwitchTransformersStack, transcribed (it imports torch): `i % step == 1 or step == 1` when step > 0."""
    transformers = pytest.importorskip("transformers")
    c = transformers.SwitchTransformersConfig.from_dict(config)
    rule = lambda L, sparse_step: {
        i for i in range(L) if ((i % sparse_step == 1 or sparse_step == 1) if sparse_step > 0 else False)
    }
    return rule(c.num_layers, c.encoder_sparse_step), rule(c.num_decoder_layers, c.decoder_sparse_step)


def _our_sparse_layers(model) -> tuple[set[int], set[int]]:
    """The layers of each stack whose feed-forward has a router, read off the built model."""
    return tuple(
        {i for i, layer in enumerate(stack.stack.layers) if hasattr(layer.ffn, "router")}
        for stack in (model.encoder, model.decoder)
    )


LAYOUTS = [  # config.json changes: the step fields, or the counts transformers computes them from
    dict(num_layers=4, num_decoder_layers=4, encoder_sparse_step=1, decoder_sparse_step=2),  # all, every other
    dict(num_layers=6, num_decoder_layers=3, encoder_sparse_step=3, decoder_sparse_step=1),  # 1 and 4; all
    dict(num_layers=4, num_decoder_layers=4, encoder_sparse_step=0, decoder_sparse_step=5),  # none; layer 1
    dict(num_layers=4, num_decoder_layers=4, encoder_sparse_step=-2, decoder_sparse_step=0),  # none; none
    dict(num_layers=1, num_decoder_layers=1, encoder_sparse_step=2, decoder_sparse_step=1),  # none (one layer); all
    # no step fields: transformers computes num_layers // num_sparse, num_layers for 0 (which still makes layer 1
    # sparse), 0 when num_sparse exceeds the layers (none)
    dict(num_layers=6, num_decoder_layers=4, encoder_sparse_step=None, decoder_sparse_step=None,
         num_sparse_encoder_layers=0, num_sparse_decoder_layers=4),
    dict(num_layers=4, num_decoder_layers=4, encoder_sparse_step=None, decoder_sparse_step=None,
         num_sparse_encoder_layers=2, num_sparse_decoder_layers=5),
]  # fmt: skip


@pytest.mark.parametrize("changes", LAYOUTS, ids=lambda c: f"{c['encoder_sparse_step']},{c['decoder_sparse_step']}")
def test_switch_layouts_per_stack_are_the_layers_transformers_builds(changes):
    """A Switch config.json whose encoder and decoder are sparse at different steps (or nowhere): the
    model load_hf would build (its shapes only) has routers in the layers transformers' own config class
    and modeling rule make sparse, and the config.json save_hf writes for it gives transformers the same
    layers and jaxformer the same config."""
    config = {k: v for k, v in (_golden_config("switch") | changes).items() if v is not None}
    theirs = _transformers_sparse_layers(config)
    cfg = hf.config_from_hf(config)
    assert _our_sparse_layers(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))) == theirs
    saved = hf.config_to_hf(cfg)
    assert _transformers_sparse_layers(saved) == theirs
    assert hf.config_from_hf(saved) == cfg


@pytest.mark.parametrize("steps", [(1, 2), (0, 0)], ids=["all-sparse encoder, every other decoder", "all dense"])
def test_switch_with_its_own_layout_per_stack_saves_and_loads_back(steps, tmp_path):
    """A random Switch model whose encoder is all sparse and decoder sparse every other layer from layer 1
    (blocks of 2 scanned: two sparse layers in the encoder's, a dense one first in the decoder's), and one
    with no sparse layer: save_hf, then load_hf gives the same parameters and logits, scanned too."""
    from jaxformer.models import build_model

    encoder_step, decoder_step = steps
    config = _golden_config("switch") | dict(encoder_sparse_step=encoder_step, decoder_sparse_step=decoder_step)
    model = build_model(hf.config_from_hf(config), seed=3)
    out = hf.save_hf(model, tmp_path / "out")
    saved = json.loads((out / hf.CONFIG).read_text())
    assert (saved["encoder_sparse_step"], saved["decoder_sparse_step"]) == steps
    back, scanned = hf.load_hf(out), hf.load_hf(out, scan_layers=True)
    assert back.cfg == model.cfg and _our_sparse_layers(back) == _transformers_sparse_layers(config)
    want = flat_params(model)
    got = flat_params(back)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(2, 64, (2, 5)), rng.integers(2, 64, (2, 4))
    with jax.default_matmul_precision("highest"):
        run = nnx.jit(lambda models: [m(src, tgt) for m in models])
        logits, logits_back, logits_scanned = (np.asarray(x) for x in run([model, back, scanned]))
    np.testing.assert_array_equal(logits_back, logits)
    np.testing.assert_allclose(logits_scanned, logits, rtol=1e-5, atol=1e-5)


def test_switch_layouts_transformers_cannot_say_are_refused_naming_the_field():
    """Out: a jaxformer layout with no {stack}_sparse_step (MoE layers not at 1, 1 + step, ...) is refused
    naming the jaxformer field that places them and the Hugging Face one; in, scanned: stacks whose
    sparse steps' blocks do not divide a stack's depth are refused naming the step fields, not a tensor."""
    cfg = hf.config_from_hf(_golden_config("switch") | dict(num_layers=6, num_decoder_layers=6))
    rows = [  # (MoE layout fields, the message)
        (dict(every=3), r"switch_transformers: model\.moe\.every: the encoder's MoE layers \[2, 5\] .* no "
                        r"encoder_sparse_step"),
        (dict(decoder_every=2, decoder_offset=0), r"model\.moe\.decoder_offset: the decoder's MoE layers \[0, 2, 4\] "
                                                  r".* no decoder_sparse_step"),
        (dict(encoder_every=3), r"model\.moe\.encoder_every: the encoder's MoE layers \[2, 5\]"),
    ]  # fmt: skip
    for fields, message in rows:
        with pytest.raises(hf.UnsupportedCheckpoint, match=message):
            hf.family_of(cfg.replace(moe=dataclasses.replace(cfg.moe, **fields)))
    # a 4-layer encoder sparse every other layer beside a 6-layer decoder sparse at layers 1 and 4: scanned, both
    # stacks take blocks of 6 layers (2 and 3's least common multiple), which the encoder's 4 are not
    mixed = _golden_config("switch") | dict(num_layers=4, num_decoder_layers=6, encoder_sparse_step=2,
                                            decoder_sparse_step=3)  # fmt: skip
    assert hf.config_from_hf(mixed).moe.encoder_every == 2  # unrolled it loads
    message = (
        r"config\.json: encoder_sparse_step=2 and decoder_sparse_step=3 make layers \[1, 3\] \(encoder\) and "
        r"\[1, 4\] \(decoder\) sparse: scanned, each stack takes blocks of 6 layers, and num_layers=4 is not"
    )
    with pytest.raises(hf.UnsupportedCheckpoint, match=message):
        hf.config_from_hf(mixed, scan_layers=True)
