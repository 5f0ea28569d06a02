"""DeepSeek-V3 (`deepseek_v3`): its config.json both ways and one rule per tensor.

A decoder of multi-head latent attention (`model.mla`: queries through a low-rank Cq with its RMSNorm,
or straight from D; keys and values per head from a cached latent of C dims with its RMSNorm, the key's
R rope dims shared by the heads) and a SwiGLU feed-forward that is dense in the first
`first_k_dense_replace` layers (`model.moe.first_dense`) and elsewhere DeepSeekMoE: top-k of
`n_routed_experts` small experts by sigmoid scores plus a balance bias (`e_score_correction_bias`,
our `router_bias`), limited to the best `topk_group` of `n_group` groups, the weights renormalised
(`norm_topk_prob`) and times `routed_scaling_factor`, beside one dense FFN as wide as the
`n_shared_experts` shared experts. RoPE is usually yarn-scaled (`model.rope_scaling`), its
mscale_all_dim scaling the logits too.

transformers (`rope_interleave=True`, the default) rotates interleaved pairs (0, 1), (2, 3), ... of a
head's rope dims, jaxformer the halves (i, i + R/2): the rope rows of the query's up-projection and of
the latent's down-projection are reordered on the way in (even dims first, then odd) and back on the
way out, which leaves every q.k unchanged. The checkpoint's multi-token prediction modules
(`num_nextn_predict_layers`, `model.mtp_depth`) are its layers num_hidden_layers + k (61 in V3):
`enorm`, `hnorm`, `eh_proj`, a decoder layer and `shared_head.norm` (their `embed_tokens` and
`shared_head.head` are copies of the model's, not read, not written); transformers reads none of them.
"""

from __future__ import annotations

import dataclasses

from jaxformer.config import MLAConfig, ModelConfig, MoEConfig
from jaxformer.interop.families.common import _experts, _get, _pad_token, _require, _rope_scaling, _rope_scaling_hf
from jaxformer.interop.families.llama import _llama_mlp
from jaxformer.interop.rules import Rule, UnsupportedCheckpoint, norm, same

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm and kv_a_layernorm keep RMSNorm's default eps


def _positive(hf: dict, key: str) -> int:
    value = hf[key]
    if not isinstance(value, int) or value < 1:
        raise UnsupportedCheckpoint(f"config.json: {key}={value!r} must be a positive integer")
    return value


