"""PEFT LoRA adapters in and out, against files the real peft library wrote (scripts/make_peft_golden.py:
a tiny random base per family, a peft adapter with random non-zero A and B, peft's logits), so no torch here.

Reading: `load_hf(base, adapter=)` and `import-hf --adapter` give peft's logits (1e-5). Writing:
`export-hf --adapter` gives back peft's tensors (names, shapes, values) and an adapter_config.json with
its rank, alpha and target modules. Covered: GPT-2 (fused c_attn) and Llama.
"""

import json
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxformer import cli, lora
from jaxformer.checkpoint import restore_workdir
from jaxformer.config import LoRAConfig, from_dict
from jaxformer.interop import hf

GOLDEN = pathlib.Path(__file__).parent / "golden" / "peft"
FAMILIES = ["gpt2", "llama"]


def golden(family):
    d = GOLDEN / family
    return d / "base", d / "adapter", np.load(d / "logits.npz")


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("family", FAMILIES)
def test_load_hf_with_a_peft_adapter_gives_peft_logits(family, scan):
    base, adapter, ref = golden(family)
    with jax.default_matmul_precision("highest"):
        adapted = np.asarray(hf.load_hf(base, adapter=adapter, scan_layers=scan)(ref["input_ids"]))
        plain = np.asarray(hf.load_hf(base, scan_layers=scan)(ref["input_ids"]))
    np.testing.assert_allclose(adapted, ref["logits"], atol=1e-5, rtol=0)
    assert np.abs(plain - ref["logits"]).max() > 1e-2  # the adapter changes the logits: the test sees it


@pytest.mark.parametrize("family", FAMILIES)
def test_import_hf_adapter_then_export_hf_adapter_gives_back_peft_files(family, tmp_path):
    base, adapter, ref = golden(family)
    workdir, out = tmp_path / "run", tmp_path / "out"
    assert cli.main(["import-hf", str(base), "--workdir", str(workdir), "--adapter", str(adapter)]) == 0
    cfg = from_dict(json.loads((workdir / "config.json").read_text()))
    theirs = json.loads((adapter / hf.ADAPTER_CONFIG).read_text())
    assert (cfg.lora.rank, cfg.lora.alpha) == (theirs["r"], theirs["lora_alpha"])
    graphdef, state, _ = restore_workdir(cfg, workdir)
    with jax.default_matmul_precision("highest"):
        logits = np.asarray(nnx.merge(graphdef, state.weights)(ref["input_ids"]))
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-5, rtol=0)

    assert cli.main(["export-hf", "--workdir", str(workdir), str(out), "--adapter"]) == 0
    written, expected = load_file(out / hf.ADAPTER_WEIGHTS), load_file(adapter / hf.ADAPTER_WEIGHTS)
    assert sorted(written) == sorted(expected)
    for name, tensor in expected.items():
        assert written[name].shape == tensor.shape, name
        np.testing.assert_allclose(written[name], tensor, atol=1e-6, rtol=0, err_msg=name)
    ours = json.loads((out / hf.ADAPTER_CONFIG).read_text())
    for field in ("peft_type", "r", "lora_alpha", "task_type", "bias", "fan_in_fan_out", "rank_pattern"):
        assert ours[field] == theirs[field], field
    assert sorted(ours["target_modules"]) == sorted(theirs["target_modules"])
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


def test_embedding_adapters_are_not_dropped_from_a_peft_adapter_in_silence(tmp_path):
    cfg = LoRAConfig(rank=2, targets=("embed", "q"))
    model = lora.add_adapters(hf.load_hf(GOLDEN / "gpt2" / "base"), cfg)
    with pytest.raises(hf.UnsupportedCheckpoint, match=r"lora.targets: PEFT adapters of 'embed' are not written"):
        hf.save_peft(model, cfg, tmp_path)
    assert not any(tmp_path.iterdir())
