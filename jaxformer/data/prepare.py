"""Tokenize once: the configured corpus becomes token arrays on disk, reused while nothing changed.

A prepared corpus is a directory `CACHE/<key>/` holding, per split (train, validation, test) and
per field the objective reads (text; source, target):
  {split}.{field}.bin       the documents' token ids, one after the other (uint16, or int32 for V > 65535)
  {split}.{field}.offsets.npy  [N + 1] int64: document i is bin[offsets[i]:offsets[i + 1]]
  {split}.label.npy         [N] int32 class indices (classification)
and `manifest.json`: the sources (path, size, sha256), the tokenizer, the settings and the counts.

Documents are stored as the objective feeds them: lm/mlm text + EOS; seq2seq source + EOS cut to
the source width (data.src_max_len, else data.max_len) and target + EOS cut to data.max_len;
classification BOS + text, cut to the source width; instruction data for lm (data.template) a
prompt field (no EOS) and a response field (+ EOS), each example cut by the pipeline to its window.

The key hashes everything the contents depend on, so an unchanged corpus is found again and a
changed file, tokenizer or setting makes a new one. A cache is written in a temporary directory
and renamed into place once complete: a killed run leaves nothing that is ever read. The files
are cut into parts, each read, checked and tokenized once into its own files (all its records, in
order) with a marker written last; a rerun takes the killed build's directory over and does only
the parts that have no marker. Once every part is done the records are counted, split, and each
part's documents routed to their split's files. Bad data (a record that fails its checks) leaves
nothing behind. Only the first SentencePiece training counts the records in a pass of its own.

This module holds the cache's key and `prepare`. What a corpus holds (splits, fields, widths, the
split of the records) lives in `jaxformer.data.layout`, the build (parts, workers, the join) in
`jaxformer.data.build`, reading a prepared cache (`Prepared`, `TokenFile`) and the records of which
caches are in use (`use`, `in_use`, `clean`) in `jaxformer.data.cache`; their names are re-exported
here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator

from jaxformer.config import Config
from jaxformer.data import sources
from jaxformer.data.build import (  # noqa: F401  (re-exported: the build of a cache lives there)
    CHUNK,
    PART_BYTES,
    PART_LAYOUT,
    ROUTE_TOKENS,
    _build,
    _build_into,
    _count_part,
    _encode_chunk,
    _encode_part,
    _init_worker,
    _limits,
    _part_labels,
    _plan,
    _read_records,
    _route,
    _Runner,
    _samples,
    _tmp_of,
    _tokenizer,
    _write_atomic,
    add_special,
    encode_flat,
)
from jaxformer.data.cache import (  # noqa: F401  (re-exported: the cache's reading and records live there)
    RECORDS,
    Prepared,
    TokenFile,
    _alive,
    _open,
    _read_record,
    _Record,
    _record,
    _record_path,
    _remove,
    _write_shared,
    clean,
    in_use,
    use,
)
from jaxformer.data.layout import (  # noqa: F401  (re-exported: what a prepared corpus holds)
    SPLITS,
    _split_of,
    check_vocab,
    completions,
    fields_of,
    split_assignment,
    widths_of,
)
from jaxformer.data.sources import DataError, source_of
from jaxformer.data.tokenizers import train_tokenizer

VERSION = 1  # of the layout above; bump it when it changes
# Below this many bytes of sources, tokenizing in this process beats starting worker processes.
PARALLEL_ABOVE = 32 << 20
# Settings that do not change the prepared tokens.
NOT_IN_KEY = (
    "length_buckets", "cache_dir", "prepare_workers", "prefetch", "pack", "max_segments", "synthetic_vocab",
    "synthetic_len",
)  # fmt: skip


def key_settings(cfg: Config) -> dict:
    """The settings the prepared tokens depend on. An unset src_max_len is left out, so caches
    prepared before it existed are found again; set to max_len, it is the same cache as unset.

    Args:
        cfg: the run's config.

    Returns:
        name -> value, the cache key's settings.
    """
    d = cfg.data
    settings = {k: v for k, v in dataclasses.asdict(d).items() if k not in NOT_IN_KEY}
    if d.src_max_len is None or d.src_max_len == d.max_len:
        del settings["src_max_len"]
    if d.template == "none":  # as src_max_len: caches prepared before templates existed are found again
        del settings["template"]
    return settings | {"objective": cfg.train.objective}


def sha256(path: pathlib.Path) -> str:
    """A file's SHA-256, read a block at a time.

    Args:
        path: the file.

    Returns:
        The hex digest.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def cache_root(cfg: Config, workdir) -> pathlib.Path:
    """data.cache_dir, else WORKDIR/data, else a directory under the system's temporary one.

    Args:
        cfg: the run's config (data.cache_dir).
        workdir (str | pathlib.Path | None): the run's directory, or None.

    Returns:
        The directory the prepared caches go under.
    """
    if cfg.data.cache_dir:
        return pathlib.Path(cfg.data.cache_dir)
    if workdir is not None:
        return pathlib.Path(workdir) / "data"
    return pathlib.Path(tempfile.gettempdir()) / "jaxformer-data"


