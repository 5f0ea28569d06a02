"""Token ids at the boundary: converted once (`as_token_ids`), checked against the vocabulary on the
host (`check_batch_ids`) or inside a program (`check_token_ids`, a host callback whose error
`checked` gives back as ours). JAX's gather would clamp an id outside [0, V) silently.

`Embed` (`jaxformer.layers`) calls `check_token_ids`; `layers.without_id_checks` turns it off.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.config import ModelConfig

Array = jax.Array


def _raise_if_out_of_range(ids, vocab_size: int, name: str = "") -> None:
    ids = np.asarray(ids)
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        where = tuple(int(i[0]) for i in np.nonzero(bad)) if ids.ndim else ()
        at = "" if ids.ndim == 0 else f"at index {where[0] if ids.ndim == 1 else where} "
        raise ValueError(f"{name}token id {int(ids[where])} {at}is outside the vocabulary [0, {vocab_size})")


RANKS = {0: "one id", 1: "[T]", 2: "[B, T]"}


def _ints_of_python(ids, name: str, vocab_size: int | None) -> np.ndarray:
    """Nested lists of Python (or NumPy) ints -> an integer array; anything else named, never rounded:
    NumPy would turn [3.0] into floats (truncated later), [True, 3] into [1, 3], a ragged list into an
    error about "inhomogeneous" shapes or an array of lists, and an int past int64 into objects."""
    items = np.asarray(ids, dtype=object)
    for x in items.reshape(-1):
        if isinstance(x, (list, tuple, np.ndarray, jax.Array)):
            raise ValueError(f"{name}: rows of different lengths; pad them to one length")
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            got = "None" if x is None else type(x).__name__
            raise TypeError(f"{name}: token ids must be integers, got {got} ({x!r})")
    if items.size == 0:
        return np.zeros(items.shape, np.int32)
    big = [int(x) for x in items.reshape(-1) if not -(2**63) <= x < 2**63]
    if big:
        valid = "(past int64)" if vocab_size is None else f"[0, {vocab_size})"
        raise ValueError(f"{name}: token id {big[0]} is outside the vocabulary {valid}")
    return items.astype(np.int64)


def as_token_ids(ids, name: str = "ids", *, vocab_size: int | None = None, rank: int = 2) -> Array:
    """`ids` (nested lists, NumPy or JAX arrays) as an integer array of `rank` ([B, T]; 1: [T]; 0: one id).

    The one conversion of token ids at the public boundary: a TypeError for floats, bools, text or None
    (nothing is rounded or wrapped), a ValueError for another rank, ragged rows or no ids at all, and,
    with `vocab_size`, for an id outside [0, vocab_size) on concrete values. Each names `name`.

    Args:
        ids (ArrayLike): token ids: nested lists, a NumPy or a JAX array.
        name: what the error messages call them.
        vocab_size: V; given, ids outside [0, V) are refused (on concrete values).
        rank: 2 ([B, T]), 1 ([T]) or 0 (one id).

    Returns:
        An int32 array of that rank.

    Raises:
        TypeError: floats, bools, text or None.
        ValueError: another rank, ragged rows, no ids, or an id outside [0, vocab_size).
    """
    if isinstance(ids, (jax.Array, np.ndarray, np.generic)):
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name}: token ids must be integers, got {ids.dtype}")
    else:
        ids = _ints_of_python(ids, name, vocab_size)
    if ids.ndim != rank:
        raise ValueError(f"{name}: token ids are {RANKS[rank]}, got shape {tuple(ids.shape)}")
    if rank and ids.size == 0:
        raise ValueError(f"{name} is empty (shape {tuple(ids.shape)})")
    if vocab_size is not None and not isinstance(ids, jax.core.Tracer):
        _raise_if_out_of_range(ids, vocab_size, name=f"{name}: ")
    return ids


def check_batch_ids(batch: dict, cfg: ModelConfig) -> dict:
    """The host batch, once no token array (`src`, `inputs`, `targets`) holds an id outside [0, V);
    otherwise a ValueError naming the key. Nothing is checked with `cfg.check_token_ids` off.
    Training checks every batch here, so its jitted steps need no callback.

    Args:
        batch: the host batch: "src", "inputs", "targets" [B, T] and others.
        cfg: the model's config (V, check_token_ids).

    Returns:
        `batch`, unchanged.

    Raises:
        ValueError: a token id outside [0, V), naming the key.
    """
    if cfg.check_token_ids:
        for key in ("src", "inputs", "targets"):
            if key in batch:
                _raise_if_out_of_range(batch[key], cfg.vocab_size, name=f"batch[{key!r}]: ")
    return batch


def check_token_ids(ids: Array, vocab_size: int) -> None:
    """Reject ids outside [0, V): JAX's gather would silently clamp them.

    Free on concrete arrays. Under a trace it is a host callback (a device-to-host copy of the
    ids each call) that stops the program; JAX then raises a `JaxRuntimeError` whose first line is
    its own ("INTERNAL: CpuCallback error ...") and whose last is ours: wrap the jitted function in
    `checked` to get our ValueError instead. Off with `ModelConfig.check_token_ids=False` (or
    `without_id_checks`) once ids are validated on the host: no callback, no check in the program.

    Args:
        ids: token ids, any shape.
        vocab_size: V.

    Raises:
        ValueError: an id outside [0, V), on concrete values (see above under a trace).
    """
    if isinstance(ids, jax.core.Tracer):
        jax.debug.callback(functools.partial(_raise_kept, vocab_size=vocab_size), ids)
    else:
        _raise_if_out_of_range(ids, vocab_size)


_raised: list[ValueError] = []  # the id error the last in-program check raised, for `checked`


class _SaidByTheError(logging.Filter):
    """JAX logs a failed callback, traceback and all, before raising its own error, which (or
    `checked`'s ValueError) already carries the id check's message: the reader gets it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not any(error is e for e in _raised)


logging.getLogger("jax._src.debugging").addFilter(_SaidByTheError())


def _raise_kept(ids, vocab_size: int) -> None:
    try:
        _raise_if_out_of_range(ids, vocab_size)
    except ValueError as e:
        _raised[:] = [e]
        raise


def checked(fn: Callable) -> Callable:
    """`fn` (say `jax.jit(loss)`, with transforms inside) that raises the ValueError naming the bad
    token id and the range [0, V) when an `Embed` check fails inside it, instead of JAX's wrapping.

    It waits for the results (`jax.block_until_ready`), as an error can only be read once the
    program ran. Why a wrapper: inside `jit` a value cannot raise by itself. A host callback stops
    the program but JAX words the error; `checkify.check` fails to lower outside `checkify` (and
    `debug_check` is a no-op there: silent clamping); jax 0.10.2 has `error_check` only privately
    and it stays silent until `raise_if_error()` is called. This keeps the callback that stops the
    program and gives its error back as ours, under jit, grad, vmap and scan alike.

    Args:
        fn: any function, usually jitted.

    Returns:
        A function with fn's signature and results, ready (`jax.block_until_ready`).

    Raises:
        ValueError: an `Embed` got a token id outside [0, V) inside `fn`.
    """

    @functools.wraps(fn)
    def run(*args, **kwargs):
        _raised.clear()
        try:
            return jax.block_until_ready(fn(*args, **kwargs))
        except jax.errors.JaxRuntimeError:
            if not _raised:
                raise
            error = _raised.pop()
        raise error.with_traceback(None) from None  # the whole story is in its one line

    return run
