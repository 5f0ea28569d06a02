"""The public API is enough to build and train a user's own NNX module (the README's example)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxformer as jf
from jaxformer import functional as F


class MyClassifier(nnx.Module):
    def __init__(self, rngs):
        cfg = jf.tiny("encoder_only", d_model=32, num_heads=4)
        self.embed = nnx.Embed(100, 32, rngs=rngs)
        self.block = jf.EncoderLayer(cfg, rngs=rngs)  # one of our layers
        self.query = nnx.Param(jax.random.normal(rngs.params(), (1, 1, 4, 8)))
        self.out = nnx.Linear(32, 2, rngs=rngs)

    def __call__(self, ids):  # [B, S]
        x = self.block(self.embed(ids), mask=F.padding_mask(ids), positions_BT=jnp.zeros_like(ids))
        k = x.reshape(*x.shape[:2], 4, 8)  # [B, S, H, K]
        q = jnp.broadcast_to(self.query[...], (x.shape[0], 1, 4, 8))
        pooled = F.dot_product_attention(q, k, k, mask=F.padding_mask(ids))  # our attention
        return self.out(pooled.reshape(x.shape[0], 32))


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
