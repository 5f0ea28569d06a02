"""Post-training: preference tuning (the DPO family: DPO's sigmoid loss, IPO, SimPO, ORPO).

- `preference`: the losses as pure functions of per-sequence log-probabilities, and those log-probs
- `pair_loss`: the train step's preference objective (completion-only log-probs, the reference)
- `pairs`: {prompt, chosen, rejected} records into batches of pairs
"""

from jaxformer.post_train.preference import (
    dpo_sigmoid_loss,
    ipo_loss,
    orpo_loss,
    preference_loss,
    sequence_logprobs,
    simpo_loss,
    token_logprobs,
)

__all__ = [
    "dpo_sigmoid_loss",
    "ipo_loss",
    "orpo_loss",
    "preference_loss",
    "sequence_logprobs",
    "simpo_loss",
    "token_logprobs",
]
