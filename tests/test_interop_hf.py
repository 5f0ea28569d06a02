"""Hugging Face checkpoints: `load_hf` / `save_hf` against transformers' own Flax models.

Each family's tiny model is given random weights (biases and norm scales too, so a misplaced one
shows), written with `save_hf` in the hub's PyTorch naming, and loaded both by transformers'
Flax classes and by `load_hf`: logits must agree to 1e-5 (float32), greedy generations token
for token (families that generate), and masked-LM or class predictions (encoders). transformers
reading our files checks the names and layouts; its own implementation of each architecture
checks the options that express it. Skipped where transformers is absent
(the test extras install it; torch is never needed).
"""

import json
import logging
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxformer as jf
from jaxformer import decode
from jaxformer.config import DecodeConfig
from jaxformer.interop import hf

transformers = pytest.importorskip("transformers", reason="the parity tests need transformers' Flax models")

V = 64
SMALL = dict(vocab_size=V, d_model=16, num_heads=2, d_ff=32, max_len=32, dropout_rate=0.0, attention_dropout_rate=0.0)
ENC_DEC = dict(num_encoder_layers=2, num_decoder_layers=2)
FAMILIES = {  # name: (jaxformer config, transformers' Flax class)
    "gpt2": (jf.gpt2_small(**SMALL, num_decoder_layers=2), "FlaxGPT2LMHeadModel"),
    "llama": (
        jf.llama(**SMALL | dict(num_heads=4, num_kv_heads=2, d_ff=40), num_decoder_layers=2),
        "FlaxLlamaForCausalLM",
    ),
    "bert": (jf.bert_base(**SMALL, num_encoder_layers=2), "FlaxBertForMaskedLM"),
    "bert_classifier": (
        jf.bert_base(**SMALL, num_encoder_layers=2, num_classes=3),
        "FlaxBertForSequenceClassification",
    ),
    "bart": (jf.bart_base(**SMALL, **ENC_DEC), "FlaxBartForConditionalGeneration"),
    "t5": (jf.t5_small(**SMALL | dict(head_dim=8), **ENC_DEC), "FlaxT5ForConditionalGeneration"),
    "t5_v1_1": (jf.t5_v1_1_small(**SMALL | dict(head_dim=8), **ENC_DEC), "FlaxT5ForConditionalGeneration"),
}
SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}
LENGTHS = np.array([10, 6])  # row 1 is padded
THEIRS = jax.numpy_rank_promotion("allow")  # transformers' Flax code relies on implicit rank promotion


class _Jnp:
    """jax.numpy with the `a_min`/`a_max` keywords of `clip` that recent JAX dropped (Flax T5 uses them)."""

    def __getattr__(self, name):
        return getattr(jnp, name)

    @staticmethod
    def clip(x, a_min=None, a_max=None):
        return jnp.clip(x, min=a_min, max=a_max)


@pytest.fixture(autouse=True)
def transformers_logs(monkeypatch, caplog):
    """transformers' warnings reach caplog; its Flax T5 gets a JAX it can call."""
    from transformers.models.t5 import modeling_flax_t5

    monkeypatch.setattr(modeling_flax_t5, "jnp", _Jnp())
    transformers.logging.enable_propagation()
    transformers.logging.set_verbosity_warning()
    caplog.set_level(logging.WARNING)
    yield caplog
    transformers.logging.disable_propagation()


def randomized(cfg, seed: int = 0) -> jf.Transformer:
    """A model of `cfg` whose every parameter (biases and norm scales included) is random."""
    model = jf.build_model(cfg, seed)
    leaves, tree = jax.tree.flatten(nnx.state(model, nnx.Param))
    rng = np.random.default_rng(seed + 1)  # NumPy draws: each of jax.random.normal's shapes would compile
    nnx.update(
        model,
        jax.tree.unflatten(tree, [jax.device_put(0.3 * rng.standard_normal(x.shape, np.float32)) for x in leaves]),
    )
    return model


def ids(shape, seed):
    return np.asarray(jax.random.randint(jax.random.key(seed), shape, 0, V), np.int32)


