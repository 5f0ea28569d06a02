"""What the pipeline scripts share (pipeline_check.py, pipeline_memory.py, pipeline_bubble.py): a
random language-model batch, the jitted gradient of a config's mean loss under its pipeline schedule,
and the gradients' worst relative error against one device's. Imported by those scripts (this folder is
on their path); each sets its own fake CPU device count before JAX starts.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxformer import config as C
from jaxformer import pipeline, sharding
from jaxformer.state import init_state
from jaxformer.train import loss_sums


def random_batch(B: int, T: int, vocab: int = 64) -> dict:
    """Ids in [1, vocab) for inputs, targets and an encoder's source, all weights 1 (seed 0)."""
    rng = np.random.default_rng(0)
    ids = lambda: rng.integers(1, vocab, (B, T)).astype(np.int32)
    return {"inputs": ids(), "targets": ids(), "weights": np.ones((B, T), np.float32), "src": ids()}


def loss_and_grads(cfg: C.Config, devices=None):
    """The jitted gradient of the mean loss, as the train step traces it, compiled on `cfg`'s mesh
    over `devices`; the compiled program, the first batch's loss and its gradients by path."""
    B, T = cfg.train.batch_size, cfg.data.max_len
    mesh = sharding.make_mesh(cfg.mesh, devices)
    with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
        graphdef, state, _ = init_state(cfg, mesh)
        batch = sharding.global_batch(random_batch(B, T), mesh, B)

        def mean_loss(params):
            with pipeline.schedule(cfg.train.grad_accum, cfg.mesh.virtual_stages, cfg.mesh.schedule):
                loss, sums = loss_sums(nnx.merge(graphdef, params), cfg.train, batch, None)
            return loss / sums["count"]

        step = jax.jit(jax.value_and_grad(mean_loss)).lower(state.params).compile()
        loss, grads = step(state.params)
    flat = {jax.tree_util.keystr(p): np.asarray(g) for p, g in jax.tree_util.tree_leaves_with_path(grads)}
    return step, float(loss), flat


def worst_gradient_error(grads: dict, reference: dict) -> float:
    """The largest relative error of any gradient against the reference's (the key bias's gradient,
    zero in exact arithmetic, left out: rounding noise only)."""
    return max(
        float(np.max(np.abs(grads[k] - g)) / (np.max(np.abs(g)) + 1e-12))
        for k, g in reference.items()
        if "k_bias" not in k
    )
