"""Building a prepared cache: the files cut into parts, each read, checked and tokenized once (in
worker processes for large corpora) into its own files with a marker written last, then the records
split and each part's documents routed to their split's files, in a temporary directory renamed
into place once complete (see `prepare.py` for the layout and the cache's key).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import multiprocessing
import os
import pathlib
import shutil
import socket
from collections.abc import Iterator

import numpy as np

from jaxformer.config import Config
from jaxformer.data import sources
from jaxformer.data.cache import _alive
from jaxformer.data.layout import SPLITS, _split_of, check_vocab, completions, fields_of, widths_of
from jaxformer.data.sources import DataError
from jaxformer.data.tokenizers import ByteTokenizer, load_tokenizer

CHUNK = 2048  # documents a worker tokenizes at a time


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


def _write_atomic(path: pathlib.Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


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
