"""PEFT LoRA adapters in and out, against files the real peft library wrote (scripts/make_peft_golden.py:
a tiny random base per family, a peft adapter with random non-zero A and B, peft's logits), so no torch here.

Reading: `load_hf(base, adapter=)` and `import-hf --adapter` give peft's logits (1e-5). Writing:
`export-hf --adapter` gives back peft's tensors (names, shapes, values) and an adapter_config.json with
its rank, alpha and target modules. Covered: GPT-2 (fused c_attn), Llama, BERT, BART, T5 and gated T5
(v1.1); Qwen 2, Qwen 3 and Gemma 3 (scripts/make_peft_family_golden.py, on the family golden bases).
targets.json holds the modules peft's own matching adapts for many target_modules: reading each adapts
the same modules (or is refused where jaxformer's LoRA cannot express it), and what jaxformer writes
selects exactly the modules it adapts.
"""

import json
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxformer import cli, lora
from jaxformer.checkpoint import restore_workdir
from jaxformer.config import LoRAConfig, from_dict
from jaxformer.interop import hf

GOLDEN = pathlib.Path(__file__).parent / "golden" / "peft"
FAMILIES = ["gpt2", "llama", "bert", "bart", "t5", "t5_v1_1"]
# scripts/make_peft_family_golden.py: adapters on tests/golden/<family>'s base
DENSE_2026 = ["qwen2", "qwen3", "gemma3_text"]


def golden(family):
    d = GOLDEN / family
    base = d / "base" if family not in DENSE_2026 else GOLDEN.parent / family
    return base, d / "adapter", np.load(d / "logits.npz")


def inputs(ref) -> list:
    """The model's positional inputs: ids, and the decoder's ids for an encoder-decoder."""
    return [ref["input_ids"]] + ([ref["decoder_input_ids"]] if "decoder_input_ids" in ref.files else [])


@nnx.jit
def logits_of(model, inputs: list):
    """The model's logits for its positional `inputs`: one compiled program, not one per operation."""
    return model(*inputs)


def same_files(out, adapter):
    """The adapter directory `out` holds peft's tensors of `adapter` (names, shapes, values) and its config's fields."""
    written, expected = load_file(out / hf.ADAPTER_WEIGHTS), load_file(adapter / hf.ADAPTER_WEIGHTS)
    assert sorted(written) == sorted(expected)
    for name, tensor in expected.items():
        assert written[name].shape == tensor.shape, name
        np.testing.assert_allclose(written[name], tensor, atol=1e-6, rtol=0, err_msg=name)
    ours, theirs = (json.loads((d / hf.ADAPTER_CONFIG).read_text()) for d in (out, adapter))
    for field in ("peft_type", "r", "lora_alpha", "task_type", "bias", "fan_in_fan_out", "rank_pattern"):
        assert ours[field] == theirs[field], field
    assert sorted(ours["target_modules"]) == sorted(theirs["target_modules"])


# Scanned stacks read adapters layer by layer alike in every family: one encoder-decoder is enough beside GPT-2, Llama,
# and Gemma 3 (a scanned block of a local and a global layer).
@pytest.mark.parametrize(
    ("family", "scan"),
    [(f, False) for f in FAMILIES + DENSE_2026] + [(f, True) for f in ("gpt2", "llama", "t5", "gemma3_text")],
    ids=lambda x: {False: "unrolled", True: "scanned"}.get(x, x),
)
def test_load_hf_with_a_peft_adapter_gives_peft_logits_and_save_peft_its_files(family, scan, tmp_path):
    """Qwen 2 (q, k, v biases beside the adapters), Qwen 3 and Gemma 3 against peft run in float64, where its
    merged and unmerged models give the same float32 logits (measured: 2.3e-6 to 7.4e-6 from ours)."""
    base, adapter, ref = golden(family)
    model = hf.load_hf(base, adapter=adapter, scan_layers=scan)
    with jax.default_matmul_precision("highest"):
        adapted = np.asarray(logits_of(model, inputs(ref)))
        plain = None if scan else np.asarray(logits_of(hf.load_hf(base), inputs(ref)))
    # rtol: gated T5's untied logits reach 15, where float32's rounding alone is ~1e-6
    np.testing.assert_allclose(adapted, ref["logits"], atol=1e-5, rtol=0 if family in DENSE_2026 else 1e-5)
    if plain is not None:
        assert np.abs(plain - ref["logits"]).max() > 1e-2  # the adapter changes the logits: the test sees it
    hf.save_peft(model, hf.read_peft_config(adapter, hf.family_of(model.cfg), model.cfg), tmp_path)
    same_files(tmp_path, adapter)


