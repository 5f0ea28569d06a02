"""Parameters cast once before a decoding loop, where the loop would cast them at every step.

A model whose parameters are float32 and whose compute dtype is bfloat16 casts each kernel where it
reads it (`kernel.astype(dtype)`). Inside a decoding loop (`lax.while_loop`, `lax.fori_loop`) that cast
is loop-invariant, but XLA's GPU compiler leaves it in the loop's body: every step reads each float32
kernel, writes it in bfloat16 and reads it again. At the 1.3B GPT-2 shape that is 10 of the 14 GB a
decoding step moves (H100, deviceless compile). `cast_once` finds, from the step's program, the
parameters that every use casts to one narrower dtype and casts them before the loop, so the step
reads them as they are.

It is exact: a parameter is cast only where each of its uses in the step converts it to that dtype,
directly or after selecting from it (a gather, a slice, a reshape: selection commutes with the cast),
so the step computes the same values bit for bit. A parameter read as it is anywhere (a norm's scale
in float32, a router's kernel) keeps its dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# Ops that pick or rearrange elements of their first operand without changing a value (and select_n, of
# its cases): a cast after them equals the same cast before them.
_SELECTIONS = {
    "gather", "dynamic_slice", "slice", "reshape", "squeeze", "expand_dims", "transpose", "broadcast_in_dim",
    "copy", "copy_p", "sharding_constraint",
}  # fmt: skip
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}


def _open(jaxpr):
    return getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr's jaxpr, or a Jaxpr itself


def cast_targets(jaxpr, var, outputs: Callable | None = None) -> set | None:
    """The dtypes that the uses of `var` in `jaxpr` convert it to, or None where some use reads it as it
    is (or through an op this does not follow). An unused var gives the empty set.

    Args:
        jaxpr (Jaxpr): a jaxpr.
        var (Var): one of its variables.
        outputs: for a jaxpr called from another, k -> the targets of its k-th output where it is
            called; None: an output is read as it is.

    Returns:
        The set of dtypes, or None.
    """
    targets = set()
    for k, v in enumerate(jaxpr.outvars):
        if v is var:
            found = None if outputs is None else outputs(k)
            if found is None:
                return None
            targets |= found
    for eqn in jaxpr.eqns:
        for pos, v in enumerate(eqn.invars):
            if v is not var:
                continue
            name = eqn.primitive.name
            if name == "convert_element_type":
                found = {np.dtype(eqn.params["new_dtype"])}
            elif (name in _SELECTIONS and pos == 0) or (name == "select_n" and pos > 0):
                found = cast_targets(jaxpr, eqn.outvars[0], outputs)
            elif name in _CALLS and _CALLS[name] in eqn.params:
                inner = _open(eqn.params[_CALLS[name]])
                outer = lambda k, eqn=eqn: cast_targets(jaxpr, eqn.outvars[k], outputs)
                found = cast_targets(inner, inner.invars[pos], outer)
            else:
                found = None
            if found is None:
                return None
            targets |= found
    return targets


def cast_plan(model: nnx.Module, dtype, step: Callable, *args) -> dict[int, np.dtype]:
    """Which floating parameters wider than `dtype` `step(model, *args)` only reads cast to one narrower
    dtype, and that dtype.

    Args:
        model: an NNX module (its arrays concrete or traced).
        dtype (str | numpy.dtype): the model's compute dtype: only parameters wider than it are looked
            at (none for a float32 model computing in float32, whose step is then not traced).
        step: (model, *args) -> anything: one step of the loop, as the loop runs it.
        *args (object): the step's other arguments (arrays, or `jax.ShapeDtypeStruct`s): only their
            shapes are used, to trace the step once more.

    Returns:
        {index of the parameter in `jax.tree.leaves(nnx.state(model))`: the dtype to store it in}.
    """
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    size = jnp.dtype(dtype).itemsize
    wide = [i for i, a in enumerate(leaves) if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize > size]
    if not wide:
        return {}

    def run(leaves, args):
        return step(nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), *args)

    jaxpr = jax.make_jaxpr(run)(leaves, args).jaxpr
    plan = {}
    for i in wide:
        targets = cast_targets(jaxpr, jaxpr.invars[i])
        if targets and len(targets) == 1 and (to := targets.pop()).itemsize < leaves[i].dtype.itemsize:
            plan[i] = to
    return plan


def apply_plan(tree, plan: dict[int, np.dtype]) -> object:
    """`tree` with the leaves `plan` names cast (`cast_plan`); the others are `tree`'s own arrays.

    Args:
        tree (object): a module's state (or its leaves in any pytree of the same order).
        plan: {leaf index: dtype}, as `cast_plan` gives it.

    Returns:
        The tree, its planned leaves cast.
    """
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [a.astype(plan[i]) if i in plan else a for i, a in enumerate(leaves)])


def cast_once(model: nnx.Module, dtype, step: Callable, *args) -> nnx.Module:
    """`model` with each parameter that `step(model, *args)` only reads cast to one narrower dtype
    stored in that dtype (`cast_plan`): give it to the loop that runs `step`.

    Args:
        model: an NNX module (its arrays concrete or traced).
        dtype (str | numpy.dtype): the model's compute dtype.
        step: (model, *args) -> anything: one step of the loop.
        *args (object): the step's other arguments (arrays or `jax.ShapeDtypeStruct`s).

    Returns:
        A module over the same graph, or `model` itself when no parameter is cast.
    """
    plan = cast_plan(model, dtype, step, *args)
    if not plan:
        return model
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, apply_plan(state, plan))