def logits_of(model, src, tgt=None):
    """jaxformer's logits (class logits for a classifier), `src` right-padded to LENGTHS: one compiled
    program per model structure and shapes (models of the same structure share it)."""
    return _logits_of(model, src, tgt)


@nnx.jit
def _logits_of(model, src, tgt):
    lengths = jnp.asarray(LENGTHS)
    if model.cfg.num_classes:
        return model.classify(jnp.asarray(src), src_lengths=lengths)
    return model(jnp.asarray(src), None if tgt is None else jnp.asarray(tgt), lengths=lengths)


def attention_mask(src):
    return (np.arange(src.shape[1])[None] < LENGTHS[:, None]).astype(np.int32)


def hf_model(cls: str, directory):
    """transformers' `cls` as it reads `directory`. Its initial parameters, which the checkpoint's
    tensors all replace (one it lacks is named in a "were not" warning), are zeros of the shapes
    its initialisation gives: traced, not run operation by operation (a program compiled for each)."""
    cls = getattr(transformers, cls)
    init = cls.init_weights

    def zeros_init(self, rng, input_shape, params=None):
        if params is not None:
            return init(self, rng, input_shape, params)
        shapes = jax.eval_shape(lambda rng: init(self, rng, input_shape), rng)
        return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes)

    with THEIRS, mock.patch.object(cls, "init_weights", zeros_init):
        return cls.from_pretrained(directory)


def hf_forward(theirs, **inputs):
    """transformers' logits of its model `theirs` for `inputs`, its parameters passed in (one compiled program)."""
    with THEIRS:
        return jax.jit(lambda params, inputs: theirs(**inputs, params=params).logits)(theirs.params, inputs)


def hf_logits_of(theirs, src, tgt=None):
    """transformers' logits (class logits for a classifier) for the same inputs."""
    decoder = {} if tgt is None else dict(decoder_input_ids=tgt)
    return hf_forward(theirs, input_ids=src, attention_mask=attention_mask(src), **decoder)


def hf_greedy(theirs, arrays: dict, **settings):
    """transformers' greedy `generate` (its sequences) for the input `arrays` with the other `settings`,
    its parameters passed in: one compiled program, where eager it would compile each operation apart."""

    def run(params, arrays):
        return theirs.generate(**arrays, **settings, do_sample=False, params=params).sequences

    with THEIRS:
        return np.asarray(jax.jit(run)(theirs.params, arrays))


def real(logits, cfg):
    """Logits where the reference is defined: all target positions, or the inputs' real positions."""
    if cfg.mode == "encoder_decoder" or cfg.num_classes:
        return np.asarray(logits)
    return np.where((np.arange(logits.shape[1]) < LENGTHS[:, None])[..., None], np.asarray(logits), 0)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, cfg, our random model, its save_hf directory, transformers' model of that directory)."""
    name = request.param
    cfg, cls = FAMILIES[name]
    model = randomized(cfg)
    directory = hf.save_hf(model, tmp_path_factory.mktemp(name), extra_config=SPECIAL)
    from transformers.models.t5 import modeling_flax_t5

    modeling_flax_t5.jnp = _Jnp()  # (module scope: the autouse fixture is per test)
    theirs = hf_model(cls, directory)
    return name, cfg, model, directory, theirs


def test_logits_equal_transformers(family, transformers_logs):
    """save_hf -> transformers and save_hf -> load_hf both give the logits of the model saved."""
    _, cfg, model, directory, theirs = family
    src = ids((2, 10), 1)
    tgt = ids((2, 7), 2) if cfg.mode == "encoder_decoder" else None
    with jax.default_matmul_precision("highest"):
        ours = logits_of(model, src, tgt)
        loaded = logits_of(hf.load_hf(directory), src, tgt)
        reference = hf_logits_of(theirs, src, tgt)
    np.testing.assert_array_equal(real(loaded, cfg), real(ours, cfg))
    np.testing.assert_allclose(real(ours, cfg), real(reference, cfg), atol=1e-5)
    assert np.abs(real(ours, cfg)).max() > 0.2  # the comparison is not of near-zero logits (T5 scales by D^-0.5)
    assert not [r.message for r in transformers_logs.records if "were not" in r.message], "names transformers ignored"


