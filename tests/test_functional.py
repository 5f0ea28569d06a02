"""The pure maths against NumPy transcriptions of the formulas and library references."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxformer import functional as F
from jaxformer.attention import kernels

# Tolerances: float32 matches references to rounding; bfloat16 inputs carry ~3 significant digits.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def numpy_attention(q, k, v, mask=None, bias=None):
    """softmax(Q K^T / sqrt(K) + bias) V in float64 NumPy, heads of k/v repeated for GQA."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    H, G = q.shape[2], k.shape[2]
    k, v = np.repeat(k, H // G, axis=2), np.repeat(v, H // G, axis=2)
    logits = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    if mask is not None:
        logits = np.where(mask, logits, -np.inf)
    logits = logits - logits.max(-1, keepdims=True)
    w = np.exp(logits)
    w = w / w.sum(-1, keepdims=True)
    return np.einsum("bhts,bshk->bthk", w, v), w


def qkv(dtype, B=2, T=5, S=7, H=4, G=4, K=8, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (B, T, H, K), dtype),
        jax.random.normal(kk, (B, S, G, K), dtype),
        jax.random.normal(kv, (B, S, G, K), dtype),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("G", [4, 2, 1])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_matches_numpy_and_jax(dtype, G, masked):
    q, k, v = qkv(dtype, G=G)
    mask = None
    if masked:  # key padding on the second row and a causal-like band
        pad = F.padding_mask(jnp.array([[1] * 7, [1] * 4 + [0] * 3]))
        mask = F.combine_masks(pad, F.causal_mask(5, 7, offset=2))
    out, w = F.dot_product_attention(q, k, v, mask=mask, return_weights=True)
    ref, ref_w = numpy_attention(q, k, v, None if mask is None else np.asarray(mask))
    assert out.dtype == dtype and w.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=TOL[dtype], rtol=TOL[dtype])
    np.testing.assert_allclose(np.asarray(w), ref_w, atol=TOL[jnp.float32])
    lib = jax.nn.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(lib, np.float32), atol=TOL[dtype])
    routed = F.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    np.testing.assert_allclose(np.asarray(routed, np.float32), np.asarray(out, np.float32), atol=TOL[dtype])
    k_BGSK, v_BGSK = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # a KV cache's heads-major layout
    for impl in ("naive", "xla"):
        heads_major = F.dot_product_attention(q, k_BGSK, v_BGSK, kv_layout="BGSK", mask=mask, implementation=impl)
        np.testing.assert_allclose(np.asarray(heads_major, np.float64), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_attention_additive_bias():
    q, k, v = qkv(jnp.float32)
    bias = jax.random.normal(jax.random.key(3), (1, 4, 5, 7))
    out = F.dot_product_attention(q, k, v, bias=bias)
    np.testing.assert_allclose(out, numpy_attention(q, k, v, bias=bias)[0], atol=TOL[jnp.float32])


@pytest.mark.parametrize("implementation", ["naive", "xla"])
def test_fully_masked_row_gives_zeros_not_nan(implementation):
    q, k, v = qkv(jnp.float32)
    mask = jnp.ones((2, 1, 5, 7), bool).at[:, :, 1, :].set(False)

    def loss(q):
        return F.dot_product_attention(q, k, v, mask=mask, implementation=implementation).sum()

    out = F.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
    assert np.all(np.asarray(out[:, 1]) == 0.0)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(jax.grad(loss)(q)))


def test_attention_dropout_is_unbiased_and_keyed():
    q, k, v = qkv(jnp.float32, B=1)
    clean = F.dot_product_attention(q, k, v)
    keys = jax.random.split(jax.random.key(1), 4000)
    drop = jax.vmap(lambda r: F.dot_product_attention(q, k, v, dropout_rate=0.3, dropout_rng=r))(keys)
    assert not np.allclose(drop[0], drop[1])  # different keys, different masks
    single = F.dot_product_attention(q, k, v, dropout_rate=0.3, dropout_rng=keys[0])
    np.testing.assert_allclose(drop[0], single, rtol=1e-6, atol=1e-6)  # the key alone decides the mask
    np.testing.assert_allclose(drop.mean(0), clean, atol=0.05)  # inverted dropout keeps the expectation
    no_key = F.dot_product_attention(q, k, v, dropout_rate=0.3, dropout_rng=None)
    np.testing.assert_array_equal(no_key, clean)


