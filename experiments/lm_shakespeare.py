"""A small GPT-style character-level (byte) language model on Shakespeare's plays.

    jaxformer train --config experiments/lm_shakespeare.py --workdir runs/lm_shakespeare

`make demo`'s job: about 8 minutes on 2 CPU cores, ending with sampled text and
held-out perplexity beside a unigram baseline. Then:
    jaxformer generate --workdir runs/lm_shakespeare --prompt "KING HENRY:"
For a longer run on an accelerator:
    --set train.steps=5000 --set model.num_decoder_layers=6 --set model.d_model=384

Time and output: 800 steps, about 8-10 minutes on 2 CPU cores; the samples and the held-out
perplexity at the end (step 800, near 6 beside the unigram model's 29) are the output to read. The
samples printed at the evaluation of step 400 come from a model half-trained; their quality: not measured.
"""

from jaxformer.config import Config, DataConfig, DecodeConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            mode="decoder_only",
            vocab_size=260,  # bytes + 4 specials: no tokenizer to train
            d_model=128,
            num_heads=4,
            d_ff=512,
            num_encoder_layers=0,
            num_decoder_layers=4,
            max_len=128,
            position="learned",
            norm_position="pre",
            activation="gelu",  # GPT-2 recipe
            scale_embeddings=False,
            dropout_rate=0.0,  # a short run over ~2M characters does not overfit
        ),
        data=DataConfig(source="shakespeare", tokenizer="byte", max_len=128, max_examples=12_000),
        train=TrainConfig(
            objective="lm",
            steps=800,
            batch_size=32,
            learning_rate=2e-3,
            warmup_steps=100,
            weight_decay=0.1,
            optimizer="adamw",
            b2=0.99,
            eps=1e-8,
            eval_every=400,
            eval_batches=16,
            log_every=50,
        ),
        # Samples: temperature 0.8 and nucleus 0.95; greedy decoding of a small byte model loops.
        # max_new_tokens: model.max_len=128 holds the prompt and its continuation.
        decode=DecodeConfig(strategy="sample", temperature=0.8, top_p=0.95, max_new_tokens=112),
    )
