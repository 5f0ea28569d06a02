"""NNX layers against flax's own layers and against invariants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxformer as jf
from jaxformer import functional as F
from jaxformer import layers


def test_attention_equals_flax_multihead_attention():
    cfg = jf.tiny("encoder_only", d_model=16, num_heads=4)
    ours = jf.MultiHeadAttention(cfg, rngs=nnx.Rngs(0))
    ref = nnx.MultiHeadAttention(num_heads=4, in_features=16, qkv_features=16, decode=False, rngs=nnx.Rngs(1))
    # Same layout ([D, H, K] in, [H, K, D] out): copy our weights into flax's layer.
    for name in ("query", "key", "value", "out"):
        mine = {"query": "q", "key": "k", "value": "v", "out": "o"}[name]
        getattr(ref, name).kernel[...] = getattr(ours, mine)[...]
        getattr(ref, name).bias[...] = getattr(ours, f"{mine}_bias")[...]
    x = jax.random.normal(jax.random.key(0), (2, 6, 16))
    memory = jax.random.normal(jax.random.key(1), (2, 5, 16))
    mask = F.padding_mask(jnp.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]))
    np.testing.assert_allclose(ours(x), ref(x, deterministic=True), atol=1e-5)
    np.testing.assert_allclose(
        ours(x, memory, mask=mask), ref(x, memory, memory, mask=mask, deterministic=True), atol=1e-5
    )


@pytest.mark.parametrize("G", [1, 2])
def test_grouped_query_attention_equals_mha_with_shared_heads(G):
    gqa_cfg = jf.tiny("encoder_only", d_model=16, num_heads=4, num_kv_heads=G, position="rope")
    gqa = jf.MultiHeadAttention(gqa_cfg, rngs=nnx.Rngs(0))
    mha = jf.MultiHeadAttention(gqa_cfg.replace(num_kv_heads=None), rngs=nnx.Rngs(1))
    for name in ("q", "o", "q_bias", "o_bias"):
        getattr(mha, name)[...] = getattr(gqa, name)[...]
    for name, axis in (("k", 1), ("v", 1), ("k_bias", 0), ("v_bias", 0)):  # each kv head serves 4 // G query heads
        getattr(mha, name)[...] = jnp.repeat(getattr(gqa, name)[...], 4 // G, axis=axis)
    x = jax.random.normal(jax.random.key(0), (2, 6, 16))
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    np.testing.assert_allclose(gqa(x, positions_BT=pos), mha(x, positions_BT=pos), atol=1e-5)


def test_embedding_scaling_and_tied_logits():
    cfg = jf.tiny("decoder_only", vocab_size=10, d_model=16)
    emb = jf.Embed(cfg, rngs=nnx.Rngs(0))
    ids = jnp.array([[3, 1, 9]])
    table = np.asarray(emb.embedding[...])
    np.testing.assert_allclose(emb(ids), table[np.asarray(ids)] * 4.0, rtol=1e-6)  # sqrt(16) = 4
    x = jax.random.normal(jax.random.key(0), (1, 3, 16))
    np.testing.assert_allclose(emb.attend(x), np.asarray(x) @ table.T, rtol=1e-5, atol=1e-5)


def test_out_of_range_token_ids_are_rejected():
    cfg = jf.tiny("decoder_only", vocab_size=10)
    emb = jf.Embed(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"token id 10 .* outside the vocabulary \[0, 10\)"):
        emb(jnp.array([[1, 10]]))
    with pytest.raises(ValueError, match="token id -1"):
        emb(jnp.array([[-1, 2]]))

    @jax.jit
    def embed(state, ids):
        return nnx.merge(graphdef, state)(ids)

    graphdef, state = nnx.split(emb)
    with pytest.raises(Exception, match=r"token id 12 .* outside the vocabulary"):
        embed(state, jnp.array([[1, 12]])).block_until_ready()
    unchecked = jf.Embed(cfg.replace(check_token_ids=False), rngs=nnx.Rngs(0))
    unchecked(jnp.array([[1, 12]]))  # the documented escape hatch: JAX clamps silently


ID_TRANSFORMS = {  # what a user wraps a model call in; `checked` goes outside
    "jit": lambda f: jax.jit(f),
    "grad": lambda f: jax.jit(jax.grad(lambda p, x: f(p, x).sum())),
    "vmap": lambda f: jax.jit(jax.vmap(f, in_axes=(None, 0))),
    "scan": lambda f: jax.jit(lambda p, xs: jax.lax.scan(lambda c, x: (c + f(p, x).sum(), None), 0.0, xs)[0]),
}


@pytest.mark.parametrize("transform", ID_TRANSFORMS)
def test_checked_gives_our_error_first_under_the_users_transforms(transform, caplog):
    """Under the user's own jit (grad, vmap, scan), `checked` raises the ValueError naming the id and
    the range, as its whole message; unwrapped, JAX's error only ends with it. Either way the message
    is said once: JAX's log of the failed callback (its traceback) is not printed beside it."""
    model = jf.build_model(jf.tiny("decoder_only", vocab_size=10, max_len=8))
    graphdef, params = nnx.split(model)
    fn = ID_TRANSFORMS[transform](lambda p, x: nnx.merge(graphdef, p)(x))
    bad = jnp.array([[1, 12, 3]])
    bad = bad[None].repeat(2, 0) if transform in ("vmap", "scan") else bad
    with pytest.raises(ValueError) as error:
        jf.checked(fn)(params, bad)
    assert str(error.value) == "token id 12 at index (0, 1) is outside the vocabulary [0, 10)"
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"(?s)^INTERNAL: .*token id 12 at index \(0, 1\)"):
        jax.block_until_ready(fn(params, bad))
    assert jf.checked(fn)(params, bad % 10) is not None  # good ids: the results
    assert not [r for r in caplog.records if "callback failed" in r.getMessage()]