def test_forced_backend_refuses_weights():
    q, k, v = qkv(jnp.float32)
    with pytest.raises(ValueError, match="cannot return weights"):
        F.dot_product_attention(q, k, v, return_weights=True, implementation="xla")
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        F.dot_product_attention(q, k[:, :, :3], v[:, :, :3])


def test_masks():
    ids = jnp.array([[5, 6, 0], [7, 0, 0]])
    np.testing.assert_array_equal(F.padding_mask(ids)[:, 0, 0], np.array([[1, 1, 0], [1, 0, 0]], bool))
    np.testing.assert_array_equal(F.causal_mask(3)[0, 0], np.tril(np.ones((3, 3), bool)))
    np.testing.assert_array_equal(F.causal_mask(2, 4, offset=2)[0, 0], np.tril(np.ones((2, 4), bool), k=2))
    cross = F.cross_attention_mask(ids, jnp.array([[1, 2], [3, 0]]))
    assert cross.shape == (2, 1, 3, 2)
    np.testing.assert_array_equal(cross[1, 0], np.array([[1, 0], [0, 0], [0, 0]], bool))
    seg = F.segment_mask(jnp.array([[1, 1, 2, 0]]), jnp.array([[1, 1, 2, 0]]))[0, 0]
    np.testing.assert_array_equal(seg, np.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]], bool))
    both = F.combine_masks(F.padding_mask(ids), None, F.causal_mask(3))
    assert both.shape == (2, 1, 3, 3) and F.combine_masks(None, None) is None


