"""A Hugging Face config.json as a `ModelConfig` and back: the directory's config.json read and its
family checked (`read_hf_config`), converted by the family's table (`config_from_hf`,
`config_to_hf`), and the one family whose config.json says a model exactly, by a round trip
(`family_of`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from jaxformer.config import ModelConfig
from jaxformer.interop.families import FAMILIES
from jaxformer.interop.families.common import _layout_of
from jaxformer.interop.families.switch import _switch_scannable
from jaxformer.interop.rules import UnsupportedCheckpoint

CONFIG = "config.json"


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


def config_from_hf(hf: dict, *, where: str | pathlib.Path = CONFIG, **overrides) -> ModelConfig:
    """A ModelConfig from a config.json's contents; `overrides` replace fields (dtype, scan_layers, ...).

    Args:
        hf: config.json's contents.
        where: the file they came from (named when a field is missing).
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
        raise UnsupportedCheckpoint(f"{where} lacks {e}") from None


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
    pattern = dataclasses.replace(cfg.moe, first_dense=0)  # the layout before the first dense layers (kept apart)
    for stack in ("encoder", "decoder"):
        layers = cfg.num_encoder_layers if stack == "encoder" else cfg.num_decoder_layers
        moe_layers = {i for i in range(layers) if pattern.is_moe_layer(stack, i)}
        every, offset = _layout_of(moe_layers, layers) if stack in cfg.stacks else (0, None)
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
