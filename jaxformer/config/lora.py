"""The LoRA section (LoRAConfig): which projections of which stacks get adapters, their rank and their
frozen base; and check_lora_fits, the section against the model it adapts."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxformer.config.architecture import ModelConfig
from jaxformer.config.base import check_field_types, require

# The projections LoRA may adapt, and the width of each one's input and output (ModelConfig -> (in, out)).
LORA_TARGETS = {
    "q": lambda m: (m.d_model, m.num_heads * m.dim_per_head),
    "k": lambda m: (m.d_model, m.kv_heads * m.dim_per_head),
    "v": lambda m: (m.d_model, m.kv_heads * m.dim_per_head),
    "o": lambda m: (m.num_heads * m.dim_per_head, m.d_model),
    "wi": lambda m: (m.d_model, m.d_ff),
    "wi_gate": lambda m: (m.d_model, m.d_ff),
    "wo": lambda m: (m.d_ff, m.d_model),
    "embed": lambda m: (m.vocab_size, m.d_model),  # the token embedding (a tied output projection with it)
    "head": lambda m: (m.d_model, m.vocab_size),  # an untied output projection
}
LORA_STACKS = ("encoder", "decoder", "cross")  # self-attention and FFN of each stack; cross-attention
LORA_MODEL_TARGETS = ("embed", "head")  # the model's own, adapted whatever `stacks` says
MODE_STACKS = {"decoder_only": ("decoder",), "encoder_only": ("encoder",), "encoder_decoder": LORA_STACKS}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters (Hu et al., 2021): W x + (alpha / rank) B A x with W frozen, only A and B trained.

    rank=0 (the default) is off: the model, its state and its checkpoints are those of full training.
    """

    rank: int = 0  # R: the adapters' inner width; 0 = no LoRA
    alpha: float = 16.0  # the update is scaled by alpha / rank, so a new rank needs no new learning rate
    dropout: float = 0.0  # dropout on the adapters' input while training (the paper's 0.05-0.1 for small data)
    # The projections adapted (the paper's choice: queries and values): any of q, k, v, o (attention), wi,
    # wi_gate, wo (feed-forward), embed (the token embedding, and a tied output with it), head (an untied output).
    targets: tuple[str, ...] = ("q", "v")
    stacks: tuple[str, ...] = LORA_STACKS  # which stacks' q..wo get them: encoder, decoder (self-attention, FFN), cross
    seed: int = 0  # the adapters' own stream: the base draws the same numbers with LoRA on or off
    # How the frozen base's projection kernels are stored: "compute" (model.dtype) or "int8" (QLoRA-style:
    # int8 with a float32 scale per output channel, dequantized in the layer that reads it; half of bfloat16).
    base: Literal["compute", "int8"] = "compute"

    def __post_init__(self):
        for field in ("targets", "stacks"):  # tuple("qv") would be ('q', 'v'): a string is refused, not split
            value = getattr(self, field)
            require(not isinstance(value, str), f"lora.{field}",
                    f"a tuple of names such as {LORA_STACKS[:2] if field == 'stacks' else ('q', 'v')}, "
                    f"not the string {value!r}")  # fmt: skip
            object.__setattr__(self, field, tuple(value))  # JSON gives lists
        check_field_types(self, "lora")
        require(self.rank >= 0, "lora.rank", f"must be positive (or 0 = off), got {self.rank}")
        require(self.alpha > 0, "lora.alpha", f"must be > 0, got {self.alpha}")
        require(0 <= self.dropout < 1, "lora.dropout", f"must be in [0, 1), got {self.dropout}")
        for name, valid, field in ((self.targets, LORA_TARGETS, "targets"), (self.stacks, LORA_STACKS, "stacks")):
            unknown = [t for t in name if t not in valid]
            require(
                not unknown, f"lora.{field}", f"unknown {', '.join(map(repr, unknown))} (valid: {', '.join(valid)})"
            )
            require(bool(name) or not self.rank, f"lora.{field}", "LoRA on (rank > 0) needs at least one")
        require(
            self.base == "compute" or self.enabled,
            "lora.base",
            f"{self.base!r} quantizes the frozen base of a LoRA run: set lora.rank > 0 (or leave base 'compute')",
        )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def check_lora_fits(lora: LoRAConfig, model: ModelConfig) -> None:
    """The LoRA section against the model it adapts: every target has a place in the stacks named (of
    those this mode has), exists in this model, and is at least `rank` wide. Config validation and
    `lora.add_adapters` (models built in code) both ask it.

    Args:
        lora: the LoRA section (rank > 0).
        model: the model section.

    Raises:
        ConfigError: a stack or target that adapts nothing, or a rank above a projection's width.
    """
    in_stacks = [t for t in lora.targets if t not in LORA_MODEL_TARGETS]
    present = [s for s in lora.stacks if s in MODE_STACKS[model.mode]]
    require(
        not in_stacks or present,
        "lora.stacks",
        f"{lora.stacks} names no stack of a {model.mode} model (it has {', '.join(MODE_STACKS[model.mode])}): "
        f"{', '.join(map(repr, in_stacks))} would adapt nothing",
    )
    for name in in_stacks:  # cross-attention has q, k, v, o only
        require(
            name in ("q", "k", "v", "o") or present != ["cross"],
            "lora.targets",
            f"{name!r} adapts nothing in lora.stacks=('cross',): cross-attention has q, k, v, o; add 'decoder' "
            "to lora.stacks for the feed-forward",
        )
    for name in lora.targets:
        if name == "wi_gate" and model.activation not in ("swiglu", "geglu"):
            require(False, "lora.targets", f"'wi_gate' exists only for gated activations, not {model.activation!r}")
        if name == "head" and model.tie_output:
            require(False, "lora.targets", "'head': the output projection is the embedding (model.tie_output): "
                    "adapt 'embed', which adapts both")  # fmt: skip
        width = min(LORA_TARGETS[name](model))
        require(
            lora.rank <= width,
            "lora.rank",
            f"rank={lora.rank} exceeds the width {width} of projection {name!r} (the smaller of its in and out)",
        )
