"""Pipeline parallelism over the mesh's `stage` axis: a scanned layer stack split by layer over S
stages, the batch run through them as M micro-batches (docs/guides/pipeline.md).

The mechanism is SPMD, one program for every stage, left to XLA's partitioner like the other axes:

- The stack's parameters [L, ...] are split over `stage` on their leading `layers` axis (the rules
  table's `layers -> stage`), as C = S x V chunks of L / C layers: chunk c = v S + s lives on stage s
  (V = `mesh.virtual_stages`; V = 1: stage s holds layers s L/S .. (s + 1) L/S - 1, its own shard).
- A `lax.scan` over M V + S - 1 ticks carries one activation per stage, [S, B/M, T, D] split over
  `stage`. At each tick every stage runs its chunk on its activation (`jax.vmap` over the stage axis
  with `spmd_axis_name="stage"`, so each device runs its own), then the activations move one stage on
  (`jnp.roll` over the split axis, which XLA lowers to a collective permute). Stage 0 takes the next
  micro-batch from a buffer [M, B/M, T, D]; the last stage writes its finished micro-batch back into
  the buffer, where, interleaved (V > 1), stage 0 reads it again for its next chunk M ticks later
  (circular; it needs M >= S).
- Backward is autodiff through the scan (GPipe): every micro-batch's forward, then every backward, the
  permutes reversed. Ticks where a stage holds no micro-batch (the bubble: (S - 1) / (M V + S - 1) of
  the ticks) compute on stand-in values whose results are never used, so they add nothing to the
  gradients. The 1F1B schedule (`jaxformer.pipeline_1f1b`) writes its backward out instead.

Embeddings, the final norm and the heads run outside the pipeline, on the whole batch, replicated over
`stage` (a tied embedding is one array read at both ends; nothing crosses stages but activations).
A stack whose keyword arrays have the batch's leading size (masks, positions, the encoder memory of a
decoder's cross-attention, a relative-position bias) gives each stage the rows of its micro-batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from jaxformer.sharding import constrain


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How a pipelined stack runs.

    Attributes:
        microbatches: M, the micro-batches the batch is cut into.
        virtual_stages: V, the chunks of layers each stage runs in turn.
        kind: "gpipe" (interleaved where V > 1) or "1f1b" (`jaxformer.pipeline_1f1b`).
    """

    microbatches: int
    virtual_stages: int = 1
    kind: str = "gpipe"


_SCHEDULE: list[Schedule] = []


@contextlib.contextmanager
def schedule(microbatches: int, virtual_stages: int = 1, kind: str = "gpipe") -> Iterator[Schedule]:
    """Scanned stacks traced in this context run as a pipeline where the mesh has a `stage` axis
    of more than one device (the train and eval steps trace the loss in it).

    Args:
        microbatches: M, the micro-batches the batch is cut into (train.grad_accum).
        virtual_stages: V, chunks of layers per stage (mesh.virtual_stages).
        kind: "gpipe" or "1f1b" (mesh.schedule).

    Returns:
        schedule (Iterator[Schedule]): a context manager; `with` gives the schedule.
    """
    _SCHEDULE.append(Schedule(microbatches, virtual_stages, kind))
    try:
        yield _SCHEDULE[-1]
    finally:
        _SCHEDULE.pop()


def stages() -> int:
    """The size of the mesh's `stage` axis in effect (1 outside a mesh).

    Returns:
        S.
    """
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or "stage" not in mesh.axis_names else mesh.shape["stage"]


def active() -> Schedule | None:
    """The schedule a stack traced now runs under: None without one or without stages.

    Returns:
        The schedule, or None.
    """
    return _SCHEDULE[-1] if _SCHEDULE and stages() > 1 else None


