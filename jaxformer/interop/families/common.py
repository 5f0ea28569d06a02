"""What the families' tables share: `Family` (a config.json both ways and the tensor rules), the
config.json field helpers (`_get`, `_require`, the activation names, the expert count), an MoE
layout read as the layers it makes MoE (`_layout_of`, `_moe_layer_set`), and a checkpoint's tensor
name as a family's rules spell it (`_canonical`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from jaxformer.config import ModelConfig
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
