"""Golden files for tests/test_interop_families.py, made with transformers' PyTorch Qwen 2, Qwen 3,
Qwen 3 MoE, Gemma 3 and Gemma 2 (needs torch and transformers 4.57; CI has neither and reads the files).

    python scripts/make_family_golden.py               # rewrites tests/golden/<family>/, each family below
    python scripts/make_family_golden.py qwen3         # one family

Each directory holds a tiny random model as transformers writes it (config.json + model.safetensors)
and `logits.npz`: fixed inputs and transformers' float32 logits. All: vocabulary 64, d_model 32,
2 layers, 4 query heads over 2 key-value heads. Qwen 2: head dim 8 (d_model / heads), biases on
q, k, v; Qwen 3: head dim 16 (not d_model / heads), QK-norm, tied embeddings; Qwen 3 MoE: layer 1
of 2 sparse (decoder_sparse_step 2: layer 0 a dense feed-forward), 8 experts of width 8, top-2
renormalised (norm_topk_prob), and in `logits_unnormalised` the same model with norm_topk_prob off;
Gemma 3: layer 0 local over a window of 3 positions (RoPE base 10000), layer 1 global (RoPE base
10^6), head dim 16, query_pre_attn_scalar 24, final logits soft-capped at 5, tied embeddings; Gemma 2:
the same layers with one RoPE base, no QK-norm, attention logits soft-capped at 2 (where a cap bites);
Qwen 3 and Gemma 3 also `logits_scaled`, the same weights with a RoPE scaling (`SCALED`). DeepSeek-V3:
3 layers, multi-head latent attention (q_lora_rank 24, kv_lora_rank 16, rope 8 interleaved, nope 16,
v 12 per head, 4 heads), yarn RoPE scaling (factor 4 over 8 trained positions, mscale 1 against
mscale_all_dim 0.707), layer 0 dense (d_ff 48), layers 1-2 top-2 of 8 experts of width 8 by sigmoid
scores in 4 groups of 2 (2 groups a token), a random balance bias, renormalised and times 2.5, one
shared expert.
Every parameter is drawn at a scale where the routing is decided by clear margins (checked), so the
two implementations choose the same experts. Seeded: a rerun writes the same numbers.

The other direction, checkpoints jaxformer writes read by transformers, in two environments:

    python scripts/make_family_golden.py export OUT    # jaxformer's environment: OUT/<case>/ and jaxformer's logits
    python scripts/make_family_golden.py check OUT     # transformers': loads each, compares its logits with jaxformer's

`export` writes each golden model back with `save_hf` (`<family>_golden`) and a jaxformer-made random
model of each family (`<family>_ours`; Qwen 3 MoE with every layer sparse and norm_topk_prob off; DeepSeek-V3
with queries straight from D, 2 shared experts, 2 groups of 4 experts). Run by hand: transformers 4.57.6
reads all 12, every tensor used, logits within 7.0e-6 of jaxformer's (DeepSeek-V3 5.4e-6 golden, 8.3e-7 ours).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
from golden import TOLERANCE, against_saved, main, torch_logits  # scripts/golden.py, beside this file

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "tests" / "golden"
VOCAB, D, T = 64, 32, 8
FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "gemma3_text", "gemma2", "deepseek_v3")
CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "gemma3_text": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
           "deepseek_v3": "DeepseekV3ForCausalLM"}  # fmt: skip
EAGER = ("gemma2", "deepseek_v3")  # attention through transformers' eager path (see `_config`)
# The same weights with a RoPE scaling, their logits beside the others (`logits_scaled`): Qwen 3 with yarn
# (every layer, cos and sin times its attention factor), Gemma 3 linear (its global layer alone).
SCALED = {"qwen3": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 8.0,
                    "beta_slow": 2.0},
          "gemma3_text": {"rope_type": "linear", "factor": 8.0}}  # fmt: skip
# DeepSeek-V3's yarn: mscale != mscale_all_dim, so cos and sin are scaled (by their ratio) and the
# logits (by mscale(factor, mscale_all_dim)^2), over 8 trained positions of 32
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 8.0,
                 "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.707}  # fmt: skip


def _config(family: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6, pad_token_id=0)  # fmt: skip
    if family == "gemma3_text":  # RoPE base 10^6 on the global layer, 10^4 on the local one
        return tf.Gemma3TextConfig(**common, rope_theta=1_000_000.0, head_dim=16, tie_word_embeddings=True,
                                   rope_local_base_freq=10_000.0, sliding_window=3, query_pre_attn_scalar=24,
                                   layer_types=["sliding_attention", "full_attention"],
                                   final_logit_softcapping=5.0)  # fmt: skip
    common["rope_theta"] = 10_000.0
    if family == "deepseek_v3":  # MLA with both low ranks, 8 experts in 4 groups, layer 0 dense; eager as gemma2
        ds = dict(common, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=48)
        return tf.DeepseekV3Config(**ds, moe_intermediate_size=8, q_lora_rank=24, kv_lora_rank=16,
                                   qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8,
                                   n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                                   norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1,
                                   rope_scaling=dict(DEEPSEEK_YARN), rope_interleave=True, tie_word_embeddings=False,
                                   attn_implementation="eager")  # fmt: skip
    if family == "gemma2":  # layer 0 local over 3 positions, layer 1 global; both soft caps
        # eager: transformers' SDPA path drops attn_logit_softcapping (its eager one is Gemma 2's reference)
        return tf.Gemma2Config(**common, head_dim=16, tie_word_embeddings=True, sliding_window=3,
                               query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                               attn_implementation="eager")  # fmt: skip
    if family == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=False)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    return tf.Qwen3MoeConfig(**common, head_dim=16, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=8, decoder_sparse_step=2, norm_topk_prob=True)  # fmt: skip


def _randomize(model, scale: float = 0.3) -> None:
    """Every parameter random at a scale that makes the logits and the routing decisive: norm scales
    near 1, everything else N(0, scale^2)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p))
        for name, b in model.named_buffers():  # DeepSeek's balance bias: positive, so every chosen score is > 0
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.rand_like(b))


