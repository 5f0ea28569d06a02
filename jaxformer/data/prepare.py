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

Reading a prepared cache (`Prepared`, `TokenFile`) and the records of which caches are in use
(`use`, `in_use`, `clean`) live in `jaxformer.data.cache`; their names are re-exported here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import pathlib
import shutil
import socket
import tempfile
from collections.abc import Iterator

import numpy as np

from jaxformer.config import Config
from jaxformer.data import sources
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
from jaxformer.data.sources import DataError, source_of
from jaxformer.data.tokenizers import ByteTokenizer, load_tokenizer, train_tokenizer

SPLITS = ("train", "validation", "test")
VERSION = 1  # of the layout above; bump it when it changes
CHUNK = 2048  # documents a worker tokenizes at a time
# Below this many bytes of sources, tokenizing in this process beats starting worker processes.
PARALLEL_ABOVE = 32 << 20
# Settings that do not change the prepared tokens.
NOT_IN_KEY = (
    "length_buckets", "cache_dir", "prepare_workers", "prefetch", "pack", "max_segments", "synthetic_vocab",
    "synthetic_len",
)  # fmt: skip


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


def _tmp_of(final: pathlib.Path) -> pathlib.Path:
    """The directory this process builds `final` in."""
    return final.parent / f"{final.name}.tmp-{socket.gethostname()}-{os.getpid()}"


