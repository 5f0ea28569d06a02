"""DeepSeek-V3 (671B: 61 layers of D=7168, multi-head latent attention with 128 heads, C=512,
Cq=1536, R=64, nope 128, v 128; the first 3 layers dense with F=18432, the other 58 top-8 of 256
experts of width 2048 by sigmoid scores in 8 groups (4 a token) beside one shared expert; V=129280),
trained in full with expert parallelism. The shape is DeepSeek-V3's config.json, read as `import-hf`
reads it (yarn RoPE scaling: factor 40 over 4096 trained positions).

Plan it on any machine (no accelerator; `pip install -e ".[tpu]"` or `".[gpu-plan]"`):

    jaxformer plan --config experiments/deepseek_v3.py --target tpu-v5p:8x8x8 --no-largest
    jaxformer plan --config experiments/deepseek_v3.py --target gpu-h100:8x8 --no-largest \\
        --set mesh.fsdp=8 --set mesh.expert=8 --set train.batch_size=64

The v5p slice of 512 chips holds the training step (planned: peak 97.9 GB of 102.0 a chip at one row
of 4096 tokens a chip, float32 weights, gradients and Adam moments 29.0 GB of it); 64 H100s (8 hosts of
8) do not (167.8 GB a GPU of training state, counted).

With the weights (a Hugging Face DeepSeek-V3 directory in bfloat16: the published FP8 checkpoint is
refused by name, dequantize it first), import them, then train:

    jaxformer import-hf PATH/TO/DeepSeek-V3 --workdir runs/deepseek_v3 --config experiments/deepseek_v3.py
    jaxformer train --workdir runs/deepseek_v3

or, to try the program on a random model (nothing worth reading):

    jaxformer train --config experiments/deepseek_v3.py --workdir runs/deepseek_v3

Run locally (tiny shrink): --set model.d_model=64 --set model.num_heads=4 --set model.d_ff=128
    --set model.num_decoder_layers=4 --set model.moe.num_experts=8 --set model.moe.experts_per_token=2
    --set model.moe.num_groups=4 --set model.moe.groups_per_token=2 --set model.moe.expert_d_ff=32
    --set model.mla.kv_lora_rank=32 --set model.mla.q_lora_rank=48 --set model.mla.rope_head_dim=8
    --set model.mla.nope_head_dim=16 --set model.mla.v_head_dim=16 --set model.vocab_size=512
    --set data.max_len=128 --set model.max_len=128 --set train.batch_size=8 --set mesh.fsdp=1 --set mesh.expert=1

Time and output: not a CPU run: on 2 CPU cores, plan only (`jaxformer plan`, above) and the tiny
shrink, which checks the program (a random model: nothing worth reading).
"""

from jaxformer.config import Config, DataConfig, MeshConfig, TrainConfig
from jaxformer.interop.hf_config import config_from_hf

# DeepSeek-V3's config.json, the fields that shape the model (its weights are not needed to plan).
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    hidden_act="silu",
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling={
        "type": "yarn",
        "factor": 40,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    tie_word_embeddings=False,
    attention_bias=False,
    num_nextn_predict_layers=1,  # one multi-token prediction module: model.layers.61 (model.mtp_depth)
)


def get_config() -> Config:
    return Config(
        model=config_from_hf(
            DEEPSEEK_V3,
            dtype="bfloat16",  # float32 master weights, bfloat16 compute
            attention_impl="auto",  # the fused kernel of the target (splash on TPU, cuDNN on GPU)
            scan_layers=True,  # the 3 dense layers unrolled, the 58 MoE layers one compiled body
            remat="full",  # recompute each layer's activations in the backward pass
            max_len=4096,  # DeepSeek-V3's pretraining length
            # the MTP module (one more MoE layer, 1.7% of the parameters) is left out of the plan; train it
            # with --set model.mtp_depth=1 --set train.mtp_weight=0.1
            mtp_depth=0,
        ),
        data=DataConfig(source="shakespeare", tokenizer="byte", max_len=4096),  # point it at your data
        train=TrainConfig(
            objective="lm",
            steps=10_000,
            batch_size=512,  # one row of 4096 tokens a chip
            optimizer="adamw",
            learning_rate=1e-5,  # a fine-tune's rate: the model comes pretrained
            schedule="cosine",
            warmup_steps=100,
        ),
        # 256 experts 16 ways (16 a chip), everything else (and the experts' D) 32 ways over fsdp
        mesh=MeshConfig(fsdp=32, expert=16),
    )
