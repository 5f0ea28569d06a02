"""PEFT LoRA adapters in and out: an adapter directory's config read as a `LoRAConfig`
(`read_peft_config`), its tensors added to a base model (`load_peft`), and a model's adapters
written as one (`save_peft`), for every family of `PEFT_MODULES` (`jaxformer.interop.families`).

    model = load_hf("gpt2/", adapter="lora/")       # a base with a PEFT adapter
    save_peft(model, lora_cfg, "lora/")             # its adapters as a PEFT adapter directory
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re

import jax
import numpy as np
from flax import nnx

from jaxformer.config import ModelConfig
from jaxformer.interop.families import FAMILIES, PEFT_MODULES
from jaxformer.interop.families.common import _canonical
from jaxformer.interop.hf_config import _read_json, family_of
from jaxformer.interop.params import _host_param, _key, _param_shape, _rules_in_effect, _stacked_path
from jaxformer.interop.rules import Rule, UnsupportedCheckpoint, _expand
from jaxformer.interop.tensors import _open
from jaxformer.models import Transformer

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's LoraModel wraps the hub model: its tensors' names start so
TASK_TYPES = {"decoder_only": "CAUSAL_LM", "encoder_decoder": "SEQ_2_SEQ_LM", "encoder_only": "FEATURE_EXTRACTION"}
# adapter_config.json fields whose other values jaxformer's LoRA cannot express: (field, values read).
PEFT_PLAIN = (
    ("use_dora", (False, None)), ("use_rslora", (False, None)), ("bias", ("none", None)),
    ("lora_bias", (False, None)), ("modules_to_save", (None, [])), ("layers_to_transform", (None, [])),
    ("layer_replication", (None,)), ("target_parameters", (None, [])), ("exclude_modules", (None, [])),
    ("trainable_token_indices", (None,)),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PeftModule:
    """One adaptable hub module of one layer: its full name, its name in target_modules, the rule of its weight.

    Attributes:
        name: the module's full name ("transformer.h.0.attn.c_attn").
        target: its name in target_modules ("c_attn").
        rule: the rule of its weight (ours: the kernels it holds).
        pattern: a regex of its name in every layer, the base model's prefix left out.
        suffix: its name after the layer index ("attn.c_attn").
    """

    name: str  # "transformer.h.0.attn.c_attn"
    target: str  # "c_attn"
    rule: Rule  # ours: the kernels (unrolled paths) it holds
    pattern: str  # a regex of its name in every layer, the base model's prefix left out: r"h\.\d+\.attn\.c_attn"
    suffix: str  # its name after the layer index: "attn.c_attn"


def peft_modules(family: str, cfg: ModelConfig) -> list[PeftModule]:
    """Every module of the model that `PEFT_MODULES` lets a PEFT adapter adapt, layer by layer.

    Args:
        family: the base's model_type.
        cfg: the base's config.

    Returns:
        The modules.

    Raises:
        UnsupportedCheckpoint: a family PEFT adapters are not read for.
    """
    if family not in PEFT_MODULES:
        raise UnsupportedCheckpoint(
            f"PEFT adapters for {family} are not supported (jaxformer reads {list(PEFT_MODULES)})"
        )
    out = []
    for template in FAMILIES[family].rules(cfg):
        if template.layout not in ("linear", "conv1d") or not template.theirs.endswith(".weight"):
            continue
        kernels = tuple(o.rsplit(".", 1)[1] for o in template.ours)
        name = template.theirs.removesuffix(".weight")
        pattern = re.escape(name.removeprefix(FAMILIES[family].prefix)).replace(re.escape("{i}"), r"\d+")
        # The first row whose suffix and kernels fit: BERT's "output.dense" (wo) is not its attention's (o).
        target = next((t for t, ours in PEFT_MODULES[family].items()
                       if (name == t or name.endswith("." + t)) and ours == kernels), None)  # fmt: skip
        if target is not None:
            suffix = name.split("{i}.")[-1]
            out += [PeftModule(rule.theirs.removesuffix(".weight"), target, rule, pattern, suffix)
                    for rule, _ in _expand([template], cfg)]  # fmt: skip
    return out


def _linear_modules(family: str, cfg: ModelConfig) -> list[str]:
    """The names of every linear module of the model that the family's rules know (adaptable or not)."""
    rules = _expand(FAMILIES[family].rules(cfg), cfg)
    return [r.theirs.removesuffix(".weight") for r, _ in rules
            if r.layout in ("linear", "conv1d") and r.theirs.endswith(".weight")]  # fmt: skip


