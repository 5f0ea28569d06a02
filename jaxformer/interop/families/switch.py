"""Switch Transformers (`switch_transformers`): T5 whose feed-forward is a mixture of experts in the
layers each stack's sparse step makes sparse (top-1 routing, a capacity per expert), its config.json
both ways, the dense and sparse layers' rules, and the scanned blocks its layouts allow."""

from __future__ import annotations

import dataclasses

from jaxformer.config import ModelConfig, MoEConfig
from jaxformer.interop.families.common import (
    ACTIVATION_NAMES,
    ACTIVATIONS,
    _experts,
    _get,
    _layout_of,
    _moe_layer_set,
    _require,
)
from jaxformer.interop.families.t5 import _t5_config, _t5_hf
from jaxformer.interop.rules import Rule, UnsupportedCheckpoint, dense

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
