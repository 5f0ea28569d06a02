"""Golden files for tests/test_peft.py, made with the real peft library (needs torch, transformers, peft).

    python scripts/make_peft_golden.py          # rewrites tests/golden/peft/<family>/

For each family: a tiny random base model (`base/`: config.json + model.safetensors), a LoRA
adapter with random non-zero A and B made by `peft.get_peft_model` (`adapter/`: adapter_config.json
+ adapter_model.safetensors), and the adapted model's float32 logits on fixed inputs
(`logits.npz`: input_ids, logits). Seeded: a rerun writes the same numbers.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import peft
import torch
import transformers

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "golden" / "peft"
VOCAB, D, LAYERS, T = 64, 16, 2, 8

# family: (the base model, the modules peft adapts: every projection jaxformer can adapt)
FAMILIES = {
    "gpt2": (
        lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=VOCAB, n_embd=D, n_head=4, n_layer=LAYERS, n_positions=32, n_inner=32)
        ),
        ["c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"],
    ),
    "llama": (
        lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=VOCAB, hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                intermediate_size=32, num_hidden_layers=LAYERS, max_position_embeddings=32,
            )
        ),
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
}  # fmt: skip


def make(family: str) -> None:
    build, targets = FAMILIES[family]
    torch.manual_seed(0)
    base = build().float().eval()
    out = OUT / family
    shutil.rmtree(out, ignore_errors=True)
    base.save_pretrained(out / "base", safe_serialization=True)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False, task_type="CAUSAL_LM",
        fan_in_fan_out=family == "gpt2",  # GPT-2's Conv1D holds its weight [in, out]
    )  # fmt: skip
    model = peft.get_peft_model(base, config).eval()  # init_lora_weights=False: B is random too, not zero
    model.save_pretrained(out / "adapter", safe_serialization=True)
    (out / "adapter" / "README.md").unlink(missing_ok=True)  # peft's model card template: not needed
    written = out / "adapter" / "adapter_config.json"  # target_modules was a set: sorted, so reruns write the same
    fields = json.loads(written.read_text())
    written.write_text(json.dumps(fields | {"target_modules": sorted(fields["target_modules"])}, indent=2) + "\n")
    input_ids = np.random.default_rng(0).integers(0, VOCAB, (2, T)).astype(np.int32)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(input_ids).long()).logits.float().numpy()
    np.savez(out / "logits.npz", input_ids=input_ids, logits=logits)
    print(f"{out}: peft {peft.__version__}, logits {logits.shape}, |max| {np.abs(logits).max():.3f}")


if __name__ == "__main__":
    for name in FAMILIES:
        make(name)
