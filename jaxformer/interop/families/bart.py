"""BART (`bart`): its config.json both ways and one rule per tensor (an encoder-decoder with learned
positions offset by 2, the embeddings' norm, post-norm layers, the final logits' bias)."""

from __future__ import annotations

from jaxformer.config import ModelConfig
from jaxformer.interop.families.common import ACTIVATION_NAMES, _activation, _get, _require, _same_on_both_sides
from jaxformer.interop.rules import Rule, attention, dense, norm, same


def _bart_config(hf: dict) -> dict:
    for key in ("add_bias_logits", "normalize_before", "add_final_layer_norm"):
        _require(hf, key, (False, None))
    return dict(
        mode="encoder_decoder", vocab_size=hf["vocab_size"], d_model=hf["d_model"],
        num_heads=_same_on_both_sides(hf, "encoder_attention_heads", "decoder_attention_heads"),
        d_ff=_same_on_both_sides(hf, "encoder_ffn_dim", "decoder_ffn_dim"),
        num_encoder_layers=hf["encoder_layers"], num_decoder_layers=hf["decoder_layers"],
        max_len=hf["max_position_embeddings"], position="learned", position_offset=2, embed_norm=True,
        activation=_activation(hf, "activation_function"), norm_eps=1e-5, dropout_rate=_get(hf, "dropout", 0.1),
        attention_dropout_rate=_get(hf, "attention_dropout", 0.0),
        scale_embeddings=bool(_get(hf, "scale_embedding", False)), logits_bias=True,
        tie_output=_get(hf, "tie_word_embeddings", True), pad_id=_get(hf, "pad_token_id", 1),
    )  # fmt: skip


def _bart_hf(cfg: ModelConfig) -> dict:
    return dict(
        architectures=["BartForConditionalGeneration"], vocab_size=cfg.vocab_size, d_model=cfg.d_model,
        encoder_attention_heads=cfg.num_heads, decoder_attention_heads=cfg.num_heads,
        encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff, encoder_layers=cfg.num_encoder_layers,
        decoder_layers=cfg.num_decoder_layers, max_position_embeddings=cfg.max_len,
        activation_function=ACTIVATION_NAMES[cfg.activation], dropout=cfg.dropout_rate,
        attention_dropout=cfg.attention_dropout_rate, scale_embedding=cfg.scale_embeddings,
        tie_word_embeddings=cfg.tie_output, pad_token_id=cfg.pad_id,
    )  # fmt: skip


def _bart_rules(cfg: ModelConfig) -> list[Rule]:
    rules = [same("model.shared.weight", "decoder.embed.embedding")]
    rules += [Rule("final_logits_bias", ("lm_head.bias",), "row")]
    for side in ("encoder", "decoder"):
        h, L = f"model.{side}.layers.{{i}}", f"{side}.stack.layers.{{i}}"
        rules += [same(f"model.{side}.embed_positions.weight", f"{side}.positions.table")]
        rules += norm(f"model.{side}.layernorm_embedding", f"{side}.embed_norm", bias=True)
        attentions = [("self_attn", "self_attn")] + ([("encoder_attn", "cross_attn")] if side == "decoder" else [])
        for theirs, ours in attentions:
            rules += attention(f"{h}.{theirs}", f"{L}.{ours}", ("q_proj", "k_proj", "v_proj", "out_proj"), bias=True)
            rules += norm(f"{h}.{theirs}_layer_norm", f"{L}.{ours}_res.norm", bias=True)
        rules += dense(f"{h}.fc1", f"{L}.ffn.wi", bias=True) + dense(f"{h}.fc2", f"{L}.ffn.wo", bias=True)
        rules += norm(f"{h}.final_layer_norm", f"{L}.ffn_res.norm", bias=True)
    return rules + ([] if cfg.tie_output else [Rule("lm_head.weight", ("lm_head.kernel",), "linear")])
