"""RoPE scaling (`model.rope_scaling`): how the rotary frequencies are stretched past the length a
model was trained at, Hugging Face's `rope_scaling` dict as a typed section (same names, same meanings).

- `linear` (position interpolation, Chen et al. 2023): every frequency divided by `factor`.
- `yarn` (Peng et al. 2023; Qwen, DeepSeek): frequencies that turn fewer than `beta_slow` times over
  `original_max_len` positions are divided by `factor`, those turning more than `beta_fast` times kept,
  a linear ramp between; cos and sin are multiplied by the attention factor mscale(factor, mscale) /
  mscale(factor, mscale_all_dim) (0.1 ln(factor) + 1 without them), and with `mscale_all_dim` the
  attention logits' scale by mscale(factor, mscale_all_dim)^2 (DeepSeek-V2/V3's softmax scale).
- `llama3` (Llama 3.1): wavelengths over original_max_len / low_freq_factor divided by `factor`, under
  original_max_len / high_freq_factor kept, a smooth blend between.

The maths is `jaxformer.functional.rope_frequencies`; this section only holds and checks the numbers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jaxformer.config.base import check_field_types, require


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1, and 1 for factor <= 1.

    Args:
        factor: the context extension factor.
        mscale: the coefficient of the logarithm.

    Returns:
        The multiplier.
    """
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeScalingConfig:
    """RoPE scaling, as Hugging Face's `rope_scaling` says it; kind="none" (the default) is plain RoPE.

    Overridden as `--set model.rope_scaling.kind=yarn --set model.rope_scaling.factor=4`.
    """

    kind: Literal["none", "linear", "yarn", "llama3"] = "none"  # HF rope_type ("default" is "none")
    factor: float = 1.0  # how many times longer than original_max_len (DeepSeek-V3: 40; Llama 3.1: 8)
    original_max_len: int = 0  # yarn, llama3: the length trained at (HF original_max_position_embeddings)
    beta_fast: float = 32.0  # yarn: frequencies turning more often than this over original_max_len are kept
    beta_slow: float = 1.0  # yarn: frequencies turning less often than this are divided by factor
    mscale: float = 0.0  # yarn: 0 = unset; with mscale_all_dim, cos/sin times mscale(f, mscale) / mscale(f, all_dim)
    mscale_all_dim: float = 0.0  # yarn: 0 = unset; > 0 also scales the attention logits by mscale(f, this)^2
    low_freq_factor: float = 1.0  # llama3: wavelengths over original_max_len / this are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths under original_max_len / this are kept
    # which layers scale their RoPE: all, or only those attending globally (Gemma 3: its local layers'
    # own RoPE base is never scaled)
    layers: Literal["all", "global"] = "all"

    def __post_init__(self):
        p = "model.rope_scaling"
        check_field_types(self, p)
        if self.kind == "none":
            require(
                self.factor == 1.0, f"{p}.factor", f"kind='none' scales nothing: factor must be 1, got {self.factor}"
            )
            return
        require(1.0 <= self.factor < math.inf, f"{p}.factor", f"must be >= 1 for kind={self.kind!r}, got {self.factor}")
        if self.kind in ("yarn", "llama3"):
            require(
                self.original_max_len > 0,
                f"{p}.original_max_len",
                f"kind={self.kind!r} needs the length the model was trained at (> 0), got {self.original_max_len}",
            )
        if self.kind == "yarn":
            require(
                0 < self.beta_slow < self.beta_fast < math.inf,
                f"{p}.beta_fast",
                f"must exceed beta_slow > 0: got beta_fast={self.beta_fast}, beta_slow={self.beta_slow}",
            )
            for name in ("mscale", "mscale_all_dim"):
                value = getattr(self, name)
                require(0 <= value < math.inf, f"{p}.{name}", f"must be >= 0 (0 = unset), got {value}")
        if self.kind == "llama3":
            require(
                0 < self.low_freq_factor < self.high_freq_factor < math.inf,
                f"{p}.high_freq_factor",
                f"must exceed low_freq_factor > 0: got high_freq_factor={self.high_freq_factor}, "
                f"low_freq_factor={self.low_freq_factor}",
            )

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (YaRN's temperature; 1 for the other kinds)."""
        if self.kind != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def logits_factor(self) -> float:
        """What the attention logits' scale is multiplied by: mscale(factor, mscale_all_dim)^2 with a yarn
        mscale_all_dim (DeepSeek's softmax scale), else 1."""
        if self.kind != "yarn" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2
