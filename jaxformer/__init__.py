"""jaxformer: the Transformer of "Attention Is All You Need" as a JAX/Flax NNX framework."""

from jaxformer import functional
from jaxformer.checkpoint import load_model
from jaxformer.config import (
    ConfigError,
    ModelConfig,
    MoEConfig,
    bart_base,
    bert_base,
    gpt2_small,
    llama,
    paper_base,
    paper_big,
    t5_small,
    t5_v1_1_small,
    tiny,
)
from jaxformer.layers import (
    DecoderLayer,
    Embed,
    EncoderLayer,
    FeedForward,
    LayerStack,
    MultiHeadAttention,
    Norm,
    PositionalEncoding,
    checked,
)
from jaxformer.models import Decoder, Encoder, Transformer, TransformerStack, build_model, count_params
from jaxformer.moe import MoEFeedForward

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
    "MoEConfig",
    "MoEFeedForward",
    "ModelConfig",
    "MultiHeadAttention",
    "Norm",
    "PositionalEncoding",
    "Transformer",
    "TransformerStack",
    "bart_base",
    "bert_base",
    "build_model",
    "checked",
    "count_params",
    "functional",
    "gpt2_small",
    "llama",
    "load_model",
    "paper_base",
    "paper_big",
    "t5_small",
    "t5_v1_1_small",
    "tiny",
]
