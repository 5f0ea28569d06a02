"""Gemma 3's text model (`gemma3_text`) and Gemma 2 (`gemma2`): their config.json both ways and one
rule per tensor.

Gemma 3 is a decoder whose layers alternate local attention over a sliding window (RoPE base
`rope_local_base_freq`) with a global layer every few (RoPE base `rope_theta`), `layer_types` saying
which; each sublayer has a norm before and after it (`norm_position="sandwich"`), every RMSNorm
scales by (1 + w) (`norm_plus_one`), queries and keys are normalised per head (`qk_norm`), the
embeddings are scaled by sqrt(D), the feed-forward is GeGLU with the tanh GELU, the attention
logits are scaled by `query_pre_attn_scalar`^-0.5, and the final logits may be soft-capped. Gemma 2
is the same less QK-norm and the local layers' RoPE base, its attention logits soft-capped too
(`attention_softcap`), a local layer every other one.
"""

from __future__ import annotations

from jaxformer.config import ModelConfig
from jaxformer.interop.families.common import _get, _pad_token, _require, _rope_scaling, _rope_scaling_hf
from jaxformer.interop.families.llama import _llama_mlp
from jaxformer.interop.rules import Rule, UnsupportedCheckpoint, attention, norm, same

LOCAL, GLOBAL = "sliding_attention", "full_attention"


