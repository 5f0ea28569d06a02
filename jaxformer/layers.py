"""Flax NNX layers of the Transformer. Each holds its parameters and calls `functional`.

Parameters are float32 and carry logical axis names (`vocab`, `embed`, `heads`, `kv`,
`mlp`, `layers`) in their `out_sharding` metadata; `jaxformer.sharding` maps them to a
mesh. Computation runs in `ModelConfig.dtype`. Dropout is driven by an explicit
`dropout_rng` argument (None = deterministic), so a model's state is its parameters only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxformer import functional as F
from jaxformer import moe as M
from jaxformer import quant, ring
from jaxformer.config import ModelConfig
from jaxformer.sharding import activation_spec, constrain, context_ways, param

Array = jax.Array
init = nnx.initializers
CACHE = ("batch", "heads", "length", None)  # a KV cache [B, G, S, K] split by position on the context axis


@jax.custom_vjp
def materialized_grad(x: Array) -> Array:
    """Identity whose gradient XLA:CPU computes once into a buffer of its own.

    XLA:CPU fuses elementwise gradient chains into their consumers, among them the transposed
    copies feeding weight gradients, which then recompute the chain while reading its inputs in
    transposed order: in a pre-norm stack the residual stream's gradient (a sum over every later
    sublayer, ~10% of a small decoder's step), and the FFN activation's backward when no bias
    gradient materialises it (~17%). An optimization barrier does not survive to the fusion pass,
    but no fusion crosses a conditional: the gradient passes through one whose two branches are
    the identity. Other backends get the gradient unchanged.

    Args:
        x: any array.

    Returns:
        `x` unchanged.
    """
    return x


def _materialized_grad_bwd(_, g):
    through_cond = lambda g: jax.lax.cond(jnp.isfinite(g.reshape(-1)[0]), lambda g: g, lambda g: g * 1.0, g)
    return (jax.lax.platform_dependent(g, cpu=through_cond, default=lambda g: g),)


materialized_grad.defvjp(lambda x: (x, None), _materialized_grad_bwd)


def split_rng(rng: Array | None, n: int) -> list[Array | None]:
    """n independent keys from `rng`, or n Nones when running deterministically.

    Args:
        rng: a PRNG key, or None.
        n: the number of keys.

    Returns:
        A list of n keys (or n Nones).
    """
    return [None] * n if rng is None else list(jax.random.split(rng, n))


def project(module: nnx.Module, name: str, spec: str, x: Array) -> Array:
    """`einsum(spec, x, module.<name>)` in the compute dtype. A kernel stored in int8 beside its
    `<name>_scale` (a LoRA run's frozen base, `lora.quantize_base`) is dequantized here, in the layer
    that reads it: one layer at a time in a scanned stack, and again in the backward (`quant.einsum`).

    Args:
        module: the layer holding the kernel (and its `<name>_scale` when quantized).
        name: the kernel's attribute name ("q", "wo", ...).
        spec: the einsum, in the legend's letters ("BTD,DHK->BTHK").
        x: the input, in the compute dtype.

    Returns:
        The einsum's output, in the compute dtype.
    """
    dt = module.cfg.dtype
    scale = getattr(module, f"{name}_scale", None)
    if scale is None:
        return jnp.einsum(spec, x, getattr(module, name)[...].astype(dt))
    y = quant.einsum(spec, x, getattr(module, name)[...], scale[...], dt)
    return checkpoint_name(y, quant.PROJECTION)  # saved as `dots_saveable` saves a matmul


def adapted(module: nnx.Module, name: str, x: Array, y: Array, dropout_rng: Array | None) -> Array:
    """`y = x @ module.<name>`, plus the update of its LoRA adapter (`jaxformer.lora`) if it has one.

    The adapter's dropout key is folded from the sublayer's with the kernel's name: the masks of
    the layer's own dropout stay what they are without LoRA.

    Args:
        module: the layer holding kernel `name` (and its adapter, if any).
        name: the kernel's attribute name.
        x: the input the kernel was applied to.
        y: x @ the kernel, as computed by the caller.
        dropout_rng: the sublayer's dropout key, or None.

    Returns:
        `y` plus the adapter's update, y's shape.
    """
    adapter = getattr(module, f"{name}_lora", None)
    if adapter is None:
        return y
    rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, zlib.crc32(name.encode()) & 0x7FFFFFFF)
    return y + adapter(x, rng).astype(y.dtype)


# ----------------------------------------------------------------------------- token ids


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


def without_id_checks(model: nnx.Module) -> nnx.Module:
    """`model` with its embeddings' id checks off, for jitted code whose ids were checked on the
    host (training batches) or come from the model itself (generation): no host callback per call.

    Args:
        model: a model (or any module holding `Embed`s).

    Returns:
        The same model, its embeddings' checks off.
    """
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Embed):
            module.cfg = dataclasses.replace(module.cfg, check_token_ids=False)
    return model


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


# ----------------------------------------------------------------------------- embeddings


class Embed(nnx.Module):
    """Token embedding, times sqrt(D) as in the paper; `attend` gives tied output logits.

    Args:
        cfg: the model's config (V, D, scale_embeddings, dtypes).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        # Paper scaling: N(0, 1/D) times sqrt(D) gives unit-variance inputs; GPT/BERT use 0.02.
        std = cfg.d_model**-0.5 if cfg.scale_embeddings else 0.02
        self.embedding = param(rngs, init.normal(std), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))

    def __call__(self, ids_BT: Array) -> Array:
        """Looks up the ids' rows (plus the LoRA adapter's), times sqrt(D) with `scale_embeddings`.

        Args:
            ids_BT: [B, T] token ids in [0, V).

        Returns:
            [B, T, D] embeddings in the compute dtype.

        Raises:
            ValueError: an id outside [0, V) with `check_token_ids` (see `check_token_ids` under jit).
        """
        cfg = self.cfg
        if cfg.check_token_ids:
            check_token_ids(ids_BT, cfg.vocab_size)
        x_BTD = jnp.take(self.embedding[...], ids_BT, axis=0).astype(cfg.dtype)
        if (adapter := getattr(self, "embedding_lora", None)) is not None:  # LoRA (jaxformer.lora): its rows
            x_BTD = x_BTD + adapter.lookup(ids_BT, cfg.dtype)
        x_BTD = constrain(x_BTD, ("batch", "length", None))
        return x_BTD * math.sqrt(cfg.d_model) if cfg.scale_embeddings else x_BTD

    def attend(self, x_BTD: Array) -> Array:
        """Logits against the embedding matrix: [B, T, D] -> [B, T, V] (vocab-parallel under TP).

        Args:
            x_BTD: [B, T, D] hidden states.

        Returns:
            [B, T, V] logits.
        """
        logits_BTV = jnp.einsum("BTD,VD->BTV", x_BTD, self.embedding[...].astype(self.cfg.dtype))
        if (adapter := getattr(self, "embedding_lora", None)) is not None:  # the adapted embedding, transposed
            logits_BTV = logits_BTV + adapter.attend(x_BTD.astype(self.cfg.dtype))
        return constrain(logits_BTV, ("batch", "length", "vocab"))


