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
from jaxformer.config.sections import (
    SYNTHETIC,
    CheckpointConfig,
    DataConfig,
    DecodeConfig,
    MeshConfig,
    TrainConfig,
)

SPLASH_TILE = 128  # splash attention's tiles: a block's lengths (and zig-zag's halves) are multiples of it


def ring_blocks_unfit(kernel: str, dtype, head_dim: int, q_block: int, kv_block: int) -> str | None:
    """Why the fused kernel `kernel` cannot attend the ring's blocks of q_block queries and kv_block
    keys, as far as their shapes and dtype tell (None: nothing here says it cannot). Config validation
    asks it before anything is built; `jaxformer.ring` asks it with the arrays, then (cuDNN) JAX's own
    checks of this machine (cuDNN present, the GPU's largest head dim).

    Args:
        kernel: "splash" or "cudnn" (any other name: None).
        dtype (str | numpy.dtype): the compute dtype.
        head_dim: K, the dimension of a head.
        q_block: the queries of one block (T / the context axis).
        kv_block: the keys of one block (S / the context axis).

    Returns:
        The reason, or None.
    """
    if kernel == "splash" and (q_block % SPLASH_TILE or kv_block % SPLASH_TILE):
        return (
            f"splash attention needs ring blocks of multiples of {SPLASH_TILE} positions, not {q_block} and {kv_block}"
        )
    if kernel == "cudnn":
        why = "cuDNN flash attention cannot attend the ring's blocks"
        if str(dtype) not in ("bfloat16", "float16"):
            return f"{why}: it computes in bfloat16 or float16, not {dtype} (model.dtype)"
        if head_dim % 8 or head_dim > 256:
            return f"{why}: the head dim must be <= 256 and a multiple of 8, but got {head_dim}"
        if q_block % 2 or kv_block % 2:
            return f"{why}: blocks of even lengths, not {q_block} and {kv_block}"
    return None