GENERATING = [name for name, (cfg, _) in FAMILIES.items() if cfg.mode != "encoder_only"]
ENCODERS = [name for name in FAMILIES if name not in GENERATING]


@pytest.mark.parametrize("family", GENERATING, indirect=True)
def test_greedy_generation_equals_transformers(family):
    _, cfg, model, _, theirs = family
    eos, new = SPECIAL["eos_token_id"], 8
    if cfg.mode == "decoder_only":
        prompts = ids((2, 5), 3)
        ours = decode.generate(model, prompts.tolist(), DecodeConfig(max_new_tokens=new), eos_id=eos).tokens[:, 0]
        out = hf_greedy(theirs, dict(input_ids=prompts), max_new_tokens=new, eos_token_id=eos, pad_token_id=eos)
        reference = out[:, prompts.shape[1] :]
    else:
        src = ids((2, 10), 4)
        rows = [list(r[:n]) for r, n in zip(src.tolist(), LENGTHS, strict=True)]
        start = SPECIAL["decoder_start_token_id"]
        ours = decode.translate(model, rows, DecodeConfig(extra_len=new), bos_id=start, eos_id=eos).tokens[:, 0]
        out = hf_greedy(
            theirs, dict(input_ids=src, attention_mask=attention_mask(src)), max_new_tokens=new, eos_token_id=eos,
            pad_token_id=cfg.pad_id, decoder_start_token_id=start, forced_bos_token_id=None, forced_eos_token_id=None,
        )  # fmt: skip
        reference = out[:, 1:]  # after the start token
    for mine, theirs_row in zip(ours, reference, strict=True):
        assert decode.strip_after_eos(mine[:new], eos) == decode.strip_after_eos(theirs_row[:new], eos)


@pytest.mark.parametrize("name", ENCODERS)
def test_encoder_predictions_equal_transformers(name, tmp_path):
    """What an encoder is for: the class, or the masked-LM predictions (the five most likely ids, in
    order) at each real position of rows where every third token is [MASK]. Initialised as a model
    to be trained (the random weights of `family` make a head that predicts one ranking everywhere)."""
    cfg, cls = FAMILIES[name]
    model = jf.build_model(cfg, seed=3)
    theirs = hf_model(cls, hf.save_hf(model, tmp_path, extra_config=SPECIAL))
    MASK = 3  # any id: the test compares predictions, not a tokenizer's conventions
    src = np.where(np.arange(10)[None] % 3 == 1, MASK, ids((2, 10), 5))
    with jax.default_matmul_precision("highest"):
        ours, reference = np.asarray(logits_of(model, src)), np.asarray(hf_logits_of(theirs, src))
    if cfg.num_classes:
        np.testing.assert_array_equal(ours.argmax(-1), reference.argmax(-1))
        return
    real_BT = np.arange(10)[None] < LENGTHS[:, None]
    top = lambda logits_NV: np.argsort(-logits_NV, -1)[:, :5]
    assert len(np.unique(top(ours[real_BT]))) > 10  # the predictions depend on the input
    np.testing.assert_array_equal(top(ours[real_BT]), top(reference[real_BT]))


def test_scanned_load_and_save_equal_unrolled(tmp_path):
    cfg = FAMILIES["t5_v1_1"][0]
    model = randomized(cfg)
    unrolled_dir = hf.save_hf(model, tmp_path / "unrolled")
    scanned = hf.load_hf(unrolled_dir, scan_layers=True)
    assert scanned.cfg.scan_layers
    src, tgt = ids((2, 10), 1), ids((2, 7), 2)
    np.testing.assert_allclose(logits_of(scanned, src, tgt), logits_of(model, src, tgt), atol=1e-6)
    scanned_dir = hf.save_hf(scanned, tmp_path / "scanned")
    from safetensors.numpy import load_file

    a, b = load_file(unrolled_dir / hf.WEIGHTS), load_file(scanned_dir / hf.WEIGHTS)
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    config_of = lambda d: json.loads((d / "config.json").read_text())
    assert config_of(unrolled_dir) == config_of(scanned_dir)