def test_unchecked_models_compile_without_a_callback():
    """`without_id_checks` (the train and decode steps) gives the program of a model built with
    check_token_ids=False: no host callback, no check; a checked model's program has the callback."""
    cfg = jf.tiny("decoder_only", vocab_size=10, max_len=8)
    ids = jnp.array([[1, 2, 3]])

    def lowered(model):
        graphdef, params = nnx.split(model)
        return jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)).lower(params, ids).as_text()

    checked = lowered(jf.build_model(cfg))
    unchecked = lowered(layers.without_id_checks(jf.build_model(cfg)))
    assert "callback" in checked
    assert "callback" not in unchecked
    assert unchecked == lowered(jf.build_model(cfg.replace(check_token_ids=False)))


def test_feed_forward_activations_match_manual():
    for activation in ("relu", "gelu", "swiglu"):
        cfg = jf.tiny("encoder_only", activation=activation)
        ffn = jf.FeedForward(cfg, rngs=nnx.Rngs(0))
        x = np.asarray(jax.random.normal(jax.random.key(0), (2, 3, 16)))
        up = x @ np.asarray(ffn.wi[...]) + np.asarray(ffn.wi_bias[...])
        if activation == "swiglu":
            gate = x @ np.asarray(ffn.wi_gate[...]) + np.asarray(ffn.wi_gate_bias[...])
            h = gate / (1 + np.exp(-gate)) * up
        else:
            h = np.asarray(F.ACTIVATIONS[activation](jnp.asarray(up)))
        ref = h @ np.asarray(ffn.wo[...]) + np.asarray(ffn.wo_bias[...])
        np.testing.assert_allclose(ffn(jnp.asarray(x)), ref, atol=1e-5, err_msg=activation)


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_encoder_layer_composition(norm_position):
    """post: LN(x + Sublayer(x)); pre: x + Sublayer(LN(x)), checked by composing the sublayers by hand."""
    cfg = jf.tiny("encoder_only", norm_position=norm_position, norm="rmsnorm")
    layer = jf.EncoderLayer(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 4, 16))
    pos = jnp.broadcast_to(jnp.arange(4), (2, 4))
    n1, n2 = layer.self_attn_res.norm, layer.ffn_res.norm
    if norm_position == "post":
        h = n1(x + layer.self_attn(x))
        ref = n2(h + layer.ffn(h))
    else:
        h = x + layer.self_attn(n1(x))
        ref = h + layer.ffn(n2(h))
    np.testing.assert_allclose(layer(x, mask=None, positions_BT=pos), ref, atol=1e-6)


def test_materialized_grad_is_the_identity_in_value_and_gradient():
    from jaxformer.layers import materialized_grad

    x = jnp.arange(6.0).reshape(2, 3)
    for g in (jnp.full((2, 3), 0.5), jnp.array([[jnp.nan, -0.0, 1.0], [jnp.inf, 2.0, -3.0]])):  # either branch
        y, vjp = jax.jit(lambda x: jax.vjp(materialized_grad, x))(x)
        np.testing.assert_array_equal(y, x)
        np.testing.assert_array_equal(jax.jit(vjp)(g)[0], g)