def _targeted(target_modules, name: str, prefix: str = "") -> bool:
    """Whether peft's `target_modules` (a list of name suffixes, a regex, or "all-linear") takes module `name`.
    A regex matches the whole name, which peft spells with the base model's `prefix` ("bert.") or without
    it (an adapter made on the bare model): either is taken."""
    if isinstance(target_modules, str):
        names = (name, name.removeprefix(prefix)) if prefix else (name,)
        return target_modules == "all-linear" or any(re.fullmatch(target_modules, n) for n in names)
    return any(name == t or name.endswith("." + t) for t in target_modules)


def read_peft_config(directory: str | pathlib.Path, family: str, cfg: ModelConfig):
    """The LoRAConfig of the PEFT adapter in `directory` for a `family` model of `cfg`: rank, alpha,
    dropout, and the targets and stacks its target_modules adapt. What jaxformer's LoRA cannot
    express (DoRA, per-module ranks, biases, modules to save, ...) fails with the field named.

    Args:
        directory: the PEFT adapter directory.
        family: the base's model_type.
        cfg: the base's config.

    Returns:
        lora (LoRAConfig): the adapter's LoRA section.

    Raises:
        FileNotFoundError: no adapter_config.json.
        UnsupportedCheckpoint: a setting jaxformer's LoRA cannot express, named.
    """
    from jaxformer import lora
    from jaxformer.config import LORA_TARGETS, LoRAConfig

    path, fields = _read_json(directory, ADAPTER_CONFIG, "a PEFT adapter directory")
    if not isinstance(fields, dict) or fields.get("peft_type") != "LORA":
        kind = fields.get("peft_type") if isinstance(fields, dict) else None
        raise UnsupportedCheckpoint(f"{path}: peft_type={kind!r}; jaxformer reads LoRA adapters (peft_type='LORA')")
    for key in ("r", "lora_alpha", "target_modules"):
        if fields.get(key) is None:
            raise UnsupportedCheckpoint(f"{path} lacks {key}")
    for key, allowed in PEFT_PLAIN:
        if fields.get(key) not in allowed:
            raise UnsupportedCheckpoint(f"{path}: {key}={fields[key]!r} is not supported (jaxformer reads {allowed})")
    # Per-module ranks and alphas: only those equal to the uniform r and lora_alpha (lora.rank, lora.alpha).
    for key, uniform in (("rank_pattern", "r"), ("alpha_pattern", "lora_alpha")):
        pattern = fields.get(key) or {}
        if not isinstance(pattern, dict) or any(v != fields[uniform] for v in pattern.values()):
            raise UnsupportedCheckpoint(
                f"{path}: {key}={pattern!r} is not supported: jaxformer's LoRA has one {uniform} for every module "
                f"({uniform}={fields[uniform]!r})"
            )
    targets, prefix = fields["target_modules"], FAMILIES[family].prefix
    every = _linear_modules(family, cfg)
    places = {m.name: m for m in peft_modules(family, cfg)}
    for name in every:
        output_layer = targets == "all-linear" and name == "lm_head"  # peft's all-linear leaves it out
        if _targeted(targets, name, prefix) and name not in places and not output_layer:
            adaptable = list(PEFT_MODULES[family])
            raise UnsupportedCheckpoint(f"{path}: target module {name} has no place in jaxformer's LoRA ({adaptable})")
    # A name of the family's table that this model lacks (T5's "wi" in a gated T5) selects nothing, as in peft.
    for t in [] if isinstance(targets, str) else targets:
        if not any(_targeted([t], name) for name in every) and t not in PEFT_MODULES[family]:
            raise UnsupportedCheckpoint(f"{path}: target_modules names {t!r}, no module of this {family} model")
    chosen = [m for m in places.values() if _targeted(targets, m.name, prefix)]
    if not chosen:
        raise UnsupportedCheckpoint(f"{path}: target_modules={targets!r} selects no module of this {family} model")
    kernels = {o.rsplit(".", 1)[1] for m in chosen for o in m.rule.ours}
    stacks = {lora._stack_of(tuple(o.split("."))) for m in chosen for o in m.rule.ours}
    out = LoRAConfig(
        rank=int(fields["r"]), alpha=float(fields["lora_alpha"]), dropout=float(fields.get("lora_dropout") or 0.0),
        targets=tuple(t for t in LORA_TARGETS if t in kernels),
        stacks=tuple(s for s in ("encoder", "decoder", "cross") if s in stacks),
    )  # fmt: skip
    # jaxformer adapts each of lora.targets in every layer of each of lora.stacks: the adapter must too.
    unadapted = [m.name for m in places.values() if m not in chosen and _adapts(m, out)]
    if unadapted:
        raise UnsupportedCheckpoint(
            f"{path}: target_modules={targets!r} leaves out {unadapted[:4]}, which jaxformer's LoRA would adapt too "
            f"(it adapts each of lora.targets={out.targets} in every layer of each of lora.stacks={out.stacks})"
        )
    return out


