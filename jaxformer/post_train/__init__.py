"""Post-training: preference tuning (the DPO family: DPO's sigmoid loss, IPO, SimPO, ORPO) and
reinforcement learning with verifiable rewards (GRPO and its fixes, Dr. GRPO and DAPO), with rollouts
from `jaxformer.engine`.

- `preference`: the DPO family's losses as pure functions of per-sequence log-probabilities
- `pair_loss`: the train step's preference objective (completion-only log-probs, the reference)
- `pairs`: {prompt, chosen, rejected} records into batches of pairs
- `grpo`: GRPO's pure maths (advantages, the clipped surrogate, KL, the loss's aggregations)
- `rewards`: reward functions (exact match, format, math answer) and their weighted sum
- `tasks`: tasks with checkable answers and the character tokenizer they are written in
- `rl`: the GRPO loop (rollouts, rewards, updates by the training step)

Both score sequences by sums of `jaxformer.functional.token_logprobs`.
"""

from jaxformer.post_train.grpo import (
    AGGREGATIONS,
    aggregate,
    group_advantages,
    informative_groups,
    kl_k3,
    surrogate_loss,
)
from jaxformer.post_train.preference import (
    dpo_sigmoid_loss,
    ipo_loss,
    orpo_loss,
    preference_loss,
    sequence_logprobs,
    simpo_loss,
)
from jaxformer.post_train.rewards import RewardError, exact_match, format_check, load_callable, math_answer, score
from jaxformer.post_train.tasks import CharTokenizer, addition, reverse

__all__ = [
    "AGGREGATIONS",
    "CharTokenizer",
    "RewardError",
    "addition",
    "aggregate",
    "dpo_sigmoid_loss",
    "exact_match",
    "format_check",
    "group_advantages",
    "informative_groups",
    "ipo_loss",
    "kl_k3",
    "load_callable",
    "math_answer",
    "orpo_loss",
    "preference_loss",
    "reverse",
    "score",
    "sequence_logprobs",
    "simpo_loss",
    "surrogate_loss",
]
