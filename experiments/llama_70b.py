"""Pre-training a Llama-2-70B-shaped model (D=8192, L=80, H=64 with 8 key/value heads, F=28672,
V=32000, T=4096): the shape for planning how to split a large model over many chips, pipeline
stages included (docs/guides/pipeline.md).

Plan it on any machine (the TPU compiler from jaxformer[tpu]; XLA's GPU compiler from
jaxformer[gpu-plan], else fake CPU devices with the H100's memory):

    jaxformer plan --config experiments/llama_70b.py --target tpu-v5p:8x8x8 --search
    jaxformer plan --config experiments/llama_70b.py --target gpu-h100:8x8 --search --set train.batch_size=256

Train it (on a slice or cluster that holds it; the mesh as the search chose, e.g. --set mesh.fsdp=512):

    jaxformer train --config experiments/llama_70b.py --workdir runs/llama_70b

Run locally (tiny shrink): --set model.d_model=64 --set model.num_heads=4 --set model.num_kv_heads=2
    --set model.d_ff=128 --set model.num_decoder_layers=4 --set data.max_len=128 --set model.max_len=128
    --set train.batch_size=8

Time and output: not a CPU run: 1.1 TB of float32 weights, gradients and Adam moments; on
2 CPU cores, plan only and the tiny shrink, which checks the program (a random model on Shakespeare).
"""

from jaxformer.config import Config, DataConfig, TrainConfig, llama


def get_config() -> Config:
    return Config(
        model=llama(
            d_model=8192,
            num_heads=64,
            num_kv_heads=8,  # grouped-query attention, as Llama 2 70B
            d_ff=28_672,
            num_decoder_layers=80,
            dtype="bfloat16",  # compute; the weights stay float32 masters
            scan_layers=True,  # one compiled layer body; pipeline stages split its layers axis
            remat="full",  # 80 layers of T=4096 activations fit only as each layer's input
            max_len=4096,
        ),
        data=DataConfig(source="shakespeare", tokenizer="byte", max_len=4096),  # point it at your data
        train=TrainConfig(
            objective="lm",
            steps=100_000,
            batch_size=1024,  # 4M tokens a step, Llama 2's batch
            optimizer="adamw",
            learning_rate=1.5e-4,  # Llama 2 70B's peak
            schedule="cosine",
            warmup_steps=2000,
            weight_decay=0.1,
        ),
    )
