"""Mixtral (`mixtral`): Llama whose feed-forward is a mixture of experts (top-k routing, softmax over
the chosen experts), its config.json both ways and the router's and experts' rules."""

from __future__ import annotations

from jaxformer.config import ModelConfig, MoEConfig
from jaxformer.interop.families.common import _experts, _get, _require
from jaxformer.interop.families.llama import _llama_config, _llama_hf
from jaxformer.interop.rules import Rule, UnsupportedCheckpoint


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
