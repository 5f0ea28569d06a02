"""GPT-2 (`gpt2`): its config.json both ways and one rule per tensor (Conv1D kernels stored [in, out],
the fused QKV split three ways)."""

from __future__ import annotations

from jaxformer.config import ModelConfig
from jaxformer.interop.families.common import ACTIVATION_NAMES, _activation, _get, _pad_token
from jaxformer.interop.rules import Rule, UnsupportedCheckpoint, dense, norm, same


def _gpt2_config(hf: dict) -> dict:
    if hf.get("add_cross_attention") or hf.get("scale_attn_by_inverse_layer_idx"):
        raise UnsupportedCheckpoint("config.json: GPT-2 cross-attention / per-layer attention scaling is not supported")
    D = hf["n_embd"]
    return dict(
        mode="decoder_only", vocab_size=hf["vocab_size"], d_model=D, num_heads=hf["n_head"],
        d_ff=_get(hf, "n_inner", 4 * D), num_encoder_layers=0, num_decoder_layers=hf["n_layer"],
        max_len=hf["n_positions"], activation=_activation(hf, "activation_function"),
        norm_eps=_get(hf, "layer_norm_epsilon", 1e-5), dropout_rate=_get(hf, "resid_pdrop", 0.1),
        attention_dropout_rate=_get(hf, "attn_pdrop", 0.1), position="learned", norm_position="pre",
        scale_embeddings=False, tie_output=_get(hf, "tie_word_embeddings", True), pad_id=_get(hf, "pad_token_id", 0),
    )  # fmt: skip


def _gpt2_hf(cfg: ModelConfig) -> dict:
    return dict(
        architectures=["GPT2LMHeadModel"], vocab_size=cfg.vocab_size, n_embd=cfg.d_model, n_head=cfg.num_heads,
        n_inner=cfg.d_ff, n_layer=cfg.num_decoder_layers, n_positions=cfg.max_len,
        activation_function=ACTIVATION_NAMES[cfg.activation], layer_norm_epsilon=cfg.norm_eps,
        resid_pdrop=cfg.dropout_rate, embd_pdrop=cfg.dropout_rate, attn_pdrop=cfg.attention_dropout_rate,
        tie_word_embeddings=cfg.tie_output, **_pad_token(cfg),
    )  # fmt: skip


def _gpt2_rules(cfg: ModelConfig) -> list[Rule]:
    h, L = "transformer.h.{i}", "decoder.stack.layers.{i}"
    rules = [same("transformer.wte.weight", "decoder.embed.embedding"),
             same("transformer.wpe.weight", "decoder.positions.table")]  # fmt: skip
    rules += norm(f"{h}.ln_1", f"{L}.self_attn_res.norm", bias=True)
    rules += [Rule(f"{h}.attn.c_attn.weight", tuple(f"{L}.self_attn.{n}" for n in "qkv"), "conv1d"),
              Rule(f"{h}.attn.c_attn.bias", tuple(f"{L}.self_attn.{n}_bias" for n in "qkv"), "vector")]  # fmt: skip
    rules += dense(f"{h}.attn.c_proj", f"{L}.self_attn.o", bias=True, inputs=2, layout="conv1d")
    rules += norm(f"{h}.ln_2", f"{L}.ffn_res.norm", bias=True)
    rules += dense(f"{h}.mlp.c_fc", f"{L}.ffn.wi", bias=True, layout="conv1d")
    rules += dense(f"{h}.mlp.c_proj", f"{L}.ffn.wo", bias=True, layout="conv1d")
    rules += norm("transformer.ln_f", "decoder.final_norm", bias=True)
    return rules + ([] if cfg.tie_output else [Rule("lm_head.weight", ("lm_head.kernel",), "linear")])