def _adapts(module: PeftModule, lora_cfg) -> bool:
    from jaxformer import lora

    return any(o.rsplit(".", 1)[1] in lora_cfg.targets and lora._stack_of(tuple(o.split("."))) in lora_cfg.stacks
               for o in module.rule.ours)  # fmt: skip


def load_peft(model: Transformer, directory: str | pathlib.Path, *, family: str, mesh=None) -> Transformer:
    """`model` (a `family` base) with the PEFT LoRA adapter in `directory` added (in place): its config
    read by `read_peft_config`, its tensors checked against the base's shapes, the tensor named if not.

    Args:
        model: the base model.
        directory: the PEFT adapter directory.
        family: the base's model_type.
        mesh (jax.sharding.Mesh | None): the mesh to place the adapters on, or None.

    Returns:
        `model`, with the adapters.

    Raises:
        FileNotFoundError: no adapter_model.safetensors.
        UnsupportedCheckpoint: a tensor missing, unplaced, or of the wrong shape, named.
    """
    from jaxformer import lora

    cfg, directory = model.cfg, pathlib.Path(directory)
    lora_cfg = read_peft_config(directory, family, cfg)
    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (a PEFT adapter saved with safe_serialization=True has it)")
    with _open(path) as f:
        # An adapter made on the bare model (BertModel) names its modules without the prefix ("bert.").
        names = {_canonical(re.sub(r"\.lora_([AB])\.default\.", r".lora_\1.", n.removeprefix(PEFT_PREFIX)),
                            FAMILIES[family]): n for n in f.keys()}  # noqa: SIM118  # fmt: skip
    with _rules_in_effect(mesh):
        lora.add_adapters(model, lora_cfg)
    state = nnx.state(model, nnx.LoRAParam)
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(state)}
    arrays, used = {}, set()
    for module in peft_modules(family, cfg):
        if not _adapts(module, lora_cfg):
            continue
        a, b = (_peft_tensor(path, names, f"{module.name}.lora_{ab}.weight", used) for ab in "AB")
        ours = module.rule.ours
        shapes_a = [_param_shape(flat, f"{o}_lora.a", cfg) for o in ours]
        shapes_b = [_param_shape(flat, f"{o}_lora.b", cfg) for o in ours]
        want_a = (lora_cfg.rank, math.prod(shapes_a[0][:-1]))
        want_b = (sum(math.prod(s[1:]) for s in shapes_b), lora_cfg.rank)
        for tensor, got, want in ((f"{module.name}.lora_A.weight", a.shape, want_a),
                                  (f"{module.name}.lora_B.weight", b.shape, want_b)):  # fmt: skip
            if tuple(got) != want:
                raise UnsupportedCheckpoint(
                    f"{path}: {PEFT_PREFIX}{tensor} has shape {tuple(got)}, the base's {module.name} wants {want} "
                    f"(r={lora_cfg.rank}): an adapter for another base model?"
                )
        # Every part of a fused module reads the one A; B splits along the fused output features.
        parts_b = np.split(b.T, len(ours), axis=1)
        for o, shape_a, shape_b, part_b in zip(ours, shapes_a, shapes_b, parts_b, strict=True):
            arrays[f"{o}_lora.a"] = a.T.reshape(shape_a)
            arrays[f"{o}_lora.b"] = part_b.reshape(shape_b)
    unused = sorted(names[n] for n in names if n not in used)
    if unused:
        raise UnsupportedCheckpoint(f"{path}: tensors with no place in the adapted model: {unused[:6]}")
    stacks: dict[str, dict[int, np.ndarray]] = {}
    values = {}
    for p, array in arrays.items():
        stacked, index = _stacked_path(p, cfg.scan_block) if cfg.scan_layers else (p, None)
        if index is None:
            values[p] = array
        else:
            stacks.setdefault(stacked, {})[index] = array
    values |= {p: np.stack([layers[i] for i in range(len(layers))]) for p, layers in stacks.items()}
    updated = []
    for p, var in flat.items():
        value = var[...]
        updated.append((tuple(_key(k) for k in p.split(".")), var.replace(jax.device_put(
            values[p].astype(np.float32), value.sharding))))  # fmt: skip
    nnx.update(model, nnx.from_flat_state(updated))
    return model


