"""Encoder-only masked-LM pretraining (BERT's 15% / 80-10-10 masking) on Shakespeare, byte level.

    jaxformer train --config experiments/mlm_shakespeare.py --workdir runs/mlm_shakespeare

Time and output: 800 steps on 2 CPU cores, time not measured (its width, depth, batch and steps are
lm_shakespeare's, whose run takes 8-10 minutes); the held-out masked-token loss and
accuracy at the evaluations of steps 400 and 800 are its output (there is no text to read).
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
            num_encoder_layers=4,
            num_decoder_layers=0,
            max_len=128,
            position="learned",
            activation="gelu",
            scale_embeddings=False,
            dropout_rate=0.1,
        ),
        data=DataConfig(source="shakespeare", tokenizer="byte", max_len=128, max_examples=12_000),
        train=TrainConfig(
            objective="mlm", steps=800, batch_size=32, learning_rate=1e-3, warmup_steps=100, eval_every=400
        ),
    )
