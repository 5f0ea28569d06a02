"""Encoder-only classification: which LibreOffice application a help paragraph is about (8 classes).

    jaxformer train --config experiments/classify_lohelp.py --workdir runs/classify_lohelp

BERT-style encoder (post-norm, learned positions, GELU) over bytes, pooled at the
leading [CLS] (BOS) token.

Time and output: 800 steps on 2 CPU cores, time not measured (a run started 2026-11-26 on 2 cores
shared with other work, load average ~9-12, trained at 1,200 tokens/s over its first 50 steps, which
would make about 25 minutes; it was stopped there); the held-out accuracy at the end (step 800) is the
figure to read (the evaluation of step 400 is earlier); the accuracies: not measured.
"""

from jaxformer.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            mode="encoder_only",
            vocab_size=260,
            d_model=128,
            num_heads=4,
            d_ff=512,
            num_encoder_layers=3,
            num_decoder_layers=0,
            max_len=128,
            position="learned",
            activation="gelu",
            scale_embeddings=False,
            num_classes=8,  # scalc sbasic swriter simpress sdatabase smath schart sdraw
            pooling="first",
            dropout_rate=0.1,
        ),
        data=DataConfig(source="lohelp_apps", tokenizer="byte", max_len=128, min_words=3),
        train=TrainConfig(
            objective="classify",
            steps=800,
            batch_size=32,
            learning_rate=1e-3,
            warmup_steps=100,
            weight_decay=0.01,
            eval_every=400,
            log_every=50,
        ),
    )
