"""Data: the user's files and the shipped corpora (sources), tokenized once (prepare), batches by step read
through grain (pipeline), tokenizers, synthetic tasks."""

from jaxformer.data.pipeline import Batches, Dataset, build_dataset
from jaxformer.data.sources import DataError
from jaxformer.data.tokenizers import (
    HF_DIR,
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    SymbolTokenizer,
    load_tokenizer,
)

__all__ = [
    "HF_DIR",
    "Batches",
    "ByteTokenizer",
    "DataError",
    "Dataset",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "SymbolTokenizer",
    "build_dataset",
    "load_tokenizer",
]