class PositionalEncoding(nnx.Module):
    """Adds absolute positions: `sinusoidal` (paper), `learned` (position p at table row
    p + `position_offset`); `rope`, `relative` and `none` act inside attention and add nothing.

    Args:
        cfg: the model's config (position, max_len, position_offset, D).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        if cfg.position == "learned":
            rows = cfg.max_len + cfg.position_offset
            self.table = param(rngs, init.normal(0.02), (rows, cfg.d_model), (None, "embed"))

    def __call__(self, x_BTD: Array, positions_BT: Array) -> Array:
        """Adds the encoding of each position (nothing for `rope`, `relative`, `none`).

        Args:
            x_BTD: [B, T, D] embeddings.
            positions_BT: [B, T] each token's position in its sequence (restarting per packed segment).

        Returns:
            [B, T, D] x plus the positions' rows.
        """
        cfg = self.cfg
        if cfg.position == "sinusoidal":
            table_TD = F.sinusoidal_positions(cfg.max_len, cfg.d_model)
        elif cfg.position == "learned":
            table_TD, positions_BT = self.table[...], positions_BT + cfg.position_offset
        else:
            return x_BTD
        return x_BTD + jnp.take(table_TD, positions_BT, axis=0).astype(x_BTD.dtype)


class RelativePositionBias(nnx.Module):
    """T5's attention logits bias: a learned [buckets, H] table read at bucketed key - query distances.

    Args:
        cfg: the model's config (relative_buckets, relative_max_distance, H).
        bidirectional: keys after the query get buckets of their own (an encoder's self-attention).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, bidirectional: bool, rngs: nnx.Rngs):
        self.cfg = cfg
        self.bidirectional = bidirectional
        self.table = param(rngs, init.normal(0.02), (cfg.relative_buckets, cfg.num_heads), (None, "heads"))

    def __call__(self, q_positions_BT: Array, kv_positions_BS: Array) -> Array:
        """The bias of each query-key pair from their distance.

        Args:
            q_positions_BT: [B, T] the queries' positions.
            kv_positions_BS: [B, S] the keys' positions.

        Returns:
            [B, H, T, S] logits bias in float32.
        """
        bias_BHTS = F.relative_position_bias(
            q_positions_BT, kv_positions_BS, self.table[...],
            bidirectional=self.bidirectional, max_distance=self.cfg.relative_max_distance,
        )  # fmt: skip
        return constrain(bias_BHTS, ("batch", "heads", None, None))


# ----------------------------------------------------------------------------- sublayers


class Norm(nnx.Module):
    """LayerNorm or RMSNorm over D, statistics in float32.

    Args:
        cfg: the model's config (norm, norm_eps, D).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.scale = param(rngs, init.ones, (cfg.d_model,), ("embed",))
        if cfg.norm == "layernorm":
            self.bias = param(rngs, init.zeros, (cfg.d_model,), ("embed",))

    def __call__(self, x_BTD: Array) -> Array:
        """Normalises each position over D.

        Args:
            x_BTD: [B, T, D] activations.

        Returns:
            [B, T, D] normalised and scaled (and shifted, for layernorm), in x's dtype.
        """
        if self.cfg.norm == "rmsnorm":
            return F.rms_norm(x_BTD, self.scale[...], self.cfg.norm_eps)
        return F.layer_norm(x_BTD, self.scale[...], self.bias[...], self.cfg.norm_eps)


class MultiHeadAttention(nnx.Module):
    """Multi-head (or grouped-query) attention; self-attention, or cross-attention over memory.

    Projections are einsums over kernels shaped [D, H, K] (queries), [D, G, K] (keys,
    values) and [H, K, D] (output), so heads are a real axis that tensor parallelism shards.

    Args:
        cfg: the model's config (D, H, G, K, position, attention_impl, dropout).
        cross: cross-attention: keys and values from the memory, no positions applied to them.
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, cross: bool = False, rngs: nnx.Rngs):
        self.cfg = cfg
        self.cross = cross
        self.use_rope = cfg.position == "rope" and not cross
        D, H, G, K = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
        in_init = init.xavier_uniform(in_axis=0, out_axis=(1, 2))
        self.q = param(rngs, in_init, (D, H, K), ("embed", "heads", "kv"))
        self.k = param(rngs, in_init, (D, G, K), ("embed", "heads", "kv"))
        self.v = param(rngs, in_init, (D, G, K), ("embed", "heads", "kv"))
        self.o = param(rngs, init.xavier_uniform(in_axis=(0, 1), out_axis=2), (H, K, D), ("heads", "kv", "embed"))
        if cfg.use_bias:
            self.q_bias = param(rngs, init.zeros, (H, K), ("heads", "kv"))
            self.k_bias = param(rngs, init.zeros, (G, K), ("heads", "kv"))
            self.v_bias = param(rngs, init.zeros, (G, K), ("heads", "kv"))
            self.o_bias = param(rngs, init.zeros, (D,), ("embed",))

    def _project(self, x_BTD: Array, name: str, dropout_rng: Array | None = None) -> Array:
        dt = self.cfg.dtype
        y_BTHK = project(self, name, "BTD,DHK->BTHK", x_BTD)
        y_BTHK = adapted(self, name, x_BTD, y_BTHK, dropout_rng)
        if self.cfg.use_bias:
            y_BTHK = y_BTHK + F.lift(getattr(self, f"{name}_bias")[...].astype(dt), y_BTHK)
        return constrain(y_BTHK, ("batch", "length", "heads", None))  # column-parallel under TP

    def project_kv(
        self, kv_BSD: Array, positions_BS: Array | None = None, dropout_rng: Array | None = None
    ) -> tuple[Array, Array]:
        """Keys and values [B, S, G, K] of the inputs attended to (RoPE applied at `positions_BS`).

        Args:
            kv_BSD: [B, S, D] the inputs attended to.
            positions_BS: [B, S] their positions (for RoPE), or None.
            dropout_rng: the adapters' dropout key, or None.

        Returns:
            (k_BSGK, v_BSGK).
        """
        k_BSGK = self._project(kv_BSD, "k", dropout_rng)
        v_BSGK = self._project(kv_BSD, "v", dropout_rng)
        if self.use_rope:
            k_BSGK = F.apply_rope(k_BSGK, positions_BS, self.cfg.rope_base)
        return k_BSGK, v_BSGK

    def __call__(
        self,
        x_BTD: Array,
        memory_BSD: Array | None = None,
        *,
        mask: F.Mask | Array | None = None,
        positions_BT: Array | None = None,
        kv_positions_BS: Array | None = None,
        memory_kv: tuple[Array, Array] | None = None,
        bias: Array | None = None,
        dropout_rng: Array | None = None,
        return_weights: bool = False,
    ) -> Array | tuple[Array, Array]:
        """Attend from x to memory (cross) or to x itself (memory None).

        Args:
            x_BTD: [B, T, D] the queries' inputs.
            memory_BSD: [B, S, D] the inputs attended to (cross-attention), or None for x itself.
            mask: which keys each query sees (`functional.Mask`, or a boolean array broadcastable to
                [B, H, T, S]), or None for all.
            positions_BT: [B, T] the queries' positions (RoPE), or None.
            kv_positions_BS: [B, S] the keys' positions; None: `positions_BT`.
            memory_kv: cross-attention keys and values already projected, heads-major [B, G, S, K]
                (`memory_cache` of the memory), as decoding does once per source; or None.
            bias: [B, H, T, S] added to the logits (T5's relative positions), or None.
            dropout_rng: the dropout key (attention weights, adapters), or None for no dropout.
            return_weights: also return the attention weights (the reference path computes them).

        Returns:
            [B, T, D]; with `return_weights`, ([B, T, D], weights [B, H, T, S]).

        Raises:
            ValueError: under context parallelism, a memory masked other than by its lengths.
        """
        if memory_kv is not None:
            return self._attend(x_BTD, *memory_kv, "BGSK", mask, bias, positions_BT, dropout_rng, return_weights)
        kv_BSD = x_BTD if memory_BSD is None else memory_BSD
        kv_positions_BS = positions_BT if kv_positions_BS is None else kv_positions_BS
        k_BSGK, v_BSGK = self.project_kv(kv_BSD, kv_positions_BS, dropout_rng)
        return self._attend(
            x_BTD, k_BSGK, v_BSGK, "BSGK", mask, bias, positions_BT, dropout_rng, return_weights, kv_positions_BS
        )

    # Decoding caches hold keys and values heads-major, [B, G, S, K]: the attention products read
    # them in place, where [B, S, G, K] would be transposed in full at every step.

    # With a context axis, a cache is split by position: slot s on the device holding block s // (S / n).

    def empty_cache(self, batch: int, length: int) -> dict:
        """A self-attention KV cache of `length` slots: {"k", "v"}: zeros [B, G, length, K].

        Args:
            batch: B.
            length: the slots, S_max.

        Returns:
            {"k", "v"}: zeros [B, G, length, K] in the compute dtype.
        """
        zeros = jnp.zeros((batch, self.cfg.kv_heads, length, self.cfg.dim_per_head), self.cfg.dtype)
        zeros = constrain(zeros, CACHE) if context_ways() > 1 else zeros
        return {"k": zeros, "v": zeros}

    def memory_cache(self, memory_BSD: Array) -> dict:
        """Cross-attention keys and values of the memory, once per source: {"k", "v"}: [B, G, S, K].

        Args:
            memory_BSD: [B, S, D] the encoder's output.

        Returns:
            {"k", "v"}: [B, G, S, K].
        """
        kv = (jnp.swapaxes(a, 1, 2) for a in self.project_kv(memory_BSD))
        return dict(zip("kv", (constrain(a, CACHE) if context_ways() > 1 else a for a in kv), strict=True))

    def extend(
        self, x_BTD: Array, cache: dict, *, mask: F.Mask, positions_BT: Array, bias: Array | None = None
    ) -> tuple[Array, dict]:
        """Self-attention of new positions over a KV cache.

        x holds T new positions per row, starting at `positions_BT[:, 0]` (per row); their
        keys and values are written into `cache` ({"k", "v"}: [B, G, S_max, K]) at those
        slots, and each query attends to the cache under `mask` (`functional.causal_cache_mask`).
        Returns (y [B, T, D], the updated cache).

        Args:
            x_BTD: [B, T, D] the new positions.
            cache: {"k", "v"}: [B, G, S_max, K].
            mask: which cache slots each query sees.
            positions_BT: [B, T] the new positions' indices.
            bias: attention logits bias broadcastable to [B, H, T, S_max], or None.

        Returns:
            (y_BTD, the updated cache).
        """
        start_B = positions_BT[:, 0]
        new = dict(zip("kv", self.project_kv(x_BTD, positions_BT), strict=True))  # [B, T, G, K]
        if context_ways() > 1:  # the cache's slots are split over the mesh's context axis
            return self._extend_context(x_BTD, cache, new, mask, positions_BT)
        cache = {
            name: constrain(F.write_rows(cache[name], jnp.swapaxes(new[name], 1, 2), start_B, axis=2),
                            ("batch", "heads", None, None))
            for name in "kv"
        }  # fmt: skip
        return self._attend(x_BTD, cache["k"], cache["v"], "BGSK", mask, bias, positions_BT, None, False), cache

    def _extend_context(self, x_BTD, cache, new, mask, positions_BT) -> tuple[Array, dict]:
        """`extend` with the cache's slots split over the context axis (`cache_spec`). A prompt the axis
        divides, from position 0 (a prefill), runs as training does: ring (or all-gather) attention
        over its own keys, which then fill the cache's first slots (one reshard). Fewer new positions
        (a decoding step) are on every device: each attends to the slots it holds, the partial softmaxes
        combined by log-sum-exp (`ring.cache_attention`), and the device holding their slots writes them."""
        q_BTHK = self._queries(x_BTD, positions_BT, None)
        T, n = x_BTD.shape[1], context_ways()
        if mask.causal and mask.q_offset is None and T % n == 0 and T > 1:  # a prefill the axis divides
            out_BTHK = self._context_attention(q_BTHK, new["k"], new["v"], mask, None, positions_BT, positions_BT)
            write = lambda c, x: jax.lax.dynamic_update_slice_in_dim(c, jnp.swapaxes(x, 1, 2).astype(c.dtype), 0, 2)
            cache = {name: constrain(write(cache[name], new[name]), CACHE) for name in "kv"}
            return self._out(out_BTHK, None), cache
        out_BTHK, k, v = ring.cache_attention(
            q_BTHK, cache["k"], cache["v"], q_index_BT=positions_BT, causal=True, new_kv=(new["k"], new["v"]),
            scale=None if self.cfg.scale_attention else 1.0, spec_BTHK=activation_spec(("batch", None, "heads", None)),
        )  # fmt: skip
        return self._out(out_BTHK, None), {"k": constrain(k, CACHE), "v": constrain(v, CACHE)}

    def _queries(self, x_BTD: Array, positions_BT: Array, dropout_rng: Array | None) -> Array:
        q_BTHK = self._project(x_BTD, "q", dropout_rng)
        return F.apply_rope(q_BTHK, positions_BT, self.cfg.rope_base) if self.use_rope else q_BTHK

    def _attend(
        self, x_BTD, k, v, kv_layout, mask, bias, positions_BT, dropout_rng, return_weights, kv_positions_BS=None
    ):
        cfg = self.cfg
        q_BTHK = self._queries(x_BTD, positions_BT, dropout_rng)
        if kv_layout == "BSGK" and context_ways() > 1:  # the sequence is split over the mesh's context axis
            return self._out(
                self._context_attention(q_BTHK, k, v, mask, bias, positions_BT, kv_positions_BS), dropout_rng
            )
        if context_ways() > 1:  # decoding's cross-attention: the source's keys and values split by position
            if bias is not None or not isinstance(mask, F.Mask) or mask.causal or mask.kv_segments is not None:
                raise ValueError("context parallelism decodes over a memory masked by its lengths only")
            out_BTHK, _, _ = ring.cache_attention(
                q_BTHK, k, v, q_index_BT=positions_BT, causal=False, kv_lengths_B=mask.kv_lengths,
                scale=None if cfg.scale_attention else 1.0, spec_BTHK=activation_spec(("batch", None, "heads", None)),
            )  # fmt: skip
            return self._out(out_BTHK, dropout_rng)
        result = F.dot_product_attention(
            q_BTHK, k, v,
            kv_layout=kv_layout,
            mask=mask,
            bias=bias,
            scale=None if cfg.scale_attention else 1.0,
            dropout_rate=cfg.attention_dropout_rate,
            dropout_rng=dropout_rng,
            return_weights=return_weights,
            implementation=cfg.attention_impl,
            spec_BTHK=activation_spec(("batch", None, "heads", None)),  # splash runs per shard of it
        )  # fmt: skip
        out_BTHK, weights = result if return_weights else (result, None)
        y_BTD = self._out(out_BTHK, dropout_rng)
        return (y_BTD, weights) if return_weights else y_BTD

    def _context_attention(self, q_BTHK, k_BSGK, v_BSGK, mask, bias, positions_BT, kv_positions_BS) -> Array:
        """Attention over sequences split on the context axis (`jaxformer.ring`): masks from the tokens'
        positions (as packed rows number them: causal within a segment is causal by position)."""
        if bias is not None or not (mask is None or isinstance(mask, F.Mask)) or (mask and mask.q_offset is not None):
            raise ValueError("context parallelism takes a structural mask only (no logits bias or q_offset)")
        mask = mask or F.Mask()
        return ring.context_attention(
            q_BTHK, k_BSGK, v_BSGK, strategy=self.cfg.context_attention, causal=mask.causal,
            kernel=self._ring_kernel(q_BTHK, k_BSGK),
            q_index_BT=positions_BT, kv_index_BS=kv_positions_BS,
            q_segments_BT=mask.q_segments, kv_segments_BS=mask.kv_segments,
            kv_lengths_B=mask.kv_lengths, q_lengths_B=mask.q_lengths,
            scale=None if self.cfg.scale_attention else 1.0, spec_BTHK=activation_spec(("batch", None, "heads", None)),
        )  # fmt: skip

    def _ring_kernel(self, q_BTHK: Array, k_BSGK: Array) -> str:
        """What attends each block inside the ring: the fused kernel `attention_impl` chooses (auto:
        cuDNN on a GPU in bfloat16, splash on a TPU) where it can take the blocks, else XLA's einsums
        ("dense"; the all-gather strategy is dense)."""
        cfg = self.cfg
        backend = F.choose_backend(cfg.attention_impl, q_BTHK, None)
        if backend not in ring.UNSERVABLE:
            return "dense"
        if cfg.context_attention != "ring":
            why = "the all-gather strategy attends densely"
        else:
            why = ring.UNSERVABLE[backend](q_BTHK, k_BSGK, context_ways())
        if why is None:
            return backend
        if cfg.attention_impl == backend:
            raise ValueError(f"model.attention_impl={backend!r}: {why}")
        F.log_fallback(f"{why}: each block is attended by XLA's einsums")
        return "dense"

    def _out(self, out_BTHK: Array, dropout_rng: Array | None) -> Array:
        """The heads' output projection: [B, T, H, K] -> [B, T, D] (row-parallel under TP)."""
        y_BTD = project(self, "o", "BTHK,HKD->BTD", out_BTHK)
        y_BTD = adapted(self, "o", out_BTHK, y_BTD, dropout_rng)
        if self.cfg.use_bias:
            y_BTD = y_BTD + F.lift(self.o_bias[...].astype(self.cfg.dtype), y_BTD)
        return constrain(y_BTD, ("batch", "length", None))


