"""The GRPO section (GRPOConfig): the task and its rewards, the rollouts (a group of samples per
prompt) and the objective's choices (GRPO, Dr. GRPO, DAPO). Off (`enabled` False) unless a run sets
`grpo.group_size`; `jaxformer grpo` reads it, `jaxformer train` ignores it."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jaxformer.config.base import _as_tuples, check_field_types, require


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Group Relative Policy Optimisation (Shao et al., 2024) with the fixes of Dr. GRPO and DAPO.

    Each of `train.steps` iterations samples `group_size` completions for each of `train.batch_size /
    group_size` prompts from the engine, scores them, and takes `updates` optimizer steps on them.

    Attributes:
        group_size: G, the samples per prompt (0: GRPO off).
        task: `module:function` giving the (prompt, answer) records (see `jaxformer.post_train.tasks`).
        chars: the characters of the task's texts (a character tokenizer).
        rewards: `module:function` (or `file.py:function`) reward functions, summed.
        reward_weights: one weight per reward function; () = 1 each.
        max_new_tokens: the most tokens a completion may have (EOS included).
        temperature: the sampling temperature (the loss's log-probabilities are taken at it too).
        scale_rewards: divide advantages by the group's std (GRPO); False: Dr. GRPO.
        loss_aggregation: "sequence" (GRPO), "token" (DAPO) or "constant" (Dr. GRPO).
        eps_low: the ratio's clip below 1.
        eps_high: the ratio's clip above 1 (DAPO's clip-higher: 0.28).
        kl_coef: beta, the weight of the k3 KL penalty to the reference (0: none, no reference pass).
        dynamic_sampling: drop the groups whose rewards are all equal (DAPO).
        updates: optimizer steps on each rollout (mu); the old policy's log-probabilities are the rollout's.
        sft_steps: supervised steps on the task's answers before GRPO (0: start from random weights).
        sft_learning_rate: their learning rate (constant after a tenth of them of warmup).
        sft_batch_size: their batch, in records.
        eval_prompts: held-out prompts whose greedy exact match is logged at each evaluation.
    """

    group_size: int = 0  # G, samples per prompt; 0 = GRPO off
    task: str = "jaxformer.post_train.tasks:addition"  # (split, count, seed) -> [{"prompt", "answer"}]
    chars: str = "0123456789+-=?"  # the task's character set: ids 3.. (pad 0, BOS 1, EOS 2)
    rewards: tuple[str, ...] = ("jaxformer.post_train.rewards:exact_match",)  # summed with reward_weights
    reward_weights: tuple[float, ...] = ()  # one per reward; () = 1 each
    max_new_tokens: int = 8  # a completion's most tokens (its EOS included); the Dr. GRPO constant
    temperature: float = 1.0  # sampling, and the log-probabilities of the loss (TRL's logits / temperature)
    scale_rewards: bool = True  # advantages / the group's std (GRPO); False = Dr. GRPO's mean-centred only
    loss_aggregation: Literal["sequence", "token", "constant"] = "sequence"  # GRPO / DAPO / Dr. GRPO
    eps_low: float = 0.2  # PPO's clip below 1
    eps_high: float = 0.2  # above 1; DAPO's clip-higher: 0.28
    kl_coef: float = 0.0  # beta on k3 KL to the reference (paper: 0.04; DAPO and Dr. GRPO: 0)
    dynamic_sampling: bool = False  # DAPO: groups of equal rewards are masked out of the update
    updates: int = 1  # optimizer steps per rollout (mu); 1 = the ratio is 1 at the step, only clipping of later ones
    sft_steps: int = 0  # supervised steps on the task before GRPO, saved apart (workdir/sft); 0 = none
    sft_learning_rate: float = 3e-3  # the warm-up's (constant after a tenth of its steps of warmup)
    sft_batch_size: int = 64  # the warm-up's records a step
    eval_prompts: int = 64  # held-out prompts answered greedily at each evaluation (train.eval_every)

    def __post_init__(self):
        p = "grpo"
        for name in ("rewards", "reward_weights"):  # JSON gives lists
            object.__setattr__(self, name, _as_tuples(getattr(self, name)))
        object.__setattr__(self, "reward_weights", tuple(float(w) for w in self.reward_weights))
        check_field_types(self, p)
        require(self.group_size >= 0, f"{p}.group_size", f"must be >= 0 (0 = off), got {self.group_size}")
        require(
            self.group_size != 1,
            f"{p}.group_size",
            "1 sample per prompt has no group to compare with (every advantage would be 0): use >= 2",
        )
        require(bool(self.rewards), f"{p}.rewards", "at least one reward function")
        for spec in (self.task, *self.rewards):
            require(
                spec.count(":") == 1 and all(spec.split(":")),
                f"{p}.rewards" if spec in self.rewards else f"{p}.task",
                f"{spec!r} is not 'module:function' or 'file.py:function'",
            )
        require(
            not self.reward_weights or len(self.reward_weights) == len(self.rewards),
            f"{p}.reward_weights",
            f"{len(self.reward_weights)} weights for {len(self.rewards)} rewards",
        )
        require(all(math.isfinite(w) for w in self.reward_weights), f"{p}.reward_weights", "weights must be finite")
        require(len(set(self.chars)) == len(self.chars) and bool(self.chars), f"{p}.chars", "distinct characters")
        require(self.max_new_tokens >= 1, f"{p}.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        require(0 < self.temperature < math.inf, f"{p}.temperature", f"must be > 0, got {self.temperature}")
        require(0 <= self.eps_low < 1, f"{p}.eps_low", f"must be in [0, 1), got {self.eps_low}")
        require(0 <= self.eps_high < math.inf, f"{p}.eps_high", f"must be >= 0, got {self.eps_high}")
        require(0 <= self.kl_coef < math.inf, f"{p}.kl_coef", f"must be >= 0, got {self.kl_coef}")
        for name in ("updates", "sft_batch_size", "eval_prompts"):
            require(getattr(self, name) >= 1, f"{p}.{name}", f"must be >= 1, got {getattr(self, name)}")
        require(self.sft_steps >= 0, f"{p}.sft_steps", f"must be >= 0, got {self.sft_steps}")
        require(0 < self.sft_learning_rate < math.inf, f"{p}.sft_learning_rate", "must be > 0")

    @property
    def enabled(self) -> bool:
        return self.group_size > 0

    @property
    def weights(self) -> tuple[float, ...]:
        """One weight per reward function."""
        return self.reward_weights or (1.0,) * len(self.rewards)


def check_grpo(cfg) -> None:
    """What GRPO asks of the run's other sections (a decoder_only lm, groups that divide the batch, a
    vocabulary that holds the task's characters).

    Args:
        cfg (Config): the run's config, with `grpo` enabled.

    Raises:
        ConfigError: a section that GRPO cannot run with, naming the field.
    """
    g, m, t = cfg.grpo, cfg.model, cfg.train
    require(m.mode == "decoder_only", "model.mode", f"GRPO samples from a decoder_only model, not {m.mode!r}")
    require(
        t.batch_size % g.group_size == 0,
        "grpo.group_size",
        f"group_size={g.group_size} does not divide train.batch_size={t.batch_size} (prompts x samples per step)",
    )
    require(
        m.vocab_size >= len(g.chars) + 3,
        "model.vocab_size",
        f"{m.vocab_size} ids cannot hold grpo.chars ({len(g.chars)} characters after pad, BOS, EOS)",
    )
