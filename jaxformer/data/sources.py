"""The user's files as records: plain text, JSONL, TSV and Parquet, read by one `Source` description.

A record is `(where, field, ...)`: `where` is "file:line" (Parquet: "file:row N"), the fields are the
strings an objective reads, in its order (lm/mlm: text; seq2seq: source, target; classify: text,
label, the label turned into its index in the label set). Every error names the file and the line,
and is raised while reading, before any training. The shipped corpora are `Source`s like any other.
"""

from __future__ import annotations

import bz2
import dataclasses
import glob
import gzip
import itertools
import json
import lzma
import pathlib
import re
from collections.abc import Iterator

import numpy as np

from jaxformer.config import Config
from jaxformer.data import templates

CORPORA = pathlib.Path(__file__).parent / "corpora"
# lohelp_apps labels: the LibreOffice application of each help page ("shared" is not one and is dropped).
APPS = ("scalc", "sbasic", "swriter", "simpress", "sdatabase", "smath", "schart", "sdraw")
FORMATS = ("text", "jsonl", "tsv", "parquet")
# The fields each objective reads, and their default names in the user's files.
FIELDS = {"lm": ("text",), "mlm": ("text",), "seq2seq": ("source", "target"), "classify": ("text", "label")}


class DataError(ValueError):
    """Bad input data; the message names the file (and line) at fault."""


@dataclasses.dataclass(frozen=True)
class Source:
    """Where records come from and how they are read.

    Attributes:
        files: paths or glob patterns (each must match a file), read in sorted order.
        fields: the names of the fields the objective reads (JSONL keys, TSV header columns, Parquet
            columns); plain text has one field, the document.
        format: one of FORMATS, or "auto" from the file name (.txt, .jsonl/.json, .tsv, .parquet;
            a trailing .xz, .gz or .bz2 is decompressed).
        unit: plain text only: a document is a "line" or a blank-line separated "paragraph".
        labels: the label set (classification); empty: the sorted labels found in the files.
        label_pattern: a regular expression whose first group is the label, searched in the label field.
        other_labels: "error" (a label outside `labels` stops the run) or "drop" (the record is skipped).
        min_words: records whose first field has fewer words are skipped; so is a record with an empty
            field.
        template: instruction data (`templates.TEMPLATES`): `fields` are (prompt, response), or a record
            holds chat `messages`; either becomes (prompt text, response text) written in the template.
    """

    files: tuple[str, ...]
    fields: tuple[str, ...]
    format: str = "auto"
    unit: str = "line"
    labels: tuple[str, ...] = ()
    label_pattern: str | None = None
    other_labels: str = "error"
    min_words: int = 0
    template: str | None = None


SHIPPED = {
    "shakespeare": Source((str(CORPORA / "shakespeare.txt.xz"),), ("text",), unit="paragraph"),
    "en_de": Source((str(CORPORA / "en_de_lohelp.tsv.xz"),), ("en", "de"), min_words=3),  # drop UI labels
    # The label is the application in the page id `text/<app>/<page>`; pages of no application are dropped.
    "lohelp_apps": Source(
        (str(CORPORA / "en_de_lohelp.tsv.xz"),), ("en", "id"), labels=APPS, label_pattern=r"^text/([^/]+)/.",
        other_labels="drop", min_words=3,
    ),
}  # fmt: skip


def expand(patterns: tuple[str, ...]) -> list[pathlib.Path]:
    """The files named by paths or glob patterns, each pattern's matches sorted.

    Args:
        patterns: paths or glob patterns.

    Returns:
        The files.

    Raises:
        DataError: a path that is no file, or a pattern that matches none.
    """
    out = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        files = [pathlib.Path(m) for m in matches if pathlib.Path(m).is_file()]
        if not files:
            raise DataError(f"{pattern}: no such data file" if matches == [pattern] else f"{pattern}: matches no file")
        out += files
    return out


def format_of(path: pathlib.Path, given: str) -> str:
    """A file's format: `given`, or with "auto" the one its name says (a compression suffix skipped).

    Args:
        path: the file.
        given: one of FORMATS, or "auto".

    Returns:
        One of FORMATS.

    Raises:
        DataError: "auto" and a name that says no format.
    """
    if given != "auto":
        return given
    suffixes = [s for s in path.suffixes if s not in (".xz", ".gz", ".bz2")]
    ext = suffixes[-1] if suffixes else ""
    found = {".txt": "text", ".text": "text", ".jsonl": "jsonl", ".json": "jsonl", ".tsv": "tsv", ".parquet": "parquet"}
    if ext not in found:
        raise DataError(f"{path}: cannot tell the format from the name; set data.format to one of {', '.join(FORMATS)}")
    return found[ext]


