"""BERT (`bert`): its config.json both ways and one rule per tensor (token types, the embeddings'
norm, post-norm layers, the masked-LM head, the pooler and classifier of a sequence classifier)."""

from __future__ import annotations

from jaxformer.config import ModelConfig
from jaxformer.interop.families.common import ACTIVATION_NAMES, _activation, _get, _require
from jaxformer.interop.rules import Rule, UnsupportedCheckpoint, attention, dense, norm, same


def _bert_config(hf: dict) -> dict:
    _require(hf, "position_embedding_type", ("absolute",), "absolute")
    classifier = any("SequenceClassification" in a for a in hf.get("architectures") or [])
    classes = len(hf.get("id2label") or {}) if classifier else 0
    return dict(
        mode="encoder_only", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        num_heads=hf["num_attention_heads"], d_ff=hf["intermediate_size"],
        num_encoder_layers=hf["num_hidden_layers"], num_decoder_layers=0,
        max_len=hf["max_position_embeddings"], type_vocab_size=hf["type_vocab_size"],
        norm_eps=_get(hf, "layer_norm_eps", 1e-12), activation=_activation(hf, "hidden_act"),
        dropout_rate=_get(hf, "hidden_dropout_prob", 0.1),
        attention_dropout_rate=_get(hf, "attention_probs_dropout_prob", 0.1), position="learned",
        embed_norm=True, scale_embeddings=False, tie_output=_get(hf, "tie_word_embeddings", True),
        pad_id=_get(hf, "pad_token_id", 0), num_classes=classes, pooling="first",
    )  # fmt: skip


def _bert_hf(cfg: ModelConfig) -> dict:
    if cfg.pooling != "first":
        raise UnsupportedCheckpoint("model.pooling='mean': BERT's pooler reads the first token")
    out = dict(
        architectures=["BertForSequenceClassification" if cfg.num_classes else "BertForMaskedLM"],
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_encoder_layers, max_position_embeddings=cfg.max_len,
        type_vocab_size=cfg.type_vocab_size, layer_norm_eps=cfg.norm_eps, hidden_act=ACTIVATION_NAMES[cfg.activation],
        hidden_dropout_prob=cfg.dropout_rate, attention_probs_dropout_prob=cfg.attention_dropout_rate,
        position_embedding_type="absolute", tie_word_embeddings=cfg.tie_output, pad_token_id=cfg.pad_id,
    )  # fmt: skip
    if cfg.num_classes:
        out["id2label"] = {str(c): f"LABEL_{c}" for c in range(cfg.num_classes)}
        out["label2id"] = {f"LABEL_{c}": c for c in range(cfg.num_classes)}
    return out


def _bert_rules(cfg: ModelConfig) -> list[Rule]:
    e, h, L = "bert.embeddings", "bert.encoder.layer.{i}", "encoder.stack.layers.{i}"
    rules = [same(f"{e}.word_embeddings.weight", "encoder.embed.embedding"),
             same(f"{e}.position_embeddings.weight", "encoder.positions.table"),
             same(f"{e}.token_type_embeddings.weight", "encoder.token_types")]  # fmt: skip
    rules += norm(f"{e}.LayerNorm", "encoder.embed_norm", bias=True)
    rules += attention(f"{h}.attention", f"{L}.self_attn", ("self.query", "self.key", "self.value", "output.dense"),
                       bias=True)  # fmt: skip
    rules += norm(f"{h}.attention.output.LayerNorm", f"{L}.self_attn_res.norm", bias=True)
    rules += dense(f"{h}.intermediate.dense", f"{L}.ffn.wi", bias=True)
    rules += dense(f"{h}.output.dense", f"{L}.ffn.wo", bias=True)
    rules += norm(f"{h}.output.LayerNorm", f"{L}.ffn_res.norm", bias=True)
    p = "cls.predictions"
    rules += [Rule(f"{p}.transform.dense.weight", ("mlm_head.transform",), "linear"),
              same(f"{p}.transform.dense.bias", "mlm_head.transform_bias"),
              same(f"{p}.bias", "mlm_head.bias")]  # fmt: skip
    rules += norm(f"{p}.transform.LayerNorm", "mlm_head.norm", bias=True)
    if not cfg.tie_output:
        rules.append(Rule(f"{p}.decoder.weight", ("mlm_head.decoder.kernel",), "linear"))
    if cfg.num_classes:
        rules += [Rule("bert.pooler.dense.weight", ("classifier.pooler",), "linear"),
                  same("bert.pooler.dense.bias", "classifier.pooler_bias"),
                  Rule("classifier.weight", ("classifier.out",), "linear"),
                  same("classifier.bias", "classifier.out_bias")]  # fmt: skip
    return rules
