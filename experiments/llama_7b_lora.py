"""LoRA fine-tuning of a Llama-2-7B-shaped model (D=4096, L=32, H=32, F=11008, V=32000) on one 80 GB GPU:
the frozen base in bfloat16 (13.5 GB), rank-16 adapters on q, k, v, o and their Adam state (tens of MB).
A full fine-tune (float32 weights, gradients and Adam moments: 16 bytes a parameter, 108 GB) does not fit.

Plan both on any machine:

    jaxformer plan --config experiments/llama_7b_lora.py --target gpu-h100:1x1 --no-largest
    jaxformer plan --config experiments/llama_7b_lora.py --target gpu-h100:1x1 --no-largest --set lora.rank=0
    jaxformer plan --config experiments/llama_7b_lora.py --target gpu-h100:1x1 --no-largest --set lora.base=int8

With pretrained weights (a Hugging Face Llama directory), import them with the adapters, then train:

    jaxformer import-hf PATH/TO/Llama-2-7b-hf --workdir runs/llama_lora --config experiments/llama_7b_lora.py
    jaxformer train --workdir runs/llama_lora

or, to try the program on a random base (nothing worth adapting):

    jaxformer train --config experiments/llama_7b_lora.py --workdir runs/llama_7b_lora

Run locally (tiny shrink): --set model.d_model=64 --set model.num_heads=4 --set model.d_ff=128
    --set model.num_decoder_layers=2 --set data.max_len=128 --set train.batch_size=8

Time and output: not a CPU run: 1000 steps on one 80 GB GPU (time there not measured); on 2 CPU cores,
plan only (`jaxformer plan`, above) and the tiny shrink, which checks the program (a random base:
nothing worth reading).
"""

from jaxformer.config import Config, DataConfig, LoRAConfig, TrainConfig, llama


def get_config() -> Config:
    return Config(
        model=llama(
            dtype="bfloat16",  # the compute dtype, and with LoRA the frozen base's storage
            scan_layers=True,  # one compiled layer body
            remat="full",  # activations of 32 layers at T=1024 would not fit beside the base
            max_len=1024,
        ),
        data=DataConfig(source="shakespeare", tokenizer="byte", max_len=1024),  # point it at your data
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