class FeedForward(nnx.Module):
    """Position-wise feed-forward D -> F -> D with ReLU (paper), GELU, or gated SwiGLU.

    Args:
        cfg: the model's config (D, F, activation, use_bias, dropout).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, Fw = cfg.d_model, cfg.d_ff
        self.gated = cfg.activation in F.GATED_ACTIVATIONS
        kernel = init.xavier_uniform()
        self.wi = param(rngs, kernel, (D, Fw), ("embed", "mlp"))
        if self.gated:
            self.wi_gate = param(rngs, kernel, (D, Fw), ("embed", "mlp"))
        self.wo = param(rngs, kernel, (Fw, D), ("mlp", "embed"))
        if cfg.use_bias:
            self.wi_bias = param(rngs, init.zeros, (Fw,), ("mlp",))
            if self.gated:
                self.wi_gate_bias = param(rngs, init.zeros, (Fw,), ("mlp",))
            self.wo_bias = param(rngs, init.zeros, (D,), ("embed",))

    def _dense(self, x: Array, name: str, spec: str, dropout_rng: Array | None) -> Array:
        dt = self.cfg.dtype
        y = adapted(self, name, x, project(self, name, spec, x), dropout_rng)
        return y + F.lift(getattr(self, f"{name}_bias")[...].astype(dt), y) if self.cfg.use_bias else y

    def __call__(self, x_BTD: Array, dropout_rng: Array | None = None) -> Array:
        """D -> F -> D at every position.

        Args:
            x_BTD: [B, T, D] activations.
            dropout_rng: the LoRA adapters' dropout key (nothing else here drops out), or None.

        Returns:
            [B, T, D].
        """
        # The activation's backward gets a buffer of its own: without a bias gradient to force one,
        # XLA:CPU fuses it into the transposed copy feeding wi's weight gradient (+17% step time).
        up_BTF = materialized_grad(self._dense(x_BTD, "wi", "BTD,DF->BTF", dropout_rng))
        if self.gated:
            gate_BTF = materialized_grad(self._dense(x_BTD, "wi_gate", "BTD,DF->BTF", dropout_rng))
            h_BTF = F.GATED_ACTIVATIONS[self.cfg.activation](gate_BTF, up_BTF)
        else:
            h_BTF = F.ACTIVATIONS[self.cfg.activation](up_BTF)
        h_BTF = constrain(h_BTF, ("batch", "length", "mlp"))
        return constrain(self._dense(h_BTF, "wo", "BTF,FD->BTD", dropout_rng), ("batch", "length", None))


# ----------------------------------------------------------------------------- layers


class Residual(nnx.Module):
    """Residual + norm + dropout around a sublayer.

    post (paper):  LayerNorm(x + Dropout(Sublayer(x)))
    pre (Annotated Transformer, GPT-2):  x + Dropout(Sublayer(LayerNorm(x)))

    Args:
        cfg: the model's config (norm_position, norm, dropout_rate).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.norm = Norm(cfg, rngs=rngs)

    def __call__(
        self, x_BTD: Array, sublayer: Callable, dropout_rng: Array | None, has_aux: bool = False
    ) -> Array | tuple[Array, object]:
        """The sublayer wrapped in its residual connection, norm and dropout.

        Args:
            x_BTD: [B, T, D] the residual stream.
            sublayer: maps [B, T, D] to [B, T, D], or to ([B, T, D], aux) with `has_aux`.
            dropout_rng: the key of the dropout on the sublayer's output, or None for none.
            has_aux: the sublayer returns (y, aux).

        Returns:
            [B, T, D]; with `has_aux`, ([B, T, D], aux).
        """

        def run(h_BTD):
            y = sublayer(h_BTD)
            y_BTD, aux = y if has_aux else (y, None)
            return F.dropout(y_BTD, self.cfg.dropout_rate, dropout_rng), aux

        if self.cfg.norm_position == "pre":
            x_BTD = materialized_grad(x_BTD)
            y_BTD, aux = run(self.norm(x_BTD))
            x_BTD = x_BTD + y_BTD
        else:
            y_BTD, aux = run(x_BTD)
            x_BTD = self.norm(x_BTD + y_BTD)
        return (x_BTD, aux) if has_aux else x_BTD


