"""DeepSeek-V3's mixture of experts (sigmoid routing with a balance bias, group-limited top-k,
aux-loss-free balancing, first-k dense layers) and multi-token prediction, against a NumPy
transcription of Hugging Face's `DeepseekV3TopkRouter` (transformers 4.57), the paper's update
rule on counted loads, and a hand-written loop over the MTP modules' parts."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import moe


def hf_topk_router(logits, bias, k, n_group, topk_group, norm_topk_prob, scaling):
    """DeepseekV3TopkRouter.forward after its linear layer, line by line in NumPy (float64)."""
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    choice = scores + bias[None, :]
    M, E = choice.shape
    group_scores = np.sort(choice.reshape(M, n_group, E // n_group), axis=-1)[..., -2:].sum(-1)
    group_idx = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
    group_mask = np.zeros_like(group_scores)
    np.put_along_axis(group_mask, group_idx, 1, axis=1)
    score_mask = np.repeat(group_mask, E // n_group, axis=-1).astype(bool)
    choice = np.where(score_mask, choice, 0.0)  # masked_fill(~score_mask, 0.0)
    idx = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, idx, axis=-1)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * scaling, idx


@pytest.mark.parametrize(
    "E, k, groups, per_token, normalize, scaling",
    [(8, 2, 1, 1, True, 1.0), (16, 4, 4, 2, True, 2.5), (12, 3, 3, 1, False, 1.5)],
)
def test_sigmoid_router_equals_hugging_faces(E, k, groups, per_token, normalize, scaling):
    rng = np.random.default_rng(E + k)
    logits = rng.normal(size=(64, E)).astype(np.float32)
    # a bias large enough to change choices, negative ones included (a masked group's 0.0 may then win)
    bias = (rng.normal(size=E) * 0.6).astype(np.float32)
    want_w, want_e = hf_topk_router(logits, bias.astype(np.float64), k, groups, per_token, normalize, scaling)
    w, e, p = moe.route_sigmoid(jnp.asarray(logits), jnp.asarray(bias), k, num_groups=groups,
                                groups_per_token=per_token, normalize=normalize, scaling=scaling)  # fmt: skip
    order = np.argsort(np.asarray(e), axis=-1)  # the sets, whatever the order within a token
    want_order = np.argsort(want_e, axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(e), order, -1), np.sort(want_e, -1))
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(w), order, -1), np.take_along_axis(want_w, want_order, -1), rtol=1e-5
    )
    np.testing.assert_allclose(np.asarray(p).sum(-1), 1.0, rtol=1e-5)
    if groups > 1:  # the groups matter here: some token's choice differs from a plain top-k's
        _, plain = hf_topk_router(logits, bias.astype(np.float64), k, 1, 1, normalize, scaling)
        assert (np.sort(plain, -1) != np.sort(want_e, -1)).any()


def test_balance_rule_moves_each_bias_towards_the_mean_load():
    bias = jnp.asarray([[0.0, 0.5, -0.5, 0.0]])
    load = jnp.asarray([[3.0, 1.0, 2.0, 2.0]])  # mean 2
    np.testing.assert_allclose(moe.balance_biases(bias, load, 0.1), [[-0.1, 0.6, -0.5, 0.0]], rtol=1e-6)