def _build_into(final, described, cfg, workdir, src, plan, run, progress) -> None:
    """Build the cache `final` in a temporary directory and rename it into place."""
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    tmp = _tmp_of(final)
    for stale in root.glob(f"{final.name}.tmp-{host}-*"):  # builds killed on this host (not running ones)
        if _alive(int(stale.name.rsplit("-", 1)[1])):
            continue
        if tmp.exists():
            shutil.rmtree(stale, ignore_errors=True)
        else:  # the first one found is taken over: its finished parts are not done again
            with contextlib.suppress(OSError):  # another process took it over first
                stale.rename(tmp)
    # Parts are numbered in this plan: a directory taken over from another plan, or of parts laid
    # out otherwise (an older jaxformer's), starts again.
    described_plan = json.dumps({"parts": PART_LAYOUT, "plan": [[p.path, p.start, p.stop] for p in plan]})
    if tmp.exists() and (not (tmp / "plan.json").is_file() or (tmp / "plan.json").read_text() != described_plan):
        shutil.rmtree(tmp)
    tmp.mkdir(exist_ok=True)
    _write_atomic(tmp / "plan.json", described_plan)
    manifest = _build(cfg, workdir, src, plan, tmp, run, progress) | described
    _write_atomic(tmp / "manifest.json", json.dumps(manifest, indent=1))
    try:
        os.rename(tmp, final)  # atomic: the cache appears whole or not at all
    except OSError:  # another process finished the same cache first: the same contents
        if not (final / "manifest.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


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


def _write_atomic(path: pathlib.Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def _records(src: sources.Source, labels, max_examples: int) -> Iterator[tuple]:
    records = sources.iter_records(src, labels)
    return itertools.islice(records, max_examples) if max_examples else records


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


# ----------------------------------------------------------------------------- parts, in parallel

PART_BYTES = 32 << 20  # a worker's share of a file: read, checked and tokenized alone
# A part's files hold all its records in file order (up to data.max_examples); the split of each
# is only known once every part is counted, so the join routes documents to their splits.
PART_LAYOUT = 2
ROUTE_TOKENS = 1 << 22  # tokens the join routes at a time (a part's are not all held at once)
_WORKER: dict = {}


class _Runner:
    """`run(fn, tasks)` -> [fn(task) ...] in order: in `workers` spawned processes, or here (0)."""

    def __init__(self, workers: int, cfg: Config, workdir):
        self.workers, self.cfg, self.workdir, self.pool = workers, cfg, workdir, None

    def __enter__(self):
        if self.workers:
            # spawn: this process runs JAX's threads, which a fork would copy in an unknown state.
            ctx = multiprocessing.get_context("spawn")
            self.pool = ctx.Pool(self.workers, _init_worker, (self.cfg, self.workdir))
        else:
            _init_worker(self.cfg, self.workdir)
        return self

    def __call__(self, fn, tasks: list) -> list:
        return self.pool.map(fn, tasks, chunksize=1) if self.pool else [fn(t) for t in tasks]

    def each(self, fn, tasks: list) -> Iterator:
        """Results in order as they come (the next parts are worked on meanwhile)."""
        return self.pool.imap(fn, tasks, chunksize=1) if self.pool else (fn(t) for t in tasks)

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def _init_worker(cfg: Config, workdir) -> None:
    _WORKER.clear()
    _WORKER.update(cfg=cfg, workdir=workdir)


def _tokenizer():
    """The worker's tokenizer, loaded once (it may be trained after the worker started)."""
    if "tok" not in _WORKER:
        _WORKER["tok"] = load_tokenizer(_WORKER["cfg"], _WORKER["workdir"] or ".")
    return _WORKER["tok"]


def _plan(src: sources.Source, run: _Runner) -> list[sources.Part]:
    """The files cut into parts, each with the number of its first line."""
    plan = sources.parts(src, PART_BYTES)
    lines = run(sources.count_lines, [p for p in plan])
    out, before = [], {}
    for part, n in zip(plan, lines, strict=True):
        out.append(dataclasses.replace(part, first_line=before.get(part.path, 0) + 1))
        before[part.path] = before.get(part.path, 0) + n
    return out


def _part_labels(task) -> set:
    src, part = task
    return {r[-1] for r in sources.iter_records(src, part=part)}


def _count_part(task) -> int:
    src, labels, part = task
    return sum(1 for _ in sources.iter_records(src, labels, part=part))


def _limits(counts: list[int], max_examples: int) -> list[int]:
    """Records taken from each part: all, up to data.max_examples in all (0: no cap)."""
    if not max_examples:
        return list(counts)
    left, out = max_examples, []
    for n in counts:
        out.append(min(n, left))
        left -= out[-1]
    return out


def encode_flat(tok, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids of all `texts` one after the other [total] int32, the length of each [N] int64),
    in one call where the tokenizer has a batch form (bytes: straight from the UTF-8 encoding).

    Args:
        tok (object): the tokenizer.
        texts: the documents.

    Returns:
        (tokens [total] int32, lengths [N] int64).
    """
    if isinstance(tok, ByteTokenizer):
        data = [t.encode("utf-8") for t in texts]
        flat = np.frombuffer(b"".join(data), np.uint8).astype(np.int32) + tok.offset
        return flat, np.fromiter(map(len, data), np.int64, len(data))
    if hasattr(tok, "sp"):
        ids = tok.sp.encode(texts)
    elif hasattr(tok, "tokenizer"):
        ids = [e.ids for e in tok.tokenizer.encode_batch(texts, add_special_tokens=False)]
    else:
        ids = [tok.encode(t) for t in texts]
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    return np.fromiter(itertools.chain.from_iterable(ids), np.int32, int(lengths.sum())), lengths


def add_special(flat: np.ndarray, lengths: np.ndarray, token: int, at_end: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each document with `token` appended (EOS) or prepended (BOS).

    Args:
        flat: [total] the documents' tokens one after the other.
        lengths: [N] their lengths.
        token: the id to add.
        at_end: append (True) or prepend (False).

    Returns:
        (tokens [total + N], lengths + 1).
    """
    lengths = lengths + 1
    ends = np.cumsum(lengths)
    where = ends - 1 if at_end else ends - lengths
    out = np.empty(int(ends[-1]) if len(ends) else 0, np.int32)
    special = np.zeros(len(out), bool)
    special[where] = True
    out[where], out[~special] = token, flat
    return out, lengths


def _encode_chunk(fields: list[list[str]]) -> list[tuple[np.ndarray, np.ndarray, tuple | None]]:
    """Per field: (tokens of the chunk's documents, their lengths, (index, length) of the first one cut)."""
    tok, objective = _WORKER["tok"], _WORKER["objective"]
    out = []
    for j, (texts, width) in enumerate(zip(fields, widths_of(_WORKER["cfg"]), strict=True)):
        flat, lengths = encode_flat(tok, texts)
        if objective == "classify":
            flat, lengths = add_special(flat, lengths, tok.bos_id, at_end=False)
        elif not (completions(_WORKER["cfg"]) and j == 0):  # a prompt has no EOS: its response follows
            flat, lengths = add_special(flat, lengths, tok.eos_id, at_end=True)
        L = width[0] if width else 0
        too_long = np.flatnonzero(lengths > L) if width else np.zeros(0, np.int64)
        first = (int(too_long[0]), int(lengths[too_long[0]])) if len(too_long) else None
        if first:  # cut to L tokens (data.too_long=reject fails on it in the parent, which knows the line)
            position = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            flat, lengths = flat[position < L], np.minimum(lengths, L)
        out.append((flat, lengths, first))
    return out


def _encode_part(task) -> dict:
    """Read, check and tokenize the records of one part, in file order, into `out/p{index}.{field}.bin`
    (+ `.len.npy`, and `p{index}.label.npy` for classification): the first `cap` records (None: all);
    the rest are read and checked only. Returns the records tokenized and read, and for labels
    found in the data (`labels` None) the part's own label names, which its label indices index."""
    index, src, labels, part, cap, out, dtype = task
    if (out / f"p{index}.json").is_file():  # finished by a build that was killed later
        return json.loads((out / f"p{index}.json").read_text())
    cfg = _WORKER["cfg"]
    tok, objective, names = _tokenizer(), cfg.train.objective, fields_of(cfg)
    _WORKER.update(tok=tok, objective=objective)
    records = sources.iter_records(src, labels, part=part)
    bins = {f: open(out / f"p{index}.{f}.bin", "wb") for f in names}  # noqa: SIM115
    lengths = {f: [np.zeros(0, np.int64)] for f in names}
    classes: list = []
    found: dict[str, int] = {}  # labels found in this part -> their index here
    done = read = 0
    try:
        while chunk := list(itertools.islice(records, CHUNK)):
            read += len(chunk)
            chunk = chunk if cap is None else chunk[: max(cap - done, 0)]  # past the cap: only checked
            if not chunk:
                continue
            encoded = _encode_chunk([[r[1 + j] for r in chunk] for j in range(len(names))])
            for j, (tokens, lens, cut) in enumerate(encoded):
                if cut and cfg.data.too_long == "reject":
                    width, setting = widths_of(cfg)[j]
                    raise DataError(
                        f"{chunk[cut[0]][0]}: sequence of {cut[1]} tokens exceeds {setting}={width} "
                        "(data.too_long=reject)"
                    )
                bins[names[j]].write(tokens.astype(dtype).tobytes())
                lengths[names[j]].append(lens)
            if completions(cfg) and cfg.data.too_long == "reject":  # prompt + response fill one window
                total = encoded[0][1] + encoded[1][1]
                if (total > cfg.data.max_len + 1).any():
                    i = int(np.argmax(total > cfg.data.max_len + 1))
                    raise DataError(f"{chunk[i][0]}: prompt and response of {total[i]} tokens exceed "
                                    f"data.max_len={cfg.data.max_len} + 1 (data.too_long=reject)")  # fmt: skip
            if objective == "classify":
                classes += [r[-1] if labels is not None else found.setdefault(r[-1], len(found)) for r in chunk]
            done += len(chunk)
    finally:
        for f in bins.values():
            f.close()
    for name, parts in lengths.items():
        np.save(out / f"p{index}.{name}.len.npy", np.concatenate(parts))
    if objective == "classify":
        np.save(out / f"p{index}.label.npy", np.asarray(classes, np.int32))
    result = {"records": done, "read": read, "labels": list(found)}
    _write_atomic(out / f"p{index}.json", json.dumps(result))  # last: the part is whole
    return result


def _route(path: pathlib.Path, lengths: np.ndarray, split_of: np.ndarray, dtype, files: list) -> None:
    """Append the first len(lengths) documents of a part's token file to the files of their splits
    (split_of: [N] 0 train, 1 validation, 2 test), in order, ROUTE_TOKENS at a time."""
    ends, size = np.cumsum(lengths), np.dtype(dtype).itemsize
    doc = 0
    while doc < len(lengths):
        start = int(ends[doc] - lengths[doc])
        stop = max(doc + 1, int(np.searchsorted(ends, start + ROUTE_TOKENS, side="right")))
        block = np.fromfile(path, dtype, count=int(ends[stop - 1]) - start, offset=start * size)
        where = np.repeat(split_of[doc:stop], lengths[doc:stop])
        for s, f in enumerate(files):
            f.write(block[where == s].tobytes())
        doc = stop


def _build(cfg: Config, workdir, src, plan, out: pathlib.Path, run, progress) -> dict:
    """Tokenize the parts (one pass over the records), then split and join them in the corpus'
    order; returns the manifest's counts, labels and samples."""
    from tqdm.auto import tqdm

    d, objective = cfg.data, cfg.train.objective
    tok = load_tokenizer(cfg, workdir or ".")
    check_vocab(cfg, tok, src)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.int32
    names = fields_of(cfg)
    given = src.labels if objective == "classify" and src.labels else None  # else found in the data
    tasks = [(i, src, given, part, d.max_examples or None, out, dtype) for i, part in enumerate(plan)]
    sizes = [(part.stop or pathlib.Path(part.path).stat().st_size) - part.start for part in plan]
    # Shown after a second: bad data found at once (records are checked as they are tokenized)
    # says only its error; a bar shown before the error is taken away again.
    bar = tqdm(
        total=sum(sizes), unit="B", unit_scale=True, desc="tokenizing", disable=not progress, mininterval=1.0, delay=1
    )
    results = []
    try:
        for result, size in zip(run.each(_encode_part, tasks), sizes, strict=True):
            results.append(result)
            bar.update(size)
    except BaseException:
        bar.leave = False
        raise
    finally:
        bar.close()
    labels = given
    if objective == "classify" and given is None:
        labels = tuple(sorted(set().union(*(r["labels"] for r in results))))
    limits = _limits([r["read"] for r in results], d.max_examples)
    assign = _split_of(sum(limits), d, src, labels)
    starts = np.cumsum([0, *limits])
    bins = {(s, f): open(out / f"{s}.{f}.bin", "wb") for s in SPLITS for f in names}  # noqa: SIM115
    lengths = {key: [np.zeros(1, np.int64)] for key in bins}
    label_parts = {s: [np.zeros(0, np.int32)] for s in SPLITS}
    try:
        for i, (result, n) in enumerate(zip(results, limits, strict=True)):  # in order of the parts: the corpus'
            split_of = assign[starts[i] : starts[i + 1]]
            (out / f"p{i}.json").unlink()  # first: a part whose files are gone is never taken as finished
            for name in names:
                lens = np.load(out / f"p{i}.{name}.len.npy")[:n]
                _route(out / f"p{i}.{name}.bin", lens, split_of, dtype, [bins[s, name] for s in SPLITS])
                for s, split in enumerate(SPLITS):
                    lengths[split, name].append(lens[split_of == s])
                (out / f"p{i}.{name}.bin").unlink()
                (out / f"p{i}.{name}.len.npy").unlink()
            if objective == "classify":
                classes = np.load(out / f"p{i}.label.npy")[:n]
                if given is None:  # the part's own label indices -> indices into the sorted label set
                    classes = np.asarray([labels.index(x) for x in result["labels"]], np.int32)[classes]
                for s, split in enumerate(SPLITS):
                    label_parts[split].append(classes[split_of == s])
                (out / f"p{i}.label.npy").unlink()
    finally:
        for f in bins.values():
            f.close()
    counts = {}
    for (split, name), parts in lengths.items():
        offsets = np.cumsum(np.concatenate(parts))
        np.save(out / f"{split}.{name}.offsets.npy", offsets)
        counts[split] = len(offsets) - 1
    if objective == "classify":
        for split in SPLITS:
            np.save(out / f"{split}.label.npy", np.concatenate(label_parts[split]))
    samples = _samples(src, labels, plan, starts, assign, max(cfg.train.num_samples, 1), run)
    if objective == "seq2seq" or completions(cfg):
        shown = [(r[1], r[2]) for r in samples]
    elif objective == "classify":
        shown = [(r[1], labels[r[2]]) for r in samples]
    else:
        shown = [(r[1][:80], r[1][80:200]) for r in samples]
    return {
        "dtype": np.dtype(dtype).name, "documents": counts, "labels": list(labels or ()),
        "sample_sources": [a for a, _ in shown], "sample_references": [b for _, b in shown],
    }  # fmt: skip


def _samples(src, labels, plan, starts, assign, k: int, run) -> list[tuple]:
    """The first k test records, read again (by the workers): the first records of a part or two."""
    wanted = np.flatnonzero(assign == 2)[:k]
    part_of = np.searchsorted(starts, wanted, side="right") - 1
    tasks = [(src, labels, plan[i], (wanted[part_of == i] - starts[i]).tolist()) for i in np.unique(part_of)]
    return [r for records in run(_read_records, tasks) for r in records]


def _read_records(task) -> list[tuple]:
    """The records at `indices` (ascending) of a part."""
    src, labels, part, indices = task
    records = list(itertools.islice(sources.iter_records(src, labels, part=part), indices[-1] + 1))
    return [records[j] for j in indices]