def feed_forward(cfg: ModelConfig, moe: bool, rngs: nnx.Rngs) -> nnx.Module:
    """A layer's feed-forward: the mixture of experts (`jaxformer.moe`) if `moe`, else the dense one.

    Args:
        cfg: the model's config (its `moe` section for the experts).
        moe: whether this layer is a mixture of experts.
        rngs: the initialisation keys.

    Returns:
        A `FeedForward` or a `moe.MoEFeedForward`.
    """
    return M.MoEFeedForward(cfg, rngs=rngs) if moe else FeedForward(cfg, rngs=rngs)


def _ffn_sublayer(layer: nnx.Module, x_BTD: Array, mask, r_ffn: Array | None) -> tuple[Array, dict | None]:
    """The feed-forward sublayer with its residual: (x, the MoE layer's statistics or None)."""
    if not isinstance(layer.ffn, M.MoEFeedForward):
        return layer.ffn_res(x_BTD, lambda h_BTD: layer.ffn(h_BTD, r_ffn), r_ffn), None
    live_BT = M.live_tokens(mask, x_BTD.shape[1])  # padding takes no expert slot and is not in the losses
    return layer.ffn_res(x_BTD, lambda h_BTD: layer.ffn(h_BTD, r_ffn, live_BT), r_ffn, has_aux=True)


