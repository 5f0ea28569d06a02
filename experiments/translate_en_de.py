"""English -> German translation of LibreOffice help paragraphs, a CPU-sized base Transformer.

    jaxformer train --config experiments/translate_en_de.py --workdir runs/translate_en_de
    jaxformer eval --workdir runs/translate_en_de      # BLEU (beam search) on the held-out split
    jaxformer translate --workdir runs/translate_en_de --src "Click the OK button."


The paper's recipe shrunk: post-norm, sinusoidal positions, ReLU, one shared
SentencePiece vocabulary and embedding matrix, Adam (0.9, 0.98, 1e-9) with the noam
schedule, label smoothing 0.1, length-bucketed batches. About 25 minutes on 2 CPU cores.

Time and output: 1500 steps at about 1 s a step on 2 CPU cores. A model stopped early translates
poorly and may print only punctuation: after 60 steps a translation is `..` (the frequent tokens are
learned first); that is an undertrained model, not a bug. Translations are worth reading at the end
(step 1500, BLEU from `jaxformer eval`); at which step they start to be: not measured (a run to find
it takes the full 25 minutes; after 250 steps it did not translate yet: BLEU 0.0, docs/guides/moe.md).
"""

from jaxformer.config import Config, DataConfig, DecodeConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            mode="encoder_decoder",
            vocab_size=3000,  # = data.spm_vocab_size: one BPE vocabulary for both languages
            d_model=192,  # sized for ~0.75 s/step on 2 CPU cores
            num_heads=4,
            d_ff=768,
            num_encoder_layers=3,
            num_decoder_layers=3,
            max_len=64,
            dropout_rate=0.1,
        ),
        data=DataConfig(
            source="en_de",
            tokenizer="sentencepiece",
            spm_vocab_size=3000,
            max_len=64,  # BPE tokens; longer paragraphs are truncated
            min_words=3,  # drop one- and two-word UI labels
        ),
        train=TrainConfig(
            objective="seq2seq",
            steps=1500,  # ~3.5 epochs of the ~28k training pairs; ~25 min at ~1 s/step
            batch_size=64,
            optimizer="adam",  # the paper's Adam: b1 0.9, b2 0.98, eps 1e-9 (the defaults)
            schedule="noam",
            learning_rate=0.5,  # multiplier of D^-0.5 * min(t^-0.5, t * warmup^-1.5): peak 1.8e-3
            warmup_steps=400,
            label_smoothing=0.1,
            eval_every=500,
            log_every=100,
        ),
        # The paper's decoding: beam 4, length penalty 0.6, up to source length + 50 tokens.
        decode=DecodeConfig(strategy="beam", beam_size=4, length_penalty=0.6, extra_len=50),
    )
