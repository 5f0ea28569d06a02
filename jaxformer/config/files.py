"""Configs from files: an experiment file's `get_config()` (load_experiment, call_file), a saved
config.json (read_config) and the nested dicts it holds (from_dict), each wrong name or value
refused with the file and the field named."""

from __future__ import annotations

import dataclasses
import json
import pathlib

from jaxformer.config.base import ConfigError, did_you_mean, require
from jaxformer.config.run import SECTIONS, Config


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
