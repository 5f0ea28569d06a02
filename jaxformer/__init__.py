"""jaxformer: the Transformer of "Attention Is All You Need" as a JAX/Flax NNX framework."""

from jaxformer import functional
from jaxformer.checkpoint import load_model
from jaxformer.config import ConfigError, ModelConfig, bert_style, gpt2_style, paper_base, paper_big, tiny
from jaxformer.layers import (
    DecoderLayer,
    Embed,
    EncoderLayer,
    FeedForward,
    LayerStack,
    MultiHeadAttention,
    Norm,
    PositionalEncoding,
)
from jaxformer.models import Decoder, Encoder, Transformer, TransformerStack, build_model, count_params

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Decoder",
    "DecoderLayer",
    "Embed",
    "Encoder",
    "EncoderLayer",
    "FeedForward",
    "LayerStack",
    "ModelConfig",
    "MultiHeadAttention",
    "Norm",
    "PositionalEncoding",
    "Transformer",
    "TransformerStack",
    "bert_style",
    "build_model",
    "count_params",
    "functional",
    "gpt2_style",
    "load_model",
    "paper_base",
    "paper_big",
    "tiny",
]
