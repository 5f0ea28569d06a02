"""Tasks with checkable answers for GRPO, and the character tokenizer they are written in.

A task is a callable `task(split, count, seed) -> list[{"prompt": str, "answer": str}]`, named in the
config (`grpo.task`) as `module:function` or `path/to/file.py:function`; "train" and "test" draw from
disjoint sets of problems.
"""

from __future__ import annotations

import zlib

import numpy as np

ARITHMETIC_CHARS = "0123456789+-=?"


class CharTokenizer:
    """One id per character of `chars`, after pad (0), BOS (1) and EOS (2): a vocabulary of a few dozen.

    Args:
        chars: the characters the texts may hold.
    """

    pad_id, bos_id, eos_id = 0, 1, 2

    def __init__(self, chars: str = ARITHMETIC_CHARS):
        self.chars = chars
        self._id = {c: i + 3 for i, c in enumerate(chars)}
        self.vocab_size = len(chars) + 3

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`.

        Args:
            text: the text.

        Returns:
            One id per character.

        Raises:
            ValueError: a character outside the tokenizer's set.
        """
        try:
            return [self._id[c] for c in text]
        except KeyError as e:
            raise ValueError(f"{e.args[0]!r} is not one of the tokenizer's characters {self.chars!r}") from None

    def decode(self, ids) -> str:
        """The text of `ids` (special ids dropped).

        Args:
            ids (list[int]): token ids.

        Returns:
            The text.
        """
        return "".join(self.chars[i - 3] for i in ids if 3 <= i < self.vocab_size)


def addition(split: str, count: int, seed: int = 0, digits: int = 2) -> list[dict]:
    """`count` problems "a+b=" with answer str(a + b), a and b below 10**digits; a pair belongs to
    "test" when the CRC-32 of its prompt is divisible by 10 (a tenth of the pairs, with no pattern in
    their digits), to "train" otherwise.

    Args:
        split: "train" or "test".
        count: how many problems.
        seed: which ones (the same seed, the same problems).
        digits: the operands' digits.

    Returns:
        [{"prompt": "12+7=", "answer": "19"}, ...].

    Raises:
        ValueError: an unknown split.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = np.random.default_rng([seed, split == "test"])
    out, n = [], 10**digits
    while len(out) < count:
        a, b = (int(x) for x in rng.integers(0, n, 2))
        prompt = f"{a}+{b}="
        if (zlib.crc32(prompt.encode()) % 10 == 0) == (split == "test"):
            out.append({"prompt": prompt, "answer": str(a + b)})
    return out


def reverse(split: str, count: int, seed: int = 0, length: int = 5) -> list[dict]:
    """`count` problems "31415?" with answer "51413": the digits reversed; held out as `addition` does.

    Args:
        split: "train" or "test".
        count: how many problems.
        seed: which ones.
        length: digits per problem.

    Returns:
        [{"prompt": "31415?", "answer": "51413"}, ...].

    Raises:
        ValueError: an unknown split.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = np.random.default_rng([seed, split == "test"])
    out = []
    while len(out) < count:
        digits = "".join(str(int(d)) for d in rng.integers(0, 10, length))
        if (zlib.crc32(digits.encode()) % 10 == 0) == (split == "test"):
            out.append({"prompt": f"{digits}?", "answer": digits[::-1]})
    return out
