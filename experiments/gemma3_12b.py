"""Gemma 3 12B's text model (D=3840, L=48, H=16 over 8 key/value heads of 256, F=15360 GeGLU,
V=262208; five local layers over a window of 1024 positions to one global layer) trained in full on
a TPU v5p slice of 16 chips (v5p-32), FSDP over all 16: the shape is gemma-3-12b's text config.json,
read as `import-hf` reads it, less its linear RoPE scaling of the global layers (refused by
`import-hf`; it changes no shape, byte or FLOP of the step).

Plan it on any machine (`pip install -e ".[tpu]"` brings the TPU compiler; no chip needed):

    jaxformer plan --config experiments/gemma3_12b.py --target tpu-v5p:2x2x4 --no-largest

then train (on every host of the slice, `scripts/tpu_pod.sh` runs it there):

    jaxformer train --config experiments/gemma3_12b.py --workdir runs/gemma3_12b

Run locally (tiny shrink): --set model.d_model=64 --set model.num_heads=4 --set model.num_kv_heads=2
    --set model.head_dim=16 --set model.d_ff=128 --set model.num_decoder_layers=6 --set model.vocab_size=512
    --set model.sliding_window=16 --set data.max_len=128 --set model.max_len=128 --set train.batch_size=8
    --set mesh.fsdp=1

Time and output: not a CPU run: a slice of 16 v5p chips (time there not measured); on 2 CPU cores,
plan only (`jaxformer plan`, above) and the tiny shrink, which checks the program (its samples are
not worth reading).
"""

from jaxformer.config import Config, DataConfig, MeshConfig, TrainConfig
from jaxformer.interop.hf_config import config_from_hf

# gemma-3-12b's text_config, the fields that shape the model (its weights are not needed to plan).
GEMMA3_12B = dict(
    model_type="gemma3_text",
    hidden_size=3840,
    intermediate_size=15360,
    num_hidden_layers=48,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    vocab_size=262208,
    query_pre_attn_scalar=256,
    sliding_window=1024,
    sliding_window_pattern=6,
    rope_theta=1000000.0,
    rope_local_base_freq=10000.0,
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    attention_bias=False,
)


def get_config() -> Config:
    return Config(
        model=config_from_hf(
            GEMMA3_12B,
            dtype="bfloat16",  # float32 master weights, bfloat16 compute
            attention_impl="auto",  # splash attention on TPU, the local layers' window as its LocalMask
            scan_layers=True,  # blocks of 6 layers (5 local, 1 global), one compiled body
            remat="full",  # recompute each layer's activations in the backward pass
            max_len=4096,
        ),
        data=DataConfig(source="shakespeare", tokenizer="byte", max_len=4096),  # point it at your data
        train=TrainConfig(
            objective="lm",
            steps=10_000,
            batch_size=32,  # 2 rows of 4096 tokens a chip
            optimizer="adamw",
            learning_rate=1e-5,  # a fine-tune's rate: the model comes pretrained
            schedule="cosine",
            warmup_steps=100,
        ),
        mesh=MeshConfig(fsdp=16),  # 12B x 16 bytes (weights, Adam moments, gradients): 192 GB over 16 chips
    )