class EncoderLayer(nnx.Module):
    """Self-attention then feed-forward (dense, or a mixture of experts with `moe`), each wrapped in `Residual`.

    Args:
        cfg: the model's config.
        moe: the feed-forward is a mixture of experts.
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, moe: bool = False, rngs: nnx.Rngs):
        self.self_attn = MultiHeadAttention(cfg, rngs=rngs)
        self.self_attn_res = Residual(cfg, rngs=rngs)
        self.ffn = feed_forward(cfg, moe, rngs)
        self.ffn_res = Residual(cfg, rngs=rngs)

    def __call__(
        self,
        x_BTD: Array,
        *,
        mask: F.Mask | Array | None,
        positions_BT: Array,
        position_bias: Array | None = None,
        dropout_rng: Array | None = None,
        with_aux: bool = False,
    ) -> Array | tuple[Array, dict | None]:
        """Self-attention then feed-forward, each with its residual.

        Args:
            x_BTD: [B, T, D] the residual stream.
            mask: which keys each query sees (`functional.Mask` or a boolean array), or None for all.
            positions_BT: [B, T] the tokens' positions.
            position_bias: [B, H, T, T] added to the self-attention logits (T5), or None.
            dropout_rng: the layer's dropout key, or None for no dropout.
            with_aux: also return the layer's MoE statistics.

        Returns:
            [B, T, D]; with `with_aux`, ([B, T, D], the MoE statistics, None if the feed-forward is dense).
        """
        r_attn, r_attn_res, r_ffn = split_rng(dropout_rng, 3)

        def attend(h_BTD):
            return self.self_attn(h_BTD, mask=mask, positions_BT=positions_BT, bias=position_bias, dropout_rng=r_attn)

        x_BTD = self.self_attn_res(x_BTD, attend, r_attn_res)
        x_BTD, aux = _ffn_sublayer(self, x_BTD, mask, r_ffn)
        return (x_BTD, aux) if with_aux else x_BTD


class DecoderLayer(nnx.Module):
    """Masked self-attention, cross-attention over the encoder memory (when `cross`), feed-forward.

    Args:
        cfg: the model's config.
        cross: with cross-attention over the encoder memory (encoder_decoder).
        moe: the feed-forward is a mixture of experts.
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, cross: bool, moe: bool = False, rngs: nnx.Rngs):
        self.self_attn = MultiHeadAttention(cfg, rngs=rngs)
        self.self_attn_res = Residual(cfg, rngs=rngs)
        if cross:
            self.cross_attn = MultiHeadAttention(cfg, cross=True, rngs=rngs)
            self.cross_attn_res = Residual(cfg, rngs=rngs)
        self.ffn = feed_forward(cfg, moe, rngs)
        self.ffn_res = Residual(cfg, rngs=rngs)
        self.cross = cross

    def __call__(
        self,
        x_BTD: Array,
        *,
        mask: F.Mask | Array | None,
        positions_BT: Array,
        memory_BSD: Array | None = None,
        memory_mask: F.Mask | Array | None = None,
        position_bias: Array | None = None,
        dropout_rng: Array | None = None,
        cache: dict | None = None,
        with_aux: bool = False,
    ) -> Array | tuple[Array, dict | None]:
        """Masked self-attention, cross-attention over the memory (with `cross`), feed-forward.

        Args:
            x_BTD: [B, T, D] the residual stream (decoding: only the new positions).
            mask: which keys each query sees in self-attention, or None for all.
            positions_BT: [B, T] the tokens' positions.
            memory_BSD: [B, S, D] the encoder's output (cross-attention), or None.
            memory_mask: which memory positions each query sees, or None for all.
            position_bias: [B, H, T, S] added to the self-attention logits (T5), or None.
            dropout_rng: the layer's dropout key, or None for no dropout.
            cache: decoding: {"self": this layer's KV cache, "memory": the memory's projected keys and
                values}; None when training.
            with_aux: also return the layer's MoE statistics (without a cache).

        Returns:
            [B, T, D]; with `cache`, ([B, T, D], the updated self-attention cache); with `with_aux`,
                ([B, T, D], the MoE statistics, None if the feed-forward is dense).
        """
        r_self, r_self_res, r_cross, r_cross_res, r_ffn = split_rng(dropout_rng, 5)
        kw = dict(mask=mask, positions_BT=positions_BT, bias=position_bias)

        def attend(h_BTD):
            if cache is None:
                return self.self_attn(h_BTD, dropout_rng=r_self, **kw), None
            return self.self_attn.extend(h_BTD, cache["self"], **kw)

        x_BTD, self_cache = self.self_attn_res(x_BTD, attend, r_self_res, has_aux=True)
        if self.cross:
            memory_kv = None if cache is None else (cache["memory"]["k"], cache["memory"]["v"])

            def cross_attend(h_BTD):
                return self.cross_attn(h_BTD, memory_BSD, mask=memory_mask, memory_kv=memory_kv, dropout_rng=r_cross)

            x_BTD = self.cross_attn_res(x_BTD, cross_attend, r_cross_res)
        x_BTD, aux = _ffn_sublayer(self, x_BTD, mask, r_ffn)
        if cache is not None:
            return x_BTD, self_cache
        return (x_BTD, aux) if with_aux else x_BTD


