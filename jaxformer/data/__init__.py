"""Data: tokenizers, shipped corpora and synthetic tasks, deterministic step-indexed batches."""

from jaxformer.data.pipeline import Batches, Dataset, build_dataset, load_tokenizer
from jaxformer.data.sources import DataError
from jaxformer.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, SymbolTokenizer

__all__ = [
    "Batches",
    "ByteTokenizer",
    "DataError",
    "Dataset",
    "SentencePieceTokenizer",
    "SymbolTokenizer",
    "build_dataset",
    "load_tokenizer",
]