@dataclasses.dataclass(frozen=True)
class Config:
    """One training run: model, optimisation, data, checkpoints, mesh, and how it generates."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    decode: DecodeConfig = dataclasses.field(default_factory=DecodeConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)

    def __post_init__(self):
        objective, mode = self.train.objective, self.model.mode
        allowed = {
            "lm": "decoder_only",
            "seq2seq": "encoder_decoder",
            "mlm": "encoder_only",
            "classify": "encoder_only",
        }
        require(
            allowed[objective] == mode,
            "train.objective",
            f"objective={objective!r} needs model.mode={allowed[objective]!r}, got {mode!r}",
        )
        if objective == "classify":
            require(self.model.num_classes > 0, "model.num_classes", "classification needs num_classes > 0")
            n = len(self.data.labels)
            classes = self.model.num_classes
            require(n <= classes, "data.labels", f"{n} labels but model.num_classes={classes}")
        d = self.data
        require(
            d.src_max_len is None or objective in ("seq2seq", "classify"),
            "data.src_max_len",
            f"objective={objective!r} reads no source (only seq2seq and classify do)",
        )
        require(
            not (d.pack and objective == "classify") or d.max_segments <= d.src_len,
            "data.max_segments",
            f"{d.max_segments} texts cannot share a row of {d.src_len} tokens",
        )
        needs = {"lm": 1, "mlm": 1, "seq2seq": 2, "classify": 2}.get(objective)
        if d.template != "none":  # instruction records: a prompt and a response, from the user's files
            require(
                objective in ("lm", "seq2seq"),
                "data.template",
                f"instruction data trains objective 'lm' or 'seq2seq', not {objective!r}",
            )
            require(d.source == "files", "data.template", f"needs data.source='files' (instruction records), "
                    f"not {d.source!r}")  # fmt: skip
            require(d.format != "text", "data.template", "plain text holds no prompt/response records: use JSONL")
            needs = 2
        require(
            not self.data.fields or needs is None or len(self.data.fields) == needs,
            "data.fields",
            f"objective={objective!r} reads {needs} field(s), got {self.data.fields}",
        )
        self._check_tokenizer()
        self._check_lora()
        m = self.mesh
        if m.data > 0 and m.fsdp > 0 and m.expert > 0:  # a fill (-1) is known only with the devices
            shards, names = m.data * m.fsdp * m.expert, "mesh.data x mesh.fsdp"
            sizes = f"{m.data} x {m.fsdp}" + (f" x {m.expert}" if m.expert > 1 else "")
            require(
                self.train.batch_size % shards == 0,
                "train.batch_size",
                f"batch_size={self.train.batch_size} does not divide over the batch shards "
                f"({names}{' x mesh.expert' if m.expert > 1 else ''} = {sizes})",
            )
        if m.expert != 1 and self.model.moe.enabled:
            require(
                m.expert == -1 or self.model.moe.num_experts % m.expert == 0,
                "mesh.expert",
                f"expert={m.expert} does not divide model.moe.num_experts={self.model.moe.num_experts}",
            )
        require(
            self.model.attention_dropout_rate == 0 or self.model.attention_impl in ("naive", "auto"),
            "model.attention_dropout_rate",
            f"attention_impl={self.model.attention_impl!r} (a fused kernel) applies no dropout to attention "
            f"probabilities: set it to 0 or attention_impl to 'naive' or 'auto'",
        )
        if m.context > 1:
            self._check_context()
        if self.model.position in ("sinusoidal", "learned"):
            require(
                self.data.max_len <= self.model.max_len,
                "data.max_len",
                f"data.max_len={self.data.max_len} exceeds model.max_len={self.model.max_len}",
            )
            require(
                d.src_len <= self.model.max_len,
                "data.src_max_len",
                f"data.src_max_len={d.src_len} exceeds model.max_len={self.model.max_len}",
            )

    def _check_context(self) -> None:
        """What context parallelism cannot split (ring attention takes no logits bias or dropout)."""
        m, model, d = self.mesh, self.model, self.data
        require(model.position != "relative", "mesh.context",
                "context parallelism takes no relative position bias (model.position='relative', T5)")  # fmt: skip
        require(model.attention_dropout_rate == 0, "mesh.context",
                "context parallelism applies no attention dropout: set model.attention_dropout_rate to 0")  # fmt: skip
        # Inside the ring cuDNN or splash attends each visiting block (ring.fused_kernel); the all-gather
        # strategy attends densely: a fused kernel asked for by name there is refused rather than
        # ignored ("auto" falls back to XLA's einsums, and says so).
        fused = model.attention_impl in ("cudnn", "splash")
        require(not fused or model.context_attention == "ring", "model.attention_impl",
                f"{model.attention_impl!r} attends the ring's blocks; model.context_attention='allgather' "
                "attends densely: use 'auto' or context_attention='ring'")  # fmt: skip
        for field, length in (("data.max_len", d.max_len), ("data.src_max_len", d.src_len)):
            require(length % m.context == 0, field, f"{length} is not divisible by mesh.context={m.context}")
        if fused:  # each attention's blocks (queries, keys) per device: the kernel named must take them all
            T, S = d.max_len // m.context, d.src_len // m.context
            blocks = {"decoder_only": [(T, T)], "encoder_only": [(S, S)]}.get(model.mode, [(S, S), (T, T), (T, S)])
            for q_block, kv_block in blocks:
                why = ring_blocks_unfit(model.attention_impl, model.dtype, model.dim_per_head, q_block, kv_block)
                require(why is None, "model.attention_impl", f"{model.attention_impl!r}: {why} (mesh.context="
                        f"{m.context}; 'auto' attends such blocks with XLA's einsums)")  # fmt: skip
        if model.context_layout == "zigzag":
            require(self.train.objective in ("lm", "seq2seq"), "model.context_layout",
                    f"zigzag balances causal attention; objective={self.train.objective!r} attends both ways: "
                    "use 'contiguous'")  # fmt: skip
            require(d.max_len % (2 * m.context) == 0, "data.max_len",
                    f"{d.max_len} is not divisible by 2 x mesh.context={m.context} (zigzag's 2n blocks)")  # fmt: skip

    def _check_lora(self) -> None:
        """The rank against the widths of the projections adapted (known only with the model)."""
        lora, model = self.lora, self.model
        if not lora.enabled:
            return
        ffn = [t for t in lora.targets if t in ("wi", "wi_gate", "wo")]
        require(
            not (ffn and model.moe.enabled),
            "lora.targets",
            f"{', '.join(map(repr, ffn))}: LoRA on feed-forward kernels is not supported with model.moe "
            "(the experts' kernels are stacked [E, ...]); adapt the attention projections (q, k, v, o)",
        )
        require(
            not (lora.base == "int8" and model.moe.enabled),
            "lora.base",
            "'int8' cannot store the MoE layers' expert kernels (model.moe): use lora.base='compute'",
        )
        check_lora_fits(lora, model)

    def _check_tokenizer(self) -> None:
        """Token ids against the model: the tokenizers whose sizes are known without a corpus, and the
        synthetic tasks' lengths (their sequences are synthetic_len long, whatever data.max_len says)."""
        d, model = self.data, self.model
        synthetic = d.source in SYNTHETIC
        require(
            synthetic == (d.tokenizer == "symbols"),
            "data.tokenizer",
            f"data.source={d.source!r} is written in symbols: set data.tokenizer='symbols', not {d.tokenizer!r}"
            if synthetic
            else f"'symbols' is for the copy/reverse tasks, not data.source={d.source!r}",
        )
        if synthetic:
            require(
                self.train.objective == "seq2seq",
                "train.objective",
                f"data.source={d.source!r} is a seq2seq task, not objective={self.train.objective!r}",
            )
            require(
                d.synthetic_vocab <= model.vocab_size,
                "model.vocab_size",
                f"model.vocab_size={model.vocab_size} is below data.synthetic_vocab={d.synthetic_vocab} (pad 0, "
                f"bos 1, symbols 2..{d.synthetic_vocab - 1}): model.vocab_size must be >= {d.synthetic_vocab}",
            )
            require(
                d.synthetic_len <= model.max_len or model.position not in ("sinusoidal", "learned"),
                "data.synthetic_len",
                f"data.synthetic_len={d.synthetic_len} exceeds model.max_len={model.max_len} "
                f"(position={model.position!r} has a table of max_len positions)",
            )
        if d.tokenizer == "sentencepiece":  # SentencePiece makes exactly spm_vocab_size pieces, or fails
            require(
                d.spm_vocab_size <= model.vocab_size,
                "data.spm_vocab_size",
                f"data.spm_vocab_size={d.spm_vocab_size} exceeds model.vocab_size={model.vocab_size}",
            )

    def to_dict(self) -> dict:
        """The config as nested dicts of plain values (what config.json holds).

        Returns:
            section -> field -> value.
        """
        return dataclasses.asdict(self)


SECTIONS = {
    "model": ModelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "mesh": MeshConfig,
    "decode": DecodeConfig,
    "lora": LoRAConfig,
}


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
    "t5_small",
    "t5_v1_1_small",
    "tiny",
]
