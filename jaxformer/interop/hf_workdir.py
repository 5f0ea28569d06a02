"""A Hugging Face model directory as a training workdir, and back: `jaxformer import-hf` / `export-hf`.

    jaxformer import-hf DIR --workdir W [--config experiments/NAME.py] [--set ...]
    jaxformer train --workdir W --set train.steps=...        # fine-tune it
    jaxformer generate --workdir W --prompt "..."            # or eval, translate
    jaxformer export-hf --workdir W OUT                      # a Hugging Face directory again
    jaxformer import-hf DIR --workdir W --adapter LORA       # the base with a PEFT LoRA adapter
    jaxformer export-hf --workdir W OUT --adapter            # the adapters alone, as a PEFT adapter

`import-hf` writes W/config.json (the checkpoint's model; data, training and decoding from the
experiment, with the checkpoint's own tokenizer: `data.tokenizer="hf"`), W/hf/ (the directory's
config.json and tokenizer files, no weights) and a step-0 checkpoint holding the pretrained
parameters, loaded onto the run's mesh tensor by tensor. Training resumes from it like any run.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax
from flax import nnx

from jaxformer.config import Config, ConfigError, apply_overrides, load_experiment, read_config
from jaxformer.data import HF_DIR
from jaxformer.interop import hf

# The experiment whose data and training settings a checkpoint is fine-tuned with, by mode.
EXPERIMENTS = pathlib.Path(__file__).resolve().parents[2] / "experiments"
DEFAULT_EXPERIMENT = {
    "decoder_only": "lm_shakespeare.py",
    "encoder_decoder": "translate_en_de.py",
    "encoder_only": "mlm_shakespeare.py",
}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".ckpt")


def _files_beside_weights(directory: pathlib.Path) -> list[pathlib.Path]:
    """The directory's config and tokenizer files: everything but weights and their index."""
    return [
        p
        for p in sorted(directory.iterdir())
        if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES) and not p.name.endswith(".index.json")
    ]


def import_hf(source, workdir, experiment: str | None = None, overrides: list[str] = (), adapter=None) -> Config:
    """Make `workdir` a training workdir at step 0 holding the checkpoint in `source` (with the PEFT
    LoRA adapter in `adapter`: the lora section is the adapter's); returns its Config."""
    from jaxformer import lora, sharding
    from jaxformer.checkpoint import start_workdir
    from jaxformer.state import start_state, state_factory, state_shardings

    source, workdir = pathlib.Path(source), pathlib.Path(workdir)
    theirs = hf.read_hf_config(source)
    imported = hf.config_from_hf(theirs, where=source / "config.json")
    if experiment is None:
        experiment = str(EXPERIMENTS / DEFAULT_EXPERIMENT[imported.mode])
        if not pathlib.Path(experiment).is_file():
            raise ConfigError(f"--config: name an experiment to train with ({experiment} is absent)")
    base = load_experiment(experiment)
    runtime = {k: getattr(base.model, k) for k in hf.RUNTIME_FIELDS}  # dtype, attention, scan, remat: the run's
    src_max_len = base.data.src_max_len and min(base.data.src_max_len, imported.max_len)  # None stays None
    data = dataclasses.replace(
        base.data, tokenizer="hf", max_len=min(base.data.max_len, imported.max_len), src_max_len=src_max_len
    )
    cfg = dataclasses.replace(base, model=imported.replace(**runtime), data=data)
    if adapter is not None:  # the adapter's rank, alpha, targets; the experiment's seed
        peft = hf.read_peft_config(adapter, theirs["model_type"], imported)
        cfg = dataclasses.replace(cfg, lora=dataclasses.replace(peft, seed=base.lora.seed))
    cfg = apply_overrides(cfg, list(overrides))
    if adapter is not None:
        _same_lora(cfg.lora, peft, adapter)
    if (workdir / "checkpoints").is_dir() and any((workdir / "checkpoints").iterdir()):
        raise ConfigError(f"{workdir} already holds checkpoints: import into a new workdir")
    hf.SafetensorsReader(source)  # the weights are there (headers read) before anything is written
    # Fields the overrides changed (a new head, say) load as overrides: what the checkpoint lacks is initialised.
    imported_fields = dataclasses.asdict(imported)  # nested sections (model.moe) compare as dicts
    changed = {k: v for k, v in dataclasses.asdict(cfg.model).items() if v != imported_fields[k]}

    mesh = sharding.make_mesh(cfg.mesh)
    sharding.check_experts(mesh, cfg.mesh, cfg.model.moe.num_experts)
    with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
        if adapter is not None:  # loaded before anything is written: an adapter that does not fit writes nothing
            model = hf.load_hf(source, mesh=mesh, adapter=adapter, **changed)
        else:
            model = lora.add_adapters(hf.load_hf(source, mesh=mesh, **changed), cfg.lora)  # LoRA: fresh adapters
        lora.quantize_base(model, cfg.lora)  # lora.base="int8": the frozen kernels in int8
        hf_dir = workdir / HF_DIR
        hf_dir.mkdir(parents=True, exist_ok=True)
        for f in _files_beside_weights(source):
            shutil.copyfile(f, hf_dir / f.name)
        if adapter is not None:  # its base_model_name_or_path, for export-hf --adapter
            shutil.copyfile(pathlib.Path(adapter) / hf.ADAPTER_CONFIG, hf_dir / hf.ADAPTER_CONFIG)
        _, create, optimizer = state_factory(cfg)
        shardings = state_shardings(cfg, jax.eval_shape(create), mesh)
        state = jax.jit(lambda p: start_state(cfg, p, optimizer), out_shardings=shardings)(nnx.state(model, nnx.Param))
        del model
        start_workdir(workdir, cfg, state)
    return cfg


