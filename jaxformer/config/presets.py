"""Published model shapes as ModelConfigs: the paper's base and big models (Table 3) and the families
`jaxformer.interop.hf` reads (BERT, GPT-2, BART, T5, Llama), a tiny one for tests, and PRESETS by name."""

from __future__ import annotations

from jaxformer.config.architecture import ModelConfig


def paper_base(vocab_size: int = 37_000, **overrides) -> ModelConfig:
    """The paper's base model: D=512, H=8, F=2048, 6+6 layers, post-norm, ~63M params at V=37k.

    Args:
        vocab_size: V.
        **overrides (object): other fields to change.

    Returns:
        The ModelConfig.
    """
    return ModelConfig(vocab_size=vocab_size, **overrides)


def paper_big(vocab_size: int = 37_000, **overrides) -> ModelConfig:
    """The paper's big model: D=1024, H=16, F=4096, dropout 0.3.

    Args:
        vocab_size: V.
        **overrides (object): other fields to change.

    Returns:
        The ModelConfig.
    """
    kw = dict(d_model=1024, num_heads=16, d_ff=4096, dropout_rate=0.3)
    return ModelConfig(vocab_size=vocab_size, **(kw | overrides))


# The published shapes of the families `jaxformer.interop.hf` reads; `vocab_size` and any field
# can be overridden (a checkpoint's own config.json always wins when loading one).


def bert_base(vocab_size: int = 30_522, **overrides) -> ModelConfig:
    """BERT-base (Devlin et al. 2019): 12 post-norm layers of D=768, learned positions, token types,
    a norm on the embeddings, exact GELU, masked-LM head tied to the embeddings; 110M params.

    Args:
        vocab_size: V.
        **overrides (object): other fields to change.

    Returns:
        The ModelConfig.
    """
    kw = dict(
        mode="encoder_only", d_model=768, num_heads=12, d_ff=3072, num_encoder_layers=12,
        num_decoder_layers=0, max_len=512, position="learned", activation="gelu_exact", norm_eps=1e-12,
        scale_embeddings=False, embed_norm=True, type_vocab_size=2, dropout_rate=0.1,
    )  # fmt: skip
    return ModelConfig(vocab_size=vocab_size, **(kw | overrides))


def gpt2_small(vocab_size: int = 50_257, **overrides) -> ModelConfig:
    """GPT-2 small (Radford et al. 2019): 12 pre-norm layers of D=768, learned positions, tanh GELU,
    tied embeddings; 124M params.

    Args:
        vocab_size: V.
        **overrides (object): other fields to change.

    Returns:
        The ModelConfig.
    """
    kw = dict(
        mode="decoder_only", d_model=768, num_heads=12, d_ff=3072, num_encoder_layers=0,
        num_decoder_layers=12, max_len=1024, position="learned", activation="gelu",
        norm_position="pre", norm_eps=1e-5, scale_embeddings=False,
    )  # fmt: skip
    return ModelConfig(vocab_size=vocab_size, **(kw | overrides))


def bart_base(vocab_size: int = 50_265, **overrides) -> ModelConfig:
    """BART-base (Lewis et al. 2020): 6+6 post-norm layers of D=768, learned positions at offset 2,
    norms on the embeddings, exact GELU, shared tied embeddings, a final logits bias; 139M params.

    Args:
        vocab_size: V.
        **overrides (object): other fields to change.

    Returns:
        The ModelConfig.
    """
    kw = dict(
        d_model=768, num_heads=12, d_ff=3072, num_encoder_layers=6, num_decoder_layers=6, max_len=1024,
        position="learned", position_offset=2, activation="gelu_exact", norm_eps=1e-5,
        scale_embeddings=False, embed_norm=True, logits_bias=True, pad_id=1,
    )  # fmt: skip
    return ModelConfig(vocab_size=vocab_size, **(kw | overrides))


def t5_small(vocab_size: int = 32_128, **overrides) -> ModelConfig:
    """T5-small v1.0 (Raffel et al. 2020): 6+6 pre-RMSNorm layers of D=512, relative position
    buckets, unscaled attention, no biases, ReLU, tied output scaled by D^-0.5; 60M params.

    Args:
        vocab_size: V.
        **overrides (object): other fields to change.

    Returns:
        The ModelConfig.
    """
    kw = dict(
        d_model=512, num_heads=8, head_dim=64, d_ff=2048, num_encoder_layers=6, num_decoder_layers=6,
        position="relative", norm="rmsnorm", norm_position="pre", norm_eps=1e-6, use_bias=False,
        scale_attention=False, scale_embeddings=False, scale_tied_logits=True,
    )  # fmt: skip
    return ModelConfig(vocab_size=vocab_size, **(kw | overrides))


def t5_v1_1_small(vocab_size: int = 32_128, **overrides) -> ModelConfig:
    """T5 v1.1 small: as T5 but gated GELU, D=512 F=1024 8+8 layers of 6 heads, untied output; 77M params.

    Args:
        vocab_size: V.
        **overrides (object): other fields to change.

    Returns:
        The ModelConfig.
    """
    kw = dict(
        num_heads=6, d_ff=1024, num_encoder_layers=8, num_decoder_layers=8, activation="geglu",
        tie_output=False, scale_tied_logits=False,
    )  # fmt: skip
    return t5_small(vocab_size, **(kw | overrides))


def llama(vocab_size: int = 32_000, **overrides) -> ModelConfig:
    """Llama 2 7B (Touvron et al. 2023): 32 pre-RMSNorm layers of D=4096, RoPE, SwiGLU F=11008,
    no biases, untied output; set num_kv_heads for grouped-query variants (Llama 3 8B: 8).

    Args:
        vocab_size: V.
        **overrides (object): other fields to change.

    Returns:
        The ModelConfig.
    """
    kw = dict(
        mode="decoder_only", d_model=4096, num_heads=32, d_ff=11_008, num_encoder_layers=0,
        num_decoder_layers=32, max_len=4096, position="rope", activation="swiglu", norm="rmsnorm",
        norm_position="pre", norm_eps=1e-5, use_bias=False, tie_output=False, scale_embeddings=False,
        dropout_rate=0.0,
    )  # fmt: skip
    return ModelConfig(vocab_size=vocab_size, **(kw | overrides))


def tiny(mode: str = "encoder_decoder", vocab_size: int = 32, **overrides) -> ModelConfig:
    """A few-thousand-parameter model of any mode for tests and smoke runs.

    Args:
        mode: "encoder_only", "decoder_only" or "encoder_decoder".
        vocab_size: V.
        **overrides (object): other fields to change.

    Returns:
        The ModelConfig.
    """
    kw = dict(
        mode=mode, d_model=16, num_heads=2, d_ff=32, max_len=32, dropout_rate=0.0,
        num_encoder_layers=0 if mode == "decoder_only" else 2,
        num_decoder_layers=0 if mode == "encoder_only" else 2,
    )  # fmt: skip
    return ModelConfig(vocab_size=vocab_size, **(kw | overrides))


PRESETS = {
    "paper_base": paper_base,
    "paper_big": paper_big,
    "bert_base": bert_base,
    "gpt2_small": gpt2_small,
    "bart_base": bart_base,
    "t5_small": t5_small,
    "t5_v1_1_small": t5_v1_1_small,
    "llama": llama,
    "tiny": tiny,
}
