"""Typed, frozen, validated configs.

Every config is a frozen dataclass whose `__post_init__` checks its fields, so a
wrong value fails with the field named before anything is built or compiled.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Literal

MODES = ("encoder_only", "decoder_only", "encoder_decoder")


class ConfigError(ValueError):
    """A config field has a wrong name, type or value; the message names the field."""


def require(ok: bool, field: str, message: str) -> None:
    """Raise ConfigError naming `field` unless `ok`."""
    if not ok:
        raise ConfigError(f"{field}: {message}")


def _check_choice(cfg, field: str, prefix: str) -> None:
    """Check a Literal-typed field holds one of its allowed values."""
    hint = typing.get_type_hints(type(cfg))[field]
    allowed = typing.get_args(hint)
    value = getattr(cfg, field)
    require(value in allowed, f"{prefix}.{field}", f"{value!r} is not one of {allowed}")


def check_field_types(cfg, prefix: str) -> None:
    """Check each field's value against its annotation (int, float, bool, str, Literal, Optional)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, hint = getattr(cfg, f.name), hints[f.name]
        if not _matches(value, hint):
            raise ConfigError(
                f"{prefix}.{f.name}: {value!r} ({type(value).__name__}) is not of type {_type_name(hint)}"
            )


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


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Transformer in one of three modes.

    Defaults are the paper's base model ("Attention Is All You Need", Table 3).
    """

    mode: Literal["encoder_only", "decoder_only", "encoder_decoder"] = "encoder_decoder"
    vocab_size: int = 37_000  # shared BPE vocabulary of the paper's WMT en-de model
    d_model: int = 512  # D
    num_heads: int = 8  # H
    num_kv_heads: int | None = None  # G; None = num_heads (multi-head), 1 = multi-query
    head_dim: int | None = None  # K; None = d_model // num_heads
    d_ff: int = 2048  # F
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    max_len: int = 512  # longest sequence the positional encoding covers
    dropout_rate: float = 0.1  # residual and embedding dropout (paper P_drop)
    attention_dropout_rate: float = 0.0  # on attention weights (Annotated Transformer uses P_drop)
    activation: Literal["relu", "gelu", "swiglu"] = "relu"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_position: Literal["post", "pre"] = "post"  # post: LayerNorm(x + Sublayer(x)) as in the paper
    norm_eps: float = 1e-6
    position: Literal["sinusoidal", "learned", "rope", "none"] = "sinusoidal"
    rope_base: float = 10_000.0
    use_bias: bool = True  # biases in projections (the paper's linear layers have them)
    share_embeddings: bool = True  # encoder and decoder input embeddings are one matrix
    tie_output: bool = True  # output logits use the (decoder) input embedding, transposed
    scale_embeddings: bool = True  # multiply embeddings by sqrt(D), paper section 3.4
    num_classes: int = 0  # encoder_only: > 0 adds a sequence classification head
    pooling: Literal["first", "mean"] = "first"  # classification pooling: [CLS] token or masked mean
    pad_id: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; parameters stay float32
    attention_impl: Literal["naive", "auto", "xla", "cudnn"] = "naive"
    scan_layers: bool = False  # one compiled layer body scanned over a stacked `layers` axis
    remat: Literal["none", "full", "dots_saveable"] = "none"
    check_token_ids: bool = True  # reject ids outside [0, V); under jit costs a host callback

    def __post_init__(self):
        p = "model"
        check_field_types(self, p)
        for name in ("vocab_size", "d_model", "num_heads", "d_ff", "max_len"):
            require(getattr(self, name) > 0, f"{p}.{name}", f"must be positive, got {getattr(self, name)}")
        for name in ("num_encoder_layers", "num_decoder_layers", "num_classes"):
            require(getattr(self, name) >= 0, f"{p}.{name}", f"must be >= 0, got {getattr(self, name)}")
        if self.head_dim is None:
            require(
                self.d_model % self.num_heads == 0,
                f"{p}.num_heads",
                f"num_heads={self.num_heads} does not divide d_model={self.d_model} (or set head_dim)",
            )
        else:
            require(self.head_dim > 0, f"{p}.head_dim", f"must be positive, got {self.head_dim}")
        kv = self.kv_heads
        require(kv > 0, f"{p}.num_kv_heads", f"must be positive, got {kv}")
        require(
            self.num_heads % kv == 0,
            f"{p}.num_kv_heads",
            f"num_kv_heads={kv} does not divide num_heads={self.num_heads}",
        )
        for name in ("dropout_rate", "attention_dropout_rate"):
            rate = getattr(self, name)
            require(0.0 <= rate < 1.0, f"{p}.{name}", f"must be in [0, 1), got {rate}")
        require(self.norm_eps > 0, f"{p}.norm_eps", f"must be positive, got {self.norm_eps}")
        require(0 <= self.pad_id < self.vocab_size, f"{p}.pad_id", f"must be in [0, vocab_size={self.vocab_size})")
        if self.position == "sinusoidal":
            require(
                self.d_model % 2 == 0, f"{p}.d_model", f"sinusoidal positions need an even d_model, got {self.d_model}"
            )
        if self.position == "rope":
            require(
                self.dim_per_head % 2 == 0, f"{p}.head_dim", f"RoPE needs an even head dim, got {self.dim_per_head}"
            )
        if self.mode in ("encoder_only", "encoder_decoder"):
            require(self.num_encoder_layers > 0, f"{p}.num_encoder_layers", f"mode={self.mode} needs an encoder")
        if self.mode in ("decoder_only", "encoder_decoder"):
            require(self.num_decoder_layers > 0, f"{p}.num_decoder_layers", f"mode={self.mode} needs a decoder")
        require(
            self.num_classes == 0 or self.mode == "encoder_only",
            f"{p}.num_classes",
            "a classification head needs mode='encoder_only'",
        )

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def dim_per_head(self) -> int:
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------- presets


def paper_base(vocab_size: int = 37_000, **overrides) -> ModelConfig:
    """The paper's base model: D=512, H=8, F=2048, 6+6 layers, post-norm, ~63M params at V=37k."""
    return ModelConfig(vocab_size=vocab_size, **overrides)