def test_a_new_head_is_initialised_with_a_warning(tmp_path, caplog):
    """A masked-LM checkpoint fine-tuned as a classifier: the encoder comes from the checkpoint, the
    classification head (absent from it) is fresh, and the log says so."""
    mlm = randomized(FAMILIES["bert"][0])
    directory = hf.save_hf(mlm, tmp_path)
    with caplog.at_level(logging.WARNING, logger="jaxformer.interop"):
        classifier = hf.load_hf(directory, num_classes=3)
    assert "classifier.out" in caplog.text and "freshly initialised" in caplog.text
    np.testing.assert_array_equal(classifier.encoder.embed.embedding[...], mlm.encoder.embed.embedding[...])
    fresh = jf.Transformer(classifier.cfg, rngs=nnx.Rngs(0))  # the head as the model initialises it
    for name in ("pooler", "out"):
        np.testing.assert_array_equal(getattr(classifier.classifier, name)[...], getattr(fresh.classifier, name)[...])
    assert classifier.classify(jnp.asarray(ids((2, 10), 1))).shape == (2, 3)


def _edit_config(directory, **changes):
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def _edit_weights(directory, edit):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(directory / hf.WEIGHTS)
    edit(tensors)
    save_file(tensors, directory / hf.WEIGHTS, metadata={"format": "pt"})


def _truncate(name):
    """A download cut short: the file's header intact, its last tensor's bytes missing."""

    def cut(d):
        data = (d / name).read_bytes()
        (d / name).write_bytes(data[: len(data) - 64])

    return cut


def _add(name, shape):
    return lambda d: _edit_weights(d, lambda t: t.update({name: np.zeros(shape, np.float32)}))


@pytest.mark.parametrize(
    "family_name, damage, error, message",
    [
        ("gpt2", lambda d: (d / "config.json").unlink(), FileNotFoundError, "config.json does not exist"),
        ("gpt2", lambda d: _edit_config(d, model_type="gpt_neox"), hf.UnsupportedCheckpoint, "model_type='gpt_neox'"),
        ("llama", lambda d: _edit_config(d, rope_scaling={"type": "dynamic", "factor": 2.0}), hf.UnsupportedCheckpoint,
         r"rope_scaling=\{.type.: .dynamic."),
        ("bert", lambda d: _edit_config(d, position_embedding_type="relative_key"), hf.UnsupportedCheckpoint,
         "position_embedding_type"),
        ("t5", lambda d: _edit_config(d, feed_forward_proj="gated-silu"), hf.UnsupportedCheckpoint,
         "feed_forward_proj"),
        ("gpt2", lambda d: _edit_config(d, n_layer=None), hf.UnsupportedCheckpoint, "n_layer"),
        ("gpt2", lambda d: (d / hf.WEIGHTS).unlink(), FileNotFoundError, "model.safetensors"),
        ("gpt2", lambda d: (d / hf.WEIGHTS).write_bytes(b"not safetensors"), hf.UnsupportedCheckpoint,
         r"model.safetensors: not a readable safetensors file \(.*header"),
        ("gpt2", _truncate(hf.WEIGHTS), hf.UnsupportedCheckpoint, r"model.safetensors: not a readable safetensors"),
        ("gpt2", lambda d: _edit_weights(d, lambda t: t.pop("transformer.h.1.mlp.c_fc.weight")),
         hf.UnsupportedCheckpoint, "lacks tensors for .*decoder.stack.layers.1.ffn.wi"),
        ("gpt2", _add("transformer.h.0.adapter.weight", 3), hf.UnsupportedCheckpoint,
         "no place .*transformer.h.0.adapter.weight"),
        ("gpt2", _add("transformer.wpe.weight", (3, 3)), hf.UnsupportedCheckpoint,
         r"transformer.wpe.weight: shape \(3, 3\) does not fit"),
    ],
)  # fmt: skip
def test_what_cannot_load_is_named(tmp_path, family_name, damage, error, message):
    directory = hf.save_hf(randomized(FAMILIES[family_name][0]), tmp_path)
    damage(directory)
    with pytest.raises(error, match=message):
        hf.load_hf(directory)


