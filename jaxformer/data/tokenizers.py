"""Tokenizers: byte-level (no training), SentencePiece (trained on the training split), symbols (synthetic tasks).

All share the special ids pad=0 and bos, eos (and mask where the objective needs it).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable, Sequence


class ByteTokenizer:
    """UTF-8 bytes shifted past four special ids: V = 260, nothing to train or save."""

    pad_id, bos_id, eos_id, mask_id = 0, 1, 2, 3
    offset = 4
    vocab_size = 256 + offset

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(i - self.offset for i in ids if i >= self.offset)
        return data.decode("utf-8", errors="replace")


class SymbolTokenizer:
    """Synthetic tasks (copy, reverse): pad 0, bos 1, symbols 2..V-1 written as numbers."""

    pad_id, bos_id = 0, 1
    eos_id = mask_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids if i > self.bos_id)


class SentencePieceTokenizer:
    """A SentencePiece model (BPE or unigram) with pad 0, unk 1, bos 2, eos 3 and a [MASK] piece."""

    pad_id, unk_id, bos_id, eos_id = 0, 1, 2, 3

    def __init__(self, model_file: str | pathlib.Path):
        import sentencepiece as spm

        self.model_file = pathlib.Path(model_file)
        if not self.model_file.is_file():
            raise FileNotFoundError(f"SentencePiece model {self.model_file} does not exist")
        self.sp = spm.SentencePieceProcessor(model_file=str(self.model_file))
        self.vocab_size = self.sp.get_piece_size()
        self.mask_id = self.sp.piece_to_id("[MASK]")

    @classmethod
    def train(
        cls, texts: Sequence[str], model_file: str | pathlib.Path, vocab_size: int, model_type: str = "bpe"
    ) -> SentencePieceTokenizer:
        """Train on `texts` (the training split only) and save `model_file` (+ .vocab)."""
        import sentencepiece as spm

        model_file = pathlib.Path(model_file)
        model_file.parent.mkdir(parents=True, exist_ok=True)
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_prefix=str(model_file.with_suffix("")),
            vocab_size=vocab_size,
            model_type=model_type,
            pad_id=0, unk_id=1, bos_id=2, eos_id=3,
            user_defined_symbols=["[MASK]"],
            character_coverage=1.0,
            input_sentence_size=200_000,
            shuffle_input_sentence=True,
            num_threads=2,
            minloglevel=2,
        )  # fmt: skip
        return cls(model_file)

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids if int(i) > self.eos_id or int(i) == 1])
