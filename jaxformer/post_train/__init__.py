"""Post-training: reinforcement learning with verifiable rewards (GRPO and its fixes, Dr. GRPO and
DAPO), with rollouts from `jaxformer.engine`.

- `grpo`: the pure maths (advantages, the clipped surrogate, KL, the loss's aggregations)
- `rewards`: reward functions (exact match, format, math answer) and their weighted sum
- `tasks`: tasks with checkable answers and the character tokenizer they are written in
- `rl`: the loop (rollouts, rewards, updates by the training step)
"""

from jaxformer.post_train.grpo import (
    AGGREGATIONS,
    aggregate,
    group_advantages,
    informative_groups,
    kl_k3,
    surrogate_loss,
    token_logprobs,
)
from jaxformer.post_train.rewards import RewardError, exact_match, format_check, load_callable, math_answer, score
from jaxformer.post_train.tasks import CharTokenizer, addition, reverse

__all__ = [
    "AGGREGATIONS",
    "CharTokenizer",
    "RewardError",
    "addition",
    "aggregate",
    "exact_match",
    "format_check",
    "group_advantages",
    "informative_groups",
    "kl_k3",
    "load_callable",
    "math_answer",
    "reverse",
    "score",
    "surrogate_loss",
    "token_logprobs",
]