def test_sinusoidal_table_is_the_papers_formula():
    T, D = 50, 16
    ref = np.zeros((T, D))
    for pos in range(T):
        for i in range(D // 2):
            ref[pos, 2 * i] = np.sin(pos / 10000 ** (2 * i / D))
            ref[pos, 2 * i + 1] = np.cos(pos / 10000 ** (2 * i / D))
    np.testing.assert_allclose(F.sinusoidal_positions(T, D), ref, atol=1e-5)


def test_rope_preserves_norm_and_depends_on_relative_position():
    B, H, K = 1, 2, 8
    q = jax.random.normal(jax.random.key(0), (B, 1, H, K))
    k = jax.random.normal(jax.random.key(1), (B, 1, H, K))

    def rotated(x, pos):
        return F.apply_rope(x, jnp.full((B, 1), pos))

    np.testing.assert_allclose(jnp.linalg.norm(rotated(q, 17), axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)

    def score(m, n):
        return jnp.einsum("bthk,bthk->bh", rotated(q, m), rotated(k, n))

    np.testing.assert_allclose(score(3, 1), score(103, 101), rtol=1e-4)
    np.testing.assert_allclose(score(5, 5), jnp.einsum("bthk,bthk->bh", q, k), rtol=1e-5)
    assert not np.allclose(score(3, 1), score(1, 3))


def test_activations_match_formulas():
    x = jnp.linspace(-4, 4, 101)
    np.testing.assert_array_equal(F.relu(x), np.maximum(np.asarray(x), 0))
    c = np.sqrt(2 / np.pi)
    xn = np.asarray(x, np.float64)
    np.testing.assert_allclose(F.gelu(x), 0.5 * xn * (1 + np.tanh(c * (xn + 0.044715 * xn**3))), atol=1e-6)
    np.testing.assert_allclose(F.swiglu(x, 2 * x), xn / (1 + np.exp(-xn)) * 2 * xn, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norms_match_flax(dtype):
    x = (3 * jax.random.normal(jax.random.key(0), (2, 5, 16)) + 1).astype(dtype)
    scale = jax.random.normal(jax.random.key(1), (16,))
    bias = jax.random.normal(jax.random.key(2), (16,))
    ln = nnx.LayerNorm(16, epsilon=1e-6, dtype=jnp.float32, rngs=nnx.Rngs(0))
    ln.scale[...], ln.bias[...] = scale, bias
    rms = nnx.RMSNorm(16, epsilon=1e-6, dtype=jnp.float32, rngs=nnx.Rngs(0))
    rms.scale[...] = scale
    x32 = x.astype(jnp.float32)
    tol = TOL[dtype]
    np.testing.assert_allclose(F.layer_norm(x, scale, bias).astype(jnp.float32), ln(x32), atol=tol, rtol=tol)
    np.testing.assert_allclose(F.rms_norm(x, scale).astype(jnp.float32), rms(x32), atol=tol, rtol=tol)


def test_cross_entropy_matches_optax_with_smoothing_and_zloss():
    B, T, V = 3, 4, 11
    logits = jax.random.normal(jax.random.key(0), (B, T, V)) * 3
    labels = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    weights = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], jnp.float32)
    loss, w = F.cross_entropy(logits, labels, weights, label_smoothing=0.1, z_loss=1e-3)
    targets = optax.smooth_labels(jax.nn.one_hot(labels, V), 0.1)
    ref = optax.softmax_cross_entropy(logits, targets) + 1e-3 * jax.nn.logsumexp(logits, -1) ** 2
    np.testing.assert_allclose(loss, ref * weights, rtol=1e-5)
    np.testing.assert_array_equal(w, weights)
    plain, _ = F.cross_entropy(logits, labels)
    np.testing.assert_allclose(plain, optax.softmax_cross_entropy_with_integer_labels(logits, labels), rtol=1e-5)


def test_top1_correct_matches_argmax_and_counts_ties():
    logits = jax.random.normal(jax.random.key(0), (4, 6, 9))
    labels = jax.random.randint(jax.random.key(1), (4, 6), 0, 9)
    labels = labels.at[0].set(jnp.argmax(logits[0], -1))  # a row of hits besides random guesses
    np.testing.assert_array_equal(F.top1_correct(logits, labels), jnp.argmax(logits, -1) == labels)
    tied = jnp.zeros((1, 1, 5))
    assert bool(F.top1_correct(tied, jnp.array([[3]]))[0, 0])


def test_every_function_under_jit_grad_vmap():
    q, k, v = qkv(jnp.float32)
    mask = F.combine_masks(F.padding_mask(jnp.ones((2, 7), jnp.int32)), F.causal_mask(5, 7))
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    scale, bias = jnp.ones(8), jnp.zeros(8)
    labels = jnp.zeros((2, 5), jnp.int32)
    fns = {
        "attention": lambda q: F.dot_product_attention(q, k, v, mask=mask),
        "attention_dropout": lambda q: F.dot_product_attention(
            q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0)
        ),
        "rope": lambda q: F.apply_rope(q, pos),
        "relu": F.relu,
        "gelu": F.gelu,
        "swiglu": lambda q: F.swiglu(q, q),
        "layer_norm": lambda q: F.layer_norm(q, scale, bias),
        "rms_norm": lambda q: F.rms_norm(q, scale),
        "cross_entropy": lambda q: F.cross_entropy(q.reshape(2, 5, 32), labels, label_smoothing=0.1)[0],
        "dropout": lambda q: F.dropout(q, 0.2, jax.random.key(1)),
    }
    for name, f in fns.items():
        eager = f(q)
        np.testing.assert_allclose(jax.jit(f)(q), eager, atol=1e-5, err_msg=name)
        g = jax.grad(lambda q, f=f: f(q).sum())(q)
        assert np.all(np.isfinite(g)), name
    # vmap over the batch axis of every array argument equals the batched call.
    per_example = jax.vmap(
        lambda qi, ki, vi, mi, pi: (
            F.dot_product_attention(qi[None], ki[None], vi[None], mask=mi[None])[0]
            + F.apply_rope(qi[None], pi[None])[0]
        )
    )(q, k, v, jnp.broadcast_to(mask, (2, 1, 5, 7)), pos)
    np.testing.assert_allclose(per_example, fns["attention"](q) + fns["rope"](q), atol=1e-5)
    pe = jax.jit(F.sinusoidal_positions, static_argnums=(0, 1))(10, 8)
    np.testing.assert_allclose(pe, F.sinusoidal_positions(10, 8))


# ----------------------------------------------------------------------------- structured masks


