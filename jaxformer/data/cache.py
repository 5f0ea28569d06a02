"""A prepared corpus on disk, and which caches are in use.

`Prepared` opens a cache directory (`prepare.py` writes it) and `TokenFile` reads its token arrays.
A workdir's record (`ROOT/workdirs/<hash of the workdir>.json`) names the cache its training uses
and the ones it replaced: `use` opens a cache and removes the caches a record replaced once no
other existing workdir's record names them; `clean` removes what no run needs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import socket

import numpy as np


class TokenFile:
    """A prepared token array on disk, read by `os.pread` (positionless: safe from many threads).

    Not memory-mapped: pages of a mapping that batches touch count in the process' resident
    memory, so a long run over a large corpus would look as if it held the corpus; reads leave
    them in the kernel's page cache only.

    Args:
        path: the `.bin` file.
        dtype (np.dtype): its tokens' dtype.
    """

    def __init__(self, path: pathlib.Path, dtype: np.dtype):
        self.path, self.dtype = path, np.dtype(dtype)
        self.size = path.stat().st_size // self.dtype.itemsize
        self.fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.size

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens start..stop-1 as int32.

        Args:
            start: the first token.
            stop: the token after the last.

        Returns:
            [stop - start] int32.
        """
        n = self.dtype.itemsize
        data = os.pread(self.fd, (int(stop) - int(start)) * n, int(start) * n)
        return np.frombuffer(data, self.dtype).astype(np.int32)

    def __getitem__(self, index):  # a slice, or an array of positions (tests, small reads)
        if isinstance(index, slice):
            return self.read(index.start or 0, self.size if index.stop is None else index.stop)
        index = np.asarray(index)
        return np.stack([self.read(i, i + 1)[0] for i in index.ravel()]).reshape(index.shape) if index.size else index

    def __array__(self, dtype=None, copy=None):
        return self.read(0, self.size) if dtype is None else self.read(0, self.size).astype(dtype)

    def rows(self, starts: np.ndarray, width: int) -> np.ndarray:
        """[len(starts), width]: tokens start..start+width-1 of each start.

        Args:
            starts: the first token of each row.
            width: the tokens per row.

        Returns:
            [len(starts), width] int32.
        """
        return np.stack([self.read(a, a + width) for a in starts]) if len(starts) else np.zeros((0, width), np.int32)


@dataclasses.dataclass
class Prepared:
    """A prepared corpus, memory-mapped: the documents of each split and field, and the labels.

    Attributes:
        directory: the cache directory.
        manifest: its manifest.json (dtype, labels, counts, samples).
    """

    directory: pathlib.Path
    manifest: dict

    def documents(self, split: str, field: str) -> tuple[TokenFile, np.ndarray]:
        """(tokens [total], offsets [N + 1]) of one split's field: nothing is read yet.

        Args:
            split: "train", "validation" or "test".
            field: a stored field (`fields_of`).

        Returns:
            (tokens, offsets): document i is tokens[offsets[i]:offsets[i + 1]].
        """
        tokens = TokenFile(self.directory / f"{split}.{field}.bin", np.dtype(self.manifest["dtype"]))
        return tokens, np.load(self.directory / f"{split}.{field}.offsets.npy", mmap_mode="r")

    def labels(self, split: str) -> np.ndarray:
        """The label index of each document of a split (classification).

        Args:
            split: "train", "validation" or "test".

        Returns:
            [N] label indices, memory-mapped.
        """
        return np.load(self.directory / f"{split}.label.npy", mmap_mode="r")

    @property
    def label_names(self) -> tuple[str, ...]:
        """The label set, in index order."""
        return tuple(self.manifest["labels"])

    def samples(self) -> tuple[list[str], list]:
        """The first test records' texts, for printing beside a model's outputs.

        Returns:
            (sources, references).
        """
        return self.manifest["sample_sources"], self.manifest["sample_references"]


def _open(directory: pathlib.Path) -> Prepared:
    return Prepared(directory, json.loads((directory / "manifest.json").read_text()))


# ----------------------------------------------------------------------------- which caches are in use

RECORDS = "workdirs"  # ROOT/workdirs/<hash of the workdir>.json: the cache a workdir's training uses


@dataclasses.dataclass
class _Record:
    """What a workdir's record held before it was rewritten (to restore it if the build fails)."""

    path: pathlib.Path
    before: str | None

    def restore(self) -> None:
        if self.before is None:
            self.path.unlink(missing_ok=True)
        else:
            _write_shared(self.path, self.before)