# The command line is one path for every family: one decoder-only and one encoder-decoder.
@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_import_hf_adapter_then_export_hf_adapter_gives_back_peft_files(family, tmp_path):
    base, adapter, ref = golden(family)
    workdir, out = tmp_path / "run", tmp_path / "out"
    assert cli.main(["import-hf", str(base), "--workdir", str(workdir), "--adapter", str(adapter)]) == 0
    cfg = from_dict(json.loads((workdir / "config.json").read_text()))
    theirs = json.loads((adapter / hf.ADAPTER_CONFIG).read_text())
    assert (cfg.lora.rank, cfg.lora.alpha) == (theirs["r"], theirs["lora_alpha"])
    graphdef, state, _ = restore_workdir(cfg, workdir)
    with jax.default_matmul_precision("highest"):
        logits = np.asarray(logits_of(nnx.merge(graphdef, state.weights), inputs(ref)))
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-5, rtol=1e-5)

    assert cli.main(["export-hf", "--workdir", str(workdir), str(out), "--adapter"]) == 0
    same_files(out, adapter)
    assert not (out / hf.WEIGHTS).exists() and not (out / hf.CONFIG).exists()


def test_gpt2_separate_qkv_adapters_write_c_attn_at_rank_3r_with_the_same_update(tmp_path):
    """q, k, v adapters with their own A write c_attn as one adapter of rank 3R (A stacked, B block-
    diagonal) whose update, by peft's formula (A^T B^T alpha'/r'), is the merged one; reading it is refused."""
    base = GOLDEN / "gpt2" / "base"
    cfg = LoRAConfig(rank=2, alpha=6.0, targets=("q", "k", "v"))
    model = lora.add_adapters(hf.load_hf(base), cfg)
    for _, _, adapter in lora.adapters(model):  # B non-zero, so that the update is not zero
        adapter.b[...] = jax.random.normal(jax.random.key(1), adapter.b.shape)
    hf.save_peft(model, cfg, tmp_path)
    fields = json.loads((tmp_path / hf.ADAPTER_CONFIG).read_text())
    assert fields["target_modules"] == ["c_attn"]
    assert fields["rank_pattern"] == {"c_attn": 6} and fields["alpha_pattern"] == {"c_attn": 18}
    tensors = load_file(tmp_path / hf.ADAPTER_WEIGHTS)
    a = tensors["base_model.model.transformer.h.1.attn.c_attn.lora_A.weight"]  # [r', in]
    b = tensors["base_model.model.transformer.h.1.attn.c_attn.lora_B.weight"]  # [out, r']
    theirs = a.T @ b.T * 18 / 6  # [in, 3 D], Conv1D's layout
    attn = model.decoder.stack.layers[1].self_attn
    ours = np.concatenate(
        [np.asarray(lora.lora_kernel(getattr(attn, f"{n}_lora").a[...], getattr(attn, f"{n}_lora").b[...], 3.0))
         .reshape(16, -1) for n in "qkv"], axis=1)  # fmt: skip
    np.testing.assert_allclose(theirs, ours, atol=1e-6)
    with pytest.raises(hf.UnsupportedCheckpoint, match=r"rank_pattern=\{'c_attn': 6\} is not supported"):
        hf.load_hf(base, adapter=tmp_path)


TARGETS = json.loads((GOLDEN / "targets.json").read_text())
# Configs whose stacks or targets a list of table names cannot select in peft: written with fuller names or a regex.
EXPORTED = {
    "bert": [dict(targets=("wo",)), dict(targets=("q", "o"))],
    "bart": [dict(targets=("q", "v"), stacks=("encoder",)), dict(targets=("q", "wi"), stacks=("cross", "decoder"))],
    "t5": [dict(targets=("q", "wo"), stacks=("encoder",))],
    "t5_v1_1": [],
}


def _read(tmp_path, family, cfg, **fields) -> LoRAConfig:
    (tmp_path / hf.ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4} | fields))
    return hf.read_peft_config(tmp_path, family, cfg)


