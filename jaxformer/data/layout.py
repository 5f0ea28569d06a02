"""What a prepared corpus holds: its splits, the fields each objective stores and the widths they are
cut to, which split each record goes to, and the check that the tokenizer's ids are the model's.
"""

from __future__ import annotations

import numpy as np

from jaxformer.config import Config
from jaxformer.data import sources
from jaxformer.data.sources import DataError

SPLITS = ("train", "validation", "test")


def completions(cfg: Config) -> bool:
    """Instruction data for a decoder-only LM: prompt and response stored apart, loss on the response.

    Args:
        cfg: the run's config.

    Returns:
        Whether `cfg` trains on completions.
    """
    return cfg.train.objective == "lm" and cfg.data.template != "none"


def fields_of(cfg: Config) -> tuple[str, ...]:
    """The stored fields of an objective (the last field of classification is its label).

    Args:
        cfg: the run's config.

    Returns:
        The field names.
    """
    if completions(cfg):
        return ("prompt", "response")
    return {"seq2seq": ("source", "target"), "classify": ("text",)}.get(cfg.train.objective, ("text",))


def widths_of(cfg: Config) -> tuple[tuple[int, str] | None, ...]:
    """Per stored field, (the width its documents are cut to, the setting that says it); None: not cut.

    Args:
        cfg: the run's config.

    Returns:
        One entry per stored field.
    """
    d, objective = cfg.data, cfg.train.objective
    if completions(cfg):  # prompt + response share the window: the pipeline cuts their sum
        return (None, None)
    src = (d.src_len, "data.max_len" if d.src_max_len is None else "data.src_max_len")
    return {"seq2seq": (src, (d.max_len, "data.max_len")), "classify": (src,)}.get(objective, (None,))


def check_vocab(cfg: Config, tok, src: sources.Source) -> None:
    """The tokenizer's ids must be the model's: a larger tokenizer would feed ids past the embedding.

    Args:
        cfg: the run's config (model.vocab_size).
        tok (object): the tokenizer.
        src: the data, named in the error.

    Raises:
        DataError: the tokenizer has more ids than model.vocab_size.
    """
    if tok.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"{', '.join(src.files)}: the {cfg.data.tokenizer} tokenizer has {tok.vocab_size} ids "
            f"but model.vocab_size={cfg.model.vocab_size} (set it to at least {tok.vocab_size})"
        )


def split_assignment(n: int, val_fraction: float, test_fraction: float, seed: int, where) -> np.ndarray:
    """[n] int8: the split (0 train, 1 validation, 2 test) of each record, by a seeded permutation
    (the same split as `sources.split` makes of a list).

    Args:
        n: the records.
        val_fraction: the validation split's share.
        test_fraction: the test split's share.
        seed: the permutation's seed.
        where (object): what the error names.

    Returns:
        [n] int8 split indices.

    Raises:
        DataError: a split would be empty.
    """
    order = np.random.default_rng(seed).permutation(n)
    n_val, n_test = int(n * val_fraction), int(n * test_fraction)
    assign = np.zeros(n, np.int8)
    assign[order[:n_val]], assign[order[n_val : n_val + n_test]] = 1, 2
    for i, name in enumerate(SPLITS):
        if not (assign == i).any():
            raise DataError(f"{where}: the {name} split is empty ({n} records in all)")
    return assign


def _split_of(n: int, d, src: sources.Source, labels) -> np.ndarray:
    """`split_assignment` of the n records kept; a split left empty says which records were dropped, and why."""
    try:
        return split_assignment(n, d.val_fraction, d.test_fraction, d.split_seed, ", ".join(src.files))
    except DataError as e:
        raise sources.why_split_empty(src, labels, e) from None