def _record_path(root: pathlib.Path, workdir) -> pathlib.Path:
    where = str(pathlib.Path(workdir).resolve())
    return root / RECORDS / f"{hashlib.sha256(where.encode()).hexdigest()[:20]}.json"


def _read_record(path: pathlib.Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):  # none, or damaged: as if none
        return {}
    return record if isinstance(record, dict) else {}


def _record(root: pathlib.Path, workdir, key: str) -> _Record | None:
    """Record `key` as `workdir`'s cache; the caches it used before stay listed as `replaces` (and
    so kept) until `use` removes them. Returns what to restore, or None if nothing changed."""
    path = _record_path(root, workdir)
    before = path.read_text() if path.is_file() else None
    record = _read_record(path)
    if record.get("key") == key:
        return None
    replaces = [k for k in [*record.get("replaces", []), record.get("key")] if k and k != key]
    pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)  # the record counts while its workdir exists
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_shared(path, json.dumps({"workdir": str(pathlib.Path(workdir).resolve()), "key": key, "replaces": replaces}))
    return _Record(path, before)


def in_use(root: pathlib.Path, but=None) -> set[str]:
    """The caches the records of existing workdirs (all but `but`'s) name, as in use or replaced.

    Args:
        root: the cache root.
        but (str | pathlib.Path | None): a workdir whose record is left out, or None.

    Returns:
        The caches' keys.
    """
    out = set()
    mine = _record_path(root, but) if but is not None else None
    for path in (root / RECORDS).glob("*.json"):
        record = _read_record(path)
        if path != mine and record and pathlib.Path(record.get("workdir", "")).is_dir():
            out |= {record.get("key"), *record.get("replaces", [])}
    return out - {None}


def use(root: pathlib.Path, key: str, workdir=None) -> Prepared:
    """Open the cache `key`. For a workdir: record it as the workdir's, and remove the caches its
    record names as replaced, unless another existing workdir's record names them. A run that has
    a removed cache open goes on reading it (its open files outlive their names).

    Args:
        root: the cache root.
        key: the cache's key (its directory's name).
        workdir (str | pathlib.Path | None): the workdir that owns it, or None (a reader).

    Returns:
        The prepared corpus.
    """
    if workdir is None:
        return _open(root / key)
    _record(root, workdir, key)  # first: from now on no other workdir's run removes it
    prepared = _open(root / key)
    path = _record_path(root, workdir)
    record = _read_record(path)
    if record.get("replaces"):
        others = in_use(root, but=workdir)
        for old in record["replaces"]:
            if old not in others:
                _remove(root / old)
        _write_shared(path, json.dumps({"workdir": record["workdir"], "key": key, "replaces": []}))
    return prepared


def _remove(cache: pathlib.Path) -> bool:
    """Take a complete cache away whole: renamed first (a reader finds all of it or none), then deleted."""
    if not (cache / "manifest.json").is_file():
        return False
    doomed = cache.with_name(f"{cache.name}.deleting-{socket.gethostname()}-{os.getpid()}")
    try:
        os.rename(cache, doomed)
    except OSError:  # another process took it first
        return False
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def clean(root: pathlib.Path) -> list[tuple[pathlib.Path, int]]:
    """Remove what no run needs under a cache root: complete caches no existing workdir's record
    names (as in use or being replaced), builds and removals killed on this host, and the records
    of workdirs that no longer exist. Builds in progress, and anything of another host's running
    processes, are left alone.

    Args:
        root: the cache root.

    Returns:
        (directory, size in bytes) of each one removed.
    """
    if not root.is_dir():
        return []
    for path in (root / RECORDS).glob("*.json"):
        if not pathlib.Path(_read_record(path).get("workdir", "")).is_dir():
            path.unlink(missing_ok=True)
    keep, host, removed = in_use(root), socket.gethostname(), []
    size = lambda entry: sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
    for entry in sorted(root.iterdir()):
        name = entry.name
        if "." not in name and name != RECORDS and name not in keep and entry.is_dir():
            bytes_ = size(entry)
            if _remove(entry):
                removed.append((entry, bytes_))
            continue
        for what in (".tmp-", ".deleting-"):  # <key><what><host>-<pid>
            by, _, pid = (name.split(what, 1)[1] if what in name else "").rpartition("-")
            if by == host and pid.isdigit() and not _alive(int(pid)):
                removed.append((entry, size(entry)))
                shutil.rmtree(entry, ignore_errors=True)
    return removed


def _write_shared(path: pathlib.Path, text: str) -> None:
    """Write atomically a file other processes may write at the same time (a name of its own to write to)."""
    part = path.with_name(f"{path.name}.part-{socket.gethostname()}-{os.getpid()}")
    part.write_text(text)
    os.replace(part, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
