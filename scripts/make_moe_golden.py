"""Golden files for tests/test_interop_moe.py, made with transformers' PyTorch Mixtral and Switch Transformers
(needs torch and transformers; CI has neither and reads the files).

    python scripts/make_moe_golden.py                 # rewrites tests/golden/mixtral/ and tests/golden/switch/

Each directory holds a tiny random model as transformers writes it (config.json + model.safetensors)
and `logits.npz`: fixed inputs and transformers' float32 logits. Mixtral: 2 layers of 4 experts,
top-2, grouped-query attention, tied embeddings. Switch: 2 + 2 layers, layer 1 of each stack sparse
(4 experts, top-1), the encoder's second row right-padded, expert_capacity 8 (nothing dropped) and,
in `logits_dropping`, the same model run with every router's capacity at `dropping_capacity` (2), where
some tokens of both stacks overflow their expert (`dropped`: how many, per stack). Every parameter is
drawn at a scale where routing is decided by clear margins, so the two implementations choose the
same experts. Seeded: a rerun writes the same numbers.

The other direction, checkpoints jaxformer writes read by transformers, in two environments:

    python scripts/make_moe_golden.py export OUT      # jaxformer's environment: OUT/<case>/ and jaxformer's logits
    python scripts/make_moe_golden.py check OUT       # transformers': loads each, compares its logits with jaxformer's

`export` writes each golden model back with `save_hf` (`*_golden`), and a jaxformer-made random model
of each family (`*_ours`; Switch with expert_capacity 3, so tokens drop; `switch_layouts_ours` with
each stack its own sparse layers, every encoder layer and the decoder's 1 and 3 of 4;
`switch_dense_ours` with none).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
from golden import TOLERANCE, against_saved, main, torch_logits  # scripts/golden.py, beside this file

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "tests" / "golden"
VOCAB, D, T, T_DEC, LENGTHS = 64, 16, 8, 6, (8, 5)
EXPERTS = 4
DROPPING = 2  # Switch's expert_capacity in the dropping case


def _mixtral():
    import transformers as tf

    return tf.MixtralForCausalLM(
        tf.MixtralConfig(
            vocab_size=VOCAB, hidden_size=D, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=4, num_local_experts=EXPERTS, num_experts_per_tok=2,
            max_position_embeddings=32, tie_word_embeddings=True, sliding_window=None, router_jitter_noise=0.0,
            rms_norm_eps=1e-5, pad_token_id=0,
        )
    )  # fmt: skip


def _switch():
    import transformers as tf

    return tf.SwitchTransformersForConditionalGeneration(
        tf.SwitchTransformersConfig(
            vocab_size=VOCAB, d_model=D, d_kv=4, d_ff=8, num_heads=2, num_layers=2, num_decoder_layers=2,
            num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_experts=EXPERTS, expert_capacity=T,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
            router_jitter_noise=0.01, dense_act_fn="relu", tie_word_embeddings=True, decoder_start_token_id=0,
        )
    )  # fmt: skip


def _randomize(model) -> None:
    """Every parameter random at a scale that makes the logits and the routing decisive: norm scales
    near 1, everything else N(0, 0.5^2)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.5 * torch.randn_like(p))


def _inputs(family: str) -> dict:
    """Fixed ids; Switch's encoder rows right-padded to LENGTHS (pad id 0, never inside a row)."""
    rng = np.random.default_rng(0)
    if family == "mixtral":
        return {"input_ids": rng.integers(0, VOCAB, (2, T)).astype(np.int32)}
    ids = rng.integers(2, VOCAB, (2, T)).astype(np.int32)
    mask = (np.arange(T)[None] < np.array(LENGTHS)[:, None]).astype(np.int32)
    return {"input_ids": ids * mask, "attention_mask": mask,
            "decoder_input_ids": rng.integers(2, VOCAB, (2, T_DEC)).astype(np.int32)}  # fmt: skip


def _routers(model) -> list:
    from transformers.models.switch_transformers import modeling_switch_transformers as st

    return [(n, m) for n, m in model.named_modules() if isinstance(m, st.SwitchTransformersTop1Router)]


def _dropped(model, inputs: dict) -> dict:
    """Live tokens over capacity, per stack: each router's top-1 choices counted in token order."""
    import torch

    counts, hooks = {"encoder": 0, "decoder": 0}, []
    live = {"encoder": torch.from_numpy(inputs["attention_mask"]).bool(),
            "decoder": torch.ones(inputs["decoder_input_ids"].shape, dtype=torch.bool)}  # fmt: skip
    for name, router in _routers(model):
        side = name.split(".")[0]

        def hook(module, args, out, side=side):
            kept_BTE = out[0]  # the top-1 one-hot, zero where the token overflowed its expert
            counts[side] += int(((kept_BTE.sum(-1) == 0) & live[side]).sum())

        hooks.append(router.register_forward_hook(hook))
    torch_logits(model, inputs)
    for h in hooks:
        h.remove()
    return counts


