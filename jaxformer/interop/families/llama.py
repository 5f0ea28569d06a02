"""Llama (`llama`): its config.json both ways and one rule per tensor (RMSNorm, RoPE, grouped-query
attention, the SwiGLU feed-forward); Mixtral reuses them with experts in the feed-forward."""

from __future__ import annotations

from collections.abc import Callable

from jaxformer.config import ModelConfig
from jaxformer.interop.families.common import _get, _pad_token, _require, _rope_scaling, _rope_scaling_hf
from jaxformer.interop.rules import Rule, attention, dense, norm, same


def _llama_config(hf: dict) -> dict:
    _require(hf, "hidden_act", ("silu",), "silu")
    _require(hf, "attention_bias", (False,), False)
    _require(hf, "mlp_bias", (False,), False)
    D, H = hf["hidden_size"], hf["num_attention_heads"]
    return dict(
        mode="decoder_only", vocab_size=hf["vocab_size"], d_model=D, num_heads=H,
        num_kv_heads=_get(hf, "num_key_value_heads", H), head_dim=_get(hf, "head_dim", D // H),
        d_ff=hf["intermediate_size"], num_encoder_layers=0, num_decoder_layers=hf["num_hidden_layers"],
        max_len=_get(hf, "max_position_embeddings", 2048), norm_eps=_get(hf, "rms_norm_eps", 1e-6),
        rope_base=float(_get(hf, "rope_theta", 10_000.0)), dropout_rate=0.0,
        attention_dropout_rate=_get(hf, "attention_dropout", 0.0), position="rope", activation="swiglu",
        norm="rmsnorm", norm_position="pre", use_bias=False, scale_embeddings=False,
        tie_output=_get(hf, "tie_word_embeddings", False), pad_id=_get(hf, "pad_token_id", 0),
        rope_scaling=_rope_scaling(hf),
    )  # fmt: skip


def _llama_hf(cfg: ModelConfig) -> dict:
    return dict(
        architectures=["LlamaForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.dim_per_head,
        intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_decoder_layers, max_position_embeddings=cfg.max_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_base, hidden_act="silu", attention_bias=False,
        mlp_bias=False, attention_dropout=cfg.attention_dropout_rate, tie_word_embeddings=cfg.tie_output,
        rope_scaling=_rope_scaling_hf(cfg), **_pad_token(cfg),
    )  # fmt: skip


def _llama_mlp(h: str, L: str) -> list[Rule]:
    rules = []
    for theirs, ours in (("gate_proj", "wi_gate"), ("up_proj", "wi"), ("down_proj", "wo")):
        rules += dense(f"{h}.mlp.{theirs}", f"{L}.ffn.{ours}", bias=False)
    return rules


def _llama_rules(cfg: ModelConfig, ffn: Callable[[str, str], list[Rule]] = _llama_mlp) -> list[Rule]:
    """Llama's tensors; `ffn(theirs, ours)` gives a layer's feed-forward rules (Mixtral's are experts)."""
    h, L = "model.layers.{i}", "decoder.stack.layers.{i}"
    rules = [same("model.embed_tokens.weight", "decoder.embed.embedding")]
    rules += norm(f"{h}.input_layernorm", f"{L}.self_attn_res.norm", bias=False)
    rules += attention(f"{h}.self_attn", f"{L}.self_attn", ("q_proj", "k_proj", "v_proj", "o_proj"), bias=False)
    rules += norm(f"{h}.post_attention_layernorm", f"{L}.ffn_res.norm", bias=False)
    rules += ffn(h, L)
    rules += norm("model.norm", "decoder.final_norm", bias=False)
    return rules + ([] if cfg.tie_output else [Rule("lm_head.weight", ("lm_head.kernel",), "linear")])
