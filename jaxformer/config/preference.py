"""The preference-tuning section (PreferenceConfig): which loss of the DPO family trains on the pairs
of `train.objective="preference"`, and its constants."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jaxformer.config.base import check_field_types, require

# The losses, and whether each reads the reference model's log-probabilities (SimPO and ORPO have none).
PREFERENCE_LOSSES = {"sigmoid": True, "ipo": True, "simpo": False, "orpo": False}


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    """Preference tuning on {prompt, chosen, rejected} pairs (`train.objective="preference"`): DPO's sigmoid
    loss (Rafailov et al. 2023), IPO (Azar et al. 2023), SimPO (Meng et al. 2024) or ORPO (Hong et al. 2024)."""

    loss: Literal["sigmoid", "ipo", "simpo", "orpo"] = "sigmoid"  # DPO's sigmoid loss, IPO, SimPO or ORPO
    # DPO's beta: how far from the reference the policy may go for a given margin (TRL's default 0.1);
    # IPO's regularisation tau; SimPO's reward scale (paper: 2.0-2.5); ORPO's lambda (paper: 0.1).
    beta: float = 0.1
    label_smoothing: float = 0.0  # cDPO: pairs assumed mislabelled with this probability (sigmoid, simpo)
    simpo_gamma: float = 0.5  # SimPO's target margin between the chosen and rejected rewards (paper: 0.5-1.6)

    def __post_init__(self):
        p = "preference"
        check_field_types(self, p)
        require(0 < self.beta < math.inf, f"{p}.beta", f"must be positive, got {self.beta}")
        require(0 <= self.label_smoothing < 0.5, f"{p}.label_smoothing", f"must be in [0, 0.5), got "
                f"{self.label_smoothing}")  # fmt: skip
        require(
            self.label_smoothing == 0 or self.loss in ("sigmoid", "simpo"),
            f"{p}.label_smoothing",
            f"applies to the sigmoid and simpo losses, not {self.loss!r}",
        )
        require(math.isfinite(self.simpo_gamma), f"{p}.simpo_gamma", f"must be finite, got {self.simpo_gamma}")

    @property
    def uses_reference(self) -> bool:
        """Whether the loss reads the reference model's log-probabilities."""
        return PREFERENCE_LOSSES[self.loss]
