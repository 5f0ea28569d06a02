"""GRPO on reversing digits: a tiny decoder-only model half-taught the task by a short supervised
warm-up, then GRPO (rollouts from jaxformer's engine, an exact-match reward) raises its held-out accuracy.

    jaxformer grpo --config experiments/grpo_reverse.py --workdir runs/grpo_reverse

Prompts "31415?", answers "51413" (`jaxformer.post_train.tasks.reverse`, a tenth of the problems held
out), one token a character (vocabulary 17). 100 supervised steps first (saved in WORKDIR/sft), then 80
GRPO iterations of 16 prompts x 8 samples at temperature 1, one update each (GRPO's defaults: std-scaled
advantages, per-sequence means, clip 0.2, no KL). The greedy exact match on 128 held-out prompts is
logged before GRPO and every 10 iterations; metrics.jsonl holds each iteration's reward, loss, clip
fraction, the engine's log-probability gap and the time of rollout and update.

Time and output: 3 min 45 s on 2 CPU cores (measured 2026-11-27 on a 2-core machine shared with other
work, load average ~13): the held-out exact match went from 66.4% after the warm-up to 79.7% after 80
iterations (81.2% at 70), the sampled reward (temperature 1) from 0.16-0.33 in its first 5
iterations to 0.40-0.59 in its last 10; the same figures on a rerun.
"""

from jaxformer.config import CheckpointConfig, Config, DataConfig, GRPOConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            mode="decoder_only",
            vocab_size=17,  # pad, BOS, EOS and "0123456789+-=?"
            d_model=64,
            num_heads=4,
            d_ff=256,
            num_encoder_layers=0,
            num_decoder_layers=2,
            max_len=16,  # BOS, "31415?", "51413", EOS: 13 tokens
            position="rope",  # no table of max_len positions for the engine's prefill chunks to run past
            norm_position="pre",
            dropout_rate=0.0,  # the ratio pi / pi_old needs one policy in rollout and update
        ),
        data=DataConfig(max_len=16),  # the update's row width (the records come from grpo.task)
        train=TrainConfig(
            objective="lm",
            steps=80,  # GRPO iterations (rollout + update)
            batch_size=128,  # 16 prompts x 8 samples
            learning_rate=3e-4,  # 2e-4 and 1e-3 on the addition task moved nothing or lowered the reward
            schedule="constant",
            warmup_steps=0,
            eval_every=10,
            log_every=5,
        ),
        checkpoint=CheckpointConfig(every=20),  # a stopped run resumes from its last 20th iteration, the same
        grpo=GRPOConfig(
            group_size=8,
            task="jaxformer.post_train.tasks:reverse",
            sft_steps=100,  # 66% held-out exact match: room for GRPO (150 steps gave 98%, 60 gave 2%)
            sft_batch_size=64,
            sft_learning_rate=3e-3,
            max_new_tokens=6,  # 5 digits and EOS
            temperature=1.0,
            eval_prompts=128,
        ),
    )
