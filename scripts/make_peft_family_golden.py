"""PEFT golden files for the dense 2026 families (Qwen 2, Qwen 3, Gemma 3), made with the real peft library
(needs torch, transformers 4.57 and peft; CI has none of them and reads the files in tests/test_peft.py).

    python scripts/make_peft_family_golden.py                # rewrites tests/golden/peft/<family>/ below
    python scripts/make_peft_family_golden.py qwen3          # one family

For each family the base is the tiny random model of tests/golden/<family> (scripts/make_family_golden.py:
vocabulary 64, d_model 32, 2 layers, 4 query heads over 2 key-value heads; Gemma 3 with a local layer
over 3 positions), read from there (rerun this script after that one rewrites a family). On it peft
puts a LoRA adapter of rank 4, alpha 8, with random non-zero A and B (`init_lora_weights=False`) on q,
k, v, o and the gated MLP's gate, up and down projections (peft's default targets for these families
are q and v alone), written to `adapter/`. B is scaled by 1/4 (the adapter still moves the logits by
1.7 to 4.4). `logits.npz` holds the fixed inputs
and the adapted model's logits, peft's unmerged forward (base plus B A x) run in float64 on the float32
weights; its merged model (`merge_and_unload`) gives the same float32 numbers (checked here: in float32
the two forwards differ by up to 9e-6). Seeded: a rerun writes the same numbers.
"""

from __future__ import annotations

import copy
import json
import pathlib
import shutil
import sys

import numpy as np
from golden import torch_logits  # scripts/golden.py, beside this file

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "tests" / "golden"
FAMILIES = ("qwen2", "qwen3", "gemma3_text")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make(family: str) -> None:
    """tests/golden/peft/<family>/: a peft adapter on the family's golden base and peft's logits."""
    import peft
    import torch
    import transformers as tf

    out = GOLDEN / "peft" / family
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(FAMILIES.index(family))  # each family its own adapter numbers
    base = tf.AutoModelForCausalLM.from_pretrained(GOLDEN / family, dtype=torch.float32).eval()
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False,
                             task_type="CAUSAL_LM")  # fmt: skip
    model = peft.get_peft_model(base, config).eval()  # init_lora_weights=False: B is random too, not zero
    with torch.no_grad():  # peft's random B moves the logits by ~6: a quarter of it, still decisive, keeps
        for name, p in model.named_parameters():  # float32's rounding of both sides within 1e-5
            if "lora_B" in name:
                p.mul_(0.25)
    model.save_pretrained(out / "adapter", safe_serialization=True)
    (out / "adapter" / "README.md").unlink(missing_ok=True)  # peft's model card template: not needed
    # target_modules was a set: sorted, so reruns write the same; the base's path is this machine's: left out
    written = out / "adapter" / "adapter_config.json"
    fields = json.loads(written.read_text())
    fields |= {"target_modules": sorted(fields["target_modules"]), "base_model_name_or_path": None}  # no local path
    written.write_text(json.dumps(fields, indent=2) + "\n")

    inputs = {"input_ids": np.load(GOLDEN / family / "logits.npz")["input_ids"]}  # the family golden's ids
    # In float64 (the float32 weights as they are) peft's merged and unmerged forwards agree to float32's
    # rounding, where in float32 they differ by up to 9e-6 on these logits, most of a 1e-5 tolerance.
    model = copy.deepcopy(model).double()
    logits = torch_logits(model, inputs)
    merged = torch_logits(copy.deepcopy(model).merge_and_unload().eval(), inputs)
    with model.disable_adapter():
        plain = torch_logits(model, inputs)
    assert np.abs(merged - logits).max() < 1e-6, family
    np.savez(out / "logits.npz", **inputs, logits=logits)
    print(f"{out}: peft {peft.__version__}, logits {logits.shape}, |max| {np.abs(logits).max():.3f}, "
          f"|merged - unmerged| {np.abs(merged - logits).max():.2e}, "
          f"|adapted - base| {np.abs(logits - plain).max():.3f}")  # fmt: skip


if __name__ == "__main__":
    for name in sys.argv[1:] or FAMILIES:
        make(name)
