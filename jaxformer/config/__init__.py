"""Typed, frozen, validated configs.

Every config is a frozen dataclass whose `__post_init__` checks its fields, so a
wrong value fails with the field named before anything is built or compiled.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import types
import typing
from typing import Literal

from jaxformer.config.architecture import MODES, ModelConfig, MoEConfig
from jaxformer.config.base import (
    ConfigError,
    _matches,
    _type_name,
    check_field_types,
    did_you_mean,
    require,
)
from jaxformer.config.lora import (
    LORA_MODEL_TARGETS,
    LORA_STACKS,
    LORA_TARGETS,
    MODE_STACKS,
    LoRAConfig,
    check_lora_fits,
)
from jaxformer.config.presets import (
    PRESETS,
    bart_base,
    bert_base,
    gpt2_small,
    llama,
    paper_base,
    paper_big,
    t5_small,
    t5_v1_1_small,
    tiny,
)
from jaxformer.config.run import SECTIONS, SPLASH_TILE, Config, ring_blocks_unfit
from jaxformer.config.sections import (
    SYNTHETIC,
    CheckpointConfig,
    DataConfig,
    DecodeConfig,
    MeshConfig,
    TrainConfig,
)


def from_dict(d: dict) -> Config:
    """Rebuild a Config from `to_dict()` output (e.g. a run's saved config.json).

    Args:
        d: section -> field -> value.

    Returns:
        The Config.

    Raises:
        ConfigError: an unknown section or field, or an invalid value.
    """
    unknown = set(d) - set(SECTIONS)
    if unknown:
        said = did_you_mean(next(iter(unknown)), SECTIONS) if len(unknown) == 1 else ""
        raise ConfigError(f"{', '.join(sorted(unknown))}: unknown config section{said}")
    return Config(**{name: _section(name, d.get(name, {})) for name in SECTIONS})


def read_config(path) -> Config:
    """A saved config.json (a workdir's, an export's) as a Config; ConfigError naming the file if it is not one.

    Args:
        path (str | pathlib.Path): the config.json.

    Returns:
        The Config.

    Raises:
        ConfigError: the file is not JSON or not a valid config, naming it.
    """
    path = pathlib.Path(path)
    try:
        values = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f"line {e.lineno}, column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else e.reason
        raise ConfigError(f"{path} is not a jaxformer config (JSON, {where})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} is not a jaxformer config (JSON object of sections)")
    try:
        return from_dict(values)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{path}: {e}") from None


def _section(name: str, values: dict):
    cls = SECTIONS[name]
    known = {f.name for f in dataclasses.fields(cls)}
    require(isinstance(values, dict), name, f"a section is an object of fields, got {type(values).__name__}")
    for key in values:
        if key not in known:
            said = did_you_mean(key, known, prefix=f"{name}.")
            raise ConfigError(f"{name}.{key}: unknown field{said} (known: {', '.join(sorted(known))})")
    return cls(**values)


def call_file(path: str, function: str, what: str):
    """Run the Python file at `path` and return its `function()`; ConfigError if either is missing.

    Args:
        path: the Python file.
        function: the name of the function to call.
        what: what the file is, for the messages ("experiment", "sweep").

    Returns:
        result (object): what the function returns.

    Raises:
        ConfigError: the file is missing, not Python, has a syntax error, or lacks the function.
    """
    import importlib.util

    file = pathlib.Path(path)
    if not file.is_file():
        siblings = [str(f) for f in file.parent.glob("*.py")]  # experiments/lm_shakspeare.py: its neighbours
        raise ConfigError(f"{what} file {path} does not exist{did_you_mean(str(path), siblings)}")
    if file.suffix != ".py":
        raise ConfigError(f"{what} file {path} is not a Python file (an {what} is a .py file defining {function}())")
    spec = importlib.util.spec_from_file_location(f"jaxformer_{what}_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ConfigError(f"{what} file {path}, line {e.lineno}: {e.msg}") from None
    if not hasattr(module, function):
        raise ConfigError(f"{path} defines no {function}()")
    return getattr(module, function)()


def load_experiment(path: str) -> Config:
    """Run experiments/NAME.py and return its `get_config()`.

    Args:
        path: the experiment file.

    Returns:
        The Config.

    Raises:
        ConfigError: the file is missing or invalid, or get_config() returns no Config.
    """
    cfg = call_file(path, "get_config", "experiment")
    if not isinstance(cfg, Config):
        raise ConfigError(f"{path}: get_config() returned {type(cfg).__name__}, not jaxformer.config.Config")
    return cfg


def field_hint(dotted: str):
    """The type annotation of the field `section.field` (or `section.field.subfield` inside a
    nested section such as `model.moe`) names; ConfigError naming it if none.

    Args:
        dotted: "section.field" or "section.field.subfield".

    Returns:
        hint (type): the annotation.

    Raises:
        ConfigError: no such field, or the name is a section.
    """
    parts = dotted.strip().split(".")
    if len(parts) < 2 or parts[0] not in SECTIONS:
        said = did_you_mean(parts[0], SECTIONS)
        raise ConfigError(f"{dotted}: a field is section.field ({', '.join(SECTIONS)}){said}")
    cls = SECTIONS[parts[0]]
    for i, name in enumerate(parts[1:], start=1):
        require(dataclasses.is_dataclass(cls), dotted, f"{'.'.join(parts[:i])} has no fields")
        hints = typing.get_type_hints(cls)
        if name not in hints:
            said = did_you_mean(name, hints, prefix=".".join(parts[:i]) + ".")
            raise ConfigError(f"{dotted}: unknown field{said} (known: {', '.join(sorted(hints))})")
        cls = hints[name]
    require(not dataclasses.is_dataclass(cls), dotted, f"is a section: set its fields ({dotted}.FIELD=...)")
    return cls


def with_values(cfg: Config, values: dict) -> Config:
    """`cfg` with fields replaced: {"section.field": value} (or "section.field.subfield"); the result is validated.

    Args:
        cfg: the config.
        values: "section.field" -> value.

    Returns:
        A new, validated Config.

    Raises:
        ConfigError: an unknown field or an invalid value.
    """
    d = cfg.to_dict()
    for dotted, value in values.items():
        field_hint(dotted)
        *parents, name = dotted.strip().split(".")
        node = d
        for part in parents:
            node = node[part]
        node[name] = value
    return from_dict(d)


def parse_overrides(overrides: list[str]) -> dict:
    """`section.field=value` strings as {"section.field": value}, each parsed by the field's type.

    Args:
        overrides: "section.field=value" strings.

    Returns:
        "section.field" -> parsed value.

    Raises:
        ConfigError: a string without "=", an unknown field, or a value its type cannot parse.
    """
    values = {}
    for item in overrides:
        require("=" in item, item, "an override is section.field=value")
        dotted, raw = item.split("=", 1)
        values[dotted.strip()] = _parse(raw.strip(), field_hint(dotted), dotted.strip())
    return values


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply `section.field=value` overrides; values are parsed by the field's type and validated.

    Args:
        cfg: the config.
        overrides: "section.field=value" strings (`--set`).

    Returns:
        A new, validated Config.

    Raises:
        ConfigError: an unknown field or an invalid value, naming it.
    """
    return with_values(cfg, parse_overrides(overrides))


def _parse(raw: str, hint, field: str):
    if raw.lower() in ("none", "null") and _matches(None, hint):
        return None
    candidates = (
        [h for h in typing.get_args(hint) if h is not type(None)]
        if typing.get_origin(hint)
        in (
            typing.Union,
            types.UnionType,
        )
        else [hint]
    )
    for h in candidates:
        try:
            if h is bool:
                if raw.lower() in ("true", "1", "yes", "false", "0", "no"):
                    return raw.lower() in ("true", "1", "yes")
                continue
            if h in (int, float):
                return h(float(raw)) if h is int and float(raw).is_integer() else h(raw)
            if h is str or typing.get_origin(h) is Literal:
                return raw
            if typing.get_origin(h) is tuple and typing.get_args(h)[:1] == (str,):
                return tuple(v.strip() for v in raw.split(",") if v.strip())
        except ValueError:
            continue
    raise ConfigError(f"{field}: cannot parse {raw!r} as {_type_name(hint)}")


# The names of the package's modules, importable from here as they were from the one module it was.
__all__ = [
    "LORA_MODEL_TARGETS",
    "LORA_STACKS",
    "LORA_TARGETS",
    "MODES",
    "MODE_STACKS",
    "PRESETS",
    "SPLASH_TILE",
    "SYNTHETIC",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DecodeConfig",
    "LoRAConfig",
    "MeshConfig",
    "MoEConfig",
    "ModelConfig",
    "TrainConfig",
    "bart_base",
    "bert_base",
    "check_field_types",
    "check_lora_fits",
    "did_you_mean",
    "gpt2_small",
    "llama",
    "paper_base",
    "paper_big",
    "require",
    "ring_blocks_unfit",
    "t5_small",
    "t5_v1_1_small",
    "tiny",
]
