"""LoRA fine-tuning of Qwen3-8B (D=4096, L=36, H=32 over 8 key/value heads of 128, F=12288,
V=151936, QK-norm) on one 80 GB GPU: the frozen base in bfloat16 (16.4 GB), rank-16 adapters on q, k,
v, o and their Adam state. The shape is Qwen3-8B's config.json, read as `import-hf` reads it.

Plan it on any machine (`pip install -e ".[gpu-plan]"`: XLA's GPU compiler, no GPU needed):

    jaxformer plan --config experiments/qwen3_8b_lora.py --target gpu-h100:1x1 --no-largest

With the pretrained weights (a Hugging Face Qwen3-8B directory), import them with the adapters, then train:

    jaxformer import-hf PATH/TO/Qwen3-8B --workdir runs/qwen3_lora --config experiments/qwen3_8b_lora.py
    jaxformer train --workdir runs/qwen3_lora

or, to try the program on a random base (nothing worth adapting):

    jaxformer train --config experiments/qwen3_8b_lora.py --workdir runs/qwen3_8b_lora

Run locally (tiny shrink): --set model.d_model=64 --set model.num_heads=4 --set model.num_kv_heads=2
    --set model.head_dim=16 --set model.d_ff=128 --set model.num_decoder_layers=2 --set model.vocab_size=512
    --set data.max_len=128 --set model.max_len=128 --set train.batch_size=8

Time and output: not a CPU run: 1000 steps on one 80 GB GPU (time there not measured); on 2 CPU cores,
plan only (`jaxformer plan`, above) and the tiny shrink, which checks the program (a random base:
nothing worth reading).
"""

from jaxformer.config import Config, DataConfig, LoRAConfig, TrainConfig
from jaxformer.interop.hf_config import config_from_hf

# Qwen3-8B's config.json, the fields that shape the model (its weights are not needed to plan).
QWEN3_8B = dict(
    model_type="qwen3",
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    hidden_act="silu",
    use_sliding_window=False,
)


def get_config() -> Config:
    return Config(
        model=config_from_hf(
            QWEN3_8B,
            dtype="bfloat16",  # the compute dtype, and with LoRA the frozen base's storage
            attention_impl="auto",  # cuDNN flash attention on the GPU
            scan_layers=True,  # one compiled layer body
            remat="full",  # activations of 36 layers at T=2048 would not fit beside the base
            max_len=2048,
        ),
        data=DataConfig(source="shakespeare", tokenizer="byte", max_len=2048),  # point it at your data
        train=TrainConfig(
            objective="lm",
            steps=1000,
            batch_size=8,
            optimizer="adamw",
            learning_rate=2e-4,  # LoRA's usual rate: higher than a full fine-tune's
            schedule="cosine",
            warmup_steps=50,
            weight_decay=0.0,
        ),
        lora=LoRAConfig(
            rank=16,
            alpha=32.0,  # scale alpha / rank = 2
            dropout=0.05,
            targets=("q", "k", "v", "o"),  # all attention projections
        ),
    )
