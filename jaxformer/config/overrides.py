"""`--set section.field=value`: the field a dotted name points to (field_hint, with "did you mean"
for a misspelled one), the value parsed by the field's type (parse_overrides), and the config with
the values in place, validated again (with_values, apply_overrides)."""

from __future__ import annotations

import dataclasses
import decimal
import types
import typing
from typing import Literal

from jaxformer.config.base import ConfigError, _matches, _type_name, did_you_mean, require
from jaxformer.config.files import from_dict
from jaxformer.config.run import SECTIONS, Config


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


def _scalar(raw: str, h):
    """`raw` as type `h` (bool, int, float, str or a Literal); ValueError if it is not one."""
    if h is bool:
        if raw.lower() in ("true", "1", "yes", "false", "0", "no"):
            return raw.lower() in ("true", "1", "yes")
        raise ValueError(raw)
    if h is int:  # exactly, as written: "1000", "1_000" or "1e3", never rounded through a float
        number = decimal.Decimal(raw.replace("_", ""))
        if number.is_finite() and number.adjusted() < 64 and number == number.to_integral_value():
            return int(number)
        raise ValueError(raw)
    if h is float:
        return float(raw)
    if h is str or typing.get_origin(h) is Literal:
        return raw
    raise ValueError(raw)


def _parse(raw: str, hint, field: str):
    if raw.lower() in ("none", "null") and _matches(None, hint):
        return None
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    candidates = [h for h in typing.get_args(hint) if h is not type(None)] if union else [hint]
    for h in candidates:
        try:
            if typing.get_origin(h) is tuple:  # tuple[X, ...]: comma-separated, each item an X ("" is ())
                return tuple(_scalar(v.strip(), typing.get_args(h)[0]) for v in raw.split(",") if v.strip())
            return _scalar(raw, h)
        except (ValueError, decimal.InvalidOperation):
            continue
    items = typing.get_origin(hint) is tuple and f"comma-separated {_type_name(typing.get_args(hint)[0])} values"
    raise ConfigError(f"{field}: cannot parse {raw!r} as {items or _type_name(hint)}")


def apply_section_overrides(section, prefix: str, overrides: list[str]):
    """`prefix.field=value` overrides of one section that is not a part of the run's Config (`engine`,
    `serve`): each value parsed by the field's type, the section validated again.

    Args:
        section (object): the section (a frozen dataclass).
        prefix: its name in the overrides ("engine").
        overrides: "prefix.field=value" strings.

    Returns:
        section (object): a new section of the same type.

    Raises:
        ConfigError: another section's field, an unknown field, or a value its type cannot parse or validate.
    """
    hints, values = typing.get_type_hints(type(section)), {}
    for item in overrides:
        require("=" in item, item, f"an override is {prefix}.field=value")
        dotted, raw = (s.strip() for s in item.split("=", 1))
        section_name, _, name = dotted.partition(".")
        require(section_name == prefix and bool(name), dotted, f"here --set takes {prefix}.FIELD=VALUE")
        if name not in hints:
            said = did_you_mean(name, hints, prefix=f"{prefix}.")
            raise ConfigError(f"{dotted}: unknown field{said} (known: {', '.join(sorted(hints))})")
        values[name] = _parse(raw, hints[name], dotted)
    return dataclasses.replace(section, **values)
