"""Hugging Face checkpoints in and out: GPT-2, Llama, BERT, BART, T5, and the mixtures of experts
Mixtral and Switch Transformers.

A Hugging Face model directory holds `config.json` and the weights in the hub's PyTorch naming,
in `model.safetensors` or in shards listed by `model.safetensors.index.json`:

    model = load_hf("gpt2/")                        # a Transformer, parameters float32
    model = load_hf("llama/", mesh=mesh)            # each tensor sharded onto the mesh as it is read
    model = load_hf("t5/", scan_layers=True)        # any ModelConfig field can be overridden
    save_hf(model, "out/")                          # config.json + model.safetensors, readable by transformers
    model = load_hf("gpt2/", adapter="lora/")       # with a PEFT LoRA adapter (every family)
    save_peft(model, lora_cfg, "lora/")             # its adapters as a PEFT adapter directory

Each family is a table (`FAMILIES`): how its `config.json` reads as a `ModelConfig` and back, and
one `Rule` per checkpoint tensor naming the jaxformer parameter(s) it is and how the layout
changes. jaxformer's parameter paths are those of `nnx.to_flat_state(nnx.state(model))` for
unrolled layers (docs/parameters.md); scanned stacks hold the same tensors stacked on a
leading layer axis. A mixture-of-experts layer stacks its experts' kernels on a leading expert
axis: a rule's `ours` path ending in `[{e}]` is expert e's slice of it. Tensors are read one at a
time, converted on the host and placed on their devices before the next is read (a stack filled
there slice by slice), so the host holds one tensor at a time, never the whole model. A
checkpoint option jaxformer cannot express fails with the field named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import pathlib
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer.config import ModelConfig, MoEConfig
from jaxformer.interop.rules import (
    Rule,
    UnsupportedCheckpoint,
    _expand,
    attention,
    dense,
    norm,
    same,
    to_ours,
    to_theirs,
)
from jaxformer.models import Transformer

log = logging.getLogger("jaxformer.interop")

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Parameters a checkpoint may lack (a new task head): they keep their fresh initialisation.
HEADS = ("lm_head.", "mlm_head.", "classifier.")


# ----------------------------------------------------------------------------- config fields


def _get(hf: dict, key: str, default=None):
    value = hf.get(key, default)
    return default if value is None else value


def _require(hf: dict, key: str, allowed, default=None):
    """hf[key] (or its default), which must be one of `allowed`."""
    value = hf.get(key, default)
    if value not in allowed:
        raise UnsupportedCheckpoint(f"config.json: {key}={value!r} is not supported (jaxformer reads {allowed})")
    return value


# HF activation names -> ours ("gelu" in Hugging Face is the exact erf form; ours is the tanh one).
ACTIVATIONS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}
ACTIVATION_NAMES = {"gelu_exact": "gelu", "gelu": "gelu_new", "relu": "relu"}


def _activation(hf: dict, key: str) -> str:
    return ACTIVATIONS[_require(hf, key, tuple(ACTIVATIONS), "gelu")]


def _same_on_both_sides(hf: dict, encoder_key: str, decoder_key: str):
    if hf[encoder_key] != hf[decoder_key]:
        raise UnsupportedCheckpoint(
            f"config.json: {encoder_key}={hf[encoder_key]} != {decoder_key}={hf[decoder_key]}; "
            "jaxformer's encoder and decoder share one width"
        )
    return hf[encoder_key]


# ----------------------------------------------------------------------------- families


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its config.json both ways and its tensor rules.

    Attributes:
        model_type: config.json's model_type ("gpt2", "llama", ...).
        prefix: the base model's prefix, which bare-model checkpoints leave out.
        to_config: config.json -> ModelConfig fields.
        from_config: ModelConfig -> config.json fields.
        rules: ModelConfig -> the tensor rules.
        ignore: regexes of tensors with no place in jaxformer.
    """

    model_type: str
    prefix: str  # the base model's prefix, which bare-model checkpoints leave out ("transformer.", "bert.")
    to_config: Callable[[dict], dict]  # config.json -> ModelConfig fields
    from_config: Callable[[ModelConfig], dict]  # ModelConfig -> config.json fields
    rules: Callable[[ModelConfig], list[Rule]]
    ignore: tuple[str, ...] = ()  # regexes of tensors with no place in jaxformer (buffers, unused heads)


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


def _pad_token(cfg: ModelConfig) -> dict:
    """A decoder-only model's pad id, written only when not 0: its padding is structure (lengths), and
    transformers would take every id-0 token of a prompt for padding."""
    return {"pad_token_id": cfg.pad_id} if cfg.pad_id else {}


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


def _llama_config(hf: dict) -> dict:
    _require(hf, "hidden_act", ("silu",), "silu")
    _require(hf, "rope_scaling", (None,))
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
    )  # fmt: skip