def make(family: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    model = (_mixtral if family == "mixtral" else _switch)().float().eval()
    _randomize(model)
    out = GOLDEN / ("mixtral" if family == "mixtral" else "switch")
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)  # not read
    inputs = _inputs(family)
    arrays = dict(inputs, logits=torch_logits(model, inputs))
    if family == "switch":
        assert _dropped(model, inputs) == {"encoder": 0, "decoder": 0}
        for _, router in _routers(model):
            router.expert_capacity = DROPPING
        dropped = _dropped(model, inputs)
        assert dropped["encoder"] and dropped["decoder"], dropped  # both stacks drop some live tokens
        arrays |= dict(logits_dropping=torch_logits(model, inputs), dropping_capacity=DROPPING,
                       dropped=np.array([dropped["encoder"], dropped["decoder"]]))  # fmt: skip
    np.savez(out / "logits.npz", **arrays)
    size = sum(p.stat().st_size for p in out.iterdir())
    extra = f", dropped at capacity {DROPPING}: {arrays['dropped'].tolist()}" if family == "switch" else ""
    print(
        f"{out}: transformers {transformers.__version__}, logits {arrays['logits'].shape}, {size / 1024:.1f} KiB{extra}"
    )


# ----------------------------------------------------------------------------- the other direction


def _ours_configs() -> dict:
    """jaxformer-made models of each family, built from jaxformer configs (not from a checkpoint)."""
    import dataclasses

    import jaxformer as jf
    from jaxformer.config import MoEConfig

    small = dict(vocab_size=VOCAB, d_model=D, d_ff=8, max_len=32, dropout_rate=0.0)
    mixtral = jf.llama(**small, num_heads=4, num_kv_heads=2, num_decoder_layers=2,
                       moe=MoEConfig(num_experts=EXPERTS, experts_per_token=2, router="topk_softmax"))  # fmt: skip
    switch = jf.t5_small(**small, num_heads=2, head_dim=4, num_encoder_layers=2, num_decoder_layers=2,
                         relative_buckets=8, relative_max_distance=16,
                         moe=MoEConfig(num_experts=EXPERTS, experts_per_token=1, every=2, expert_capacity=3,
                                       router_noise=0.01, z_loss_weight=0.001, aux_loss_weight=0.001))  # fmt: skip
    # each stack its own layout: every encoder layer sparse (encoder_sparse_step=1), the decoder's 1 and 3 (2)
    layouts = switch.replace(num_encoder_layers=4, num_decoder_layers=4,
                             moe=dataclasses.replace(switch.moe, encoder_every=1))  # fmt: skip
    dense = switch.replace(moe=dataclasses.replace(switch.moe, encoder_every=0, decoder_every=0))  # steps 0
    return {"mixtral_ours": ("mixtral", mixtral), "switch_ours": ("switch", switch),
            "switch_layouts_ours": ("switch", layouts), "switch_dense_ours": ("switch", dense)}  # fmt: skip


def export(out: pathlib.Path) -> None:
    """jaxformer writes each golden model back (`<family>_golden`) and a model of its own per family
    (`<family>_ours`) with `save_hf`, beside its float32 logits on the golden inputs."""
    import jax
    from flax import nnx

    import jaxformer as jf
    from jaxformer.interop import hf

    cases = {f"{f}_golden": (f, lambda f=f: hf.load_hf(GOLDEN / f)) for f in ("mixtral", "switch")}
    for case, (family, cfg) in _ours_configs().items():

        def build(cfg=cfg):
            model = jf.build_model(cfg, 0)
            leaves, tree = jax.tree.flatten(nnx.state(model, nnx.Param))
            keys = jax.random.split(jax.random.key(1), len(leaves))
            nnx.update(
                model,
                jax.tree.unflatten(
                    tree, [0.5 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
                ),
            )
            return model

        cases[case] = (family, build)
    for case, (family, build) in cases.items():
        ref = np.load(GOLDEN / family / "logits.npz")
        model = build()
        shutil.rmtree(out / case, ignore_errors=True)
        hf.save_hf(model, out / case)
        src = ref["input_ids"]
        with jax.default_matmul_precision("highest"):
            if family == "mixtral":
                logits = model(src)
            else:
                logits = model(src, ref["decoder_input_ids"], lengths=ref["attention_mask"].sum(1))
        inputs = {k: ref[k] for k in ("input_ids", "attention_mask", "decoder_input_ids") if k in ref.files}
        np.savez(out / case / "logits.npz", **inputs, logits=np.asarray(logits))
        print(f"{out / case}: {model.cfg.moe}")


def check(out: pathlib.Path) -> None:
    """transformers loads each directory `export` wrote: every tensor used, and its logits against jaxformer's."""
    import transformers as tf

    worst = 0.0
    for case in sorted(p.name for p in out.iterdir() if (p / "config.json").is_file()):
        d = out / case
        cls = tf.MixtralForCausalLM if case.startswith("mixtral") else tf.SwitchTransformersForConditionalGeneration
        model, info = cls.from_pretrained(d, output_loading_info=True)
        model = model.float().eval()
        unexpected, missing = info["unexpected_keys"], [k for k in info["missing_keys"] if "lm_head" not in k]
        assert not unexpected and not missing, (case, unexpected, missing)
        ref = np.load(d / "logits.npz")
        logits, err = against_saved(model, ref)
        worst = max(worst, err)
        fields = json.loads((d / "config.json").read_text())
        what = {k: fields.get(k) for k in ("num_local_experts", "num_experts_per_tok", "num_experts", "expert_capacity",
                                            "num_sparse_encoder_layers") if k in fields}  # fmt: skip
        print(f"{case}: {what}; |logits - jaxformer's| max {err:.2e} (|logits| max {np.abs(logits).max():.2f})")
        assert err < TOLERANCE, case
    print(f"transformers {tf.__version__} read all; worst logits difference {worst:.2e}")


def make_all(names: list[str]) -> None:
    """The golden files of each family named (default: both)."""
    for name in names or ("mixtral", "switch"):
        make(name)


if __name__ == "__main__":
    main(make_all, export, check)