def tokenizer_identity(cfg: Config, workdir) -> str | None:
    """What identifies the tokenizer's ids: its kind, and the hash of its file (None: not trained yet).

    Args:
        cfg: the run's config (data.tokenizer).
        workdir (str | pathlib.Path | None): the run's directory, or None for the current one.

    Returns:
        The identity, or None.
    """
    kind = cfg.data.tokenizer
    if kind in ("byte", "symbols"):
        return kind
    path = pathlib.Path(workdir or ".") / ("tokenizer.model" if kind == "sentencepiece" else "hf/tokenizer.json")
    return f"{kind}:{sha256(path)}" if path.is_file() else None


def prepare(cfg: Config, workdir=None, progress: bool = True, own: bool = True) -> Prepared:
    """The prepared corpus of `cfg`: found in the cache when nothing changed, else built (and the
    SentencePiece tokenizer trained on the training split the first time).

    With a workdir and `own` (training, `jaxformer prepare`; not readers such as eval), the cache
    is recorded as the workdir's, and the one it recorded before is removed once this one is
    ready, unless another workdir's record names it (see `use`).

    Args:
        cfg: the run's config.
        workdir (str | pathlib.Path | None): the run's directory, or None.
        progress: print progress while building.
        own: record the cache as the workdir's.

    Returns:
        The prepared corpus.

    Raises:
        DataError: bad data (file and line named); nothing of the build is kept.
    """
    d = cfg.data
    src = source_of(cfg)
    files = sources.expand(src.files)
    settings = key_settings(cfg)
    fingerprint = [{"path": str(p.resolve()), "size": p.stat().st_size, "sha256": sha256(p)} for p in files]
    root = cache_root(cfg, workdir)

    def key_of(tokenizer: str) -> str:
        described = {"version": VERSION, "settings": settings, "sources": fingerprint, "tokenizer": tokenizer}
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]

    owner = workdir if own else None
    tokenizer = tokenizer_identity(cfg, workdir)
    if tokenizer is not None and (root / key_of(tokenizer) / "manifest.json").is_file():
        return use(root, key_of(tokenizer), owner)
    workers = d.prepare_workers or os.cpu_count() or 1
    parallel = workers > 1 and sum(p.stat().st_size for p in files) > PARALLEL_ABOVE
    made_root, final, recorded = not root.exists(), None, None
    try:
        with _Runner(workers if parallel else 0, cfg, workdir) as run:
            plan = _plan(src, run)
            if tokenizer is None:  # SentencePiece, trained on the training split (the first time only)
                tokenizer = _train_sentencepiece(cfg, workdir, src, plan, run)
            final = root / key_of(tokenizer)
            if not (final / "manifest.json").is_file():
                if owner is not None:  # recorded before it exists: `clean` never takes a cache being built
                    recorded = _record(root, owner, final.name)
                described = {"version": VERSION, "settings": settings, "sources": fingerprint, "tokenizer": tokenizer}
                _build_into(final, described, cfg, workdir, src, plan, run, progress)
    except DataError:  # bad data fails the same way every time: nothing of this build is kept
        if final is not None:  # removed once the workers have stopped writing into it
            shutil.rmtree(_tmp_of(final), ignore_errors=True)
        if recorded is not None:
            recorded.restore()
        if made_root:
            for directory in (root / RECORDS, root):
                with contextlib.suppress(OSError):
                    directory.rmdir()
        raise
    return use(root, final.name, owner)


def _train_sentencepiece(cfg: Config, workdir, src: sources.Source, plan: list, run) -> str:
    """Train SentencePiece on the training split; returns the tokenizer's identity. Which records
    are training ones needs their number, so this first time they are counted in a pass of its own."""
    d, objective = cfg.data, cfg.train.objective
    labels = None
    if objective == "classify":
        labels = src.labels or tuple(sorted(set().union(*run(_part_labels, [(src, p) for p in plan]))))
    counts = run(_count_part, [(src, labels, p) for p in plan])
    n = sum(_limits(counts, d.max_examples))
    assign = _split_of(n, d, src, labels)
    n_text = 2 if objective == "seq2seq" or completions(cfg) else 1
    records = enumerate(_records(src, labels, d.max_examples))
    train_tokenizer(cfg, (x for i, r in records if assign[i] == 0 for x in r[1 : 1 + n_text]), workdir)
    return tokenizer_identity(cfg, workdir)


def _records(src: sources.Source, labels, max_examples: int) -> Iterator[tuple]:
    records = sources.iter_records(src, labels)
    return itertools.islice(records, max_examples) if max_examples else records
