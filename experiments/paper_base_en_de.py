"""The paper's base configuration (Table 3) on the shipped English-German pairs, for accelerators.

    jaxformer train --config experiments/paper_base_en_de.py --workdir runs/paper_base_en_de

D=512, H=8, F=2048, 6+6 layers, post-norm, sinusoidal, ReLU, dropout 0.1, label
smoothing 0.1, Adam(0.9, 0.98, 1e-9), noam schedule with 4000 warmup steps, one shared
embedding matrix (source, target, output). bfloat16 compute, float32 parameters.
Run locally (tiny shrink):  --set model.num_encoder_layers=1 --set model.num_decoder_layers=1 --set train.steps=20

Time and output: not a CPU run: 100k steps on accelerators (time there not measured); on 2 CPU cores,
plan only (`jaxformer plan`) and the tiny shrink, which checks that the program runs (its translations
are not worth reading).
"""

from jaxformer.config import Config, DataConfig, TrainConfig, paper_base


def get_config() -> Config:
    return Config(
        model=paper_base(vocab_size=8000, max_len=128, dtype="bfloat16"),
        data=DataConfig(source="en_de", tokenizer="sentencepiece", spm_vocab_size=8000, max_len=128),
        train=TrainConfig(
            objective="seq2seq",
            steps=100_000,  # the paper trains 100k steps
            batch_size=256,
            optimizer="adam",
            schedule="noam",
            learning_rate=1.0,
            warmup_steps=4000,
            label_smoothing=0.1,
            eval_every=2000,
            log_every=100,
        ),
    )
