"""The public API is enough to build and train a user's own NNX module: the example of
docs/guides/concepts.md ("Using the pieces in your own JAX code"), taken from the page as written."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guides" / "concepts.md"
(EXAMPLE,) = [b for b in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S) if "class MyClassifier" in b]
_namespace = {}
exec(compile(EXAMPLE, str(GUIDE), "exec"), _namespace)
MyClassifier = _namespace["MyClassifier"]


def test_user_module_trains_one_step_with_plain_optax():
    model = MyClassifier(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ids = jnp.array([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    labels = jnp.array([0, 1, 1])

    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(ids), labels).mean()

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss, grads

    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    loss0, grads = step(model, optimizer)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    after = nnx.state(model, nnx.Param)
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), before, after))
    assert all(changed), "every parameter, ours and the user's, is updated"
    assert float(loss_fn(model)) < float(loss0)