def read_lines(path: str | pathlib.Path, block: int = 1 << 24, part: Part | None = None) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 text file, decompressed by its suffix; a line that is not UTF-8 fails.

    Read and decoded a block of whole lines at a time: per-line reads dominate the time otherwise.
    `part`: only the bytes start..stop of an uncompressed file, whose first line is number first_line.

    Args:
        path: the file.
        block: bytes read at a time.
        part: the part of the file to read, or None for all of it.

    Returns:
        (line number, line without its end) pairs, one at a time.

    Raises:
        DataError: a line that is not UTF-8 (file, line and byte named), or a file that cannot be read.
    """
    path = pathlib.Path(path)
    opener = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}.get(path.suffix, open)
    start, stop, first_line = (0, None, 1) if part is None else (part.start, part.stop, part.first_line)
    lineno, rest = first_line - 1, b""
    try:
        with opener(path, "rb") as f:
            if start:
                f.seek(start)
            left = float("inf") if stop is None else stop - start
            while True:
                data = f.read(int(min(block, left)))
                left -= len(data)
                chunk = rest + data
                cut = len(chunk) if not data else chunk.rfind(b"\n") + 1
                if not data and not chunk:
                    break
                if cut == 0:  # no line ends in this block yet
                    rest = chunk
                    continue
                whole, rest = chunk[:cut], chunk[cut:]
                try:
                    text = whole.decode("utf-8")
                except UnicodeDecodeError as e:
                    bad = lineno + whole.count(b"\n", 0, e.start) + 1
                    column = e.start - whole.rfind(b"\n", 0, e.start) - 1
                    raise DataError(f"{path}:{bad}: not UTF-8 ({e.reason} at byte {column})") from None
                lines = text.split("\n")
                if text.endswith("\n"):
                    lines.pop()
                for line in lines:
                    lineno += 1
                    yield lineno, line[:-1] if line.endswith("\r") else line
                if not data:
                    break
    except (lzma.LZMAError, EOFError, OSError, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: cannot be read ({e})") from e


def _text(path: pathlib.Path, src: Source, part: Part | None) -> Iterator[tuple[str, dict]]:
    name = src.fields[0]
    if src.unit == "line":
        for lineno, line in read_lines(path, part=part):
            if line.strip():
                yield f"{path}:{lineno}", {name: line}
        return
    current, start = [], 0
    for lineno, line in itertools.chain(read_lines(path, part=part), [(0, "")]):  # streamed, never the whole file
        if line.strip():
            start = start or lineno
            current.append(line)
        elif current:
            yield f"{path}:{start}", {name: "\n".join(current)}
            current, start = [], 0


def _jsonl(path: pathlib.Path, src: Source, part: Part | None) -> Iterator[tuple[str, dict]]:
    for lineno, line in read_lines(path, part=part):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: a JSON object is expected, got {type(row).__name__}")
        yield f"{path}:{lineno}", row


def _tsv(path: pathlib.Path, src: Source, part: Part | None) -> Iterator[tuple[str, dict]]:
    _, header = next(read_lines(path, block=1 << 16), (1, ""))  # every part reads the file's header
    lines = read_lines(path, part=part)
    if part is None or part.start == 0:
        next(lines, None)
    columns = header.split("\t")
    missing = [f for f in src.fields if f not in columns]
    if header and missing:
        raise DataError(f"{path}:1: the header has no column {missing[0]!r} (it has {', '.join(columns)})")
    for lineno, line in lines:
        if not line.strip():
            continue
        values = line.split("\t")
        if len(values) != len(columns):
            raise DataError(f"{path}:{lineno}: expected {len(columns)} tab-separated columns, got {len(values)}")
        yield f"{path}:{lineno}", dict(zip(columns, values, strict=True))


def _parquet(path: pathlib.Path, src: Source, part: Part | None) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot be read as Parquet ({e})") from e
    missing = [f for f in src.fields if f not in file.schema_arrow.names]
    if missing:
        raise DataError(f"{path}: no column {missing[0]!r} (it has {', '.join(file.schema_arrow.names)})")
    row = 0
    for batch in file.iter_batches(columns=list(src.fields)):
        for values in zip(*(batch.column(f).to_pylist() for f in src.fields), strict=True):
            row += 1
            fields = {}
            for name, v in zip(src.fields, values, strict=True):
                if isinstance(v, bytes):
                    try:
                        v = v.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise DataError(f"{path}:row {row}: column {name!r} is not UTF-8 ({e.reason})") from None
                fields[name] = v
            yield f"{path}:row {row}", fields


READERS = {"text": _text, "jsonl": _jsonl, "tsv": _tsv, "parquet": _parquet}


@dataclasses.dataclass(frozen=True)
class Part:
    """Bytes start..stop (None: to the end) of one file, cut at a record boundary; its first line's number.

    Attributes:
        path: the file.
        start: the first byte.
        stop: the byte after the last, or None for the end.
        first_line: the number of the part's first line.
    """

    path: str
    start: int = 0
    stop: int | None = None
    first_line: int = 1


def parts(src: Source, size: int) -> list[Part]:
    """The files of `src` cut into parts of about `size` bytes at record boundaries (a line end; a
    blank line for paragraphs), for readers in parallel; compressed and Parquet files stay whole.
    first_line is left at 1: `count_lines` gives each part its own.

    Args:
        src: the source.
        size: about how many bytes a part holds.

    Returns:
        The parts, in file order.
    """
    out = []
    for path in expand(src.files):
        total = path.stat().st_size
        if path.suffix in (".xz", ".gz", ".bz2") or format_of(path, src.format) == "parquet" or total <= size:
            out.append(Part(str(path)))
            continue
        mark = b"\n\n" if format_of(path, src.format) == "text" and src.unit == "paragraph" else b"\n"
        cuts = [0]
        with open(path, "rb") as f:
            while cuts[-1] + size < total:
                f.seek(cuts[-1] + size)
                window, at = b"", -1
                while at < 0 and (more := f.read(1 << 16)):
                    window += more
                    at = window.find(mark)
                if at < 0:
                    break
                cuts.append(cuts[-1] + size + at + len(mark))
        out += [Part(str(path), a, b) for a, b in zip(cuts, [*cuts[1:], None], strict=True)]
    return out


def count_lines(part: Part) -> int:
    """Line ends in a part (the next part of its file starts that many lines further).

    Args:
        part: the part.

    Returns:
        The count.
    """
    count = 0
    with open(part.path, "rb") as f:
        f.seek(part.start)
        left = float("inf") if part.stop is None else part.stop - part.start
        while left > 0 and (data := f.read(int(min(1 << 24, left)))):
            count += data.count(b"\n")
            left -= len(data)
    return count


def iter_records(
    src: Source, labels: tuple[str, ...] | None = None, part: Part | None = None, dropped: dict | None = None
) -> Iterator[tuple]:
    """The records of `src` one by one, in file order (memory flat whatever the corpus' size).

    With `labels` (classification) the last field becomes its index in `labels`; a label outside
    them fails or drops the record as `src.other_labels` says. A missing field, an empty file or a
    line that is not UTF-8 fails with the file and line named.

    Args:
        src: the source.
        labels: the label set (classification), or None.
        part: read only this part of one file, or None for every file.
        dropped: a dict to count the records left out in, by why (`describe_dropped` says it).

    Returns:
        Records (where, field, ...), one at a time.

    Raises:
        DataError: a missing field, a label outside the set, an empty file or no records left (each
            error names the file and line).
    """
    pattern = re.compile(src.label_pattern) if src.label_pattern else None
    index = None if labels is None else {name: i for i, name in enumerate(labels)}
    template = templates.get(src.template) if src.template else None
    kept, dropped = 0, {} if dropped is None else dropped
    names = ("prompt", "response") if template is not None else src.fields
    drop = lambda why: dropped.__setitem__(why, dropped.get(why, 0) + 1)
    for path in expand(src.files) if part is None else [pathlib.Path(part.path)]:
        fmt = format_of(path, src.format)
        if fmt == "text" and len(src.fields) != 1:
            raise DataError(f"{path}: plain text holds one field per document, but {len(src.fields)} are needed "
                            f"({', '.join(src.fields)}): use JSONL, TSV or Parquet")  # fmt: skip
        count = 0
        for where, row in READERS[fmt](path, src, part):
            count += 1
            values = []
            if template is not None:
                try:
                    values = list(templates.to_pair(template, row, src.fields))
                except ValueError as e:
                    raise DataError(f"{where}: {e}") from None
            for name in src.fields if template is None else ():
                if name not in row or row[name] is None:
                    raise DataError(f"{where}: no field {name!r}")
                v = row[name]
                values.append(v if isinstance(v, str) else str(v) if isinstance(v, int) else json.dumps(v))
            if src.min_words and len(values[0].split()) < src.min_words:
                drop(f"fewer than data.min_words={src.min_words} words")
                continue
            if empty := [name for name, v in zip(names, values, strict=False) if not v.strip()]:
                drop(f"an empty {empty[0]!r}")
                continue
            if pattern is not None:
                m = pattern.search(values[-1])
                if m is None:
                    raise DataError(f"{where}: {src.fields[-1]} {values[-1]!r} does not match {src.label_pattern!r}")
                values[-1] = m.group(1)
            if index is not None:
                if values[-1] not in index:
                    if src.other_labels == "drop":
                        drop("a label outside the set (data.other_labels='drop')")
                        continue
                    raise DataError(f"{where}: label {values[-1]!r} is not in the label set ({', '.join(labels)})")
                values[-1] = index[values[-1]]
            kept += 1
            yield (where, *values)
        if count == 0 and (part is None or (part.stop is None and part.start == 0)):
            raise DataError(f"{path}: empty file (no records)")
    if not kept and part is None:
        raise DataError(f"{', '.join(src.files)}: no records left ({describe_dropped(dropped)})")


def describe_dropped(dropped: dict) -> str:
    """What `iter_records` left out, and why: "3 records dropped: 2 with an empty 'response', 1 with ...".

    Args:
        dropped: why -> how many records (`iter_records`'s `dropped`).

    Returns:
        One clause.
    """
    if not dropped:
        return "none dropped"
    whys = ", ".join(f"{n} with {why}" for why, n in sorted(dropped.items(), key=lambda kv: -kv[1]))
    return f"{sum(dropped.values())} records dropped: {whys}"


def why_split_empty(src: Source, labels: tuple[str, ...] | None, error: Exception) -> DataError:
    """A split's emptiness with why the records went: the files read again, counting what was left out.

    Args:
        src: the source.
        labels: the label set (classification), or None.
        error: the split's error ("the train split is empty (0 records in all)").

    Returns:
        The error to raise, its message ending in what was dropped and why.
    """
    dropped = {}
    try:
        for _ in iter_records(src, labels, dropped=dropped):
            pass
    except DataError as e:  # no records left at all: its message says why
        return e
    return DataError(f"{error}; {describe_dropped(dropped)}")


def label_set(src: Source) -> tuple[str, ...]:
    """The declared labels, or the sorted labels found in the files (one pass over them).

    Args:
        src: the source.

    Returns:
        The labels.
    """
    return src.labels or tuple(sorted({r[-1] for r in iter_records(src)}))


def read(src: Source, labelled: bool = False) -> tuple[list[tuple], tuple[str, ...]]:
    """All records of `src` in a list, and with `labelled` (the last field is a label) the label set.

    Args:
        src: the source.
        labelled: the last field is a label.

    Returns:
        (records, labels), labels empty without `labelled`.
    """
    labels = label_set(src) if labelled else None
    return list(iter_records(src, labels)), labels or ()


def split(records: list, val_fraction: float, test_fraction: float, seed: int, path) -> tuple[list, list, list]:
    """Deterministic train/validation/test split of `records` by a seeded permutation.

    Args:
        records: the records.
        val_fraction: the validation split's share.
        test_fraction: the test split's share.
        seed: the permutation's seed.
        path (object): what the error names (the data's files).

    Returns:
        (train, validation, test), each in the records' order.

    Raises:
        DataError: a split would be empty.
    """
    order = np.random.default_rng(seed).permutation(len(records))
    n_val, n_test = int(len(records) * val_fraction), int(len(records) * test_fraction)
    parts = (order[n_val + n_test :], order[:n_val], order[n_val : n_val + n_test])
    out = tuple([records[i] for i in sorted(p)] for p in parts)
    for name, part in zip(("train", "validation", "test"), out, strict=True):
        if not part:
            raise DataError(f"{path}: the {name} split is empty ({len(records)} records in all)")
    return out


def source_of(cfg: Config) -> Source:
    """The configured data as a `Source`: a shipped corpus (its file replaced by `data.path`) or the user's files.

    Args:
        cfg: the run's config (data, train.objective).

    Returns:
        The source.

    Raises:
        DataError: a shipped corpus with fewer fields per record than the objective reads.
    """
    d, objective = cfg.data, cfg.train.objective
    if d.source == "files":
        fields = d.fields or (("prompt", "response") if d.template != "none" else FIELDS[objective])
        template = None if d.template == "none" else d.template
        return Source(d.files, fields, d.format, d.text_unit, d.labels, min_words=d.min_words or 0, template=template)
    src = SHIPPED[d.source]
    needs = len(FIELDS[objective])
    if not d.fields and len(src.fields) < needs:  # refused before the corpus is read (it was an IndexError)
        raise DataError(
            f"data.source={d.source!r} holds {len(src.fields)} field(s) per record ({', '.join(src.fields)}), "
            f"but objective={objective!r} reads {needs}: use data.source=files with data.fields"
        )
    if d.path:
        src = dataclasses.replace(src, files=(d.path,))
    if d.min_words is not None:
        src = dataclasses.replace(src, min_words=d.min_words)
    if d.fields:
        src = dataclasses.replace(src, fields=d.fields)
    return src
