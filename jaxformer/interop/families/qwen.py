"""Qwen 2 (`qwen2`), Qwen 3 (`qwen3`) and Qwen 3 MoE (`qwen3_moe`): Llama with a few pieces changed,
their config.json both ways and their tensors' rules.

Qwen 2 adds biases to the query, key and value projections alone (`ModelConfig.qkv_bias`). Qwen 3
drops them and normalises each head's queries and keys by an RMSNorm before RoPE (`qk_norm`), its
head dim set apart from d_model / heads. Qwen 3 MoE is Qwen 3 whose feed-forward is many small
experts (`moe.expert_d_ff`), top-k of the softmax over all experts, renormalised over the k chosen
or not (`norm_topk_prob`: jaxformer's routers "topk_softmax" and "softmax_topk"), in every
`decoder_sparse_step`-th layer.
"""

from __future__ import annotations

from jaxformer.config import ModelConfig, MoEConfig
from jaxformer.interop.families.common import _experts, _get, _require
from jaxformer.interop.families.llama import _llama_config, _llama_hf, _llama_mlp, _llama_rules
from jaxformer.interop.rules import Rule, UnsupportedCheckpoint, dense, same

# Llama's config.json fields Qwen's configs do not have (their value is fixed by the family).
_NOT_QWEN = ("attention_bias", "mlp_bias")


def _full_attention(hf: dict) -> None:
    """Refuse a sliding window: every layer of jaxformer's model sees the whole causal prefix."""
    if hf.get("use_sliding_window"):
        raise UnsupportedCheckpoint(
            "config.json: use_sliding_window=True is not supported: jaxformer's Qwen layers see the whole causal prefix"
        )
    kinds = set(_get(hf, "layer_types", ["full_attention"]))
    if kinds != {"full_attention"}:
        raise UnsupportedCheckpoint(f"config.json: layer_types {sorted(kinds)} is not supported (only full_attention)")


def _llama_fields(hf: dict) -> dict:
    """Llama's reading of the shared fields, without the checks of fields Qwen does not have."""
    return _llama_config({k: v for k, v in hf.items() if k not in _NOT_QWEN})


def _qwen2_config(hf: dict) -> dict:
    _full_attention(hf)
    return _llama_fields(hf) | dict(qkv_bias=True)


def _qwen_hf(cfg: ModelConfig, architecture: str) -> dict:
    hf = {k: v for k, v in _llama_hf(cfg).items() if k not in _NOT_QWEN}
    return hf | dict(architectures=[architecture], use_sliding_window=False, sliding_window=None)


def _qwen2_hf(cfg: ModelConfig) -> dict:
    return _qwen_hf(cfg, "Qwen2ForCausalLM")


def _qwen3_config(hf: dict) -> dict:
    _full_attention(hf)
    _require(hf, "attention_bias", (False,), False)
    return _llama_fields(hf) | dict(qk_norm=True)


def _qwen3_hf(cfg: ModelConfig) -> dict:
    return _qwen_hf(cfg, "Qwen3ForCausalLM") | dict(attention_bias=False)


def _qwen3_moe_config(hf: dict) -> dict:
    if _get(hf, "mlp_only_layers", []):
        raise UnsupportedCheckpoint(
            f"config.json: mlp_only_layers={hf['mlp_only_layers']} is not supported: jaxformer places MoE layers "
            "every decoder_sparse_step layers"
        )
    E = _experts(hf, "num_experts")
    k, step = hf["num_experts_per_tok"], _get(hf, "decoder_sparse_step", 1)
    if not isinstance(k, int) or not 1 <= k <= E:
        raise UnsupportedCheckpoint(f"config.json: num_experts_per_tok={k!r} must be in [1, num_experts={E}]")
    if not isinstance(step, int) or step < 1:
        raise UnsupportedCheckpoint(f"config.json: decoder_sparse_step={step!r} must be a positive number of layers")
    # transformers adds the load-balancing loss only with output_router_logits.
    aux = float(_get(hf, "router_aux_loss_coef", 0.001)) if hf.get("output_router_logits") else 0.0
    router = "topk_softmax" if _get(hf, "norm_topk_prob", False) else "softmax_topk"
    moe = MoEConfig(num_experts=E, experts_per_token=k, every=step, router=router, aux_loss_weight=aux,
                    expert_d_ff=hf["moe_intermediate_size"])  # fmt: skip
    return _qwen3_config(hf) | dict(moe=moe)


def _qwen3_moe_hf(cfg: ModelConfig) -> dict:
    moe = cfg.moe
    every, offset = moe.layout("decoder")
    if not every:
        raise UnsupportedCheckpoint("model.moe.decoder_every=0: a Qwen 3 MoE model has MoE layers (else write qwen3)")
    if offset != every - 1:  # the layout decoder_sparse_step says: layers every-1, 2*every-1, ...
        raise UnsupportedCheckpoint(
            f"model.moe.decoder_offset={offset}: Qwen 3 MoE's layers are MoE at (i + 1) % decoder_sparse_step == 0"
        )
    return _qwen3_hf(cfg) | dict(
        architectures=["Qwen3MoeForCausalLM"], num_experts=moe.num_experts, num_experts_per_tok=moe.experts_per_token,
        decoder_sparse_step=every, moe_intermediate_size=moe.expert_d_ff or cfg.d_ff,
        norm_topk_prob=moe.router == "topk_softmax", mlp_only_layers=[],
        output_router_logits=moe.aux_loss_weight > 0, router_aux_loss_coef=moe.aux_loss_weight,
    )  # fmt: skip


def _qwen3_moe_ffn(h: str, L: str) -> list[Rule]:
    """A layer's feed-forward: in MoE layers the router (gate) [E, D] and each expert's gate, up and
    down projections (its slice of our stacked kernels), in the others Llama's dense one."""
    m = f"{h}.mlp"
    rules = [Rule(f"{m}.gate.weight", (f"{L}.ffn.router",), "linear", layers="moe")]
    for theirs, ours in (("gate_proj", "wi_gate"), ("up_proj", "wi"), ("down_proj", "wo")):
        rules.append(Rule(f"{m}.experts.{{e}}.{theirs}.weight", (f"{L}.ffn.{ours}[{{e}}]",), "linear", layers="moe"))
    return rules + [Rule(r.theirs, r.ours, r.layout, r.inputs, layers="dense") for r in _llama_mlp(h, L)]


def _qk_norms(h: str, L: str) -> list[Rule]:
    return [same(f"{h}.self_attn.{n}_norm.weight", f"{L}.self_attn.{n}_norm") for n in "qk"]


def _qwen2_rules(cfg: ModelConfig) -> list[Rule]:
    h, L = "model.layers.{i}", "decoder.stack.layers.{i}"
    rules = _llama_rules(cfg)
    for n in "qkv":
        rules += dense(f"{h}.self_attn.{n}_proj", f"{L}.self_attn.{n}", bias=True)[1:]  # the biases
    return rules


def _qwen3_rules(cfg: ModelConfig) -> list[Rule]:
    h, L = "model.layers.{i}", "decoder.stack.layers.{i}"
    return _llama_rules(cfg) + _qk_norms(h, L)


def _qwen3_moe_rules(cfg: ModelConfig) -> list[Rule]:
    h, L = "model.layers.{i}", "decoder.stack.layers.{i}"
    return _llama_rules(cfg, _qwen3_moe_ffn) + _qk_norms(h, L)
