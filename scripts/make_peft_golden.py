"""Golden files for tests/test_peft.py, made with the real peft library (needs torch, transformers, peft).

    python scripts/make_peft_golden.py                # rewrites tests/golden/peft/<family>/ and targets.json
    python scripts/make_peft_golden.py bert t5        # only these families (targets.json is always rewritten)

For each family: a tiny random base model (`base/`: config.json + model.safetensors), a LoRA
adapter with random non-zero A and B made by `peft.get_peft_model` (`adapter/`: adapter_config.json
+ adapter_model.safetensors), and the adapted model's float32 logits on fixed inputs
(`logits.npz`: input_ids, decoder_input_ids for encoder-decoder models, logits). Seeded: a rerun
writes the same numbers. `targets.json`: per family, the modules peft's own matching adapts for each
of a list of `target_modules` (suffix lists and regexes, the ones jaxformer writes among them).

The other direction, adapters jaxformer writes read by peft, in two environments:

    python scripts/make_peft_golden.py export OUT     # jaxformer's environment: OUT/<case>/ in the same format
    python scripts/make_peft_golden.py check OUT      # peft's: loads each, compares peft's logits with jaxformer's
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
from golden import TOLERANCE, against_saved, main, torch_logits  # scripts/golden.py, beside this file

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "tests" / "golden" / "peft"
VOCAB, D, LAYERS, T, T_DEC = 64, 16, 2, 8, 6
BERT_ALL = ["attention.output.dense", "intermediate.dense", "key", "output.dense", "query", "value"]
BART_ALL = ["fc1", "fc2", "k_proj", "out_proj", "q_proj", "v_proj"]


def _families() -> dict:
    """family: (the base model, the modules peft adapts: every projection jaxformer can adapt, task type)."""
    import transformers as tf

    t5 = dict(vocab_size=VOCAB, d_model=D, d_kv=4, d_ff=32, num_layers=LAYERS, num_heads=4,
              relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0)  # fmt: skip
    return {
        "gpt2": (
            lambda: tf.GPT2LMHeadModel(
                tf.GPT2Config(vocab_size=VOCAB, n_embd=D, n_head=4, n_layer=LAYERS, n_positions=32, n_inner=32)
            ),
            ["c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"], "CAUSAL_LM",
        ),
        "llama": (
            lambda: tf.LlamaForCausalLM(
                tf.LlamaConfig(
                    vocab_size=VOCAB, hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                    intermediate_size=32, num_hidden_layers=LAYERS, max_position_embeddings=32,
                )
            ),
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "CAUSAL_LM",
        ),
        "bert": (
            lambda: tf.BertForMaskedLM(
                tf.BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=4,
                              intermediate_size=32, max_position_embeddings=32, type_vocab_size=2)
            ),
            BERT_ALL, "FEATURE_EXTRACTION",
        ),
        "bart": (
            lambda: tf.BartForConditionalGeneration(
                tf.BartConfig(vocab_size=VOCAB, d_model=D, encoder_layers=LAYERS, decoder_layers=LAYERS,
                              encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
                              decoder_ffn_dim=32, max_position_embeddings=32)
            ),
            BART_ALL, "SEQ_2_SEQ_LM",
        ),
        "t5": (lambda: tf.T5ForConditionalGeneration(tf.T5Config(**t5)),
               ["q", "k", "v", "o", "wi", "wo"], "SEQ_2_SEQ_LM"),
        "t5_v1_1": (  # gated: wi_0 (the gate) and wi_1
            lambda: tf.T5ForConditionalGeneration(
                tf.T5Config(**t5, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
            ),
            ["q", "k", "v", "o", "wi_0", "wi_1", "wo"], "SEQ_2_SEQ_LM",
        ),
    }  # fmt: skip


# Per family, target_modules whose peft selection targets.json records: common lists, names that
# clash by suffix, regexes, what jaxformer refuses; then (after the blank line) what jaxformer's save_peft
# writes for the configs tests/test_peft.py exports where those differ (fuller names, regexes).
TARGET_CASES = {
    "bert": [["query", "value"], ["query", "key", "value"], BERT_ALL, ["output.dense"], ["dense"], "all-linear",
             r"(?:.*\.)?encoder\.layer\.\d+\.output\.dense",

             ["attention.output.dense", "output.dense"], ["attention.output.dense", "query"]],
    "bart": [["q_proj", "v_proj"], BART_ALL, ["encoder_attn.q_proj"], ["self_attn.q_proj", "self_attn.v_proj"],
             ["fc1"], ["encoder_attn.q_proj", "fc1"], "all-linear",
             r"(?:.*\.)?encoder\.layers\.\d+\.self_attn\.(q|v)_proj",

             ["self_attn.q_proj"],
             r"(?:.*\.)?(?:encoder\.layers\.\d+\.self_attn\.q_proj|encoder\.layers\.\d+\.self_attn\.v_proj)",
             r"(?:.*\.)?(?:decoder\.layers\.\d+\.encoder_attn\.q_proj|decoder\.layers\.\d+\.fc1|"
             r"decoder\.layers\.\d+\.self_attn\.q_proj)"],
    "t5": [["q", "v"], ["q", "k", "v", "o", "wi", "wo"], ["EncDecAttention.q"], ["SelfAttention.q", "wo"],

           ["layer.1.EncDecAttention.q"],
           ["layer.0.SelfAttention.q", "layer.1.DenseReluDense.wo", "layer.2.DenseReluDense.wo"],
           r"(?:.*\.)?(?:encoder\.block\.\d+\.layer\.0\.SelfAttention\.q|encoder\.block\.\d+\.layer\.1\.DenseReluDense\.wo)"],
    "t5_v1_1": [["q", "v"], ["q", "k", "v", "o", "wi_0", "wi_1", "wo"], ["wi_0", "wi_1"],
                ["q", "k", "v", "o", "wi", "wo"],  # T5's list: "wi" selects nothing here, as peft allows

                ["k", "o", "q", "v", "wo"]],
}  # fmt: skip


def _inputs(task: str) -> dict:
    """Fixed ids; no pad ids in encoder models' inputs (jaxformer takes an encoder's trailing pads for padding)."""
    rng = np.random.default_rng(0)
    low = 0 if task == "CAUSAL_LM" else 2
    out = {"input_ids": rng.integers(low, VOCAB, (2, T)).astype(np.int32)}
    if task == "SEQ_2_SEQ_LM":
        out["decoder_input_ids"] = rng.integers(low, VOCAB, (2, T_DEC)).astype(np.int32)
    return out


def make(family: str, families: dict) -> None:
    import peft
    import torch

    build, targets, task = families[family]
    torch.manual_seed(0)
    base = build().float().eval()
    out = GOLDEN / family
    shutil.rmtree(out, ignore_errors=True)
    base.save_pretrained(out / "base", safe_serialization=True)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False, task_type=task,
        fan_in_fan_out=family == "gpt2",  # GPT-2's Conv1D holds its weight [in, out]
    )  # fmt: skip
    model = peft.get_peft_model(base, config).eval()  # init_lora_weights=False: B is random too, not zero
    model.save_pretrained(out / "adapter", safe_serialization=True)
    (out / "adapter" / "README.md").unlink(missing_ok=True)  # peft's model card template: not needed
    written = out / "adapter" / "adapter_config.json"  # target_modules was a set: sorted, so reruns write the same
    fields = json.loads(written.read_text())
    written.write_text(json.dumps(fields | {"target_modules": sorted(fields["target_modules"])}, indent=2) + "\n")
    inputs = _inputs(task)
    logits = torch_logits(model, inputs)
    np.savez(out / "logits.npz", **inputs, logits=logits)
    print(f"{out}: peft {peft.__version__}, logits {logits.shape}, |max| {np.abs(logits).max():.3f}")


def targets(families: dict) -> None:
    """targets.json: the modules (as peft names them in the hub model) that peft's own matching adapts
    for each case of TARGET_CASES."""
    import peft
    import torch

    out = {}
    for family, cases in TARGET_CASES.items():
        build, _, task = families[family]
        out[family] = []
        for target_modules in cases:
            torch.manual_seed(0)
            model = peft.get_peft_model(build(), peft.LoraConfig(r=2, target_modules=target_modules, task_type=task))
            out[family].append({"target_modules": target_modules, "peft_adapts": sorted(model.targeted_module_names)})
    (GOLDEN / "targets.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"{GOLDEN / 'targets.json'}: {sum(map(len, out.values()))} cases")


# ----------------------------------------------------------------------------- the other direction

# case: (golden family, LoRAConfig fields): the stacks and targets a suffix list cannot select among them.
EXPORT_CASES = {
    "bert_wo": ("bert", dict(targets=("wo",))),
    "bert_all": ("bert", dict(targets=("q", "k", "v", "o", "wi", "wo"))),
    "bart_encoder_qv": ("bart", dict(targets=("q", "v"), stacks=("encoder",))),
    "bart_cross_q_ffn": ("bart", dict(targets=("q", "wi"), stacks=("cross", "decoder"))),
    "t5_encoder_q_wo": ("t5", dict(targets=("q", "wo"), stacks=("encoder",))),
    "t5_v1_1_gate": ("t5_v1_1", dict(targets=("wi_gate", "v"))),
    "gpt2_qkv": ("gpt2", dict(targets=("q", "k", "v"))),
}


def export(out: pathlib.Path) -> None:
    """jaxformer writes each EXPORT_CASES adapter (random B) beside a copy of its golden base and its logits."""
    import jax

    from jaxformer import lora
    from jaxformer.config import LoRAConfig
    from jaxformer.interop import hf

    for case, (family, fields) in EXPORT_CASES.items():
        ref = np.load(GOLDEN / family / "logits.npz")
        inputs = [ref[k] for k in ("input_ids", "decoder_input_ids") if k in ref.files]
        cfg = LoRAConfig(rank=2, alpha=6.0, **fields)
        model = lora.add_adapters(hf.load_hf(GOLDEN / family / "base"), cfg)
        for k, (_, _, adapter) in enumerate(lora.adapters(model)):
            adapter.b[...] = jax.random.normal(jax.random.key(k), adapter.b.shape)
        shutil.rmtree(out / case, ignore_errors=True)
        shutil.copytree(GOLDEN / family / "base", out / case / "base")
        hf.save_peft(model, cfg, out / case / "adapter")
        with jax.default_matmul_precision("highest"):
            logits = np.asarray(model(*inputs))
        np.savez(out / case / "logits.npz", **{k: ref[k] for k in ref.files if k != "logits"}, logits=logits)
        print(f"{out / case}: {json.loads((out / case / 'adapter' / hf.ADAPTER_CONFIG).read_text())['target_modules']}")


def check(out: pathlib.Path) -> None:
    """peft loads each adapter `export` wrote onto its base: every tensor used, and jaxformer's logits."""
    import peft
    import transformers as tf
    from safetensors import safe_open

    worst = 0.0
    for case in sorted(p.name for p in out.iterdir() if (p / "adapter").is_dir()):
        d = out / case
        base = tf.AutoModelForMaskedLM if "bert" in case else tf.AutoModelForSeq2SeqLM
        base = tf.AutoModelForCausalLM if case.startswith(("gpt2", "llama")) else base
        model = peft.PeftModel.from_pretrained(base.from_pretrained(d / "base"), d / "adapter").eval()
        ref = np.load(d / "logits.npz")
        fields = json.loads((d / "adapter" / "adapter_config.json").read_text())
        adapted = sorted(model.base_model.targeted_module_names)
        with safe_open(d / "adapter" / "adapter_model.safetensors", "np") as f:
            written = sorted({k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in f.keys()})  # noqa: SIM118
        assert adapted == written, f"{case}: peft adapts {sorted(set(adapted) ^ set(written))} (not) in the file"
        _, err = against_saved(model, ref)
        worst = max(worst, err)
        print(f"{case}: target_modules {fields['target_modules']!r} -> peft adapts the file's {len(adapted)}; "
              f"|logits - jaxformer's| max {err:.2e}")  # fmt: skip
        assert err < TOLERANCE, case
    print(f"all {len(list(out.iterdir()))} read by peft {peft.__version__}; worst logits difference {worst:.2e}")


def make_all(names: list[str]) -> None:
    """The golden files of each family named (default: all), then targets.json for every family."""
    families = _families()
    for name in names or families:
        make(name, families)
    targets(families)


if __name__ == "__main__":
    main(make_all, export, check)
