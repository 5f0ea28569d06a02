"""What every config section is built on: ConfigError, `require`, the check of each field's value
against its annotation, and the "did you mean" of a misspelled name."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Literal


class ConfigError(ValueError):
    """A config field has a wrong name, type or value; the message names the field."""


def require(ok: bool, field: str, message: str) -> None:
    """Raise ConfigError naming `field` unless `ok`.

    Args:
        ok: the condition that must hold.
        field: the dotted field the message names ("model.d_model").
        message: what is wrong and what is expected.

    Raises:
        ConfigError: `ok` is false.
    """
    if not ok:
        raise ConfigError(f"{field}: {message}")


def check_field_types(cfg, prefix: str) -> None:
    """Check each field's value against its annotation (int, float, bool, str, Literal, Optional), and each
    seed (a field named `seed` or `*_seed`) against [0, 2**32), which every user of a seed takes: Grain's
    shuffles refuse a negative one and JAX's keys one past 64 bits, mid-run with the workdir written, and
    the engine's sampling seeds are 32 bits.

    Args:
        cfg (object): a config section (a dataclass).
        prefix: its section name, for the messages ("model").

    Raises:
        ConfigError: a field's value does not match its annotation, or a seed is out of [0, 2**32), naming the field.
    """
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, hint = getattr(cfg, f.name), hints[f.name]
        if typing.get_origin(hint) is Literal and value not in typing.get_args(hint):
            choices = ", ".join(repr(c) for c in typing.get_args(hint))
            raise ConfigError(f"{prefix}.{f.name}: {value!r} is not one of the choices: {choices}")
        if not _matches(value, hint):
            raise ConfigError(
                f"{prefix}.{f.name}: {value!r} ({type(value).__name__}) is not of type {_type_name(hint)}"
            )
        if f.name == "seed" or f.name.endswith("_seed"):
            require_seed(value, f"{prefix}.{f.name}")


def require_seed(seed: int, field: str) -> None:
    """Raise ConfigError naming `field` unless `seed` is in [0, 2**32), the range every user of a seed
    takes (`check_field_types` says which).

    Args:
        seed: the seed.
        field: the dotted field the message names ("train.seed").

    Raises:
        ConfigError: the seed is not an int in that range.
    """
    ok = isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**32
    require(ok, field, f"must be in [0, 2**32) (a 32-bit seed), got {seed!r}")


def _matches(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if hint is typing.Any:
        return True
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (tuple, list):
        return isinstance(value, origin)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, hint)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _type_name(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def did_you_mean(name: str, known, prefix: str = "") -> str:
    """ "; did you mean X?" for the known names closest to a misspelled `name`, or "": those holding each
    of its words (`num_layer` -> `num_decoder_layers`), else difflib's closest.

    Args:
        name: what was given.
        known (Iterable[str]): the names there are.
        prefix: written before each suggestion ("model.").

    Returns:
        The suggestion, or "".
    """
    known, words = sorted(known), [w for w in name.lower().split("_") if w]
    close = [k for k in known if words and all(any(v.startswith(w) for v in k.split("_")) for w in words)]
    close = close if 0 < len(close) <= 3 else difflib.get_close_matches(name, known, n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(prefix + c for c in close)}?" if close else ""


def _as_tuples(x):
    return tuple(_as_tuples(i) for i in x) if isinstance(x, (list, tuple)) else x
