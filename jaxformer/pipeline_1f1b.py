"""The 1F1B pipeline schedule (one forward, one backward): each micro-batch's backward starts on the
last stage in the tick its forward ends there, so a stage holds a bounded number of micro-batches'
inputs instead of all M of them (docs/guides/pipeline.md).

The same SPMD mechanism as `jaxformer.pipeline` (a `lax.scan` over ticks, `jax.vmap` over the stage
axis with `spmd_axis_name="stage"`, `jnp.roll` between stages), with the backward written out rather
than left to autodiff:

- At tick t stage s runs the forward of micro-batch t - s and the backward of micro-batch
  t - (2 S - 2 - s); M + 2 S - 2 ticks in three scans: S - 1 forward-only ticks (warm-up), M ticks of
  both, S - 1 backward-only ticks (cool-down), so a stage computes (M + S - 1) forwards and as many
  backwards, GPipe's count, and its bubble is GPipe's (S - 1) / (M + S - 1).
- The last stage runs the loss of its micro-batch (the *tail*: final norm, head and cross-entropy,
  given by the loss through `tail`) in the tick its forward ends, and its cotangent starts that
  micro-batch's backward in the same tick; cotangents move one stage back a tick (`jnp.roll` by -1).
- A stage keeps only its chunk's *inputs* of the micro-batches between their forward and backward,
  in a ring of K = min(M, 2 S - 1) slots (stage s uses 2 (S - 1 - s) + 1 of them; a lockstep tick
  moves either direction one stage, so a round trip from stage s takes 2 (S - 1 - s) ticks), and
  recomputes the chunk's forward inside `jax.vjp` at the backward: the layers' internals live one
  micro-batch at a time. GPipe keeps all M micro-batches' internals for autodiff.
- The stage's parameter gradients add up in the scan's carry; stage 0's input cotangents go to a
  buffer [M, b, T, D], the cotangent of the stack's input (so the embedding's gradient, tied or not,
  is autodiff's as before).

The stack returns its outputs through a `jax.custom_vjp` whose forward (under differentiation) runs
this schedule and whose backward returns the gradients it computed, ignoring the outputs' incoming
cotangent: that is right only when the quantity differentiated is the tail's summed loss (the train
step's), which `Config` checks (mesh.schedule='1f1b' takes the lm and mlm objectives, decoder_only
and encoder_only). The tail runs once a micro-batch: one `value_and_grad` gives its metrics, the
cotangent of its input and the gradients of the parameters it reads (the head's, the final norm's),
summed in the carry and returned by the backward; the step's loss and metrics are the pipeline's
sums (`summed`). Evaluation, with nothing to differentiate, traces its loss under
GPipe's schedule (`train.make_steps`), so it runs no tail.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.pipeline import Schedule, run, stages
from jaxformer.sharding import constrain


@dataclasses.dataclass(frozen=True)
class Tail:
    """The loss a 1F1B pipeline's last stage runs on each micro-batch's outputs.

    Attributes:
        fn: (shared, y [b, T, D], rows) -> the micro-batch's summed metrics, a dict of scalars whose
            "loss" is the summed loss.
        shared: arrays the loss reads whole (the head's and final norm's parameters).
        rows: arrays with the batch's leading size (labels, weights), cut into micro-batches.
        losses: where the pipeline puts the summed metrics of its micro-batches; their "loss" is the
            value through which its gradients, the tail's parameters' included, flow.
    """

    fn: Callable
    shared: object
    rows: object
    losses: list = dataclasses.field(default_factory=list)


_TAIL: list[Tail] = []


@contextlib.contextmanager
def tail(fn: Callable, shared: object, rows: object) -> Iterator[Tail]:
    """A 1F1B pipeline traced in this context runs `fn` as its per-micro-batch loss (the loss that
    is differentiated must be the sum of these).

    Args:
        fn: (shared, y [b, T, D], rows) -> the micro-batch's summed metrics ({"loss": ..., ...}).
        shared: a pytree of arrays `fn` reads whole.
        rows: a pytree of arrays [B, ...] cut into micro-batches of b rows.

    Returns:
        tail (Iterator[Tail]): a context manager; `with` gives the tail.
    """
    _TAIL.append(Tail(fn, shared, rows))
    try:
        yield _TAIL[-1]
    finally:
        _TAIL.pop()


def current_tail() -> Tail | None:
    """The tail in effect, or None.

    Returns:
        The innermost `tail` context's Tail, or None.
    """
    return _TAIL[-1] if _TAIL else None


def _float(a) -> bool:
    return isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.inexact)


def _zero_cotangent(a):
    return jnp.zeros_like(a) if _float(a) else np.zeros(np.shape(a), jax.dtypes.float0)


def run_1f1b(
    stage_fn: Callable,
    params: list[jax.Array],
    names: list[tuple],
    x_BTD: jax.Array,
    kwargs: dict,
    *,
    dropout_rng: jax.Array | None,
    plan: Schedule,
    loss: Tail,
) -> jax.Array:
    """x through a stack's L layers as a 1F1B pipeline (the module docstring): the outputs are
    GPipe's; their gradients are those of `loss`'s summed micro-batch losses.

    Args:
        stage_fn: as `pipeline.run`'s.
        params: the stack's parameters, each [L, ...].
        names: their logical axis names, one tuple each.
        x_BTD: [B, T, D] the stack's input.
        kwargs: the layers' other inputs; arrays with B leading rows are cut into micro-batches.
        dropout_rng: the stack's dropout key (micro-batch m folds in m), or None for no dropout.
        plan: micro-batches (virtual stages must be 1).
        loss: the per-micro-batch loss of the last stage.

    Returns:
        [B, T, D] after the L layers.

    Raises:
        ValueError: the batch or the layers do not divide as the schedule needs, or V > 1.
    """
    S, M = stages(), plan.microbatches
    L, B = params[0].shape[0], x_BTD.shape[0]
    if B % M or L % S or M < S or plan.virtual_stages != 1:
        raise ValueError(f"a 1F1B pipeline of {S} stages, {M} micro-batches, cannot run {L} layers on {B} rows")
    leaves, treedef = jax.tree.flatten(kwargs)
    arrays = [i for i, a in enumerate(leaves) if isinstance(a, jax.Array)]

    def with_leaves(values):  # the kwargs with their array leaves replaced
        out = list(leaves)
        for i, v in zip(arrays, values, strict=True):
            out[i] = v
        return jax.tree.unflatten(treedef, out)

    @jax.custom_vjp
    def piped(params, x_BTD, values, shared, rows):
        y = run(stage_fn, params, names, x_BTD, with_leaves(values), dropout_rng=dropout_rng, plan=plan)
        each = [loss.fn(shared, yb, r) for yb, r in zip(jnp.split(y, M), _split(rows, M), strict=True)]
        return y, jax.tree.map(lambda *a: sum(a), *each)

    def forward(params, x_BTD, values, shared, rows):
        y, sums, grads, dx, dvalues, dshared = _schedule(stage_fn, params, names, x_BTD, leaves, arrays, treedef,
                                                         values, shared, rows, loss.fn, dropout_rng, S, M)  # fmt: skip
        drows = jax.tree.map(_zero_cotangent, rows)
        return (y, sums), ((grads, dx, dvalues, dshared), drows)

    def backward(res, cotangents):  # the summed loss's gradients times its cotangent; y's is dropped
        found, drows = res
        dl = cotangents[1]["loss"]
        scaled = jax.tree.map(lambda g: g if g.dtype == jax.dtypes.float0 else (dl * g).astype(g.dtype), found)
        return (*scaled, drows)

    piped.defvjp(forward, backward)
    y, l = piped(params, x_BTD, [leaves[i] for i in arrays], loss.shared, loss.rows)
    loss.losses.append(l)
    return y


def _split(rows, M):
    """The rows' pytree as M micro-batches' pytrees."""
    return [jax.tree.map(lambda a, m=m: a.reshape(M, -1, *a.shape[1:])[m], rows) for m in range(M)]


def summed(loss: Tail) -> dict | None:
    """The summed metrics of the micro-batches the pipeline's tail ran, each a micro-batch's loss once.

    Args:
        loss: the tail the pipeline ran (its `losses` filled), or one it did not run.

    Returns:
        The metrics summed over the pipeline's runs ("loss" differentiable through the schedule, the
        tail's parameters included), or None where it did not run.
    """
    if not loss.losses:
        return None
    return jax.tree.map(lambda *a: sum(a), *loss.losses)


def _schedule(stage_fn, params, names, x_BTD, leaves, arrays, treedef, values, shared, rows, tail_fn, rng, S, M):
    """The 1F1B ticks: (outputs [B, T, D], summed metrics, parameter gradients, input cotangents,
    kwargs' cotangents, the tail's parameters' gradients)."""
    L = params[0].shape[0]
    B, T, D = x_BTD.shape
    b, Lc, K = B // M, L // S, min(M, 2 * S - 1)
    chunks = [
        constrain(a.reshape(S, Lc, *a.shape[1:]), ("layers", None, *n[1:])) for a, n in zip(params, names, strict=True)
    ]
    micro = lambda a: a.reshape(M, b, *a.shape[1:])
    cut = [a.ndim > 0 and a.shape[0] == B for a in values]  # per micro-batch, else read whole
    diff = [_float(a) for a in values]  # cotangents for floating inputs (a relative-position bias)
    vals = [micro(a) if c else a for a, c in zip(values, cut, strict=True)]
    tail_rows = jax.tree.map(micro, rows)
    s_S = jnp.arange(S)
    act = ("layers", "batch", "length", None)

    def kw_of(v):  # this micro-batch's kwargs from the value list
        out = list(leaves)
        for i, a in zip(arrays, v, strict=True):
            out[i] = a
        return jax.tree.unflatten(treedef, out)

    def stage_values(m_S):  # [S, ...] each stage's rows of its micro-batch; whole arrays broadcast
        return [
            jnp.take(a, m_S, axis=0) if c else jnp.broadcast_to(a, (S, *a.shape))
            for a, c in zip(vals, cut, strict=True)
        ]

    def keys(m_S):
        return None if rng is None else jax.vmap(lambda m: jax.random.fold_in(rng, m))(m_S)

    def one_fwd(p, x, first, key, *v):
        return stage_fn(p, x, first, key, kw_of(v))

    def one_bwd(p, x, first, key, g, *v):  # the chunk's forward again, inside vjp
        dv_idx = [i for i, d in enumerate(diff) if d]

        def f(p, x, dv):
            full = list(v)
            for i, a in zip(dv_idx, dv, strict=True):
                full[i] = a
            return stage_fn(p, x, first, key, kw_of(full))

        _, vjp = jax.vjp(f, p, x, [v[i] for i in dv_idx])
        return vjp(g)

    def tick(carry, t, do_f, do_b):
        fwd_SbTD, bwd_SbTD, stash, grads, y_buf, dx_buf, dvals, sums, dshared = carry
        first_S = s_S * Lc
        if do_f:
            f_S = t - s_S
            ok_f = (f_S >= 0) & (f_S < M)
            m_f = jnp.clip(f_S, 0, M - 1)
            fwd_SbTD = constrain(fwd_SbTD.at[0].set(x_buf[jnp.clip(t, 0, M - 1)]), act)
            slot = m_f % K  # stash each stage's input until its backward
            keep = jnp.where(ok_f[:, None, None, None], fwd_SbTD, stash[s_S, slot])
            stash = stash.at[s_S, slot].set(keep)
            out_SbTD = jax.vmap(one_fwd, spmd_axis_name="stage")(chunks, fwd_SbTD, first_S, keys(m_f),
                                                                   *stage_values(m_f))  # fmt: skip
            out_SbTD = constrain(out_SbTD, act)
            m, ok = m_f[S - 1], ok_f[S - 1]  # the last stage's finished micro-batch: its loss, its cotangent
            y_bTD = out_SbTD[S - 1]
            y_buf = y_buf.at[m].set(jnp.where(ok, y_bTD, y_buf[m]))
            r = jax.tree.map(lambda a: a[m], tail_rows)
            # the tail once: its value, its input's cotangent and its parameters' gradients from one vjp
            (_, out), (dsh, dy) = jax.value_and_grad(with_loss, argnums=(0, 1), has_aux=True)(read, y_bTD, r)
            sums = jax.tree.map(lambda a, o: a + jnp.where(ok, o, 0).astype(a.dtype), sums, out)
            dshared = jax.tree.map(lambda a, d: a + jnp.where(ok, d, 0).astype(a.dtype), dshared, dsh)
            bwd_SbTD = bwd_SbTD.at[S - 1].set(jnp.where(ok, dy, 0).astype(bwd_SbTD.dtype))
            fwd_SbTD = jnp.roll(out_SbTD, 1, axis=0)
        if do_b:
            b_S = t - (2 * S - 2 - s_S)
            ok_b = (b_S >= 0) & (b_S < M)
            m_b = jnp.clip(b_S, 0, M - 1)
            x_SbTD = constrain(stash[s_S, m_b % K], act)
            g_SbTD = constrain(jnp.where(ok_b[:, None, None, None], bwd_SbTD, 0), act)
            dp, dx_SbTD, dv = jax.vmap(one_bwd, spmd_axis_name="stage")(chunks, x_SbTD, first_S, keys(m_b), g_SbTD,
                                                                         *stage_values(m_b))  # fmt: skip
            grads = [g + jnp.where(ok_b.reshape(S, *(1,) * (d.ndim - 1)), d, 0) for g, d in zip(grads, dp, strict=True)]
            dx_SbTD = constrain(dx_SbTD, act)
            m0, ok0 = m_b[0], ok_b[0]
            dx_buf = dx_buf.at[m0].set(jnp.where(ok0, dx_SbTD[0], dx_buf[m0]))
            dvals = _add_value_cotangents(dvals, dv, ok_b, m_b, [c for c, d in zip(cut, diff, strict=True) if d], S)
            bwd_SbTD = jnp.roll(dx_SbTD, -1, axis=0)  # stage s + 1's input cotangent to stage s
        return (fwd_SbTD, bwd_SbTD, stash, grads, y_buf, dx_buf, dvals, sums, dshared), None

    x_buf = constrain(micro(x_BTD), (None, "batch", "length", None))
    zero_act = jnp.zeros((S, b, T, D), x_BTD.dtype)
    dvals0 = [jnp.zeros_like(a) for a, d in zip(vals, diff, strict=True) if d]
    # the tail's gradients are kept only for the shared leaves it reads (the head's, the final norm's)
    flat, shared_def = jax.tree.flatten(shared)
    rows0 = jax.tree.map(lambda a: a[0], tail_rows)
    jaxpr = jax.make_jaxpr(lambda f, y, r: tail_fn(jax.tree.unflatten(shared_def, f), y, r))(flat, x_buf[0], rows0)
    used = {id(v) for e in jaxpr.jaxpr.eqns for v in e.invars} | {id(v) for v in jaxpr.jaxpr.outvars}
    reads = [id(v) in used and _float(a) for v, a in zip(jaxpr.jaxpr.invars[: len(flat)], flat, strict=True)]
    read = [a for a, u in zip(flat, reads, strict=True) if u]

    def with_loss(read, y, r):  # (summed loss, summed metrics) of the tail given the leaves it reads
        it = iter(read)
        out = tail_fn(jax.tree.unflatten(shared_def, [next(it) if u else a for a, u in zip(flat, reads, strict=True)]),
                      y, r)  # fmt: skip
        return out["loss"], out

    sums0 = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(tail_fn, shared, x_buf[0], rows0))
    carry = (zero_act, zero_act, jnp.zeros((S, K, b, T, D), x_BTD.dtype), [jnp.zeros_like(c) for c in chunks],
             jnp.zeros_like(x_buf), jnp.zeros_like(x_buf), dvals0, sums0, list(map(jnp.zeros_like, read)))  # fmt: skip
    for start, n, do_f, do_b in ((0, S - 1, True, False), (S - 1, M, True, True), (M + S - 1, S - 1, False, True)):
        body = lambda c, t, do_f=do_f, do_b=do_b: tick(c, t, do_f, do_b)
        carry, _ = jax.lax.scan(body, carry, start + jnp.arange(n))
    _, _, _, grads, y_buf, dx_buf, dvals, sums, dshared = carry
    grads = [g.reshape(L, *g.shape[2:]) for g in grads]
    it = iter(dvals)
    dvalues = [(next(it).reshape(a.shape) if d else _zero_cotangent(a)) for a, d in zip(values, diff, strict=True)]
    it = iter(dshared)
    dshared = jax.tree.unflatten(
        shared_def, [next(it) if u else _zero_cotangent(a) for a, u in zip(flat, reads, strict=True)]
    )
    return y_buf.reshape(B, T, D), sums, grads, dx_buf.reshape(B, T, D), dvalues, dshared


def _add_value_cotangents(dvals, dv, ok_b, m_b, cut, S):
    """The kwargs' cotangents of this tick's backwards added in: per micro-batch rows, or whole."""
    out = []
    for acc, d, c in zip(dvals, dv, cut, strict=True):
        d = jnp.where(ok_b.reshape(S, *(1,) * (d.ndim - 1)), d, 0)
        if c:
            for s in range(S):
                acc = acc.at[m_b[s]].add(d[s])
        else:
            acc = acc + d.sum(0)
        out.append(acc)
    return out
