"""Rewards for GRPO: plain Python callables over texts, named in the experiment (`module:function`, or a
file `path/to/file.py:function`), several summed with weights.

A reward function is called with keyword arguments, TRL's convention: `fn(prompts=[...],
completions=[...], answers=[...])`, one entry per sample, and returns one float per sample.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence

import numpy as np

RewardFn = Callable[..., Sequence[float]]


class RewardError(ValueError):
    """A task or reward function that cannot be loaded, raises, or returns what is not one finite
    float per sample; the message names the function."""


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1 where the completion, stripped of surrounding spaces, is the answer; else 0.

    Args:
        prompts: the prompts (unused).
        completions: the sampled completions.
        answers: the expected answers.

    Returns:
        One reward per sample.
    """
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answers, strict=True)]


def format_check(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1 where the completion is one number and nothing else (the answer's format, right or wrong).

    Args:
        prompts: the prompts (unused).
        completions: the sampled completions.
        answers: the expected answers (unused).

    Returns:
        One reward per sample.
    """
    return [float(_NUMBER.fullmatch(c.strip()) is not None) for c in completions]


def math_answer(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1 where the completion's final answer equals the expected number: the content of its last
    `\\boxed{...}`, else what follows its last "####", else its last number; compared as numbers.

    Args:
        prompts: the prompts (unused).
        completions: the sampled completions.
        answers: the expected answers (numbers as text).

    Returns:
        One reward per sample.
    """
    out = []
    for c, a in zip(completions, answers, strict=True):
        boxed = re.findall(r"\\boxed\{([^}]*)\}", c)
        text = boxed[-1] if boxed else c.rsplit("####", 1)[-1]
        found = _NUMBER.findall(text)
        try:
            out.append(float(bool(found) and math.isclose(float(found[-1]), float(a), abs_tol=1e-6)))
        except ValueError:  # an answer that is not a number matches nothing
            out.append(0.0)
    return out


def load_callable(spec: str, field: str) -> Callable:
    """The function a `module:function` or `path/to/file.py:function` spec names.

    Args:
        spec: the spec.
        field: the config field that holds it (named in errors).

    Returns:
        The callable.

    Raises:
        RewardError: a spec that is not `X:function`, a module or file that cannot be loaded, or a name
            it lacks or that is not callable.
    """
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise RewardError(f"{field}: {spec!r} is not 'module:function' or 'file.py:function'")
    where, name = spec.split(":")
    try:
        fn = _from_file(where, name) if where.endswith(".py") else getattr(importlib.import_module(where), name, None)
    except (ImportError, OSError, SyntaxError) as e:
        raise RewardError(f"{field}: cannot load {where!r} ({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise RewardError(f"{field}: {where!r} has no function {name!r}")
    return fn


def _from_file(path: str, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_reward_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name, None)


def score(
    fns: Sequence[tuple[str, RewardFn]],
    weights: Sequence[float],
    prompts: list[str],
    completions: list[str],
    answers: list[str],
) -> tuple[np.ndarray, dict[str, float]]:
    """The weighted sum of every reward function's rewards, each checked.

    Args:
        fns: (name, function) pairs.
        weights: one weight per function.
        prompts: one prompt per sample.
        completions: one completion per sample.
        answers: one answer per sample.

    Returns:
        result (tuple[np.ndarray, dict]): ([N] float64 total rewards, {"reward/NAME": mean} per function).

    Raises:
        RewardError: a function that raises, or returns the wrong number of values or a non-finite one
            (the message names the function and the sample).
    """
    total, means = np.zeros(len(completions)), {}
    for (name, fn), w in zip(fns, weights, strict=True):
        try:
            got = fn(prompts=prompts, completions=completions, answers=answers)
            r = np.asarray(got, dtype=np.float64)
        except Exception as e:
            raise RewardError(f"reward {name} raised {type(e).__name__}: {e}") from e
        if r.shape != (len(completions),):
            raise RewardError(f"reward {name} returned shape {r.shape}, expected one per sample ({len(completions)},)")
        if not np.all(np.isfinite(r)):
            i = int(np.flatnonzero(~np.isfinite(r))[0])
            raise RewardError(f"reward {name} returned {r[i]} for sample {i} (completion {completions[i]!r})")
        total += w * r
        means[f"reward/{name.rsplit(':', 1)[-1]}"] = float(r.mean())
    return total, means
