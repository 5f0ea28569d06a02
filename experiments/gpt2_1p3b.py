"""A 1.3B GPT-2-shaped language model (D=2048, L=24, H=16, V=50304, T=1024) for a TPU pod slice or a
multi-GPU node: the shape the GPU benchmark measures (scripts/gpu_check.sh), made a training run.

Plan it first, on any machine (`pip install -e ".[tpu]"` brings the TPU compiler, `".[gpu-plan]"`
XLA's GPU compiler; neither needs the chip):

    jaxformer plan --config experiments/gpt2_1p3b.py --target tpu-v5p:4x4x4   # v5p-128: 64 chips
    jaxformer plan --config experiments/gpt2_1p3b.py --target tpu-v5e:16x16   # v5e-256: 256 chips
    jaxformer plan --config experiments/gpt2_1p3b.py --target gpu-h100:1x8    # one node of 8 H100 SXM

then train (on every host of a pod, `scripts/tpu_pod.sh` runs it there):

    jaxformer train --config experiments/gpt2_1p3b.py --workdir runs/gpt2_1p3b

Run locally (tiny shrink): --set model.d_model=64 --set model.num_heads=4 --set model.d_ff=256
    --set model.num_decoder_layers=2 --set data.max_len=128 --set model.max_len=128 --set train.batch_size=8

Time and output: not a CPU run: 100k steps on a pod slice (time there not measured); on 2 CPU cores,
plan only (`jaxformer plan`, above) and the tiny shrink, which checks the program (its samples are
not worth reading).
"""

from jaxformer.config import Config, DataConfig, MeshConfig, TrainConfig, gpt2_small


def get_config() -> Config:
    return Config(
        model=gpt2_small(
            vocab_size=50_304,  # GPT-2's 50257 padded to a multiple of 128: the vocabulary matmuls tile evenly
            d_model=2048,
            num_heads=16,  # head dim 128: the width splash attention's tiles and the MXU like
            d_ff=8192,
            num_decoder_layers=24,
            max_len=1024,
            dropout_rate=0.0,  # one pass over a large corpus does not overfit
            dtype="bfloat16",  # float32 master weights, bfloat16 compute
            attention_impl="auto",  # splash attention on TPU, cuDNN flash attention on GPU
            scan_layers=True,  # one compiled layer body: compiles in a fraction of the unrolled time
            remat="full",  # recompute each layer's activations in the backward pass: the batch that fits grows
        ),
        data=DataConfig(source="shakespeare", tokenizer="byte", max_len=1024),  # point data.path at your corpus
        train=TrainConfig(
            objective="lm",
            steps=100_000,
            batch_size=512,  # 0.5M tokens per step, GPT-3's batch at this size
            optimizer="adamw",
            learning_rate=2e-4,  # GPT-3 1.3B
            warmup_steps=2000,
            weight_decay=0.1,
            eval_every=2000,
            log_every=100,
        ),
        mesh=MeshConfig(data=-1, fsdp=8),  # FSDP within groups of 8 chips, data parallel across them
    )