def test_mask_structure_means_the_dense_masks():
    """Each field of `Mask` gives the dense mask the old helpers (and the paper) define."""
    ids = jnp.array([[5, 6, 0, 0], [7, 8, 9, 0]])
    lengths = jnp.array([2, 3])
    dense = lambda m, T=4, S=4: np.asarray(m.dense(T, S))
    np.testing.assert_array_equal(dense(F.Mask(kv_lengths=lengths)), np.asarray(F.padding_mask(ids)).repeat(4, 2))
    np.testing.assert_array_equal(dense(F.Mask(causal=True))[0, 0], np.tril(np.ones((4, 4), bool)))
    both = F.combine_masks(F.padding_mask(ids), F.causal_mask(4))
    np.testing.assert_array_equal(dense(F.Mask(causal=True, kv_lengths=lengths)), np.asarray(both))
    q_pad = dense(F.Mask(q_lengths=lengths, kv_lengths=lengths))
    np.testing.assert_array_equal(q_pad, np.asarray(F.cross_attention_mask(ids, ids)))
    segs = jnp.array([[1, 1, 2, 0], [1, 2, 2, 3]])
    np.testing.assert_array_equal(dense(F.Mask(q_segments=segs, kv_segments=segs)), F.segment_mask(segs, segs))
    offset = dense(F.Mask(causal=True, q_offset=jnp.array([2, 0])), T=2)
    np.testing.assert_array_equal(offset[0, 0], np.tril(np.ones((2, 4), bool), k=2))
    np.testing.assert_array_equal(offset[1, 0], np.tril(np.ones((2, 4), bool)))
    one_step = F.causal_cache_mask(jnp.array([[2], [0]]))  # one new position per row: a key length
    assert not one_step.causal and one_step.kv_lengths.tolist() == [3, 1]
    assert F.causal_cache_mask(None) == F.Mask(causal=True)  # a prefill: the plain causal mask
    assert F.as_mask(F.Mask()) is None


def structured_cases():
    """Every kind of mask the models use, at even lengths (cuDNN wants them with a bias): (name, T, S, mask)."""
    T, S = 6, 8
    seg_q = jnp.array([[1, 1, 2, 2, 0, 0], [1, 2, 2, 3, 3, 3]])
    seg_kv = jnp.array([[1, 1, 1, 2, 2, 0, 0, 0], [1, 2, 2, 2, 3, 3, 3, 3]])
    return [
        ("padded bidirectional", S, S, F.Mask(kv_lengths=jnp.array([8, 4]))),
        ("padded queries and keys", S, S, F.Mask(q_lengths=jnp.array([8, 4]), kv_lengths=jnp.array([8, 4]))),
        ("causal", S, S, F.Mask(causal=True)),
        ("causal, padded", S, S, F.Mask(causal=True, kv_lengths=jnp.array([8, 3]))),
        ("cross, T != S", T, S, F.Mask(kv_lengths=jnp.array([7, 2]))),
        ("packed self", T, T, F.Mask(causal=True, q_segments=seg_q, kv_segments=seg_q)),
        ("packed cross", T, S, F.Mask(q_segments=seg_q, kv_segments=seg_kv)),
        ("prefill into a cache", T, S, F.causal_cache_mask(None)),
        ("cache, one step", 1, S, F.causal_cache_mask(jnp.array([[3], [7]]))),
        ("cache, several steps", 2, S, F.causal_cache_mask(jnp.array([[3, 4], [0, 1]]))),
        ("no keys in a row", T, S, F.Mask(kv_lengths=jnp.array([0, 5]))),
    ]


@pytest.mark.parametrize("case", range(len(structured_cases())), ids=[c[0] for c in structured_cases()])
@pytest.mark.parametrize("G", [4, 1])
def test_xla_path_given_structure_equals_the_reference(case, G):
    """The fused path ("xla": `jax.nn.dot_product_attention` told is_causal and lengths) equals the
    einsum reference on the dense mask, values and gradients, in float32 at pinned precision."""
    _, T, S, mask = structured_cases()[case]
    q, k, v = qkv(jnp.float32, T=T, S=S, G=G)

    @jax.jit  # both paths in one program, the mask's arrays its arguments: eagerly, 4x the CPU time
    def both(q, k, v, mask):
        def run(impl):
            f = lambda q, k, v: F.dot_product_attention(q, k, v, mask=mask, implementation=impl)
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(jnp.cos(out))

        return run("naive"), run("xla")

    with jax.default_matmul_precision("highest"):
        (ref, ref_grads), (fused, grads) = both(q, k, v, mask)
    np.testing.assert_allclose(fused, ref, atol=1e-5)
    for g, rg in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, rg, atol=1e-5)
    dense = mask.dense(T, S)
    np.testing.assert_allclose(ref, numpy_attention_zeroing(q, k, v, dense), atol=1e-5)


