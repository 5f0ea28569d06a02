"""The rule machinery of the Hugging Face tables: one `Rule` per checkpoint tensor, the helpers a
family's table is written with (`same`, `dense`, `norm`, `attention`), the layout transforms both
ways (`to_ours`, `to_theirs`), and a table's rules for every layer and expert of a model
(`_expand`). `UnsupportedCheckpoint` is the error every part of `jaxformer.interop` raises for what
jaxformer cannot express.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Literal

import numpy as np

from jaxformer.config import ConfigError, ModelConfig


class UnsupportedCheckpoint(ConfigError):
    """The checkpoint (or the model to save) uses something jaxformer cannot express; the message names it."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """One checkpoint tensor and the jaxformer parameter(s) it holds.

    Attributes:
      theirs: the checkpoint's name; "{i}" stands for the layer index.
      ours: jaxformer parameter paths (unrolled); several split the tensor in equal parts along
        its output features (GPT-2's fused QKV).
      layout: "same" (identical shape), "vector" (a flat vector of ours), "row" ([1, N]),
        "linear" (torch Linear [out, in]), "conv1d" (GPT-2's Conv1D [in, out]).
      inputs: linear/conv1d: how many leading axes of ours are input features (2 for an
        attention output [H, K, D]).
      layers: the layers of its stack it is in: "all", or only those whose feed-forward is
        "dense" or "moe" (`model.moe.every`). "{e}" in `theirs` stands for the expert index, and
        `ours` then ends in "[{e}]": that expert's slice of the stacked kernel.
      rows: linear only: ours' output features are the checkpoint's rows in this order (DeepSeek's
        interleaved RoPE dims read as rotate-half ones); None keeps them.
    """

    theirs: str
    ours: tuple[str, ...]
    layout: Literal["same", "vector", "row", "linear", "conv1d"] = "same"
    inputs: int = 1
    layers: Literal["all", "dense", "moe"] = "all"
    rows: tuple[int, ...] | None = None


def same(theirs: str, ours: str) -> Rule:
    """A tensor stored as jaxformer stores it: `theirs` -> `ours`, shape unchanged.

    Args:
        theirs: the checkpoint's name.
        ours: our parameter path.

    Returns:
        The `Rule`.
    """
    return Rule(theirs, (ours,))


def dense(theirs: str, ours: str, *, bias: bool, inputs: int = 1, layout: str = "linear") -> list[Rule]:
    """A projection: `theirs.weight` -> ours, `theirs.bias` -> ours_bias.

    Args:
        theirs: the checkpoint module's name (without ".weight").
        ours: our kernel's path.
        bias: the module has a bias.
        inputs: how many leading axes of our kernel are input features.
        layout: "linear" ([out, in]) or "conv1d" ([in, out]).

    Returns:
        The rules of the weight (and bias).
    """
    rules = [Rule(f"{theirs}.weight", (ours,), layout, inputs)]
    return [*rules, Rule(f"{theirs}.bias", (f"{ours}_bias",), "vector")] if bias else rules


def norm(theirs: str, ours: str, *, bias: bool, names: tuple[str, str] = ("weight", "bias")) -> list[Rule]:
    """A norm: `theirs.weight` -> ours.scale and, with `bias`, `theirs.bias` -> ours.bias (`names` renames them).

    Args:
        theirs: the checkpoint module's name.
        ours: our norm's path.
        bias: the norm has a bias.
        names: the checkpoint's names of the scale and the bias.

    Returns:
        The rules.
    """
    rules = [same(f"{theirs}.{names[0]}", f"{ours}.scale")]
    return [*rules, same(f"{theirs}.{names[1]}", f"{ours}.bias")] if bias else rules


def attention(theirs: str, ours: str, names: tuple[str, str, str, str], *, bias: bool) -> list[Rule]:
    """Separate q, k, v, output projections named `names` under `theirs`.

    Args:
        theirs: the checkpoint attention module's name.
        ours: our attention's path.
        names: the checkpoint's names of the q, k, v and output projections.
        bias: the projections have biases.

    Returns:
        The rules.
    """
    out = []
    for name, mine in zip(names, "qkvo", strict=True):
        out += dense(f"{theirs}.{name}", f"{ours}.{mine}", bias=bias, inputs=2 if mine == "o" else 1)
    return out


def to_ours(tensor: np.ndarray, rule: Rule, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """The checkpoint tensor as our parameters of `shapes`.

    Args:
        tensor: the checkpoint tensor.
        rule: its rule.
        shapes: the shapes of our parameters it fills.

    Returns:
        Our parameters, float32.

    Raises:
        UnsupportedCheckpoint: the tensor's size does not match the shapes, naming it.
    """
    if rule.layout in ("linear", "conv1d"):
        tensor = tensor if rule.rows is None else tensor[np.asarray(rule.rows)]
        in_out = tensor.T if rule.layout == "linear" else tensor
        parts = np.split(in_out, len(shapes), axis=1)
    else:
        parts = np.split(tensor.reshape(-1), len(shapes)) if len(shapes) > 1 else [tensor]
    out = []
    for part, shape in zip(parts, shapes, strict=True):
        if part.size != math.prod(shape):
            raise UnsupportedCheckpoint(
                f"{rule.theirs}: shape {tensor.shape} does not fit {', '.join(rule.ours)} of shape(s) {shapes}"
            )
        out.append(np.ascontiguousarray(part.reshape(shape)))
    return out


def to_theirs(arrays: list[np.ndarray], rule: Rule) -> np.ndarray:
    """Our parameters as the checkpoint's tensor (the inverse of `to_ours`).

    Args:
        arrays: our parameters the rule names.
        rule: the rule.

    Returns:
        The checkpoint tensor.
    """
    if rule.layout in ("linear", "conv1d"):
        in_out = np.concatenate([a.reshape(math.prod(a.shape[: rule.inputs]), -1) for a in arrays], axis=1)
        out = in_out.T if rule.layout == "linear" else in_out
        if rule.rows is not None:  # back to the checkpoint's order: row rows[j] is our feature j
            out = out[np.argsort(np.asarray(rule.rows))]
        return np.ascontiguousarray(out)
    if rule.layout == "vector" or len(arrays) > 1:
        return np.concatenate([a.reshape(-1) for a in arrays])
    return arrays[0].reshape(1, -1) if rule.layout == "row" else arrays[0]


def _expand(rules: list[Rule], cfg: ModelConfig) -> Iterator[tuple[Rule, int | None]]:
    """(rule with the layer and expert indices filled in, the layer index or None) for every layer of
    its stack that it is in (`Rule.layers`), and every expert."""
    for rule in rules:
        if "{i}" not in rule.theirs:
            yield rule, None
            continue
        side = rule.ours[0].split(".")[0]
        layers = cfg.num_encoder_layers if side == "encoder" else cfg.num_decoder_layers
        for i in range(layers):
            if rule.layers != "all" and cfg.moe.is_moe_layer(side, i) != (rule.layers == "moe"):
                continue
            for e in range(cfg.moe.num_experts) if "{e}" in rule.theirs else (None,):
                ours = tuple(o.format(i=i, e=e) for o in rule.ours)
                yield dataclasses.replace(rule, theirs=rule.theirs.format(i=i, e=e), ours=ours), i
