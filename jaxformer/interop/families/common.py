"""What the families' tables share: `Family` (a config.json both ways and the tensor rules), the
config.json field helpers (`_get`, `_require`, the activation names, the expert count), an MoE
layout read as the layers it makes MoE (`_layout_of`, `_moe_layer_set`), and a checkpoint's tensor
name as a family's rules spell it (`_canonical`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from jaxformer.config import ConfigError, ModelConfig, RopeScalingConfig
from jaxformer.interop.rules import Rule, UnsupportedCheckpoint


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


def _pad_token(cfg: ModelConfig) -> dict:
    """A decoder-only model's pad id, written only when not 0: its padding is structure (lengths), and
    transformers would take every id-0 token of a prompt for padding."""
    return {"pad_token_id": cfg.pad_id} if cfg.pad_id else {}


def _experts(hf: dict, num_key: str) -> int:
    """The checkpoint's expert count (`num_key`), checked."""
    E = hf[num_key]
    if not isinstance(E, int) or E < 1:
        raise UnsupportedCheckpoint(f"config.json: {num_key}={E!r} must be a positive number of experts")
    return E


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


def _canonical(name: str, family: Family) -> str:
    """A checkpoint name as the family's rules spell it: old BERT names (gamma/beta) renamed, and
    the base model's prefix added where a bare-model checkpoint leaves it out."""
    name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name))
    heads = ("lm_head.", "cls.", "classifier.", "final_logits_bias")
    if family.prefix and not name.startswith(family.prefix) and not name.startswith(heads):
        return family.prefix + name
    return name


# rope_scaling keys each kind reads (besides rope_type / type) as Hugging Face's ROPE_INIT_FUNCTIONS do
ROPE_KEYS = {
    "linear": {"factor"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"},
    "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
}


def _rope_scaling(hf: dict, kinds=tuple(ROPE_KEYS), *, layers: str = "all", logits_mscale: bool = False):
    """config.json's `rope_scaling` as `model.rope_scaling`: one of `kinds`, each key it has read;
    what jaxformer cannot express refused naming the key. `logits_mscale`: the family's attention
    multiplies its logits' scale by mscale(factor, mscale_all_dim)^2 (DeepSeek); elsewhere a
    mscale_all_dim is refused, transformers' attention not reading it."""
    scaling = hf.get("rope_scaling")
    if scaling is None:
        return RopeScalingConfig()
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind == "default":
        return RopeScalingConfig()
    if kind not in kinds:
        raise UnsupportedCheckpoint(
            f"config.json: rope_scaling={scaling!r} is not supported (jaxformer reads rope_type {list(kinds)})"
        )
    for key, value in scaling.items():
        fixed = {"rope_type", "type", "truncate", "attention_factor"}
        if (
            key not in ROPE_KEYS[kind] | fixed
            or (key == "truncate" and value is not True)
            or (key == "attention_factor" and value is not None)
        ):
            raise UnsupportedCheckpoint(f"config.json: rope_scaling.{key}={value!r} is not supported for {kind}")
    if scaling.get("mscale_all_dim") and not logits_mscale:
        raise UnsupportedCheckpoint(
            f"config.json: rope_scaling.mscale_all_dim={scaling['mscale_all_dim']!r} is not supported: "
            f"jaxformer scales the attention logits by it, as DeepSeek does; {hf.get('model_type')} does not"
        )
    original = scaling.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
    fields = dict(kind=kind, factor=float(scaling.get("factor", 1.0)), layers=layers)
    if kind in ("yarn", "llama3"):
        fields["original_max_len"] = original
    if kind == "yarn":  # transformers' defaults where a key is absent or null
        defaults = {"beta_fast": 32, "beta_slow": 1, "mscale": 0, "mscale_all_dim": 0}
        fields |= {key: float(scaling.get(key) or value) for key, value in defaults.items()}
    if kind == "llama3":
        fields |= {key: float(scaling[key]) for key in ("low_freq_factor", "high_freq_factor")}
    try:
        return RopeScalingConfig(**fields)
    except ConfigError as e:
        raise UnsupportedCheckpoint(f"config.json: rope_scaling={scaling!r}: {e}") from None


def _rope_scaling_hf(cfg: ModelConfig) -> dict | None:
    """`model.rope_scaling` as config.json's `rope_scaling` (None for plain RoPE)."""
    r = cfg.rope_scaling
    if not r.enabled:
        return None
    out = {"rope_type": r.kind, "factor": r.factor}
    if r.kind == "yarn":
        out |= dict(original_max_position_embeddings=r.original_max_len, beta_fast=r.beta_fast, beta_slow=r.beta_slow)
        out |= {k: getattr(r, k) for k in ("mscale", "mscale_all_dim") if getattr(r, k)}
    if r.kind == "llama3":
        out |= dict(original_max_position_embeddings=r.original_max_len, low_freq_factor=r.low_freq_factor,
                    high_freq_factor=r.high_freq_factor)  # fmt: skip
    return out