def _peft_tensor(path: pathlib.Path, names: dict, name: str, used: set) -> np.ndarray:
    if name not in names:
        raise UnsupportedCheckpoint(f"{path} lacks {PEFT_PREFIX}{name}")
    used.add(name)
    with _open(path) as f:
        return f.get_tensor(names[name]).astype(np.float32)


def save_peft(
    model: Transformer, lora_cfg, directory: str | pathlib.Path, *, family: str | None = None, base: str | None = None
) -> pathlib.Path:
    """Write the LoRA adapters of `model` (made with `lora_cfg`) as a PEFT adapter directory:
    adapter_config.json and adapter_model.safetensors in peft's naming (A [r, in], B [out, r]),
    for the hub model `base` (base_model_name_or_path). A fused hub module whose parts hold one
    shared A is written at rank R; parts with their own A as one adapter of rank n*R, A stacked and
    B block-diagonal, with peft's rank_pattern and alpha_pattern keeping the scale alpha / R.

    Args:
        model: the model with adapters.
        lora_cfg (LoRAConfig): the LoRA section they were made with.
        directory: the directory to write.
        family: the family, or None (the one that fits).
        base: the hub name of the base (base_model_name_or_path), or None.

    Returns:
        `directory`.

    Raises:
        UnsupportedCheckpoint: no adapters, or none that PEFT can name.
    """
    from safetensors.numpy import save_file

    from jaxformer.config import LORA_MODEL_TARGETS

    if unwritten := [t for t in lora_cfg.targets if t in LORA_MODEL_TARGETS]:
        raise UnsupportedCheckpoint(
            f"lora.targets: PEFT adapters of {', '.join(map(repr, unwritten))} are not written (only q, k, v, o "
            "and the feed-forward's): export the model with its adapters folded in (export-hf without --adapter)"
        )
    cfg = model.cfg
    family = family or family_of(cfg)
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    has = lambda o: (_stacked_path(f"{o}_lora.a", cfg.scan_block)[0] if cfg.scan_layers else f"{o}_lora.a") in flat
    tensors, targets, rank_pattern, alpha_pattern, chosen = {}, set(), {}, {}, []
    R, fan_in_fan_out = lora_cfg.rank, False
    for module in peft_modules(family, cfg):
        ours = module.rule.ours
        adapted = [k for k, o in enumerate(ours) if has(o)]
        if not adapted:
            continue
        targets.add(module.target)
        chosen.append(module)
        fan_in_fan_out |= module.rule.layout == "conv1d"
        width = [math.prod(_param_shape(flat, o, cfg)[module.rule.inputs :]) for o in ours]  # output features
        a_parts = {k: _host_param(flat, f"{ours[k]}_lora.a", cfg).reshape(-1, R) for k in adapted}  # [in, R]
        b_parts = {k: _host_param(flat, f"{ours[k]}_lora.b", cfg).reshape(R, -1) for k in adapted}  # [R, out]
        if all(np.array_equal(a_parts[adapted[0]], a_parts[k]) for k in adapted):  # one shared A: rank R
            a = a_parts[adapted[0]]
            b = np.concatenate([b_parts.get(k, np.zeros((R, w), np.float32)) for k, w in enumerate(width)], axis=1)
        else:  # A stacked [in, n R], B block-diagonal [n R, out]: the same update, rank n R
            n = len(adapted)
            a = np.concatenate([a_parts[k] for k in adapted], axis=1)
            b = np.zeros((n * R, sum(width)), np.float32)
            starts = np.cumsum([0, *width])
            for j, k in enumerate(adapted):
                b[j * R : (j + 1) * R, starts[k] : starts[k + 1]] = b_parts[k]
            rank_pattern[module.target] = n * R
            alpha_pattern[module.target] = _number(n * lora_cfg.alpha)
        tensors[f"{PEFT_PREFIX}{module.name}.lora_A.weight"] = np.ascontiguousarray(a.T)
        tensors[f"{PEFT_PREFIX}{module.name}.lora_B.weight"] = np.ascontiguousarray(b.T)
    if not tensors:
        raise UnsupportedCheckpoint("the model has no LoRA adapters to write (lora.rank=0?)")
    target_modules = _target_modules(family, cfg, chosen, sorted(targets))
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    fields = dict(
        peft_type="LORA", task_type=TASK_TYPES[cfg.mode], base_model_name_or_path=base, r=R,
        lora_alpha=_number(lora_cfg.alpha), lora_dropout=lora_cfg.dropout, target_modules=target_modules,
        fan_in_fan_out=fan_in_fan_out, bias="none", rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
        use_rslora=False, use_dora=False, init_lora_weights=True, inference_mode=True, modules_to_save=None,
        layers_to_transform=None, layers_pattern=None, revision=None,
    )  # fmt: skip
    (directory / ADAPTER_CONFIG).write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    return directory


def _target_modules(family: str, cfg: ModelConfig, chosen: list[PeftModule], names: list[str]) -> list[str] | str:
    """target_modules that select exactly the `chosen` modules in peft's matching: their names (`names`)
    where those select no other module (in BERT "output.dense" takes the attention's output too; in BART
    and T5 a name takes every stack), else their names after the layer index ("self_attn.q_proj": not
    the cross-attention's), else a regex of the chosen modules' names in every layer ("encoder" only)."""
    prefix, every, want = FAMILIES[family].prefix, _linear_modules(family, cfg), {m.name for m in chosen}
    for candidate in (names, sorted({m.suffix for m in chosen})):
        if {n for n in every if _targeted(candidate, n)} == want:
            return candidate
    patterns = sorted({m.pattern for m in chosen})
    regex = r"(?:.*\.)?" + (patterns[0] if len(patterns) == 1 else f"(?:{'|'.join(patterns)})")
    assert {n for n in every if _targeted(regex, n, prefix)} == want, regex  # the patterns are the names'
    return regex


def _number(x: float) -> int | float:
    """An integral float as an int, as peft writes lora_alpha."""
    return int(x) if float(x).is_integer() else x
