"""Hugging Face checkpoints in and out: GPT-2, Llama, BERT, BART, T5, Qwen 2 and 3, Gemma 2 and 3, and the
mixtures of experts Mixtral, Switch Transformers and Qwen 3 MoE.

A Hugging Face model directory holds `config.json` and the weights in the hub's PyTorch naming,
in `model.safetensors` or in shards listed by `model.safetensors.index.json`:

    model = load_hf("gpt2/")                        # a Transformer, parameters float32
    model = load_hf("llama/", mesh=mesh)            # each tensor sharded onto the mesh as it is read
    model = load_hf("t5/", scan_layers=True)        # any ModelConfig field can be overridden
    save_hf(model, "out/")                          # config.json + model.safetensors, readable by transformers
    model = load_hf("gpt2/", adapter="lora/")       # with a PEFT LoRA adapter (every family)
    save_peft(model, lora_cfg, "lora/")             # its adapters as a PEFT adapter directory

Each family is a table (`FAMILIES`): how its `config.json` reads as a `ModelConfig` and back, and
one `Rule` per checkpoint tensor naming the jaxformer parameter(s) it is and how the layout
changes. jaxformer's parameter paths are those of `nnx.to_flat_state(nnx.state(model))` for
unrolled layers (docs/parameters.md); scanned stacks hold the same tensors stacked on a
leading layer axis. A mixture-of-experts layer stacks its experts' kernels on a leading expert
axis: a rule's `ours` path ending in `[{e}]` is expert e's slice of it. Tensors are read one at a
time, converted on the host and placed on their devices before the next is read (a stack filled
there slice by slice), so the host holds one tensor at a time, never the whole model. A
checkpoint option jaxformer cannot express fails with the field named.

This module holds `load_hf` and `save_hf`; the pieces they use each have a module, and every name
they define is importable from here as well:

- `jaxformer.interop.rules`: `Rule`, the helpers a table is written with, the layout transforms,
  `UnsupportedCheckpoint`;
- `jaxformer.interop.families`: `FAMILIES` and `PEFT_MODULES`, a module per family (`gpt2`, `llama`,
  `bert`, `bart`, `t5`, `mixtral`, `switch`, `qwen`, `gemma`), what they share in `families.common`;
- `jaxformer.interop.hf_config`: config.json as a `ModelConfig` and back, `family_of`;
- `jaxformer.interop.tensors`: the safetensors files read one tensor at a time;
- `jaxformer.interop.params`: our side: where a parameter path lives, tensors placed, one read back;
- `jaxformer.interop.peft`: PEFT LoRA adapters in and out.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import re

import jax
from flax import nnx

# Every name this module had before its pieces moved stays importable from it (the `noqa: F401` imports).
# A test that monkeypatches one patches the module that reads it (`jaxformer.interop.params._place`, not
# `hf._place`): a name re-exported here is a second reference, which the moved code does not read.
from jaxformer.interop.families import FAMILIES, PEFT_MODULES, TIED_COPIES, Family  # noqa: F401
from jaxformer.interop.families.bart import _bart_config, _bart_hf, _bart_rules  # noqa: F401
from jaxformer.interop.families.bert import _bert_config, _bert_hf, _bert_rules  # noqa: F401
from jaxformer.interop.families.common import (  # noqa: F401
    ACTIVATION_NAMES,
    ACTIVATIONS,
    _activation,
    _canonical,
    _experts,
    _get,
    _layout_of,
    _moe_layer_set,
    _pad_token,
    _require,
    _same_on_both_sides,
)
from jaxformer.interop.families.gpt2 import _gpt2_config, _gpt2_hf, _gpt2_rules  # noqa: F401
from jaxformer.interop.families.llama import _llama_config, _llama_hf, _llama_mlp, _llama_rules  # noqa: F401
from jaxformer.interop.families.mixtral import _mixtral_config, _mixtral_experts, _mixtral_hf  # noqa: F401
from jaxformer.interop.families.switch import (  # noqa: F401
    SWITCH_STACKS,
    _layout_fields,
    _switch_config,
    _switch_ffn,
    _switch_hf,
    _switch_scannable,
    _switch_sparse_layers,
    _switch_sparse_step,
)
from jaxformer.interop.families.t5 import T5_FFN, _t5_config, _t5_ffn, _t5_hf, _t5_rules  # noqa: F401
from jaxformer.interop.hf_config import (  # noqa: F401
    CONFIG,
    RUNTIME_FIELDS,
    _differences,
    _explicit,
    _expresses,
    _read_json,
    _round_trip,
    config_from_hf,
    config_to_hf,
    family_of,
    read_hf_config,
)
from jaxformer.interop.params import (  # noqa: F401
    _fill,
    _fresh_params,
    _head,
    _host_param,
    _key,
    _layer_sharding,
    _locate,
    _param_shape,
    _place,
    _rules_in_effect,
    _set_layer,
    _stacked_path,
)
from jaxformer.interop.peft import (  # noqa: F401
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PLAIN,
    PEFT_PREFIX,
    TASK_TYPES,
    PeftModule,
    _adapts,
    _linear_modules,
    _number,
    _peft_tensor,
    _target_modules,
    _targeted,
    load_peft,
    peft_modules,
    read_peft_config,
    save_peft,
)
from jaxformer.interop.rules import (  # noqa: F401
    Rule,
    UnsupportedCheckpoint,
    _expand,
    attention,
    dense,
    norm,
    same,
    to_ours,
    to_theirs,
)
from jaxformer.interop.tensors import INDEX, WEIGHTS, SafetensorsReader, _open  # noqa: F401
from jaxformer.models import Transformer

log = logging.getLogger("jaxformer.interop")

# Parameters a checkpoint may lack (a new task head): they keep their fresh initialisation.
HEADS = ("lm_head.", "mlm_head.", "classifier.")


# ----------------------------------------------------------------------------- load


def load_hf(
    directory: str | pathlib.Path,
    *,
    mesh: jax.sharding.Mesh | None = None,
    adapter: str | pathlib.Path | None = None,
    **overrides,
) -> Transformer:
    """A Transformer holding the Hugging Face checkpoint in `directory` (parameters float32).

    `overrides` replace ModelConfig fields that do not change the weights (`scan_layers`, `dtype`,
    `attention_impl`, `dropout_rate`, `num_classes` for a new classification head, ...). With a
    `mesh` (and the logical-axis rules in effect, `jaxformer.sharding.use`; the default rules
    otherwise), each tensor goes straight to its shards. Parameters of a task head the checkpoint
    lacks keep a fresh initialisation, with a warning; any other missing or unplaced tensor is an error.

    Args:
        directory: the Hugging Face model directory.
        mesh: the mesh to place the parameters on, or None (the default device).
        adapter: a PEFT LoRA adapter directory of this base, or None.
        **overrides (object): ModelConfig fields to replace.

    Returns:
        The model.

    Raises:
        FileNotFoundError: a file of the directory is missing.
        UnsupportedCheckpoint: a setting or tensor jaxformer cannot place, named.
    """
    from jaxformer import sharding

    hf = read_hf_config(directory)
    family = FAMILIES[hf["model_type"]]
    cfg = config_from_hf(hf, where=pathlib.Path(directory) / "config.json", **overrides)
    reader = SafetensorsReader(directory)
    with _rules_in_effect(mesh):
        abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
        graphdef, abstract_params = nnx.split(abstract, nnx.Param)
        shardings = sharding.state_shardings(abstract_params, mesh) if mesh is not None else None
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(abstract_params)}
    placement = dict(zip(flat, jax.tree.leaves(shardings), strict=True)) if shardings is not None else {}
    names = {_canonical(n, family): n for n in reader.names()}
    filled, used = {}, set()
    pending: dict[str, tuple[jax.Array, set]] = {}  # scanned stacks being filled: (stack, layers in so far)
    for rule, _ in _expand(family.rules(cfg), cfg):
        if rule.theirs not in names:
            continue  # reported below as missing parameters
        used.add(rule.theirs)
        targets = [_locate(o, cfg.scan_layers, cfg.scan_block, _head(cfg, o)) for o in rule.ours]
        shapes = [flat[p].shape[len(index) :] for p, index in targets]
        arrays = to_ours(reader[names[rule.theirs]], rule, shapes)
        filled |= _fill(arrays, targets, pending, flat, placement)
        del arrays  # before the next tensor is read
    unused = sorted(n for c, n in names.items() if c not in used and not any(re.search(p, c) for p in family.ignore))
    if unused:
        raise UnsupportedCheckpoint(f"{directory}: tensors with no place in jaxformer's {cfg.mode} model: {unused[:8]}")
    missing = sorted(set(flat) - set(filled))
    lacking = [m for m in missing if not m.startswith(HEADS)]
    if lacking:
        raise UnsupportedCheckpoint(f"{directory}: the checkpoint lacks tensors for {lacking[:8]}")
    if missing:
        log.warning("%s lacks %s: freshly initialised (a new head to train)", directory, ", ".join(missing))
        filled |= _fresh_params(cfg, missing, placement, mesh)
    params = nnx.from_flat_state([(tuple(_key(k) for k in p.split(".")), flat[p].replace(filled[p])) for p in flat])
    model = nnx.merge(graphdef, params)
    return model if adapter is None else load_peft(model, adapter, family=family.model_type, mesh=mesh)


# ----------------------------------------------------------------------------- save


def save_hf(
    model: Transformer,
    directory: str | pathlib.Path,
    *,
    family: str | None = None,
    extra_config: dict | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> pathlib.Path:
    """Write `model` as a Hugging Face model directory: config.json (+ `extra_config`, e.g. special
    token ids) and safetensors in the hub's PyTorch naming, float32, in shards of at most
    `max_shard_bytes` with an index when it is larger. Scanned or unrolled, any sharding: one
    tensor at a time is gathered to the host.

    Args:
        model: the model.
        directory: the directory to write.
        family: the family to write it as, or None (the one that fits).
        extra_config: more config.json fields, or None.
        max_shard_bytes: the largest safetensors file.

    Returns:
        `directory`.

    Raises:
        UnsupportedCheckpoint: no family expresses the model.
    """
    from safetensors.numpy import save_file

    cfg = model.cfg
    family = family or family_of(cfg)
    hf = config_to_hf(cfg, family) | {"torch_dtype": "float32"} | (extra_config or {})
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    rules = list(_expand(FAMILIES[family].rules(cfg), cfg))
    nbytes = [4 * sum(math.prod(_param_shape(flat, o, cfg)) for o in r.ours) for r, _ in rules]
    shards: list[list[int]] = [[]]
    size = 0
    for k, n in enumerate(nbytes):
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    n = len(shards)
    files = [WEIGHTS] if n == 1 else [f"model-{s + 1:05d}-of-{n:05d}.safetensors" for s in range(n)]
    weight_map = {}
    for file, members in zip(files, shards, strict=True):
        tensors = {}
        for k in members:
            rule, _ = rules[k]
            tensors[rule.theirs] = to_theirs([_host_param(flat, o, cfg) for o in rule.ours], rule)
            weight_map[rule.theirs] = file
        save_file(tensors, directory / file, metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(nbytes)}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX).write_text(json.dumps(index, indent=2))
    (directory / CONFIG).write_text(json.dumps(hf, indent=2, sort_keys=True))
    return directory