def _global_every(hf: dict, layers: int, pattern: int) -> int:
    """`layer_types` as jaxformer's `global_every` (layer i global when (i + 1) % every == 0; 0: none)."""
    kinds = _get(hf, "layer_types", None)
    if kinds is None:  # transformers' default: Gemma 3's sliding_window_pattern (6), Gemma 2's 2
        every = _get(hf, "sliding_window_pattern", pattern)
        kinds = [GLOBAL if (i + 1) % every == 0 else LOCAL for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {LOCAL, GLOBAL}:
        raise UnsupportedCheckpoint(f"config.json: layer_types={kinds!r} must list {LOCAL!r} or {GLOBAL!r} per layer")
    if GLOBAL not in kinds:
        return 0
    every = kinds.index(GLOBAL) + 1
    if kinds != [GLOBAL if (i + 1) % every == 0 else LOCAL for i in range(layers)]:
        raise UnsupportedCheckpoint(
            f"config.json: layer_types={kinds} is not supported: jaxformer places a global layer every "
            "global_every layers (layer i global when (i + 1) % global_every == 0)"
        )
    return every


def _gemma3_config(hf: dict) -> dict:
    _require(hf, "attn_logit_softcapping", (None,))
    _require(hf, "use_bidirectional_attention", (False,), False)
    fields = _gemma_config(hf, pattern=6)
    # transformers scales the global layers' RoPE alone (the local layers' rotary embedding is "default")
    layers = "global" if fields["sliding_window"] else "all"
    return fields | dict(rope_scaling=_rope_scaling(hf, layers=layers))


def _gemma2_config(hf: dict) -> dict:
    _rope_scaling(hf, kinds=())  # refused: jaxformer reads no RoPE scaling of Gemma 2's
    cap, base = float(_get(hf, "attn_logit_softcapping", 0.0)), float(_get(hf, "rope_theta", 10_000.0))
    fields = _gemma_config(hf, pattern=2)  # one RoPE base for every layer
    return fields | dict(qk_norm=False, attention_softcap=cap, rope_base=base, rope_local_base=None)


def _gemma_config(hf: dict, pattern: int) -> dict:
    _require(hf, "hidden_activation", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh")
    _require(hf, "attention_bias", (False,), False)
    D, H, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    K = _get(hf, "head_dim", 256)
    every = _global_every(hf, layers, pattern)
    window = hf.get("sliding_window") if every != 1 else 0  # every layer global: no window
    if every != 1 and (not isinstance(window, int) or window < 1):
        raise UnsupportedCheckpoint(f"config.json: sliding_window={window!r} must be a positive number of positions")
    base, local_base = float(_get(hf, "rope_theta", 1_000_000.0)), float(_get(hf, "rope_local_base_freq", 10_000.0))
    scalar = _get(hf, "query_pre_attn_scalar", 256)
    return dict(
        mode="decoder_only", vocab_size=hf["vocab_size"], d_model=D, num_heads=H,
        num_kv_heads=_get(hf, "num_key_value_heads", H), head_dim=K, d_ff=hf["intermediate_size"],
        num_encoder_layers=0, num_decoder_layers=layers, max_len=_get(hf, "max_position_embeddings", 131_072),
        norm_eps=_get(hf, "rms_norm_eps", 1e-6), rope_base=base, sliding_window=window,
        global_every=every if window else 0,
        rope_local_base=local_base if window and local_base != base else None,
        dropout_rate=0.0, attention_dropout_rate=_get(hf, "attention_dropout", 0.0), position="rope",
        activation="geglu", norm="rmsnorm", norm_position="sandwich", norm_plus_one=True, qk_norm=True,
        use_bias=False, scale_embeddings=True, attention_scale=None if scalar == K else float(scalar) ** -0.5,
        final_logit_softcap=float(_get(hf, "final_logit_softcapping", 0.0)),
        tie_output=_get(hf, "tie_word_embeddings", True), pad_id=_get(hf, "pad_token_id", 0),
    )  # fmt: skip


def _gemma3_hf(cfg: ModelConfig) -> dict:
    K, L = cfg.dim_per_head, cfg.num_decoder_layers
    kinds = [LOCAL if cfg.is_local_layer(i) else GLOBAL for i in range(L)]
    scalar = K if cfg.attention_scale is None else round(cfg.attention_scale**-2, 6)
    return dict(
        architectures=["Gemma3ForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads, head_dim=K,
        intermediate_size=cfg.d_ff, num_hidden_layers=L, max_position_embeddings=cfg.max_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_base, rope_local_base_freq=cfg.rope_local_base or cfg.rope_base,
        sliding_window=cfg.sliding_window or cfg.max_len, layer_types=kinds, hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=scalar, attention_bias=False, attention_dropout=cfg.attention_dropout_rate,
        final_logit_softcapping=cfg.final_logit_softcap or None, attn_logit_softcapping=None,
        rope_scaling=_rope_scaling_hf(cfg),
        tie_word_embeddings=cfg.tie_output, **_pad_token(cfg),
    )  # fmt: skip


def _gemma2_hf(cfg: ModelConfig) -> dict:
    hf = {k: v for k, v in _gemma3_hf(cfg).items() if k != "rope_local_base_freq"}
    return hf | dict(architectures=["Gemma2ForCausalLM"], attn_logit_softcapping=cfg.attention_softcap or None)


def _gemma2_rules(cfg: ModelConfig) -> list[Rule]:
    return [r for r in _gemma3_rules(cfg) if not r.theirs.endswith(("q_norm.weight", "k_norm.weight"))]


def _gemma3_rules(cfg: ModelConfig) -> list[Rule]:
    h, L = "model.layers.{i}", "decoder.stack.layers.{i}"
    rules = [same("model.embed_tokens.weight", "decoder.embed.embedding")]
    sandwich = (
        ("input_layernorm", "self_attn_res.norm"),
        ("post_attention_layernorm", "self_attn_res.post_norm"),
        ("pre_feedforward_layernorm", "ffn_res.norm"),
        ("post_feedforward_layernorm", "ffn_res.post_norm"),
    )
    for theirs, ours in sandwich:
        rules += norm(f"{h}.{theirs}", f"{L}.{ours}", bias=False)
    rules += attention(f"{h}.self_attn", f"{L}.self_attn", ("q_proj", "k_proj", "v_proj", "o_proj"), bias=False)
    rules += [same(f"{h}.self_attn.{n}_norm.weight", f"{L}.self_attn.{n}_norm") for n in "qk"]
    rules += _llama_mlp(h, L)
    rules += norm("model.norm", "decoder.final_norm", bias=False)
    return rules + ([] if cfg.tie_output else [Rule("lm_head.weight", ("lm_head.kernel",), "linear")])