# ----------------------------------------------------------------------------- stacks

LAYER_INPUT = "layer_input"  # the name of each layer's input in a stack, which "offload_inputs" keeps on the host
_TO_HOST = dict(offload_src="device", offload_dst="pinned_host")
REMAT_POLICIES = {
    "full": None,  # save nothing, recompute the whole layer in the backward pass
    "dots_saveable": jax.checkpoint_policies.save_from_both_policies(  # keep matmul outputs (int8 kernels' too)
        jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.save_only_these_names(quant.PROJECTION)
    ),
    # The values "dots_saveable" keeps, moved to host memory in the forward pass and back for the backward.
    "offload_dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims(**_TO_HOST),
    # "full", but each layer's input (what a recomputation starts from) waits in host memory, not the device's.
    "offload_inputs": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT], **_TO_HOST
    ),
}
"""`model.remat` -> the `jax.checkpoint` policy of each layer ("none" and "auto" are resolved by `LayerStack`)."""


class LayerStack(nnx.Module):
    """L layers, scanned (parameters stacked on a leading `layers` axis, one compiled body, compile
    time flat in depth) or unrolled (a list); same outputs.

    Layer i draws its dropout keys from fold_in(dropout_rng, i) in both forms. `make_layer(rngs, i)`
    builds layer i. Scanned, a stack whose layers are alike (no MoE, or MoE in every layer) is built
    as layer 0 and stacked over L; MoE on every N-th layer (`model.moe.every` = N > 1) makes blocks of
    N layers (N - 1 dense and the MoE one, at the stack's offset; `ModelConfig.scan_block`, the least
    common multiple of the stacks' N when they differ): `layers` is then a list of N stacks, the j-th
    holding layer j of every block [L / N, ...] (layer i is block i // N, position i % N), and the scan
    runs over blocks. The statistics of the MoE layers, one row per
    layer (`jaxformer.moe`), go to `moe.collect` at each call.

    Args:
        cfg: the model's config (scan_layers, remat, moe.every).
        make_layer: (rngs, i) -> layer i.
        num_layers: L.
        rngs: the initialisation keys.
    """

    def __init__(
        self, cfg: ModelConfig, make_layer: Callable[[nnx.Rngs, int], nnx.Module], num_layers: int, *, rngs: nnx.Rngs
    ):
        self.cfg = cfg
        self.num_layers = num_layers
        self.block = cfg.scan_block if cfg.scan_layers else 1  # N layers per scanned block
        keys = jax.random.split(rngs.params(), num_layers)
        if cfg.scan_layers:
            make = lambda j: nnx.vmap(  # layer j of a block, once per block, from unrolled layer i's key
                lambda k: make_layer(nnx.Rngs(params=k), j),
                in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"},
            )  # fmt: skip
            N = self.block
            self.layers = make(0)(keys) if N == 1 else nnx.List([make(j)(keys[j::N]) for j in range(N)])
        else:
            self.layers = nnx.List([make_layer(nnx.Rngs(params=k), i) for i, k in enumerate(keys)])

    def __call__(self, x_BTD: Array, *, dropout_rng: Array | None = None, **kwargs) -> Array:
        """Runs x through every layer; the MoE layers' statistics go to `moe.collect`.

        Args:
            x_BTD: [B, T, D] the residual stream.
            dropout_rng: the stack's dropout key (layer i folds in i), or None for no dropout.
            **kwargs (object): the layers' other arguments (mask, positions, memory), the same for each.

        Returns:
            [B, T, D] after the L layers.
        """

        def apply(graphdef, state, x_BTD, index, kwargs):  # -> (x, MoE statistics or None)
            x_BTD = checkpoint_name(x_BTD, LAYER_INPUT)
            rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, index)
            return nnx.merge(graphdef, state)(x_BTD, dropout_rng=rng, with_aux=True, **kwargs)

        remat = self.cfg.remat if self.cfg.remat != "auto" else "dots_saveable" if self.cfg.scan_layers else "none"
        if remat != "none":
            apply = jax.checkpoint(
                apply, policy=REMAT_POLICIES[remat], prevent_cse=not self.cfg.scan_layers, static_argnums=(0,)
            )
        if self.cfg.scan_layers:
            N = self.block
            splits = [nnx.split(self.layers)] if N == 1 else [nnx.split(stack) for stack in self.layers]
            graphdefs, states = [g for g, _ in splits], [s for _, s in splits]

            def body(x_BTD, block):  # layers b * N .. b * N + N - 1; the MoE ones' statistics, in order
                states_b, b = block
                auxes = []
                for j in range(N):
                    x_BTD, aux = apply(graphdefs[j], states_b[j], x_BTD, b * N + j, kwargs)
                    auxes += [] if aux is None else [aux]
                return x_BTD, jax.tree.map(lambda *xs: jnp.stack(xs), *auxes) if auxes else None

            x_BTD, aux = jax.lax.scan(body, x_BTD, (states, jnp.arange(self.num_layers // N)))
            if aux is not None:  # the MoE layers' statistics, one row per layer: [blocks, per block] -> rows
                M.report(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), aux))
            return x_BTD
        sums = []
        for index, layer in enumerate(self.layers):
            graphdef, state = nnx.split(layer)
            x_BTD, aux = apply(graphdef, state, x_BTD, index, kwargs)
            sums += [] if aux is None else [aux]
        if sums:
            M.report(jax.tree.map(lambda *xs: jnp.stack(xs), *sums))
        return x_BTD

    # Decoding runs the layers one by one, scanned or not, each with a cache of its own that a step
    # writes in place: a list of {"self": the layer's KV cache, "memory": the memory's keys and
    # values (cross-attention)}. (Scanning would restack every layer's cache at every step.)

    def unstacked(self) -> list[nnx.Module]:
        """The layers as a list; scanned layers are sliced out of their stacked parameters, here at
        every call (XLA does not hoist the slices out of a decoding loop: `generate` and `translate`
        slice once, before it, with `models.unrolled`).

        Returns:
            The L layers.
        """
        if not self.cfg.scan_layers:
            return list(self.layers)
        N = self.block
        splits = [nnx.split(self.layers)] if N == 1 else [nnx.split(stack) for stack in self.layers]
        return [
            nnx.merge(splits[i % N][0], jax.tree.map(lambda a, b=i // N: a[b], splits[i % N][1]))
            for i in range(self.num_layers)
        ]

    def map_layers(self, fn: Callable[[nnx.Module], object]) -> list:
        """[fn(layer) for every layer].

        Args:
            fn: a function of one layer.

        Returns:
            The L results.
        """
        return [fn(layer) for layer in self.unstacked()]

    def extend(self, x_BTD: Array, cache: list, **kwargs) -> tuple[Array, list]:
        """Decoding: x (new positions) through every layer with its entry of `cache`; returns
        (x, the caches with every layer's "self" entry updated).

        Args:
            x_BTD: [B, T, D] the new positions.
            cache: one dict per layer ({"self": {"k", "v"}, and "cross" with memory}).
            **kwargs (object): passed to each layer's `extend` (mask, positions_BT, bias, ...).

        Returns:
            (x_BTD, the updated caches).
        """
        updated = []
        for layer, layer_cache in zip(self.unstacked(), cache, strict=True):
            x_BTD, self_cache = layer(x_BTD, cache=layer_cache, **kwargs)
            updated.append({**layer_cache, "self": self_cache})
        return x_BTD, updated

    def reorder_cache(self, cache: list, rows_B: Array) -> list:
        """Row i of every layer's self-attention cache takes row rows_B[i]'s (beam search); the
        memory's keys and values, the same for every beam of a source, stay.

        Args:
            cache: one dict per layer, as `extend` takes.
            rows_B: [B] int, the row each row takes.

        Returns:
            The reordered caches.
        """
        return [{**c, "self": jax.tree.map(lambda a: jnp.take(a, rows_B, axis=0), c["self"])} for c in cache]