def numpy_attention_zeroing(q, k, v, dense):
    """The NumPy reference with rows that see no key set to zero (as jaxformer defines them)."""
    full = np.broadcast_to(np.asarray(dense), (q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
    out, _ = numpy_attention(q, k, v, np.where(full.any(-1, keepdims=True), full, True))
    return np.where(full.any(-1).transpose(0, 2, 1)[..., None], out, 0.0)


@pytest.mark.parametrize("case", range(len(structured_cases())), ids=[c[0] for c in structured_cases()])
def test_cudnn_is_given_only_what_it_accepts(cudnn_checked, case):
    """Every mask reaches cuDNN as arguments its checks accept, lengths and causality as structure."""
    name, T, S, mask = structured_cases()[case]
    q, k, v = qkv(jnp.float32, T=T, S=S)

    @jax.jit  # one program, the mask's arrays its arguments (the checks read shapes and dtypes as they trace)
    def both(q, k, v, mask):
        return tuple(F.dot_product_attention(q, k, v, mask=mask, implementation=i) for i in ("cudnn", "naive"))

    with jax.default_matmul_precision("highest"):
        out, ref = both(q, k, v, mask)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    (call,) = cudnn_checked
    if mask.q_segments is None and not (mask.causal and mask.q_offset is not None):
        assert call["mask"] is None, name  # structure alone: no dense mask for the kernel to read
        assert call.get("is_causal", False) == mask.causal


def test_auto_picks_cudnn_on_gpu_and_falls_back_once(cudnn_checked, monkeypatch, caplog):
    """auto on a GPU: cuDNN in bfloat16; XLA for float32 or a head dim cuDNN refuses; the reference
    for dropout on probabilities; each fallback said once, with its reason."""
    q, k, v = qkv(jnp.bfloat16)
    mask = F.Mask(causal=True, kv_lengths=jnp.array([5, 3]))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(kernels, "_fallbacks_logged", set())
    with caplog.at_level("WARNING", logger="jaxformer"):
        F.dot_product_attention(q, k, v, mask=mask, implementation="auto")
        assert len(cudnn_checked) == 1
        for _ in range(2):
            F.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask=mask, implementation="auto")
            F.dot_product_attention(*qkv(jnp.bfloat16, K=12), mask=mask, implementation="auto")
            F.dot_product_attention(
                q, k, v, mask=mask, implementation="auto", dropout_rate=0.1, dropout_rng=jax.random.key(0)
            )
    assert len(cudnn_checked) == 1
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3, said
    assert "bfloat16 or float16" in said[0] and "head dim must be" in said[1] and "dropout" in said[2]


@pytest.fixture
def splash_interpreted(monkeypatch):
    """The Pallas splash-attention kernel run by Pallas's interpreter on CPU (the very kernel TPUs
    compile, its masks and segment ids included). Returns the list of kernels made."""
    import functools

    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    made, real = [], splash.make_splash_mha

    def interpreted(*args, **kw):
        made.append(args[0])
        return functools.partial(real, interpret=True)(*args, **kw)

    monkeypatch.setattr(splash, "make_splash_mha", interpreted)
    return made


def test_splash_given_structure_equals_the_reference(splash_interpreted):
    """Causal packed rows with padding (segment 0), key lengths (one row sees no key) and query
    lengths, as splash's causal mask and segment ids: output and query gradient equal the reference's."""
    B, T, H, G, K = 2, 128, 2, 1, 32
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq, (B, T, H, K))
    k, v = jax.random.normal(kk, (B, T, G, K)), jax.random.normal(kv, (B, T, G, K))
    segments = jnp.array([[1] * 50 + [2] * 60 + [0] * 18, [3] * 128])
    mask = F.Mask(causal=True, q_segments=segments, kv_segments=segments, kv_lengths=jnp.array([100, 0]))
    mask = dataclasses.replace(mask, q_lengths=jnp.array([120, 128]))

    def loss(q, implementation):
        out = F.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
        return jnp.sum(out * jnp.cos(jnp.arange(K))[None, None, None, :]), out

    (_, out), grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(q, "splash")
    (_, ref), ref_grad = jax.value_and_grad(loss, has_aux=True)(q, "naive")
    assert len(splash_interpreted) == 1  # the kernel (its custom VJP serves the backward pass)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    np.testing.assert_allclose(grad, ref_grad, atol=2e-5)
    assert not np.any(out[1])  # the row that sees no key is zeros


