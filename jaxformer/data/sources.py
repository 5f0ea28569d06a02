"""Readers for the shipped corpora, with errors that name the file and line, and deterministic splits."""

from __future__ import annotations

import lzma
import pathlib

import numpy as np

CORPORA = pathlib.Path(__file__).parent / "corpora"
SHIPPED = {
    "shakespeare": CORPORA / "shakespeare.txt.xz",
    "en_de": CORPORA / "en_de_lohelp.tsv.xz",
    "lohelp_apps": CORPORA / "en_de_lohelp.tsv.xz",
}
# lohelp_apps labels: the LibreOffice application of each help page ("shared" is not one and is dropped).
APPS = ("scalc", "sbasic", "swriter", "simpress", "sdatabase", "smath", "schart", "sdraw")


class DataError(ValueError):
    """Bad input data; the message names the file (and line) at fault."""


def read_lines(path: str | pathlib.Path) -> list[str]:
    """Lines of a UTF-8 text file, xz-compressed if it ends in .xz."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise DataError(f"{path} does not exist")
    try:
        data = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
    except (lzma.LZMAError, EOFError) as e:
        raise DataError(f"{path}: cannot be decompressed ({e})") from e
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}, line {line}: not UTF-8 (byte {data[e.start]:#04x})") from None


def read_tsv(path: str | pathlib.Path, columns: tuple[str, ...]) -> list[tuple[int, tuple[str, ...]]]:
    """Rows of a TSV whose header names `columns`, each as (line number, fields)."""
    lines = read_lines(path)
    if not lines or tuple(lines[0].split("\t")) != columns:
        raise DataError(f"{path}:1: expected the header {'<TAB>'.join(columns)}")
    rows = []
    for lineno, line in enumerate(lines[1:], start=2):
        fields = tuple(line.split("\t"))
        if len(fields) != len(columns):
            raise DataError(f"{path}:{lineno}: expected {len(columns)} tab-separated columns, got {len(fields)}")
        rows.append((lineno, fields))
    return rows


def paragraphs(path: str | pathlib.Path) -> list[tuple[int, str]]:
    """Blank-line separated paragraphs of a text, each with its first line number."""
    out, current, start = [], [], 0
    for lineno, line in enumerate([*read_lines(path), ""], start=1):
        if line.strip():
            start = start or lineno
            current.append(line)
        elif current:
            out.append((start, "\n".join(current)))
            current, start = [], 0
    return out


def translation_pairs(path, min_words: int) -> list[tuple[int, str, str]]:
    """(line, english, german) pairs, dropping UI labels with fewer than `min_words` English words."""
    rows = read_tsv(path, ("id", "en", "de"))
    return [(n, en, de) for n, (_, en, de) in rows if len(en.split()) >= min_words and de.strip()]


def app_labels(path, min_words: int) -> list[tuple[int, str, int]]:
    """(line, english paragraph, application index in APPS) from the help page ids."""
    out = []
    for n, (pid, en, _) in read_tsv(path, ("id", "en", "de")):
        parts = pid.split("/")
        if len(parts) < 3 or parts[0] != "text":
            raise DataError(f"{path}:{n}: id {pid!r} is not text/<app>/<page>")
        if parts[1] in APPS and len(en.split()) >= min_words:
            out.append((n, en, APPS.index(parts[1])))
    return out


def split(records: list, val_fraction: float, test_fraction: float, seed: int, path) -> tuple[list, list, list]:
    """Deterministic train/validation/test split of `records` by a seeded permutation."""
    order = np.random.default_rng(seed).permutation(len(records))
    n_val, n_test = int(len(records) * val_fraction), int(len(records) * test_fraction)
    parts = (order[n_val + n_test :], order[:n_val], order[n_val : n_val + n_test])
    out = tuple([records[i] for i in sorted(p)] for p in parts)
    for name, part in zip(("train", "validation", "test"), out, strict=True):
        if not part:
            raise DataError(f"{path}: the {name} split is empty ({len(records)} records in all)")
    return out