def _deepseek_config(hf: dict) -> dict:
    if hf.get("quantization_config"):  # the published V3 is FP8 blocks with their weight_scale_inv tensors
        method = hf["quantization_config"].get("quant_method") if isinstance(hf["quantization_config"], dict) else None
        raise UnsupportedCheckpoint(
            f"config.json: quantization_config (quant_method={method!r}) is not supported: jaxformer reads "
            "float weights (dequantize the checkpoint to bfloat16 first)"
        )
    _require(hf, "hidden_act", ("silu",), "silu")
    _require(hf, "attention_bias", (False,), False)
    _require(hf, "rope_interleave", (True,), True)  # the rope rows' order the rules read
    _require(hf, "rms_norm_eps", (LATENT_NORM_EPS,), LATENT_NORM_EPS)  # one eps for every norm
    D, H, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    if _get(hf, "num_key_value_heads", H) != H:
        raise UnsupportedCheckpoint(
            f"config.json: num_key_value_heads={hf['num_key_value_heads']} is not supported: "
            f"latent attention's keys are per head (num_attention_heads={H})"
        )
    E, k = _experts(hf, "n_routed_experts"), hf["num_experts_per_tok"]
    if not isinstance(k, int) or not 1 <= k <= E:
        raise UnsupportedCheckpoint(f"config.json: num_experts_per_tok={k!r} must be in [1, n_routed_experts={E}]")
    first = _get(hf, "first_k_dense_replace", 0)
    if not isinstance(first, int) or not 0 <= first < layers:
        raise UnsupportedCheckpoint(
            f"config.json: first_k_dense_replace={first!r} must leave an MoE layer of num_hidden_layers={layers}"
        )
    groups, chosen = _positive(hf, "n_group"), _positive(hf, "topk_group")
    if chosen > groups:
        raise UnsupportedCheckpoint(f"config.json: topk_group={chosen} must be in [1, n_group={groups}]")
    moe = MoEConfig(
        num_experts=E, experts_per_token=k, router="sigmoid_topk",
        normalize_topk=bool(_get(hf, "norm_topk_prob", True)),
        routed_scaling=float(_get(hf, "routed_scaling_factor", 1.0)), num_groups=groups,
        groups_per_token=chosen, first_dense=first,
        shared_experts=_positive(hf, "n_shared_experts"), expert_d_ff=hf["moe_intermediate_size"],
    )  # fmt: skip
    mla = MLAConfig(kv_lora_rank=_positive(hf, "kv_lora_rank"), q_lora_rank=_get(hf, "q_lora_rank", 0),
                    rope_head_dim=hf["qk_rope_head_dim"], nope_head_dim=hf["qk_nope_head_dim"],
                    v_head_dim=hf["v_head_dim"])  # fmt: skip
    return dict(
        mode="decoder_only", vocab_size=hf["vocab_size"], d_model=D, num_heads=H, d_ff=hf["intermediate_size"],
        num_encoder_layers=0, num_decoder_layers=layers, max_len=_get(hf, "max_position_embeddings", 4096),
        norm_eps=LATENT_NORM_EPS, rope_base=float(_get(hf, "rope_theta", 10_000.0)), dropout_rate=0.0,
        attention_dropout_rate=_get(hf, "attention_dropout", 0.0), position="rope", activation="swiglu",
        norm="rmsnorm", norm_position="pre", use_bias=False, scale_embeddings=False,
        tie_output=_get(hf, "tie_word_embeddings", False), pad_id=_get(hf, "pad_token_id", 0),
        rope_scaling=_rope_scaling(hf, logits_mscale=True), mla=mla, moe=moe,
        mtp_depth=_get(hf, "num_nextn_predict_layers", 0),
    )  # fmt: skip