def test_a_model_no_family_expresses_is_refused_with_the_fields():
    with pytest.raises(hf.UnsupportedCheckpoint, match=r"no Hugging Face family .*position='sinusoidal'"):
        hf.save_hf(jf.build_model(jf.tiny("decoder_only")), "unused")


# ----------------------------------------------------------------------------- tokenizer and workdir


def bpe_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer (GPT-2's kind) trained on the shipped Shakespeare, `<|endoftext|>` = 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxformer.data import sources

    texts = [r[1] for r in sources.read(sources.SHIPPED["shakespeare"])[0][:2000]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def test_hf_tokenizer_encodes_as_transformers_and_finds_its_special_ids(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from jaxformer.data import HFTokenizer

    bpe_tokenizer().save(str(tmp_path / "tokenizer.json"))
    ours = HFTokenizer(tmp_path)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    text = "KING HENRY: Now, lords, for France! — déjà vu"
    assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ours.encode(text)) == text
    assert ours.vocab_size == 300 and (ours.bos_id, ours.eos_id, ours.pad_id) == (0, 0, 0)  # GPT-2: no pad, eos
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 5, "eos_token_id": [7, 8], "pad_token_id": 9}))
    assert (HFTokenizer(tmp_path).bos_id, HFTokenizer(tmp_path).eos_id, HFTokenizer(tmp_path).pad_id) == (5, 7, 9)
    (tmp_path / "config.json").write_text(json.dumps({"is_encoder_decoder": True, "decoder_start_token_id": 3}))
    assert HFTokenizer(tmp_path).bos_id == 3  # the decoder starts from it

    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    wordpiece.train_from_iterator(["to be or not to be"], trainers.WordPieceTrainer(special_tokens=specials))
    bert_dir = tmp_path / "bert"
    bert_dir.mkdir()
    wordpiece.save(str(bert_dir / "tokenizer.json"))
    bert = HFTokenizer(bert_dir)
    assert (bert.pad_id, bert.unk_id, bert.bos_id, bert.eos_id, bert.mask_id) == (0, 1, 2, 3, 4)
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        HFTokenizer(tmp_path / "nowhere")