def paper_big(vocab_size: int = 37_000, **overrides) -> ModelConfig:
    """The paper's big model: D=1024, H=16, F=4096, dropout 0.3."""
    kw = dict(d_model=1024, num_heads=16, d_ff=4096, dropout_rate=0.3)
    return ModelConfig(vocab_size=vocab_size, **(kw | overrides))


def bert_style(vocab_size: int = 30_522, **overrides) -> ModelConfig:
    """BERT-base-like encoder: post-norm, learned positions, GELU, 12 layers of D=768."""
    kw = dict(
        mode="encoder_only", d_model=768, num_heads=12, d_ff=3072, num_encoder_layers=12,
        num_decoder_layers=0, position="learned", activation="gelu", norm_eps=1e-12,
        scale_embeddings=False,
    )  # fmt: skip
    return ModelConfig(vocab_size=vocab_size, **(kw | overrides))


def gpt2_style(vocab_size: int = 50_257, **overrides) -> ModelConfig:
    """GPT-2-small-like decoder: pre-norm, learned positions, GELU, tied embeddings."""
    kw = dict(
        mode="decoder_only", d_model=768, num_heads=12, d_ff=3072, num_encoder_layers=0,
        num_decoder_layers=12, max_len=1024, position="learned", activation="gelu",
        norm_position="pre", norm_eps=1e-5, scale_embeddings=False,
    )  # fmt: skip
    return ModelConfig(vocab_size=vocab_size, **(kw | overrides))


def tiny(mode: str = "encoder_decoder", vocab_size: int = 32, **overrides) -> ModelConfig:
    """A few-thousand-parameter model of any mode for tests and smoke runs."""
    kw = dict(
        mode=mode, d_model=16, num_heads=2, d_ff=32, max_len=32, dropout_rate=0.0,
        num_encoder_layers=0 if mode == "decoder_only" else 2,
        num_decoder_layers=0 if mode == "encoder_only" else 2,
    )  # fmt: skip
    return ModelConfig(vocab_size=vocab_size, **(kw | overrides))


PRESETS = {
    "paper_base": paper_base,
    "paper_big": paper_big,
    "bert_style": bert_style,
    "gpt2_style": gpt2_style,
    "tiny": tiny,
}