def _same_lora(ours, peft, adapter) -> None:
    """The run's lora section builds the adapter's adapters (overrides may change dropout and seed only)."""
    for field in ("rank", "alpha", "targets", "stacks"):
        if getattr(ours, field) != getattr(peft, field):
            raise ConfigError(
                f"lora.{field}={getattr(ours, field)!r}: the adapter in {adapter} has {getattr(peft, field)!r} "
                "(--adapter sets the lora section; leave it out of --set)"
            )


def export_hf(workdir, out, adapter: bool = False, overwrite: bool = False) -> pathlib.Path:
    """The latest checkpoint of `workdir` as a Hugging Face directory `out`: weights and config.json
    (with the imported config's other fields, such as special token ids, kept), and the tokenizer.
    `adapter`: the LoRA adapters alone, as a PEFT adapter directory (and the tokenizer).

    `out` must be new or empty: files of an older export left beside the new ones would be read in
    their place (a reader takes a sharded export's index before model.safetensors). `overwrite`
    removes the files of an older export first (`out` must hold a config.json or
    adapter_config.json: a model directory, not any directory)."""
    from jaxformer import lora
    from jaxformer.checkpoint import class_labels, restore_workdir

    workdir, out = pathlib.Path(workdir), pathlib.Path(out)
    _check_export_target(out, overwrite)
    config_file = workdir / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} does not exist: is {workdir} a training workdir?")
    cfg = read_config(config_file)
    if adapter and not cfg.lora.enabled:
        raise ConfigError(
            f"--adapter: {workdir} has no LoRA adapters (lora.rank=0); export-hf without --adapter writes its weights"
        )
    graphdef, state, _ = restore_workdir(cfg, workdir)
    hf_dir = workdir / HF_DIR
    original = json.loads((hf_dir / hf.CONFIG).read_text()) if (hf_dir / hf.CONFIG).is_file() else {}
    family = original.get("model_type") if original.get("model_type") in hf.FAMILIES else None
    if not adapter:
        model = lora.merge(nnx.merge(graphdef, state.weights))  # LoRA: the adapters folded into the weights
        ours = hf.config_to_hf(cfg.model, family)  # raises, naming the fields, if no family expresses the model
        extra = {k: v for k, v in original.items() if k not in ours and k not in ("torch_dtype", "dtype")}
        if "id2label" in ours:  # a classifier: its class names (training's, or the imported id2label kept)
            labels = class_labels(workdir, cfg.model.num_classes)
            extra |= {"id2label": dict(enumerate(labels)), "label2id": {name: c for c, name in enumerate(labels)}}
    try:
        if overwrite and out.is_dir():
            for old in out.iterdir():  # the older export's files: weights, index, configs, tokenizer
                if old.is_file() or old.is_symlink():
                    old.unlink()
        if adapter:
            return _export_adapter(nnx.merge(graphdef, state.weights), cfg, family, hf_dir, out)
        hf.save_hf(model, out, family=family, extra_config=extra)
        _copy_tokenizer(hf_dir, out)
    except OSError as e:
        where = e.filename if e.filename is not None else out
        raise OSError(f"export-hf: cannot write the Hugging Face directory {out}: {e.strerror or e} ({where})") from e
    return out


def _check_export_target(out: pathlib.Path, overwrite: bool) -> None:
    """`out` is new or empty (or, with `overwrite`, an older export), before anything is read or written."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"export-hf: {out} is a file, not a directory: give a new directory to write")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return
    listed = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
    if not overwrite:
        raise FileExistsError(
            f"export-hf: {out} is not empty ({listed}): give a new directory, or --overwrite to replace an "
            "older export there"
        )
    if not {hf.CONFIG, hf.ADAPTER_CONFIG} & set(held):
        raise FileExistsError(
            f"export-hf --overwrite: {out} holds no {hf.CONFIG} or {hf.ADAPTER_CONFIG} ({listed}): it is not an "
            "older export, and nothing in it is removed"
        )


def _copy_tokenizer(hf_dir: pathlib.Path, out: pathlib.Path, *also_skip: str) -> None:
    """The imported directory's files beside the weights (tokenizer and the like), but the configs we write."""
    if hf_dir.is_dir():
        for f in _files_beside_weights(hf_dir):
            if f.name not in (hf.CONFIG, hf.ADAPTER_CONFIG, *also_skip):
                shutil.copyfile(f, out / f.name)


def _export_adapter(model, cfg: Config, family: str | None, hf_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The model's adapters as a PEFT adapter directory, for the base named by the imported adapter's
    base_model_name_or_path (or the imported config's _name_or_path), with the tokenizer."""
    imported = hf_dir / hf.ADAPTER_CONFIG
    base = json.loads(imported.read_text()).get("base_model_name_or_path") if imported.is_file() else None
    if base is None and (hf_dir / hf.CONFIG).is_file():
        base = json.loads((hf_dir / hf.CONFIG).read_text()).get("_name_or_path") or None
    hf.save_peft(model, cfg.lora, out, family=family, base=base)
    _copy_tokenizer(hf_dir, out, "generation_config.json")  # an adapter directory holds no model settings
    return out