def _inputs() -> dict:
    return {"input_ids": np.random.default_rng(0).integers(1, VOCAB, (2, T)).astype(np.int32)}


def _routing_margin(model, inputs: dict) -> float:
    """The smallest gap between a token's k-th and (k+1)-th router probability over every MoE layer
    (DeepSeek: between its k-th and (k+1)-th biased score within the chosen groups, and between the
    chosen groups' scores and the next group's)."""
    import torch

    gaps, hooks = [], []

    def hook(module, args, out):
        probs = torch.softmax(out[1].float(), -1)  # the block returns (states, router logits)
        top = torch.topk(probs, module.top_k + 1, -1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    def deepseek_hook(router, args, out):
        x = args[0].reshape(-1, router.weight.shape[1]).float()
        choice = torch.sigmoid(x @ router.weight.float().T) + router.e_score_correction_bias  # [M, E]
        groups = choice.view(len(choice), router.n_group, -1).topk(2, -1).values.sum(-1)  # [M, groups]
        top_groups = groups.topk(router.topk_group + 1, -1)
        gaps.append(float((top_groups.values[:, -2] - top_groups.values[:, -1]).min()))
        keep = torch.zeros_like(groups).scatter_(1, top_groups.indices[:, :-1], 1.0).bool()
        within = choice.masked_fill(~keep.repeat_interleave(choice.shape[1] // router.n_group, 1), -1e9)
        top = within.topk(router.top_k + 1, -1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))
        assert float(top[:, :-1].min()) > 0  # transformers masks the other groups with 0: never chosen here

    for m in model.modules():
        if type(m).__name__ == "Qwen3MoeSparseMoeBlock":
            hooks.append(m.register_forward_hook(hook))
        if type(m).__name__ == "DeepseekV3TopkRouter":
            hooks.append(m.register_forward_hook(deepseek_hook))
    torch_logits(model, inputs)
    for h in hooks:
        h.remove()
    return min(gaps)


def make(family: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, CLASSES[family])(_config(family)).float().eval()
    # Gemma 2 (no QK-norm: logits of 0.3-scale weights reach float32's 1e-5 limit through the soft cap) and
    # DeepSeek-V3 (float32 differences of 1.2e-5 on logits up to 5.9 at 0.3) at 0.2
    _randomize(model, 0.2 if family in ("gemma2", "deepseek_v3") else 0.3)
    out = GOLDEN / family
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)  # not read
    inputs = _inputs()
    arrays = dict(inputs, logits=torch_logits(model, inputs))
    extra = ""
    if family in SCALED:
        cfg = _config(family)
        cfg.rope_scaling = dict(SCALED[family])
        scaled = getattr(transformers, CLASSES[family])(cfg).float().eval()
        scaled.load_state_dict(model.state_dict())
        arrays["logits_scaled"] = torch_logits(scaled, inputs)
    if family in ("qwen3_moe", "deepseek_v3"):
        margin = _routing_margin(model, inputs)
        assert margin > 1e-3, margin
        extra = f", routing margin {margin:.3g}"
    if family == "qwen3_moe":
        for m in model.modules():
            if type(m).__name__ == "Qwen3MoeSparseMoeBlock":
                m.norm_topk_prob = False
        arrays["logits_unnormalised"] = torch_logits(model, inputs)
    np.savez(out / "logits.npz", **arrays)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(
        f"{out}: transformers {transformers.__version__}, logits {arrays['logits'].shape}, {size / 1024:.1f} KiB{extra}"
    )


# ----------------------------------------------------------------------------- the other direction


def _ours_configs() -> dict:
    """jaxformer-made models of each family, built from jaxformer configs (not from a checkpoint)."""
    import jaxformer as jf
    from jaxformer.config import MLAConfig, MoEConfig, RopeScalingConfig

    small = dict(vocab_size=VOCAB, d_model=D, d_ff=32, max_len=32, dropout_rate=0.0, num_heads=4, num_kv_heads=2,
                 num_decoder_layers=2, norm_eps=1e-6)  # fmt: skip
    qwen2 = jf.llama(**small, qkv_bias=True)
    qwen3 = jf.llama(**small, head_dim=16, qk_norm=True, tie_output=True)
    moe = MoEConfig(num_experts=8, experts_per_token=2, router="softmax_topk", expert_d_ff=8)
    qwen3_moe = jf.llama(**small, head_dim=16, qk_norm=True, moe=moe)
    # Gemma 3: 3 layers, layers 0 and 1 local over 4 positions, layer 2 global; the scale of K^-0.5
    gemma = jf.llama(**small | dict(num_decoder_layers=3), head_dim=16, qk_norm=True, activation="geglu",
                     norm_position="sandwich", norm_plus_one=True, scale_embeddings=True, tie_output=True,
                     sliding_window=4, global_every=3, rope_local_base=10_000.0, rope_base=1_000_000.0)  # fmt: skip
    gemma2 = gemma.replace(qk_norm=False, rope_local_base=None, rope_base=10_000.0, global_every=2,
                           num_decoder_layers=4, attention_softcap=2.0, final_logit_softcap=5.0)  # fmt: skip
    # DeepSeek-V3: queries straight from D (q_lora_rank 0), 2 shared experts, 2 groups of 4 (1 a token)
    mla = MLAConfig(kv_lora_rank=16, q_lora_rank=0, rope_head_dim=8, nope_head_dim=8, v_head_dim=8)
    ds_moe = MoEConfig(num_experts=8, experts_per_token=2, router="sigmoid_topk", num_groups=2, groups_per_token=1,
                       routed_scaling=1.5, first_dense=1, shared_experts=2, expert_d_ff=8)  # fmt: skip
    yarn = RopeScalingConfig(kind="yarn", factor=2.0, original_max_len=16, mscale=1.0, mscale_all_dim=1.0)
    deepseek = jf.llama(**small | dict(num_decoder_layers=3, num_kv_heads=None), mla=mla, moe=ds_moe, rope_scaling=yarn)
    return {"qwen2_ours": ("qwen2", qwen2), "qwen3_ours": ("qwen3", qwen3), "qwen3_moe_ours": ("qwen3_moe", qwen3_moe),
            "gemma3_text_ours": ("gemma3_text", gemma), "gemma2_ours": ("gemma2", gemma2),
            "deepseek_v3_ours": ("deepseek_v3", deepseek)}  # fmt: skip


def export(out: pathlib.Path) -> None:
    """jaxformer writes each golden model back (`<family>_golden`) and a model of its own per family
    (`<family>_ours`) with `save_hf`, beside its float32 logits on the golden inputs."""
    import jax
    from flax import nnx

    import jaxformer as jf
    from jaxformer.interop import hf

    cases = {f"{f}_golden": (f, lambda f=f: hf.load_hf(GOLDEN / f)) for f in FAMILIES}
    for case, (family, cfg) in _ours_configs().items():

        def build(cfg=cfg):
            model = jf.build_model(cfg, 0)
            leaves, tree = jax.tree.flatten(nnx.state(model, nnx.Param))
            keys = jax.random.split(jax.random.key(1), len(leaves))
            noise = [0.3 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
            nnx.update(model, jax.tree.unflatten(tree, noise))
            return model

        cases[case] = (family, build)
    for case, (family, build) in cases.items():
        ref = np.load(GOLDEN / family / "logits.npz")
        model = build()
        shutil.rmtree(out / case, ignore_errors=True)
        hf.save_hf(model, out / case, family=family)
        with jax.default_matmul_precision("highest"):
            logits = model(ref["input_ids"])
        np.savez(out / case / "logits.npz", input_ids=ref["input_ids"], logits=np.asarray(logits))
        print(f"{out / case}: {family}")


def check(out: pathlib.Path) -> None:
    """transformers loads each directory `export` wrote: every tensor used, and its logits against jaxformer's."""
    import transformers as tf

    worst = 0.0
    for case in sorted(p.name for p in out.iterdir() if (p / "config.json").is_file()):
        d = out / case
        fields = json.loads((d / "config.json").read_text())
        cls = getattr(tf, CLASSES[fields["model_type"]])
        eager = {"attn_implementation": "eager"} if fields["model_type"] in EAGER else {}  # as in `_config`
        model, info = cls.from_pretrained(d, output_loading_info=True, **eager)
        model = model.float().eval()
        unexpected, missing = info["unexpected_keys"], [k for k in info["missing_keys"] if "lm_head" not in k]
        assert not unexpected and not missing, (case, unexpected, missing)
        logits, err = against_saved(model, np.load(d / "logits.npz"))
        worst = max(worst, err)
        print(f"{case}: |logits - jaxformer's| max {err:.2e} (|logits| max {np.abs(logits).max():.2f})")
        assert err < TOLERANCE, case
    print(f"transformers {tf.__version__} read all; worst logits difference {worst:.2e}")


def make_all(names: list[str]) -> None:
    """The golden files of each family named (default: all)."""
    for name in names or FAMILIES:
        make(name)


if __name__ == "__main__":
    main(make_all, export, check)