def test_auto_picks_splash_on_tpu_and_falls_back_once(monkeypatch, caplog):
    """auto on a TPU: splash for lengths on its 128-wide tiles; XLA for a bias or short lengths, the
    reference for dropout on probabilities; each fallback said once. splash itself refuses what it cannot do."""
    made = []
    monkeypatch.setattr(kernels, "_splash", lambda *a: made.append(a) or a[0])
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(kernels, "_fallbacks_logged", set())
    q128, k128, v128 = (jnp.zeros((1, 128, 2, 8)) for _ in range(3))
    q, k, v = qkv(jnp.float32)
    with caplog.at_level("WARNING", logger="jaxformer"):
        for _ in range(2):
            F.dot_product_attention(q128, k128, v128, mask=F.Mask(causal=True), implementation="auto")
            F.dot_product_attention(q128, k128, v128, bias=jnp.zeros((1, 2, 128, 128)), implementation="auto")
            F.dot_product_attention(q, k, v, mask=F.Mask(causal=True), implementation="auto")
            F.dot_product_attention(q, k, v, implementation="auto", dropout_rate=0.1, dropout_rng=jax.random.key(0))
    assert len(made) == 2
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3, said
    assert "bias" in said[0] and "multiples of 128" in said[1] and "dropout" in said[2]
    with pytest.raises(ValueError, match="multiples of 128"):
        F.dot_product_attention(q, k, v, implementation="splash")


def test_exact_gelu_is_x_times_the_normal_cdf():
    x = np.linspace(-6, 6, 101)
    expected = [v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x]
    np.testing.assert_allclose(F.gelu_exact(jnp.asarray(x, jnp.float32)), expected, atol=1e-6)
    assert float(jnp.abs(F.gelu(jnp.float32(1.0)) - F.gelu_exact(jnp.float32(1.0)))) > 1e-4  # tanh differs


def t5_bucket(relative: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's bucket of one relative position (key - query), written from the paper's description."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if relative > 0:
            bucket += num_buckets
        distance = abs(relative)
    else:
        distance = max(-relative, 0)
    exact = num_buckets // 2
    if distance < exact:
        return bucket + distance
    scaled = math.log(distance / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    return bucket + min(exact + int(scaled), num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_buckets_match_t5(bidirectional):
    relative = np.arange(-300, 301)
    got = F.relative_position_buckets(
        jnp.asarray(relative), bidirectional=bidirectional, num_buckets=32, max_distance=128
    )
    expected = [t5_bucket(int(r), bidirectional, 32, 128) for r in relative]
    np.testing.assert_array_equal(got, expected)


def test_relative_position_bias_reads_the_table_per_head():
    table_NH = jax.random.normal(jax.random.key(0), (8, 3))
    q_BT, kv_BS = jnp.array([[0, 1, 2]]), jnp.array([[0, 1, 2, 3]])
    bias_BHTS = F.relative_position_bias(q_BT, kv_BS, table_NH, bidirectional=True, max_distance=16)
    assert bias_BHTS.shape == (1, 3, 3, 4)
    for t in range(3):
        for s in range(4):
            np.testing.assert_array_equal(bias_BHTS[0, :, t, s], table_NH[t5_bucket(s - t, True, 8, 16)])


@pytest.mark.parametrize("impl", ["naive", "xla"])
def test_attention_scale_replaces_one_over_sqrt_k(impl):
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 5, 4, 8)) for i in range(3))
    unscaled = F.dot_product_attention(q, k, v, scale=1.0, implementation=impl)
    np.testing.assert_allclose(unscaled, F.dot_product_attention(q * math.sqrt(8), k, v), atol=1e-5)


