"""T5 (`t5`): its config.json both ways and one rule per tensor (relative position buckets, RMSNorm,
no biases, the gated feed-forward of T5 v1.1); Switch Transformers reuses them with experts."""

from __future__ import annotations

from collections.abc import Callable

from jaxformer.config import ModelConfig
from jaxformer.interop.families.common import _get, _require
from jaxformer.interop.rules import Rule, attention, dense, norm, same

T5_FFN = {"relu": "relu", "gated-gelu": "geglu"}


def _t5_config(hf: dict) -> dict:
    tied = _get(hf, "tie_word_embeddings", True)
    return dict(
        mode="encoder_decoder", vocab_size=hf["vocab_size"], d_model=hf["d_model"], num_heads=hf["num_heads"],
        head_dim=hf["d_kv"], d_ff=hf["d_ff"], num_encoder_layers=hf["num_layers"],
        num_decoder_layers=_get(hf, "num_decoder_layers", hf["num_layers"]), max_len=_get(hf, "n_positions", 512),
        position="relative", relative_buckets=_get(hf, "relative_attention_num_buckets", 32),
        relative_max_distance=_get(hf, "relative_attention_max_distance", 128),
        activation=T5_FFN[_require(hf, "feed_forward_proj", tuple(T5_FFN), "relu")], norm="rmsnorm",
        norm_position="pre", norm_eps=_get(hf, "layer_norm_epsilon", 1e-6), dropout_rate=_get(hf, "dropout_rate", 0.1),
        use_bias=False, scale_attention=False, scale_embeddings=False, tie_output=tied, scale_tied_logits=tied,
        pad_id=_get(hf, "pad_token_id", 0),
    )  # fmt: skip


def _t5_hf(cfg: ModelConfig) -> dict:
    return dict(
        architectures=["T5ForConditionalGeneration"], vocab_size=cfg.vocab_size, d_model=cfg.d_model,
        num_heads=cfg.num_heads, d_kv=cfg.dim_per_head, d_ff=cfg.d_ff, num_layers=cfg.num_encoder_layers,
        num_decoder_layers=cfg.num_decoder_layers, n_positions=cfg.max_len,
        relative_attention_num_buckets=cfg.relative_buckets, relative_attention_max_distance=cfg.relative_max_distance,
        feed_forward_proj={v: k for k, v in T5_FFN.items()}[cfg.activation], layer_norm_epsilon=cfg.norm_eps,
        dropout_rate=cfg.dropout_rate, tie_word_embeddings=cfg.tie_output, pad_token_id=cfg.pad_id,
        decoder_start_token_id=cfg.pad_id, is_encoder_decoder=True,
    )  # fmt: skip


def _t5_ffn(cfg: ModelConfig, f: str, L: str) -> list[Rule]:
    if cfg.activation == "geglu":
        rules = dense(f"{f}.DenseReluDense.wi_0", f"{L}.ffn.wi_gate", bias=False)
        rules += dense(f"{f}.DenseReluDense.wi_1", f"{L}.ffn.wi", bias=False)
    else:
        rules = dense(f"{f}.DenseReluDense.wi", f"{L}.ffn.wi", bias=False)
    return rules + dense(f"{f}.DenseReluDense.wo", f"{L}.ffn.wo", bias=False)


def _t5_rules(cfg: ModelConfig, ffn: Callable[[ModelConfig, str, str], list[Rule]] = _t5_ffn) -> list[Rule]:
    """T5's tensors; `ffn(cfg, theirs, ours)` gives a layer's feed-forward rules (Switch's are experts)."""
    rules = [same("shared.weight", "decoder.embed.embedding")]
    qkvo = ("q", "k", "v", "o")
    for side in ("encoder", "decoder"):
        h, L = f"{side}.block.{{i}}.layer", f"{side}.stack.layers.{{i}}"
        sublayers = [("SelfAttention", "self_attn")]
        if side == "decoder":
            sublayers.append(("EncDecAttention", "cross_attn"))
        rules.append(
            same(f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", f"{side}.relative_bias.table")
        )
        for n, (theirs, ours) in enumerate(sublayers):
            rules += attention(f"{h}.{n}.{theirs}", f"{L}.{ours}", qkvo, bias=False)
            rules += norm(f"{h}.{n}.layer_norm", f"{L}.{ours}_res.norm", bias=False)
        f = f"{h}.{len(sublayers)}"
        rules += ffn(cfg, f, L)
        rules += norm(f"{f}.layer_norm", f"{L}.ffn_res.norm", bias=False)
        rules += norm(f"{side}.final_layer_norm", f"{side}.final_norm", bias=False)
    return rules + ([] if cfg.tie_output else [Rule("lm_head.weight", ("lm_head.kernel",), "linear")])
