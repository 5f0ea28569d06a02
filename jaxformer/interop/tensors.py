"""A checkpoint's tensors, read one at a time from `model.safetensors` or from the shards its index
lists (`SafetensorsReader`), and a safetensors file opened with its damage named (`_open`).

Named `tensors`, not `safetensors`, so that no import of the safetensors package can find this file.
"""

from __future__ import annotations

import contextlib
import json
import pathlib

import numpy as np

from jaxformer.interop.rules import UnsupportedCheckpoint

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class SafetensorsReader:
    """The tensors of a directory's `model.safetensors` or of the shards its index lists, each read
    on demand (never the whole checkpoint in memory).

    A shard is memory-mapped only while one of its tensors is copied out: the pages of a mapping
    that stays open count in the process's resident memory until it closes, so shards kept open
    for the whole load would hold every byte read so far (the whole checkpoint by the end).

    Args:
        directory: the directory with model.safetensors or model.safetensors.index.json.

    Raises:
        FileNotFoundError: neither file, or a shard the index lists, exists.
        UnsupportedCheckpoint: the index lists tensors its shards lack.
    """

    def __init__(self, directory: str | pathlib.Path):
        directory = pathlib.Path(directory)
        if (directory / INDEX).is_file():
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (directory / WEIGHTS).is_file():
            files, weight_map = [WEIGHTS], None
        else:
            raise FileNotFoundError(f"{directory} holds neither {WEIGHTS} nor {INDEX}")
        self.where = {}  # tensor name -> its shard's path
        for name in files:
            if not (directory / name).is_file():
                raise FileNotFoundError(f"{directory / name}, listed in {INDEX}, does not exist")
            with _open(directory / name) as shard:
                self.where |= dict.fromkeys(shard.keys(), directory / name)
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.where))
            if missing:
                raise UnsupportedCheckpoint(f"{INDEX} lists tensors its shards lack: {missing[:5]}")

    def names(self) -> list[str]:
        """The tensors' names, sorted.

        Returns:
            The names.
        """
        return sorted(self.where)

    def __getitem__(self, name: str) -> np.ndarray:
        with _open(self.where[name]) as shard:
            return shard.get_tensor(name)  # a copy: valid once the mapping is closed


@contextlib.contextmanager
def _open(path: pathlib.Path):
    """A safetensors file, memory-mapped; a damaged or truncated one is an UnsupportedCheckpoint
    naming it (safetensors' own error names neither the file nor the tensor)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="numpy") as shard:
            yield shard
    except SafetensorError as e:
        raise UnsupportedCheckpoint(f"{path}: not a readable safetensors file ({e}); download it again") from None