def _deepseek_hf(cfg: ModelConfig) -> dict:
    m, moe = cfg.mla, cfg.moe
    if not m.enabled or not moe.enabled:
        raise UnsupportedCheckpoint("deepseek_v3 is latent attention (model.mla.kv_lora_rank > 0) with experts")
    return dict(
        architectures=["DeepseekV3ForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff, moe_intermediate_size=moe.expert_d_ff or cfg.d_ff,
        num_hidden_layers=cfg.num_decoder_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads, n_shared_experts=moe.shared_experts, n_routed_experts=moe.num_experts,
        routed_scaling_factor=moe.routed_scaling, kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank or None,
        qk_rope_head_dim=m.rope_head_dim, v_head_dim=m.v_head_dim, qk_nope_head_dim=m.nope_head_dim,
        n_group=moe.num_groups, topk_group=moe.groups_per_token, num_experts_per_tok=moe.experts_per_token,
        first_k_dense_replace=moe.first_dense, norm_topk_prob=moe.normalize_topk, hidden_act="silu",
        max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_output,
        rope_theta=cfg.rope_base, rope_scaling=_rope_scaling_hf(cfg), rope_interleave=True, attention_bias=False,
        attention_dropout=cfg.attention_dropout_rate, num_nextn_predict_layers=cfg.mtp_depth, **_pad_token(cfg),
    )  # fmt: skip


def _rope_rows(prefix: int, rope: int) -> list[int]:
    """Rows [prefix | rope dims] with the rope dims' interleaved pairs as rotate-half's halves: the
    even dims, then the odd ones."""
    return list(range(prefix)) + [prefix + d for d in (*range(0, rope, 2), *range(1, rope, 2))]


def _deepseek_rules(cfg: ModelConfig) -> list[Rule]:
    h, L = "model.layers.{i}", "decoder.stack.layers.{i}"
    m = cfg.mla
    N, R = m.nope_head_dim, m.rope_head_dim
    q_rows = tuple(head * (N + R) + r for head in range(cfg.num_heads) for r in _rope_rows(N, R))
    a, o = f"{h}.self_attn", f"{L}.self_attn"
    rules = [same("model.embed_tokens.weight", "decoder.embed.embedding")]
    rules += norm(f"{h}.input_layernorm", f"{L}.self_attn_res.norm", bias=False)
    if m.q_lora_rank:
        rules += [Rule(f"{a}.q_a_proj.weight", (f"{o}.q_down",), "linear"),
                  same(f"{a}.q_a_layernorm.weight", f"{o}.q_norm"),
                  Rule(f"{a}.q_b_proj.weight", (f"{o}.q_up",), "linear", rows=q_rows)]  # fmt: skip
    else:
        rules.append(Rule(f"{a}.q_proj.weight", (f"{o}.query",), "linear", rows=q_rows))
    rules += [
        Rule(f"{a}.kv_a_proj_with_mqa.weight", (f"{o}.kv_down",), "linear", rows=tuple(_rope_rows(m.kv_lora_rank, R))),
        same(f"{a}.kv_a_layernorm.weight", f"{o}.kv_norm"),
        Rule(f"{a}.kv_b_proj.weight", (f"{o}.kv_up",), "linear"),
        Rule(f"{a}.o_proj.weight", (f"{o}.out",), "linear", inputs=2),
    ]
    rules += norm(f"{h}.post_attention_layernorm", f"{L}.ffn_res.norm", bias=False)
    rules += [Rule(r.theirs, r.ours, r.layout, r.inputs, layers="dense") for r in _llama_mlp(h, L)]
    mlp, ffn = f"{h}.mlp", f"{L}.ffn"
    rules += [Rule(f"{mlp}.gate.weight", (f"{ffn}.router",), "linear", layers="moe"),
              Rule(f"{mlp}.gate.e_score_correction_bias", (f"{ffn}.router_bias",), layers="moe")]  # fmt: skip
    for theirs, ours in (("gate_proj", "wi_gate"), ("up_proj", "wi"), ("down_proj", "wo")):
        rules.append(Rule(f"{mlp}.experts.{{e}}.{theirs}.weight", (f"{ffn}.{ours}[{{e}}]",), "linear", layers="moe"))
        rules.append(Rule(f"{mlp}.shared_experts.{theirs}.weight", (f"{ffn}.shared_{ours}",), "linear", layers="moe"))
    layer = rules[1:]  # a decoder layer's rules, "{i}" for its index
    rules += norm("model.norm", "decoder.final_norm", bias=False)
    rules += _mtp_rules(cfg, layer)
    return rules + ([] if cfg.tie_output else [Rule("lm_head.weight", ("lm_head.kernel",), "linear")])


def _mtp_rules(cfg: ModelConfig, layer: list[Rule]) -> list[Rule]:
    """Multi-token prediction module k (from 0) as the checkpoint's layer num_hidden_layers + k: its
    norms, eh_proj [D, 2D] and a decoder layer's tensors (MoE where the decoder's pattern puts it)."""
    rules = []
    for k in range(cfg.mtp_depth):
        index = cfg.num_decoder_layers + k
        h, m = f"model.layers.{index}", f"mtp.{k}"
        moe = cfg.moe.is_moe_layer("decoder", index)
        rules += [same(f"{h}.enorm.weight", f"{m}.enorm.scale"), same(f"{h}.hnorm.weight", f"{m}.hnorm.scale"),
                  Rule(f"{h}.eh_proj.weight", (f"{m}.eh_proj",), "linear"),
                  same(f"{h}.shared_head.norm.weight", f"{m}.final_norm.scale")]  # fmt: skip
        for r in layer:
            if r.layers != "all" and (r.layers == "moe") != moe:
                continue
            theirs = r.theirs.replace("model.layers.{i}", h)
            ours = tuple(o.replace("decoder.stack.layers.{i}", f"{m}.stack.layers.0") for o in r.ours)
            for e in range(cfg.moe.num_experts) if "{e}" in theirs else (None,):
                rules.append(dataclasses.replace(r, theirs=theirs.format(e=e), ours=tuple(o.format(e=e) for o in ours),
                                                 layers="all"))  # fmt: skip
    return rules