def test_chunked_cross_entropy_equals_the_plain_loss_value_and_gradient():
    """Chunks of 3 of T = 7 positions (the last padded with weight 0): the sums and the gradients of
    the hidden states and of the head's weights equal those of the loss on the whole logits; with
    label smoothing, z-loss, zero weights, tied (scaled) and untied (biased) heads; bfloat16 to its
    precision; a length split in 2 blocks, chunks taking positions of each."""
    B, T, D, V = 2, 7, 5, 13
    keys = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(keys[0], (B, T, D))
    params = {"w": jax.random.normal(keys[1], (D, V)), "b": jax.random.normal(keys[2], (V,)) * 0.1}
    labels = jax.random.randint(keys[3], (B, T), 0, V)
    weights = jnp.array([[1, 1, 0, 1, 1, 1, 0], [1, 0, 0, 1, 1, 1, 1]], jnp.float32)
    heads = {  # [B, t, D] -> [B, t, V] for any t
        "untied + bias": lambda p, x: jnp.einsum("BTD,DV->BTV", x, p["w"]) + p["b"][None, None],
        "tied, scaled": lambda p, x: jnp.einsum("BTD,VD->BTV", x * D**-0.5, p["w"].T),
        "bfloat16": lambda p, x: jnp.einsum("BTD,DV->BTV", x.astype(jnp.bfloat16), p["w"].astype(jnp.bfloat16)),
    }
    smooth = {"label_smoothing": 0.1, "z_loss": 1e-3}

    def plain(p, h, head):  # the loss on the whole logits, written out as the step wrote it before chunking
        labels_, weights_ = labels[:, : h.shape[1]], weights[:, : h.shape[1]]
        logits = head(p, h)
        loss, w = F.cross_entropy(logits, labels_, weights_, **smooth)
        nll, _ = F.cross_entropy(logits, labels_, weights_)
        correct = (F.top1_correct(logits.astype(jnp.float32), labels_) * w).sum()
        return loss.sum(), {"loss": loss.sum(), "nll": nll.sum(), "correct": correct, "count": w.sum()}

    def chunked(p, h, head, chunk, blocks=1):
        labels_, weights_ = labels[:, : h.shape[1]], weights[:, : h.shape[1]]
        head_p = functools.partial(head, p)
        sums = F.chunked_cross_entropy(h, head_p, labels_, weights_, chunk=chunk, blocks=blocks, **smooth)
        return sums["loss"], sums

    @jax.jit
    def everything(params, h):
        grad = lambda f, *a, h=h: jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, h, *a)
        out = {name: (grad(plain, head), grad(chunked, head, 3)) for name, head in heads.items()}
        # a length split in 2 blocks (a context axis): chunks of 2 + 2 positions, each block's 3 padded to 4
        head = heads["untied + bias"]
        out["2 blocks"] = (grad(plain, head, h=h[:, :6]), grad(chunked, head, 4, 2, h=h[:, :6]))
        return out

    for name, (((_, want), want_grads), ((_, got), got_grads)) in everything(params, h).items():
        tol = 1e-2 if name == "bfloat16" else 1e-6
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=tol, err_msg=f"{name}: {k}")
        for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max(), err_msg=name)
        count = weights[:, :6].sum() if name == "2 blocks" else weights.sum()
        assert float(want["count"]) == float(count) and float(want["loss"]) > float(want["nll"]) > 0


def test_chunked_cross_entropy_compiles_to_a_fraction_of_the_plain_loss_memory():
    """Loss and gradient at V = 50257 (GPT-2's), 2048 tokens, D = 64, compiled (not run): the plain
    loss's temporaries hold the [2048, V] float32 logits and their gradient (~785 MiB); chunks of 256
    tokens hold 1/8 of that at a time, plus the [D, V] gradient they add up. Asserted: below 2 x 1/8."""
    B, T, D, V, chunk = 4, 512, 64, 50257, 64  # 64 positions of 4 rows: 256 tokens a chunk

    def temp_bytes(chunk):
        def loss(h, w, labels, weights):
            head = lambda x: jnp.einsum("BTD,DV->BTV", x, w)
            return F.chunked_cross_entropy(h, head, labels, weights, chunk=chunk, label_smoothing=0.1)["loss"]

        shapes = [((B, T, D), jnp.float32), ((D, V), jnp.float32), ((B, T), jnp.int32), ((B, T), jnp.float32)]
        args = [jax.ShapeDtypeStruct(*s) for s in shapes]
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    plain, chunked = temp_bytes(None), temp_bytes(chunk)
    assert plain > 2 * B * T * V * 4 * 0.9, "the plain loss holds the logits and their gradient"
    assert chunked < 2 * (chunk / T) * plain, (chunked / 2**20, plain / 2**20)