@pytest.mark.parametrize("case", list(TARGETS))
def test_target_modules_adapt_the_modules_peft_adapts_both_ways(case, tmp_path):
    """Reading: each target_modules of targets.json adapts the modules peft's matching adapted, or is
    refused where those are no lora.targets x lora.stacks. Writing: the target_modules save_peft writes
    for that config (and for EXPORTED) is one of targets.json's, peft adapts exactly our modules with
    it, and it reads back as the same config."""
    cfg = hf.config_from_hf(hf.read_hf_config(GOLDEN / case / "base"))
    family = hf.family_of(cfg)
    modules = hf.peft_modules(family, cfg)
    chosen = lambda lora_cfg: sorted(m.name for m in modules if hf._adapts(m, lora_cfg))
    expressible = lambda names: LoRAConfig(  # the config adapting peft's modules, if one does
        rank=2,
        targets=tuple({o.rsplit(".", 1)[1] for m in modules if m.name in names for o in m.rule.ours}),
        stacks=tuple({lora._stack_of(tuple(o.split("."))) for m in modules if m.name in names for o in m.rule.ours}),
    )
    key = lambda targets: json.dumps(sorted(targets) if isinstance(targets, list) else targets)
    peft_selects = {key(c["target_modules"]): c["peft_adapts"] for c in TARGETS[case]}
    configs = []
    for c in TARGETS[case]:
        theirs = c["peft_adapts"]
        if set(theirs) <= {m.name for m in modules} and chosen(expressible(theirs)) == theirs:
            configs.append(_read(tmp_path, family, cfg, target_modules=c["target_modules"]))
            assert chosen(configs[-1]) == theirs, c["target_modules"]
        else:
            with pytest.raises(hf.UnsupportedCheckpoint, match=r"target.module"):
                _read(tmp_path, family, cfg, target_modules=c["target_modules"])
    for lora_cfg in configs + [LoRAConfig(rank=2, **fields) for fields in EXPORTED[case]]:
        ours = [m for m in modules if hf._adapts(m, lora_cfg)]
        written = hf._target_modules(family, cfg, ours, sorted({m.target for m in ours}))
        assert key(written) in peft_selects, f"{written} is not in targets.json: add it to scripts/make_peft_golden.py"
        assert peft_selects[key(written)] == chosen(lora_cfg), written
        assert chosen(_read(tmp_path, family, cfg, target_modules=written)) == chosen(lora_cfg), written


def test_rank_and_alpha_patterns_read_when_uniform_else_refused_by_name(tmp_path):
    cfg = hf.config_from_hf(hf.read_hf_config(GOLDEN / "bart" / "base"))
    uniform = _read(tmp_path, "bart", cfg, target_modules=["q_proj"], rank_pattern={"q_proj": 2},
                    alpha_pattern={"encoder_attn.q_proj": 4})  # fmt: skip
    assert (uniform.rank, uniform.alpha) == (2, 4.0)
    for field, value in (("rank_pattern", {"encoder_attn.q_proj": 8}), ("alpha_pattern", {"q_proj": 16})):
        with pytest.raises(hf.UnsupportedCheckpoint, match=rf"{field}=\{{'\S+': \d+\}} is not supported: .* one "):
            _read(tmp_path, "bart", cfg, target_modules=["q_proj"], **{field: value})


@pytest.mark.parametrize(("case", "fields"), [("bert", EXPORTED["bert"][0]), ("bart", EXPORTED["bart"][1]),
                                              ("t5", EXPORTED["t5"][0])])  # fmt: skip
def test_save_peft_of_some_stacks_then_load_hf_gives_the_same_logits(case, fields, tmp_path):
    """An adapter on some stacks only (written with a regex or fuller names) reads back with its logits."""
    base, _, ref = golden(case)
    lora_cfg = LoRAConfig(rank=2, alpha=6.0, **fields)
    model = lora.add_adapters(hf.load_hf(base), lora_cfg)
    for k, (_, _, adapter) in enumerate(lora.adapters(model)):  # B non-zero, so that the update is not zero
        adapter.b[...] = jax.random.normal(jax.random.key(k), adapter.b.shape)
    hf.save_peft(model, lora_cfg, tmp_path)
    if case == "bert":  # as peft names an adapter made on the bare BertModel: no "bert." in its names
        tensors = load_file(tmp_path / hf.ADAPTER_WEIGHTS)
        save_file({k.replace(".bert.", "."): v for k, v in tensors.items()}, tmp_path / hf.ADAPTER_WEIGHTS)
    back = hf.load_hf(base, adapter=tmp_path)
    paths = lambda m: sorted(p for p, _ in nnx.to_flat_state(nnx.state(m, nnx.LoRAParam)))
    assert paths(back) == paths(model)  # the same adapters, no more
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(
            np.asarray(logits_of(back, inputs(ref))), np.asarray(logits_of(model, inputs(ref))), atol=1e-5
        )


def test_embedding_adapters_are_not_dropped_from_a_peft_adapter_in_silence(tmp_path):
    cfg = LoRAConfig(rank=2, targets=("embed", "q"))
    model = lora.add_adapters(hf.load_hf(GOLDEN / "gpt2" / "base"), cfg)
    with pytest.raises(hf.UnsupportedCheckpoint, match=r"lora.targets: PEFT adapters of 'embed' are not written"):
        hf.save_peft(model, cfg, tmp_path)
    assert not any(tmp_path.iterdir())