def _llama_hf(cfg: ModelConfig) -> dict:
    return dict(
        architectures=["LlamaForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.dim_per_head,
        intermediate_size=cfg.d_ff, num_hidden_layers=cfg.num_decoder_layers, max_position_embeddings=cfg.max_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_base, hidden_act="silu", attention_bias=False,
        mlp_bias=False, attention_dropout=cfg.attention_dropout_rate, tie_word_embeddings=cfg.tie_output,
        **_pad_token(cfg),
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


# ----------------------------------------------------------------------------- mixtures of experts


def _experts(hf: dict, num_key: str) -> int:
    """The checkpoint's expert count (`num_key`), checked."""
    E = hf[num_key]
    if not isinstance(E, int) or E < 1:
        raise UnsupportedCheckpoint(f"config.json: {num_key}={E!r} must be a positive number of experts")
    return E


def _mixtral_config(hf: dict) -> dict:
    # Mixtral's jitter (training only) scales the experts' inputs too, jaxformer's router_noise the router's alone.
    _require(hf, "router_jitter_noise", (0, 0.0), 0.0)
    sliding, longest = hf.get("sliding_window"), _get(hf, "max_position_embeddings", 2048)
    if sliding is not None and sliding < longest:
        raise UnsupportedCheckpoint(
            f"config.json: sliding_window={sliding} (< max_position_embeddings={longest}) is not supported: "
            "jaxformer's attention sees the whole causal prefix"
        )
    k = hf["num_experts_per_tok"]
    E = _experts(hf, "num_local_experts")
    if not isinstance(k, int) or not 1 <= k <= E:
        raise UnsupportedCheckpoint(f"config.json: num_experts_per_tok={k!r} must be in [1, num_local_experts={E}]")
    # transformers adds the load-balancing loss only with output_router_logits.
    aux = float(_get(hf, "router_aux_loss_coef", 0.001)) if hf.get("output_router_logits") else 0.0
    moe = MoEConfig(num_experts=E, experts_per_token=k, router="topk_softmax", aux_loss_weight=aux)
    return _llama_config(hf) | dict(moe=moe)


def _mixtral_hf(cfg: ModelConfig) -> dict:
    moe = cfg.moe
    hf = {k: v for k, v in _llama_hf(cfg).items() if k not in ("attention_bias", "mlp_bias")}
    return hf | dict(
        architectures=["MixtralForCausalLM"], num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.experts_per_token, router_jitter_noise=0.0, sliding_window=None,
        output_router_logits=moe.aux_loss_weight > 0, router_aux_loss_coef=moe.aux_loss_weight,
    )  # fmt: skip


def _mixtral_experts(h: str, L: str) -> list[Rule]:
    """Mixtral's sparse block: the router (gate) [E, D] and per expert w1 (the SiLU-gated half), w3 (up),
    w2 (down), each expert's slice of our stacked kernels."""
    m = f"{h}.block_sparse_moe"
    rules = [Rule(f"{m}.gate.weight", (f"{L}.ffn.router",), "linear")]
    for theirs, ours in (("w1", "wi_gate"), ("w3", "wi"), ("w2", "wo")):
        rules.append(Rule(f"{m}.experts.{{e}}.{theirs}.weight", (f"{L}.ffn.{ours}[{{e}}]",), "linear"))
    return rules


SWITCH_STACKS = (("encoder", "num_layers"), ("decoder", "num_decoder_layers"))  # (stack, its depth's field)


def _switch_sparse_layers(num_layers: int, step: int) -> set[int]:
    """The layers transformers' SwitchTransformersStack makes sparse: layer i when step > 0 and
    (step == 1 or i % step == 1). Every layer with step 1; layers 1, 1 + step, 1 + 2 * step, ...
    with step >= 2 (layer 1 alone once step >= num_layers - 1, none in a 1-layer stack); none with
    step <= 0."""
    return {i for i in range(num_layers) if step > 0 and (step == 1 or i % step == 1)}


def _switch_sparse_step(hf: dict, stack: str, num_layers: int) -> int:
    """The `{stack}_sparse_step` transformers' model reads: config.json's own when it has one (the
    config class keeps a saved value over the one it computes), else what the config class computes
    from num_sparse_{stack}_layers: num_layers // num_sparse, or num_layers when num_sparse is 0."""
    key = f"{stack}_sparse_step"
    if key in hf:
        step = hf[key]
        if not isinstance(step, int) or isinstance(step, bool):
            raise UnsupportedCheckpoint(f"config.json: {key}={step!r} must be a whole number of layers")
        return step
    count = f"num_sparse_{stack}_layers"
    num_sparse = _get(hf, count, 3)
    if not isinstance(num_sparse, int) or isinstance(num_sparse, bool):
        raise UnsupportedCheckpoint(f"config.json: {count}={num_sparse!r} must be a whole number of layers")
    return num_layers // num_sparse if num_sparse > 0 else num_layers


def _layout_of(layers: set[int], num_layers: int) -> tuple[int, int | None] | None:
    """The (every, offset) whose MoE layers (i % every == offset) in a stack of `num_layers` are exactly
    `layers`: (0, None) for none, a lone layer o as (num_layers, o); None when no pair says them."""
    ordered = sorted(layers)
    if not ordered:
        return 0, None
    every = ordered[1] - ordered[0] if len(ordered) > 1 else num_layers
    offset = ordered[0]
    if offset >= every or {i for i in range(num_layers) if i % every == offset} != layers:
        return None
    return every, offset


def _moe_layer_set(cfg: ModelConfig, stack: str) -> set[int]:
    layers = cfg.num_encoder_layers if stack == "encoder" else cfg.num_decoder_layers
    return {i for i in range(layers) if cfg.moe.is_moe_layer(stack, i)}


def _layout_fields(layouts: dict[str, tuple[int, int | None]]) -> dict:
    """MoEConfig's layout fields for each stack's (every, offset): one shared `every` (the decoder's
    when it has MoE layers), and a stack's own every and offset only where they differ from it."""
    shared = next((every for every, _ in (layouts["decoder"], layouts["encoder"]) if every), 1)
    fields = dict(every=shared)
    for stack, (every, offset) in layouts.items():
        if every != shared:
            fields[f"{stack}_every"] = every
        if every and offset != every - 1:
            fields[f"{stack}_offset"] = offset
    return fields


def _switch_config(hf: dict) -> dict:
    _require(hf, "router_bias", (False,), False)
    _require(hf, "router_dtype", ("float32",), "float32")  # jaxformer's router runs in float32
    E = _experts(hf, "num_experts")
    layouts = {}
    for stack, depth in SWITCH_STACKS:
        layers = hf["num_layers"] if depth == "num_layers" else _get(hf, depth, hf["num_layers"])
        sparse = _switch_sparse_layers(layers, _switch_sparse_step(hf, stack, layers))
        layouts[stack] = _layout_of(sparse, layers)  # every pattern transformers builds has one
    capacity = _get(hf, "expert_capacity", 64)
    if not isinstance(capacity, int) or capacity < 1:
        raise UnsupportedCheckpoint(f"config.json: expert_capacity={capacity!r} must be a positive number of tokens")
    moe = MoEConfig(
        num_experts=E, experts_per_token=1, **_layout_fields(layouts), router="softmax_topk", expert_capacity=capacity,
        router_noise=float(_get(hf, "router_jitter_noise", 0.01)),
        z_loss_weight=float(_get(hf, "router_z_loss_coef", 0.001)),
        aux_loss_weight=float(_get(hf, "router_aux_loss_coef", 0.001)),
    )  # fmt: skip
    activation = ACTIVATIONS[_require(hf, "dense_act_fn", tuple(ACTIVATIONS), "relu")]
    return _t5_config({k: v for k, v in hf.items() if k != "feed_forward_proj"}) | dict(activation=activation, moe=moe)


def _switch_hf(cfg: ModelConfig) -> dict:
    moe = cfg.moe
    sparse = {}
    for stack, layers in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
        ours = _moe_layer_set(cfg, stack)
        step = next((s for s in range(layers + 1) if _switch_sparse_layers(layers, s) == ours), None)
        if step is None:
            every, offset = moe.layout(stack)
            own = [f for f in (f"{stack}_offset", f"{stack}_every") if getattr(moe, f) is not None]
            field = f"model.moe.{own[0] if own else 'every'}"
            raise UnsupportedCheckpoint(
                f"{field}: the {stack}'s MoE layers {sorted(ours)} (i % {every} == {offset}, of {layers}) have no "
                f"{stack}_sparse_step: Hugging Face's Switch makes layers 1, 1 + step, 1 + 2 * step, ... sparse "
                f"(every layer with step 1, none with 0); set model.moe.{stack}_offset=1, or every 1"
            )
        # The step itself (transformers keeps a saved step over the one it computes) and a count that
        # computes the same step where there is one (num_layers // count; the number of sparse layers
        # where it does; 0 for none).
        count = next((n for n in (len(ours), *range(1, layers + 1)) if n and layers // n == step), len(ours))
        count = count if step else 0
        sparse |= {f"{stack}_sparse_step": step, f"num_sparse_{stack}_layers": count}
    hf = {k: v for k, v in _t5_hf(cfg.replace(activation="relu")).items() if k != "feed_forward_proj"}
    return hf | sparse | dict(
        architectures=["SwitchTransformersForConditionalGeneration"], dense_act_fn=ACTIVATION_NAMES[cfg.activation],
        num_experts=moe.num_experts, expert_capacity=moe.expert_capacity, router_bias=False, router_dtype="float32",
        router_jitter_noise=moe.router_noise, router_z_loss_coef=moe.z_loss_weight,
        router_aux_loss_coef=moe.aux_loss_weight, router_ignore_padding_tokens=False,
    )  # fmt: skip


def _switch_ffn(cfg: ModelConfig, f: str, L: str) -> list[Rule]:
    """Switch's feed-forward: dense (`mlp.wi`, `mlp.wo`) or sparse (a router and experts), per layer."""
    dense_ffn = dense(f"{f}.mlp.wi", f"{L}.ffn.wi", bias=False) + dense(f"{f}.mlp.wo", f"{L}.ffn.wo", bias=False)
    rules = [dataclasses.replace(r, layers="dense") for r in dense_ffn]
    rules.append(Rule(f"{f}.mlp.router.classifier.weight", (f"{L}.ffn.router",), "linear", layers="moe"))
    for name in ("wi", "wo"):
        rules.append(Rule(f"{f}.mlp.experts.expert_{{e}}.{name}.weight", (f"{L}.ffn.{name}[{{e}}]",), "linear",
                          layers="moe"))  # fmt: skip
    return rules


TIED_COPIES = (r"^(model\.)?(encoder|decoder)\.embed_tokens\.weight$", r"^lm_head\.weight$")
FAMILIES = {
    "gpt2": Family("gpt2", "transformer.", _gpt2_config, _gpt2_hf, _gpt2_rules,
                   ignore=(r"\.attn\.(masked_)?bias$", r"^lm_head\.weight$")),
    "llama": Family("llama", "model.", _llama_config, _llama_hf, _llama_rules,
                    ignore=(r"rotary_emb\.inv_freq$", r"^lm_head\.weight$")),
    "bert": Family("bert", "bert.", _bert_config, _bert_hf, _bert_rules,
                   ignore=(r"position_ids$", r"^cls\.seq_relationship\.", r"^cls\.predictions\.decoder\.",
                           r"^bert\.pooler\.")),
    "bart": Family("bart", "model.", _bart_config, _bart_hf, _bart_rules, ignore=TIED_COPIES),
    "t5": Family("t5", "", _t5_config, _t5_hf, _t5_rules, ignore=TIED_COPIES),
    "mixtral": Family("mixtral", "model.", _mixtral_config, _mixtral_hf,
                      lambda cfg: _llama_rules(cfg, _mixtral_experts),
                      ignore=(r"rotary_emb\.inv_freq$", r"^lm_head\.weight$")),
    "switch_transformers": Family("switch_transformers", "", _switch_config, _switch_hf,
                                  lambda cfg: _t5_rules(cfg, _switch_ffn), ignore=TIED_COPIES),
}  # fmt: skip

# PEFT LoRA adapters: per family, each hub module peft adapts (as `target_modules` names it) and the
# jaxformer kernels it holds. A fused module (GPT-2's c_attn = q, k, v) carries one low-rank update of
# the fused kernel: it reads exactly as q, k and v adapters sharing one A; separate q, k, v adapters
# write exactly as one of rank n*R (A stacked, B block-diagonal) via peft's rank_pattern.
PEFT_MODULES = {
    "gpt2": {"c_attn": ("q", "k", "v"), "attn.c_proj": ("o",), "c_fc": ("wi",), "mlp.c_proj": ("wo",)},
    "llama": {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",), "gate_proj": ("wi_gate",),
              "up_proj": ("wi",), "down_proj": ("wo",)},
    # BERT's attention output and FFN output are both "...output.dense": fuller names tell them apart here;
    # in peft's suffix matching "output.dense" takes both (save_peft writes a regex for the FFN's alone).
    "bert": {"query": ("q",), "key": ("k",), "value": ("v",), "attention.output.dense": ("o",),
             "intermediate.dense": ("wi",), "output.dense": ("wo",)},
    # BART and T5 name a projection alike in the encoder, the decoder and the cross-attention (lora.stacks).
    "bart": {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "out_proj": ("o",), "fc1": ("wi",),
             "fc2": ("wo",)},
    "t5": {"q": ("q",), "k": ("k",), "v": ("v",), "o": ("o",), "wi": ("wi",), "wi_0": ("wi_gate",),
           "wi_1": ("wi",), "wo": ("wo",)},  # wi_0 / wi_1: T5 v1.1's gated FFN (gate, up)
}  # fmt: skip


# ----------------------------------------------------------------------------- configs


def _read_json(directory: str | pathlib.Path, name: str, what: str) -> tuple[pathlib.Path, object]:
    """(path, contents) of the JSON file `name` in `directory` (`what` the directory should be)."""
    path = pathlib.Path(directory) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {directory} {what}?")
    try:
        return path, json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnsupportedCheckpoint(f"{path} is not JSON ({e})") from None


def read_hf_config(directory: str | pathlib.Path) -> dict:
    """The directory's config.json, checked to name a family jaxformer reads.

    Args:
        directory: the Hugging Face model directory.

    Returns:
        The config.json contents.

    Raises:
        FileNotFoundError: no config.json.
        UnsupportedCheckpoint: not JSON, or a model_type jaxformer does not read.
    """
    path, hf = _read_json(directory, CONFIG, "a Hugging Face model directory")
    family = hf.get("model_type") if isinstance(hf, dict) else None
    if family not in FAMILIES:
        supported = sorted(FAMILIES)
        raise UnsupportedCheckpoint(f"{path}: model_type={family!r} is not supported (jaxformer reads {supported})")
    return hf


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """A ModelConfig from a config.json's contents; `overrides` replace fields (dtype, scan_layers, ...).

    Args:
        hf: config.json's contents.
        **overrides (object): ModelConfig fields to replace.

    Returns:
        The ModelConfig.

    Raises:
        UnsupportedCheckpoint: an unsupported family or setting, or a field missing, named.
    """
    hf = {key: value for key, value in hf.items() if value is not None}  # null = absent
    try:
        fields = FAMILIES[hf["model_type"]].to_config(hf) | overrides
        if hf["model_type"] == "switch_transformers" and fields.get("scan_layers"):
            _switch_scannable(hf, ModelConfig(**(fields | {"scan_layers": False})))
        return ModelConfig(**fields)
    except KeyError as e:
        raise UnsupportedCheckpoint(f"config.json lacks {e}") from None


def _switch_scannable(hf: dict, cfg: ModelConfig) -> None:
    """Refuse, naming the step fields, sparse layouts whose scanned blocks (`ModelConfig.scan_block`)
    do not divide a stack's depth."""
    N = cfg.scan_block
    for stack, depth in SWITCH_STACKS:
        layers = getattr(cfg, f"num_{stack}_layers")
        if layers % N:
            steps = " and ".join(
                f"{s}_sparse_step={_switch_sparse_step(hf, s, getattr(cfg, f'num_{s}_layers'))}"
                for s, _ in SWITCH_STACKS
            )
            raise UnsupportedCheckpoint(
                f"config.json: {steps} make layers {sorted(_moe_layer_set(cfg, 'encoder'))} (encoder) and "
                f"{sorted(_moe_layer_set(cfg, 'decoder'))} (decoder) sparse: scanned, each stack takes blocks of {N} "
                f"layers, and {depth}={layers} is not a multiple; load with scan_layers=False"
            )


def config_to_hf(cfg: ModelConfig, family: str | None = None) -> dict:
    """config.json contents for `cfg`, in `family` or the one family that expresses it exactly.

    Args:
        cfg: the model's config.
        family: "gpt2", "llama", "bert", "bart", "t5", or None (the one that fits).

    Returns:
        config.json contents.

    Raises:
        UnsupportedCheckpoint: the family cannot express the model, listing the differences.
    """
    family = family or family_of(cfg)
    hf = FAMILIES[family].from_config(cfg) | {"model_type": family}
    if not _expresses(family, cfg):
        raise UnsupportedCheckpoint(f"{family} cannot express this model: {_differences(family, cfg)}")
    return hf


RUNTIME_FIELDS = ("dtype", "attention_impl", "matmul_precision", "scan_layers", "remat", "check_token_ids")


def _explicit(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with head_dim and num_kv_heads spelled out, as config.json holds them, and each stack's MoE
    layout as the layers it makes MoE (one (every, offset) per stack of the mode: two spellings of the
    same layers are one model)."""
    layout = {"every": 1}
    for stack in ("encoder", "decoder"):
        layers = cfg.num_encoder_layers if stack == "encoder" else cfg.num_decoder_layers
        every, offset = _layout_of(_moe_layer_set(cfg, stack), layers) if stack in cfg.stacks else (0, None)
        layout |= {f"{stack}_every": every, f"{stack}_offset": offset}
    moe = dataclasses.replace(cfg.moe, **layout)
    return cfg.replace(head_dim=cfg.dim_per_head, num_kv_heads=cfg.kv_heads, moe=moe)


def _round_trip(family: str, cfg: ModelConfig) -> ModelConfig:
    hf = FAMILIES[family].from_config(cfg) | {"model_type": family}
    return _explicit(config_from_hf(hf, **{f: getattr(cfg, f) for f in RUNTIME_FIELDS}))


def _differences(family: str, cfg: ModelConfig) -> str:
    try:
        back = _round_trip(family, cfg)
    except (ValueError, KeyError) as e:
        return str(e)
    cfg = _explicit(cfg)
    diff = [f"{f.name}={getattr(cfg, f.name)!r} (would be {getattr(back, f.name)!r})"
            for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(back, f.name)]  # fmt: skip
    return ", ".join(diff) or "nothing"


def _expresses(family: str, cfg: ModelConfig) -> bool:
    try:
        return _round_trip(family, cfg) == _explicit(cfg)
    except (ValueError, KeyError):
        return False


def family_of(cfg: ModelConfig) -> str:
    """The family whose config.json says exactly `cfg` (round trip equal); else an error listing the
    fields each family would change.

    Args:
        cfg: the model's config.

    Returns:
        The family's model_type.

    Raises:
        UnsupportedCheckpoint: no family expresses the model.
    """
    for name in FAMILIES:
        if _expresses(name, cfg):
            return name
    reasons = "; ".join(f"{name}: {_differences(name, cfg)}" for name in FAMILIES)
    raise UnsupportedCheckpoint(f"no Hugging Face family expresses this model ({reasons})")


# ----------------------------------------------------------------------------- reading tensors


class SafetensorsReader:
    """The tensors of a directory's `model.safetensors` or of the shards its index lists, each read
    on demand (never the whole checkpoint in memory).

    A shard is memory-mapped only while one of its tensors is copied out: the pages of a mapping
    that stays open count in the process's resident memory until it closes, so shards kept open
    for the whole load would hold every byte read so far (the whole checkpoint by the end).

    Args:
        directory: the directory with model.safetensors or model.safetensors.index.json.

    Raises:
        FileNotFoundError: neither file, or a shard the index lists, exists.
        UnsupportedCheckpoint: the index lists tensors its shards lack.
    """

    def __init__(self, directory: str | pathlib.Path):
        directory = pathlib.Path(directory)
        if (directory / INDEX).is_file():
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (directory / WEIGHTS).is_file():
            files, weight_map = [WEIGHTS], None
        else:
            raise FileNotFoundError(f"{directory} holds neither {WEIGHTS} nor {INDEX}")
        self.where = {}  # tensor name -> its shard's path
        for name in files:
            if not (directory / name).is_file():
                raise FileNotFoundError(f"{directory / name}, listed in {INDEX}, does not exist")
            with _open(directory / name) as shard:
                self.where |= dict.fromkeys(shard.keys(), directory / name)
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.where))
            if missing:
                raise UnsupportedCheckpoint(f"{INDEX} lists tensors its shards lack: {missing[:5]}")

    def names(self) -> list[str]:
        """The tensors' names, sorted.

        Returns:
            The names.
        """
        return sorted(self.where)

    def __getitem__(self, name: str) -> np.ndarray:
        with _open(self.where[name]) as shard:
            return shard.get_tensor(name)  # a copy: valid once the mapping is closed


@contextlib.contextmanager
def _open(path: pathlib.Path):
    """A safetensors file, memory-mapped; a damaged or truncated one is an UnsupportedCheckpoint
    naming it (safetensors' own error names neither the file nor the tensor)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="numpy") as shard:
            yield shard
    except SafetensorError as e:
        raise UnsupportedCheckpoint(f"{path}: not a readable safetensors file ({e}); download it again") from None


# ----------------------------------------------------------------------------- load


def _stacked_path(path: str, block: int = 1) -> tuple[str, int | None]:
    """An unrolled path in a scanned model: ("encoder.stack.layers.q", 3) for "encoder.stack.layers.3.q";
    scanned in blocks of `block` layers (`ModelConfig.scan_block`, MoE every N-th layer), layer i is
    position i % N of block i // N: ("encoder.stack.layers.1.q", 1) for layer 3 with N = 2."""
    match = re.match(r"^(.*\.layers)\.(\d+)\.(.*)$", path)
    if not match:
        return path, None
    i = int(match[2])
    position = "" if block == 1 else f".{i % block}"
    return f"{match[1]}{position}.{match[3]}", i // block


def _locate(path: str, scanned: bool, block: int = 1) -> tuple[str, tuple[int, ...]]:
    """Where a rule's (unrolled) path lives: the parameter and the leading indices of its slice in it.
    "decoder.stack.layers.3.ffn.wi[1]" is ("decoder.stack.layers.3.ffn.wi", (1,)) unrolled, and
    ("decoder.stack.layers.ffn.wi", (3, 1)) scanned (the layer axis first, then the expert axis;
    in blocks of `block` layers, `_stacked_path`)."""
    match = re.fullmatch(r"(.*)\[(\d+)\]", path)
    path, index = (match[1], (int(match[2]),)) if match else (path, ())
    if scanned:
        stacked, layer = _stacked_path(path, block)
        if layer is not None:
            return stacked, (layer, *index)
    return path, index


def load_hf(
    directory: str | pathlib.Path,
    *,
    mesh: jax.sharding.Mesh | None = None,
    adapter: str | pathlib.Path | None = None,
    **overrides,
) -> Transformer:
    """A Transformer holding the Hugging Face checkpoint in `directory` (parameters float32).

    `overrides` replace ModelConfig fields that do not change the weights (`scan_layers`, `dtype`,
    `attention_impl`, `dropout_rate`, `num_classes` for a new classification head, ...). With a
    `mesh` (and the logical-axis rules in effect, `jaxformer.sharding.use`; the default rules
    otherwise), each tensor goes straight to its shards. Parameters of a task head the checkpoint
    lacks keep a fresh initialisation, with a warning; any other missing or unplaced tensor is an error.

    Args:
        directory: the Hugging Face model directory.
        mesh: the mesh to place the parameters on, or None (the default device).
        adapter: a PEFT LoRA adapter directory of this base, or None.
        **overrides (object): ModelConfig fields to replace.

    Returns:
        The model.

    Raises:
        FileNotFoundError: a file of the directory is missing.
        UnsupportedCheckpoint: a setting or tensor jaxformer cannot place, named.
    """
    from jaxformer import sharding

    hf = read_hf_config(directory)
    family = FAMILIES[hf["model_type"]]
    cfg = config_from_hf(hf, **overrides)
    reader = SafetensorsReader(directory)
    with _rules_in_effect(mesh):
        abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
        graphdef, abstract_params = nnx.split(abstract, nnx.Param)
        shardings = sharding.state_shardings(abstract_params, mesh) if mesh is not None else None
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(abstract_params)}
    placement = dict(zip(flat, jax.tree.leaves(shardings), strict=True)) if shardings is not None else {}
    names = {_canonical(n, family): n for n in reader.names()}
    filled, used = {}, set()
    pending: dict[str, tuple[jax.Array, set]] = {}  # scanned stacks being filled: (stack, layers in so far)
    for rule, _ in _expand(family.rules(cfg), cfg):
        if rule.theirs not in names:
            continue  # reported below as missing parameters
        used.add(rule.theirs)
        targets = [_locate(o, cfg.scan_layers, cfg.scan_block) for o in rule.ours]
        shapes = [flat[p].shape[len(index) :] for p, index in targets]
        arrays = to_ours(reader[names[rule.theirs]], rule, shapes)
        filled |= _fill(arrays, targets, pending, flat, placement)
        del arrays  # before the next tensor is read
    unused = sorted(n for c, n in names.items() if c not in used and not any(re.search(p, c) for p in family.ignore))
    if unused:
        raise UnsupportedCheckpoint(f"{directory}: tensors with no place in jaxformer's {cfg.mode} model: {unused[:8]}")
    missing = sorted(set(flat) - set(filled))
    lacking = [m for m in missing if not m.startswith(HEADS)]
    if lacking:
        raise UnsupportedCheckpoint(f"{directory}: the checkpoint lacks tensors for {lacking[:8]}")
    if missing:
        log.warning("%s lacks %s: freshly initialised (a new head to train)", directory, ", ".join(missing))
        filled |= _fresh_params(cfg, missing, placement, mesh)
    params = nnx.from_flat_state([(tuple(_key(k) for k in p.split(".")), flat[p].replace(filled[p])) for p in flat])
    model = nnx.merge(graphdef, params)
    return model if adapter is None else load_peft(model, adapter, family=family.model_type, mesh=mesh)


def _fill(arrays: list[np.ndarray], targets: list, pending: dict, flat: dict, placement: dict) -> dict:
    """Place a checkpoint tensor's parameter arrays (by path); a slice of a stacked parameter (a
    scanned layer's, an expert's) goes into its stack in `pending`, on the stack's devices, and a
    stack with every slice in is done.

    A function of its own so that no host array outlives this tensor: a loop variable would keep
    the last one alive while the next tensor is read.
    """
    placed = {}
    for (path, index), array in zip(targets, arrays, strict=True):
        sharding = placement.get(path)
        if not index:
            placed[path] = _place(array, sharding)
            continue
        if path not in pending:  # its first slice: the stack, zeros, straight on its devices
            pending[path] = (jnp.zeros(flat[path].shape, jnp.float32, device=sharding), set())
        stack, done = pending.pop(path)
        stack = _set_layer(stack, _place(array, _layer_sharding(sharding, len(index))), index, sharding)
        done.add(index)
        if len(done) == math.prod(stack.shape[: len(index)]):
            placed[path] = stack
        else:
            pending[path] = (stack, done)
    return placed


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _set_layer(stack: jax.Array, layer: jax.Array, index: tuple, sharding) -> jax.Array:
    """stack[index] = layer (`index` the leading indices: layer, expert), written in place (the stack
    is donated), laid out as `sharding`: a stack filled slice by slice on its devices, never whole on
    the host. The indices are traced: one compiled program serves every slice."""
    start = (*index, *(0,) * layer.ndim)
    stack = jax.lax.dynamic_update_slice(stack, layer.reshape((1,) * len(index) + layer.shape), start)
    return stack if sharding is None else jax.lax.with_sharding_constraint(stack, sharding)


def _layer_sharding(stacked, leading: int):
    """The sharding of one slice of a stack sharded as `stacked` (its `leading` axes dropped)."""
    if stacked is None:
        return None
    return jax.sharding.NamedSharding(stacked.mesh, jax.sharding.PartitionSpec(*stacked.spec[leading:]))


def _key(part: str):
    return int(part) if part.isdigit() else part


def _canonical(name: str, family: Family) -> str:
    """A checkpoint name as the family's rules spell it: old BERT names (gamma/beta) renamed, and
    the base model's prefix added where a bare-model checkpoint leaves it out."""
    name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name))
    heads = ("lm_head.", "cls.", "classifier.", "final_logits_bias")
    if family.prefix and not name.startswith(family.prefix) and not name.startswith(heads):
        return family.prefix + name
    return name


def _place(array: np.ndarray, sharding) -> jax.Array:
    # Parameters are float32 (compute runs in ModelConfig.dtype); a float32 tensor is not copied again.
    array = array.astype(np.float32, copy=False)
    return jax.device_put(array, sharding) if sharding is not None else jnp.asarray(array)


def _fresh_params(cfg: ModelConfig, paths: list[str], placement: dict, mesh) -> dict:
    """Freshly initialised parameters at `paths` (the heads a checkpoint lacks), by path. Under jit
    only they are computed and placed: the rest of the initialisation is dead code XLA drops, so a
    new head on a large checkpoint never initialises the whole model again."""

    def create() -> dict:
        state = nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        every = {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(state)}
        return {p: every[p] for p in paths}

    with _rules_in_effect(mesh):
        return jax.jit(create, out_shardings={p: placement[p] for p in paths} if placement else None)()


def _rules_in_effect(mesh):
    """The mesh and rules context for sharded loading (the caller's rules if set, else the default)."""
    import contextlib

    import flax.linen as nn

    from jaxformer import sharding
    from jaxformer.config import MeshConfig

    if mesh is None or nn.get_logical_axis_rules():
        return contextlib.nullcontext()
    return sharding.use(mesh, sharding.rules_for(MeshConfig()))


# ----------------------------------------------------------------------------- save


def save_hf(
    model: Transformer,
    directory: str | pathlib.Path,
    *,
    family: str | None = None,
    extra_config: dict | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> pathlib.Path:
    """Write `model` as a Hugging Face model directory: config.json (+ `extra_config`, e.g. special
    token ids) and safetensors in the hub's PyTorch naming, float32, in shards of at most
    `max_shard_bytes` with an index when it is larger. Scanned or unrolled, any sharding: one
    tensor at a time is gathered to the host.

    Args:
        model: the model.
        directory: the directory to write.
        family: the family to write it as, or None (the one that fits).
        extra_config: more config.json fields, or None.
        max_shard_bytes: the largest safetensors file.

    Returns:
        `directory`.

    Raises:
        UnsupportedCheckpoint: no family expresses the model.
    """
    from safetensors.numpy import save_file

    cfg = model.cfg
    family = family or family_of(cfg)
    hf = config_to_hf(cfg, family) | {"torch_dtype": "float32"} | (extra_config or {})
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    rules = list(_expand(FAMILIES[family].rules(cfg), cfg))
    nbytes = [4 * sum(math.prod(_param_shape(flat, o, cfg)) for o in r.ours) for r, _ in rules]
    shards: list[list[int]] = [[]]
    size = 0
    for k, n in enumerate(nbytes):
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    n = len(shards)
    files = [WEIGHTS] if n == 1 else [f"model-{s + 1:05d}-of-{n:05d}.safetensors" for s in range(n)]
    weight_map = {}
    for file, members in zip(files, shards, strict=True):
        tensors = {}
        for k in members:
            rule, _ = rules[k]
            tensors[rule.theirs] = to_theirs([_host_param(flat, o, cfg) for o in rule.ours], rule)
            weight_map[rule.theirs] = file
        save_file(tensors, directory / file, metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(nbytes)}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX).write_text(json.dumps(index, indent=2))
    (directory / CONFIG).write_text(json.dumps(hf, indent=2, sort_keys=True))
    return directory


def _param_shape(flat: dict, path: str, cfg: ModelConfig) -> tuple[int, ...]:
    stacked, index = _locate(path, cfg.scan_layers, cfg.scan_block)
    return flat[stacked].shape[len(index) :]


def _host_param(flat: dict, path: str, cfg: ModelConfig) -> np.ndarray:
    """One parameter (one layer's or expert's slice of a stack) gathered to the host as float32."""
    stacked, index = _locate(path, cfg.scan_layers, cfg.scan_block)
    value = flat[stacked][...]
    return np.asarray(jax.device_get(value[index] if index else value), np.float32)


# ----------------------------------------------------------------------------- PEFT adapters

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's LoraModel wraps the hub model: its tensors' names start so
TASK_TYPES = {"decoder_only": "CAUSAL_LM", "encoder_decoder": "SEQ_2_SEQ_LM", "encoder_only": "FEATURE_EXTRACTION"}
# adapter_config.json fields whose other values jaxformer's LoRA cannot express: (field, values read).
PEFT_PLAIN = (
    ("use_dora", (False, None)), ("use_rslora", (False, None)), ("bias", ("none", None)),
    ("lora_bias", (False, None)), ("modules_to_save", (None, [])), ("layers_to_transform", (None, [])),
    ("layer_replication", (None,)), ("target_parameters", (None, [])), ("exclude_modules", (None, [])),
    ("trainable_token_indices", (None,)),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PeftModule:
    """One adaptable hub module of one layer: its full name, its name in target_modules, the rule of its weight.

    Attributes:
        name: the module's full name ("transformer.h.0.attn.c_attn").
        target: its name in target_modules ("c_attn").
        rule: the rule of its weight (ours: the kernels it holds).
        pattern: a regex of its name in every layer, the base model's prefix left out.
        suffix: its name after the layer index ("attn.c_attn").
    """

    name: str  # "transformer.h.0.attn.c_attn"
    target: str  # "c_attn"
    rule: Rule  # ours: the kernels (unrolled paths) it holds
    pattern: str  # a regex of its name in every layer, the base model's prefix left out: r"h\.\d+\.attn\.c_attn"
    suffix: str  # its name after the layer index: "attn.c_attn"


def peft_modules(family: str, cfg: ModelConfig) -> list[PeftModule]:
    """Every module of the model that `PEFT_MODULES` lets a PEFT adapter adapt, layer by layer.

    Args:
        family: the base's model_type.
        cfg: the base's config.

    Returns:
        The modules.

    Raises:
        UnsupportedCheckpoint: a family PEFT adapters are not read for.
    """
    if family not in PEFT_MODULES:
        raise UnsupportedCheckpoint(
            f"PEFT adapters for {family} are not supported (jaxformer reads {list(PEFT_MODULES)})"
        )
    out = []
    for template in FAMILIES[family].rules(cfg):
        if template.layout not in ("linear", "conv1d") or not template.theirs.endswith(".weight"):
            continue
        kernels = tuple(o.rsplit(".", 1)[1] for o in template.ours)
        name = template.theirs.removesuffix(".weight")
        pattern = re.escape(name.removeprefix(FAMILIES[family].prefix)).replace(re.escape("{i}"), r"\d+")
        # The first row whose suffix and kernels fit: BERT's "output.dense" (wo) is not its attention's (o).
        target = next((t for t, ours in PEFT_MODULES[family].items()
                       if (name == t or name.endswith("." + t)) and ours == kernels), None)  # fmt: skip
        if target is not None:
            suffix = name.split("{i}.")[-1]
            out += [PeftModule(rule.theirs.removesuffix(".weight"), target, rule, pattern, suffix)
                    for rule, _ in _expand([template], cfg)]  # fmt: skip
    return out


def _linear_modules(family: str, cfg: ModelConfig) -> list[str]:
    """The names of every linear module of the model that the family's rules know (adaptable or not)."""
    rules = _expand(FAMILIES[family].rules(cfg), cfg)
    return [r.theirs.removesuffix(".weight") for r, _ in rules
            if r.layout in ("linear", "conv1d") and r.theirs.endswith(".weight")]  # fmt: skip


def _targeted(target_modules, name: str, prefix: str = "") -> bool:
    """Whether peft's `target_modules` (a list of name suffixes, a regex, or "all-linear") takes module `name`.
    A regex matches the whole name, which peft spells with the base model's `prefix` ("bert.") or without
    it (an adapter made on the bare model): either is taken."""
    if isinstance(target_modules, str):
        names = (name, name.removeprefix(prefix)) if prefix else (name,)
        return target_modules == "all-linear" or any(re.fullmatch(target_modules, n) for n in names)
    return any(name == t or name.endswith("." + t) for t in target_modules)


def read_peft_config(directory: str | pathlib.Path, family: str, cfg: ModelConfig):
    """The LoRAConfig of the PEFT adapter in `directory` for a `family` model of `cfg`: rank, alpha,
    dropout, and the targets and stacks its target_modules adapt. What jaxformer's LoRA cannot
    express (DoRA, per-module ranks, biases, modules to save, ...) fails with the field named.

    Args:
        directory: the PEFT adapter directory.
        family: the base's model_type.
        cfg: the base's config.

    Returns:
        lora (LoRAConfig): the adapter's LoRA section.

    Raises:
        FileNotFoundError: no adapter_config.json.
        UnsupportedCheckpoint: a setting jaxformer's LoRA cannot express, named.
    """
    from jaxformer import lora
    from jaxformer.config import LORA_TARGETS, LoRAConfig

    path, fields = _read_json(directory, ADAPTER_CONFIG, "a PEFT adapter directory")
    if not isinstance(fields, dict) or fields.get("peft_type") != "LORA":
        kind = fields.get("peft_type") if isinstance(fields, dict) else None
        raise UnsupportedCheckpoint(f"{path}: peft_type={kind!r}; jaxformer reads LoRA adapters (peft_type='LORA')")
    for key in ("r", "lora_alpha", "target_modules"):
        if fields.get(key) is None:
            raise UnsupportedCheckpoint(f"{path} lacks {key}")
    for key, allowed in PEFT_PLAIN:
        if fields.get(key) not in allowed:
            raise UnsupportedCheckpoint(f"{path}: {key}={fields[key]!r} is not supported (jaxformer reads {allowed})")
    # Per-module ranks and alphas: only those equal to the uniform r and lora_alpha (lora.rank, lora.alpha).
    for key, uniform in (("rank_pattern", "r"), ("alpha_pattern", "lora_alpha")):
        pattern = fields.get(key) or {}
        if not isinstance(pattern, dict) or any(v != fields[uniform] for v in pattern.values()):
            raise UnsupportedCheckpoint(
                f"{path}: {key}={pattern!r} is not supported: jaxformer's LoRA has one {uniform} for every module "
                f"({uniform}={fields[uniform]!r})"
            )
    targets, prefix = fields["target_modules"], FAMILIES[family].prefix
    every = _linear_modules(family, cfg)
    places = {m.name: m for m in peft_modules(family, cfg)}
    for name in every:
        output_layer = targets == "all-linear" and name == "lm_head"  # peft's all-linear leaves it out
        if _targeted(targets, name, prefix) and name not in places and not output_layer:
            adaptable = list(PEFT_MODULES[family])
            raise UnsupportedCheckpoint(f"{path}: target module {name} has no place in jaxformer's LoRA ({adaptable})")
    # A name of the family's table that this model lacks (T5's "wi" in a gated T5) selects nothing, as in peft.
    for t in [] if isinstance(targets, str) else targets:
        if not any(_targeted([t], name) for name in every) and t not in PEFT_MODULES[family]:
            raise UnsupportedCheckpoint(f"{path}: target_modules names {t!r}, no module of this {family} model")
    chosen = [m for m in places.values() if _targeted(targets, m.name, prefix)]
    if not chosen:
        raise UnsupportedCheckpoint(f"{path}: target_modules={targets!r} selects no module of this {family} model")
    kernels = {o.rsplit(".", 1)[1] for m in chosen for o in m.rule.ours}
    stacks = {lora._stack_of(tuple(o.split("."))) for m in chosen for o in m.rule.ours}
    out = LoRAConfig(
        rank=int(fields["r"]), alpha=float(fields["lora_alpha"]), dropout=float(fields.get("lora_dropout") or 0.0),
        targets=tuple(t for t in LORA_TARGETS if t in kernels),
        stacks=tuple(s for s in ("encoder", "decoder", "cross") if s in stacks),
    )  # fmt: skip
    # jaxformer adapts each of lora.targets in every layer of each of lora.stacks: the adapter must too.
    unadapted = [m.name for m in places.values() if m not in chosen and _adapts(m, out)]
    if unadapted:
        raise UnsupportedCheckpoint(
            f"{path}: target_modules={targets!r} leaves out {unadapted[:4]}, which jaxformer's LoRA would adapt too "
            f"(it adapts each of lora.targets={out.targets} in every layer of each of lora.stacks={out.stacks})"
        )
    return out


def _adapts(module: PeftModule, lora_cfg) -> bool:
    from jaxformer import lora

    return any(o.rsplit(".", 1)[1] in lora_cfg.targets and lora._stack_of(tuple(o.split("."))) in lora_cfg.stacks
               for o in module.rule.ours)  # fmt: skip


def load_peft(model: Transformer, directory: str | pathlib.Path, *, family: str, mesh=None) -> Transformer:
    """`model` (a `family` base) with the PEFT LoRA adapter in `directory` added (in place): its config
    read by `read_peft_config`, its tensors checked against the base's shapes, the tensor named if not.

    Args:
        model: the base model.
        directory: the PEFT adapter directory.
        family: the base's model_type.
        mesh (jax.sharding.Mesh | None): the mesh to place the adapters on, or None.

    Returns:
        `model`, with the adapters.

    Raises:
        FileNotFoundError: no adapter_model.safetensors.
        UnsupportedCheckpoint: a tensor missing, unplaced, or of the wrong shape, named.
    """
    from jaxformer import lora

    cfg, directory = model.cfg, pathlib.Path(directory)
    lora_cfg = read_peft_config(directory, family, cfg)
    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (a PEFT adapter saved with safe_serialization=True has it)")
    with _open(path) as f:
        # An adapter made on the bare model (BertModel) names its modules without the prefix ("bert.").
        names = {_canonical(re.sub(r"\.lora_([AB])\.default\.", r".lora_\1.", n.removeprefix(PEFT_PREFIX)),
                            FAMILIES[family]): n for n in f.keys()}  # noqa: SIM118  # fmt: skip
    with _rules_in_effect(mesh):
        lora.add_adapters(model, lora_cfg)
    state = nnx.state(model, nnx.LoRAParam)
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(state)}
    arrays, used = {}, set()
    for module in peft_modules(family, cfg):
        if not _adapts(module, lora_cfg):
            continue
        a, b = (_peft_tensor(path, names, f"{module.name}.lora_{ab}.weight", used) for ab in "AB")
        ours = module.rule.ours
        shapes_a = [_param_shape(flat, f"{o}_lora.a", cfg) for o in ours]
        shapes_b = [_param_shape(flat, f"{o}_lora.b", cfg) for o in ours]
        want_a = (lora_cfg.rank, math.prod(shapes_a[0][:-1]))
        want_b = (sum(math.prod(s[1:]) for s in shapes_b), lora_cfg.rank)
        for tensor, got, want in ((f"{module.name}.lora_A.weight", a.shape, want_a),
                                  (f"{module.name}.lora_B.weight", b.shape, want_b)):  # fmt: skip
            if tuple(got) != want:
                raise UnsupportedCheckpoint(
                    f"{path}: {PEFT_PREFIX}{tensor} has shape {tuple(got)}, the base's {module.name} wants {want} "
                    f"(r={lora_cfg.rank}): an adapter for another base model?"
                )
        # Every part of a fused module reads the one A; B splits along the fused output features.
        parts_b = np.split(b.T, len(ours), axis=1)
        for o, shape_a, shape_b, part_b in zip(ours, shapes_a, shapes_b, parts_b, strict=True):
            arrays[f"{o}_lora.a"] = a.T.reshape(shape_a)
            arrays[f"{o}_lora.b"] = part_b.reshape(shape_b)
    unused = sorted(names[n] for n in names if n not in used)
    if unused:
        raise UnsupportedCheckpoint(f"{path}: tensors with no place in the adapted model: {unused[:6]}")
    stacks: dict[str, dict[int, np.ndarray]] = {}
    values = {}
    for p, array in arrays.items():
        stacked, index = _stacked_path(p, cfg.scan_block) if cfg.scan_layers else (p, None)
        if index is None:
            values[p] = array
        else:
            stacks.setdefault(stacked, {})[index] = array
    values |= {p: np.stack([layers[i] for i in range(len(layers))]) for p, layers in stacks.items()}
    updated = []
    for p, var in flat.items():
        value = var[...]
        updated.append((tuple(_key(k) for k in p.split(".")), var.replace(jax.device_put(
            values[p].astype(np.float32), value.sharding))))  # fmt: skip
    nnx.update(model, nnx.from_flat_state(updated))
    return model


def _peft_tensor(path: pathlib.Path, names: dict, name: str, used: set) -> np.ndarray:
    if name not in names:
        raise UnsupportedCheckpoint(f"{path} lacks {PEFT_PREFIX}{name}")
    used.add(name)
    with _open(path) as f:
        return f.get_tensor(names[name]).astype(np.float32)


def save_peft(
    model: Transformer, lora_cfg, directory: str | pathlib.Path, *, family: str | None = None, base: str | None = None
) -> pathlib.Path:
    """Write the LoRA adapters of `model` (made with `lora_cfg`) as a PEFT adapter directory:
    adapter_config.json and adapter_model.safetensors in peft's naming (A [r, in], B [out, r]),
    for the hub model `base` (base_model_name_or_path). A fused hub module whose parts hold one
    shared A is written at rank R; parts with their own A as one adapter of rank n*R, A stacked and
    B block-diagonal, with peft's rank_pattern and alpha_pattern keeping the scale alpha / R.

    Args:
        model: the model with adapters.
        lora_cfg (LoRAConfig): the LoRA section they were made with.
        directory: the directory to write.
        family: the family, or None (the one that fits).
        base: the hub name of the base (base_model_name_or_path), or None.

    Returns:
        `directory`.

    Raises:
        UnsupportedCheckpoint: no adapters, or none that PEFT can name.
    """
    from safetensors.numpy import save_file

    from jaxformer.config import LORA_MODEL_TARGETS

    if unwritten := [t for t in lora_cfg.targets if t in LORA_MODEL_TARGETS]:
        raise UnsupportedCheckpoint(
            f"lora.targets: PEFT adapters of {', '.join(map(repr, unwritten))} are not written (only q, k, v, o "
            "and the feed-forward's): export the model with its adapters folded in (export-hf without --adapter)"
        )
    cfg = model.cfg
    family = family or family_of(cfg)
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    has = lambda o: (_stacked_path(f"{o}_lora.a", cfg.scan_block)[0] if cfg.scan_layers else f"{o}_lora.a") in flat
    tensors, targets, rank_pattern, alpha_pattern, chosen = {}, set(), {}, {}, []
    R, fan_in_fan_out = lora_cfg.rank, False
    for module in peft_modules(family, cfg):
        ours = module.rule.ours
        adapted = [k for k, o in enumerate(ours) if has(o)]
        if not adapted:
            continue
        targets.add(module.target)
        chosen.append(module)
        fan_in_fan_out |= module.rule.layout == "conv1d"
        width = [math.prod(_param_shape(flat, o, cfg)[module.rule.inputs :]) for o in ours]  # output features
        a_parts = {k: _host_param(flat, f"{ours[k]}_lora.a", cfg).reshape(-1, R) for k in adapted}  # [in, R]
        b_parts = {k: _host_param(flat, f"{ours[k]}_lora.b", cfg).reshape(R, -1) for k in adapted}  # [R, out]
        if all(np.array_equal(a_parts[adapted[0]], a_parts[k]) for k in adapted):  # one shared A: rank R
            a = a_parts[adapted[0]]
            b = np.concatenate([b_parts.get(k, np.zeros((R, w), np.float32)) for k, w in enumerate(width)], axis=1)
        else:  # A stacked [in, n R], B block-diagonal [n R, out]: the same update, rank n R
            n = len(adapted)
            a = np.concatenate([a_parts[k] for k in adapted], axis=1)
            b = np.zeros((n * R, sum(width)), np.float32)
            starts = np.cumsum([0, *width])
            for j, k in enumerate(adapted):
                b[j * R : (j + 1) * R, starts[k] : starts[k + 1]] = b_parts[k]
            rank_pattern[module.target] = n * R
            alpha_pattern[module.target] = _number(n * lora_cfg.alpha)
        tensors[f"{PEFT_PREFIX}{module.name}.lora_A.weight"] = np.ascontiguousarray(a.T)
        tensors[f"{PEFT_PREFIX}{module.name}.lora_B.weight"] = np.ascontiguousarray(b.T)
    if not tensors:
        raise UnsupportedCheckpoint("the model has no LoRA adapters to write (lora.rank=0?)")
    target_modules = _target_modules(family, cfg, chosen, sorted(targets))
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    fields = dict(
        peft_type="LORA", task_type=TASK_TYPES[cfg.mode], base_model_name_or_path=base, r=R,
        lora_alpha=_number(lora_cfg.alpha), lora_dropout=lora_cfg.dropout, target_modules=target_modules,
        fan_in_fan_out=fan_in_fan_out, bias="none", rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
        use_rslora=False, use_dora=False, init_lora_weights=True, inference_mode=True, modules_to_save=None,
        layers_to_transform=None, layers_pattern=None, revision=None,
    )  # fmt: skip
    (directory / ADAPTER_CONFIG).write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    return directory


def _target_modules(family: str, cfg: ModelConfig, chosen: list[PeftModule], names: list[str]) -> list[str] | str:
    """target_modules that select exactly the `chosen` modules in peft's matching: their names (`names`)
    where those select no other module (in BERT "output.dense" takes the attention's output too; in BART
    and T5 a name takes every stack), else their names after the layer index ("self_attn.q_proj": not
    the cross-attention's), else a regex of the chosen modules' names in every layer ("encoder" only)."""
    prefix, every, want = FAMILIES[family].prefix, _linear_modules(family, cfg), {m.name for m in chosen}
    for candidate in (names, sorted({m.suffix for m in chosen})):
        if {n for n in every if _targeted(candidate, n)} == want:
            return candidate
    patterns = sorted({m.pattern for m in chosen})
    regex = r"(?:.*\.)?" + (patterns[0] if len(patterns) == 1 else f"(?:{'|'.join(patterns)})")
    assert {n for n in every if _targeted(regex, n, prefix)} == want, regex  # the patterns are the names'
    return regex


def _number(x: float) -> int | float:
    """An integral float as an int, as peft writes lora_alpha."""
    return int(x) if float(x).is_integer() else x