def bubble_fraction(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The share of a stage's ticks spent idle: (S - 1) / (M V + S - 1).

    Args:
        stages: S.
        microbatches: M.
        virtual_stages: V.

    Returns:
        The fraction, in [0, 1).
    """
    return (stages - 1) / (microbatches * virtual_stages + stages - 1)


def run(
    stage_fn: Callable,
    params: list[jax.Array],
    names: list[tuple],
    x_BTD: jax.Array,
    kwargs: dict,
    *,
    dropout_rng: jax.Array | None,
    plan: Schedule,
) -> jax.Array:
    """x through a stack's L layers as a pipeline over the mesh's stages (the module docstring).

    Args:
        stage_fn: (a chunk's parameters, each [L/C, ...], x [b, T, D], index of its first layer, dropout
            key or None, kwargs of the micro-batch) -> [b, T, D]: the chunk's layers in order; layer i
            of the stack draws its dropout key from fold_in(key, i).
        params: the stack's parameters, each [L, ...].
        names: their logical axis names, one tuple each.
        x_BTD: [B, T, D] the stack's input.
        kwargs: the layers' other inputs; arrays with B leading rows are cut into micro-batches.
        dropout_rng: the stack's dropout key (micro-batch m folds in m), or None for no dropout.
        plan: micro-batches and virtual stages.

    Returns:
        [B, T, D] after the L layers.

    Raises:
        ValueError: the batch or the layers do not divide as the schedule needs.
    """
    S, M, V = stages(), plan.microbatches, plan.virtual_stages
    L = params[0].shape[0]
    B, T, D = x_BTD.shape
    if B % M or L % (S * V) or M < S:
        raise ValueError(f"a pipeline of {S} stages x {V} chunks, {M} micro-batches, cannot run {L} layers on {B} rows")
    b, Lc = B // M, L // (S * V)

    def chunked(a, logical):  # [L, ...] -> [V, S, L/C, ...]: chunk v S + s on stage s
        a = a.reshape(V, S, Lc, *a.shape[1:])
        return constrain(a, (None, "layers", None, *logical[1:]))

    chunks = [chunked(a, logical) for a, logical in zip(params, names, strict=True)]
    micro = lambda a: a.reshape(M, b, *a.shape[1:])
    leaves, treedef = jax.tree.flatten(kwargs)
    cut = [isinstance(a, jax.Array) and a.ndim > 0 and a.shape[0] == B for a in leaves]
    cut_leaves = [micro(a) for a, c in zip(leaves, cut, strict=True) if c]
    s_S = jnp.arange(S)

    def one_stage(p, x_bTD, first, rng, *rows):  # one stage's chunk on its micro-batch's rows
        it = iter(rows)
        kw = jax.tree.unflatten(treedef, [next(it) if c else a for a, c in zip(leaves, cut, strict=True)])
        return stage_fn(p, x_bTD, first, rng, kw)

    def tick(carry, t):
        state_SbTD, buf_MbTD = carry
        u_S = jnp.clip(t - s_S, 0, M * V - 1)  # the (repeat, micro-batch) each stage is on
        r_S, m_S = u_S // M, u_S % M
        state_SbTD = state_SbTD.at[0].set(buf_MbTD[t % M])  # stage 0: the next micro-batch (or chunk)
        state_SbTD = constrain(state_SbTD, ("layers", "batch", "length", None))

        def pick(a):  # [V, S, ...] -> [S, ...]: each stage's chunk of its repeat
            out = a[0]
            for v in range(1, V):
                out = jnp.where((r_S == v).reshape(S, *(1,) * (out.ndim - 1)), a[v], out)
            return out

        p = [pick(a) for a in chunks]
        rows = [jnp.take(a, m_S, axis=0) for a in cut_leaves]  # [S, b, ...]: each stage's micro-batch
        rng = None if dropout_rng is None else jax.vmap(lambda m: jax.random.fold_in(dropout_rng, m))(m_S)
        first_S = (r_S * S + s_S) * Lc
        out_SbTD = jax.vmap(one_stage, spmd_axis_name="stage")(p, state_SbTD, first_S, rng, *rows)
        out_SbTD = constrain(out_SbTD, ("layers", "batch", "length", None))
        # the last stage's finished micro-batch goes back to the buffer (stand-in ticks write nothing)
        done = (t - (S - 1) >= 0) & (t - (S - 1) < M * V)
        m = m_S[S - 1]
        buf_MbTD = buf_MbTD.at[m].set(jnp.where(done, out_SbTD[S - 1], buf_MbTD[m]))
        return (jnp.roll(out_SbTD, 1, axis=0), buf_MbTD), None

    buf_MbTD = constrain(micro(x_BTD), (None, "batch", "length", None))
    state_SbTD = jnp.zeros((S, b, T, D), x_BTD.dtype)
    (_, buf_MbTD), _ = jax.lax.scan(tick, (state_SbTD, buf_MbTD), jnp.arange(M * V + S - 1))
    return buf_MbTD.reshape(B, T, D)