def test_import_hf_train_export_hf(tmp_path, capsys):
    """`import-hf` -> `train` (fine-tuning on the shipped Shakespeare with the checkpoint's own
    tokenizer) -> `export-hf`: step 0 holds the checkpoint's weights, the export holds the trained
    ones (transformers reads them with the same logits), its config and tokenizer carry over."""
    from jaxformer import cli
    from jaxformer.checkpoint import restore_workdir
    from jaxformer.config import from_dict
    from jaxformer.data import build_dataset

    source, workdir, out = tmp_path / "gpt2", tmp_path / "run", tmp_path / "exported"
    tok = bpe_tokenizer()
    # One layer: the families' tests above map every layer; here each command builds, traces (and
    # transformers initialises) the model anew, so a second layer would only add time.
    cfg = jf.gpt2_small(vocab_size=300, d_model=32, num_heads=2, d_ff=64, max_len=64, num_decoder_layers=1)
    hf.save_hf(randomized(cfg), source, extra_config={"bos_token_id": 0, "eos_token_id": 0})
    tok.save(str(source / "tokenizer.json"))
    settings = [
        "train.steps=3", "train.batch_size=8", "train.log_every=1", "train.eval_every=3", "train.eval_batches=1",
        "train.num_samples=0", "checkpoint.every=3", "data.max_examples=2000",
    ]  # fmt: skip
    sets = [a for s in settings for a in ("--set", s)]
    assert cli.main(["import-hf", str(source), "--workdir", str(workdir), *sets]) == 0

    run_cfg = from_dict(json.loads((workdir / "config.json").read_text()))
    assert run_cfg.data.tokenizer == "hf" and run_cfg.model == hf.config_from_hf(hf.read_hf_config(source))
    graphdef, state, _ = restore_workdir(run_cfg, workdir)
    x = jnp.asarray(ids((2, 10), 1))
    forward = nnx.jit(lambda model, x: model(x))  # one program per model structure, not one per operation
    pretrained = forward(hf.load_hf(source), x)
    assert int(state.step) == 0
    np.testing.assert_array_equal(forward(nnx.merge(graphdef, state.params), x), pretrained)
    batch = build_dataset(run_cfg, workdir).train.get(0)
    assert (batch["targets"] == 0).any() and batch["weights"].all()  # <|endoftext|> is pad and eos: it counts

    capsys.readouterr()
    assert cli.main(["train", "--workdir", str(workdir), "--quiet"]) == 0
    assert '"vocab_size"' not in capsys.readouterr().out, "--quiet prints no config (it is in WORKDIR/config.json)"
    assert cli.main(["export-hf", "--workdir", str(workdir), str(out)]) == 0
    graphdef, state, _ = restore_workdir(run_cfg, workdir)
    trained = nnx.merge(graphdef, state.params)
    assert int(state.step) == 3 and not np.allclose(forward(trained, x), pretrained)
    np.testing.assert_array_equal(forward(hf.load_hf(out), x), forward(trained, x))
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    theirs = hf_model("FlaxGPT2LMHeadModel", out)
    reference = hf_forward(theirs, input_ids=np.asarray(x))
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(forward(trained, x), reference, atol=1e-5)

    capsys.readouterr()
    prompt = ["--prompt", "KING HENRY:", "--set", "decode.strategy=greedy", "--set", "decode.max_new_tokens=5"]
    assert cli.main(["generate", "--hf", str(out), *prompt]) == 0
    assert cli.main(["generate", "--workdir", str(workdir), *prompt]) == 0
    from_hf, from_workdir = capsys.readouterr().out.split("KING HENRY:\n=> ")[1:]
    assert from_hf.strip() == from_workdir.strip() != ""
    assert cli.main(["generate", "--hf", str(out), *prompt, "--set", "decode.max_new_tokens=500"]) == 0
    room = 64 - len(tok.encode("KING HENRY:").ids)
    assert f"note: at most {room} new tokens (decode.max_new_tokens=500): model.max_len=64" in capsys.readouterr().err


def test_a_classifier_s_class_names_come_in_with_import_hf_and_go_out_with_export_hf(tmp_path):
    """An imported sequence classifier keeps its `id2label`: the engine names its classes by it and
    `export-hf` writes it back (it once wrote LABEL_0...); a classifier trained here exports the names its
    training kept (WORKDIR/labels.json) instead; a model without names gets Hugging Face's defaults."""
    from jaxformer.checkpoint import class_labels, write_labels
    from jaxformer.engine import Engine
    from jaxformer.interop.hf_workdir import export_hf, import_hf

    source, workdir = tmp_path / "bert", tmp_path / "run"
    names = {"0": "negative", "1": "neutral", "2": "positive"}
    cfg = jf.bert_base(**SMALL | dict(vocab_size=300), num_encoder_layers=1, num_classes=3)
    label2id = {name: int(c) for c, name in names.items()}
    hf.save_hf(randomized(cfg), source, extra_config={"id2label": names, "label2id": label2id})
    bpe_tokenizer().save(str(source / "tokenizer.json"))
    import_hf(source, workdir, overrides=["train.objective=classify"])
    assert Engine.from_workdir(workdir).labels == ("negative", "neutral", "positive")
    export_hf(workdir, tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["id2label"] == names and exported["label2id"] == label2id

    write_labels(workdir, ["bad", "fine", "good"])  # as a classify run in this workdir leaves it
    export_hf(workdir, tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["id2label"] == {"0": "bad", "1": "fine", "2": "good"}
    assert class_labels(tmp_path / "nowhere", 2) == ("LABEL_0", "LABEL_1")
    assert class_labels(workdir, 4) == ("bad", "fine", "good", "LABEL_3")  # more classes than names
