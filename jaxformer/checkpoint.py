"""Saving and restoring parameters with orbax-checkpoint.

For now: the final parameters of a run, in `WORKDIR/params` (atomic: orbax writes to a
temporary directory and renames it when complete).
"""

from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp


def save_params(workdir: pathlib.Path, params) -> pathlib.Path:
    path = (workdir / "params").absolute()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, params, force=True)
    return path


def restore_params(workdir: pathlib.Path, like):
    """Restore into the structure, shapes and shardings of `like` (e.g. a fresh model's params)."""
    path = (workdir / "params").absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no saved parameters (train first)")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path, abstract)
