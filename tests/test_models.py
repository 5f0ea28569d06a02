"""Whole models: invariants of each mode, stack variants, dtypes, parameter counts, configs."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxformer as jf

MODES = ["encoder_only", "decoder_only", "encoder_decoder"]
B, T, V = 2, 8, 32


def ids(seed, shape=(B, T), low=1):
    return jax.random.randint(jax.random.key(seed), shape, low, V)


def forward(model, src, tgt=None, **kw):
    return model(src, tgt, **kw) if model.cfg.mode == "encoder_decoder" else model(src, **kw)


@pytest.mark.parametrize("mode", ["decoder_only", "encoder_decoder"])
@pytest.mark.parametrize("position", ["sinusoidal", "rope"])
def test_causality(mode, position):
    """Changing target tokens after position t changes no output at positions <= t."""
    model = jf.build_model(jf.tiny(mode, position=position))
    src, tgt = ids(0), ids(1)
    t = 4
    changed = tgt.at[:, t + 1 :].set(ids(2)[:, t + 1 :])
    out = model(src, tgt) if mode == "encoder_decoder" else model(tgt)
    out2 = model(src, changed) if mode == "encoder_decoder" else model(changed)
    np.testing.assert_allclose(out[:, : t + 1], out2[:, : t + 1], atol=1e-6)
    assert not np.allclose(out[:, t + 1 :], out2[:, t + 1 :])


@pytest.mark.parametrize("mode", MODES)
def test_padding_invariance(mode):
    """Ids under padding, and extra padding, change no output at real positions."""
    model = jf.build_model(jf.tiny(mode, num_classes=3 if mode == "encoder_only" else 0, pooling="mean"))
    live = jnp.arange(T)[None, :] < jnp.array([[5], [3]])
    segs = live.astype(jnp.int32)  # packed-style padding marker: segment 0

    def run(fill_seed):
        src, tgt = jnp.where(live, ids(0), ids(fill_seed)), jnp.where(live, ids(1), ids(fill_seed + 1))
        if mode == "encoder_decoder":
            return model(src, tgt, segments=segs, tgt_segments=segs)
        return model(src, segments=segs)

    real = live[..., None]
    a, b = run(10), run(20)
    np.testing.assert_allclose(jnp.where(real, a, 0), jnp.where(real, b, 0), atol=1e-5)
    src, tgt = jnp.where(live, ids(0), 0), jnp.where(live, ids(1), 0)  # pad_id padding
    np.testing.assert_allclose(jnp.where(real, forward(model, src, tgt), 0), jnp.where(real, a, 0), atol=1e-5)
    longer = forward(model, jnp.pad(src, ((0, 0), (0, 5))), jnp.pad(tgt, ((0, 0), (0, 5))))[:, :T]
    np.testing.assert_allclose(jnp.where(real, longer, 0), jnp.where(real, a, 0), atol=1e-5)
    if mode == "encoder_only":
        np.testing.assert_allclose(model.classify(src), model.classify(jnp.pad(src, ((0, 0), (0, 5)))), atol=1e-5)


def test_encoder_without_positions_is_permutation_equivariant():
    model = jf.build_model(jf.tiny("encoder_only", position="none"))
    src = ids(0)
    perm = jax.random.permutation(jax.random.key(1), T)
    out = model.encode(src)
    np.testing.assert_allclose(model.encode(src[:, perm]), out[:, perm], atol=1e-5)


def stacked(unrolled_tree):
    """Turn the per-layer subtrees {0: ..., 1: ...} of an unrolled model's state into stacked arrays."""
    if isinstance(unrolled_tree, dict) and set(unrolled_tree) == set(range(len(unrolled_tree))) and unrolled_tree:
        layers = [unrolled_tree[i] for i in range(len(unrolled_tree))]
        return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    if isinstance(unrolled_tree, dict):
        return {k: stacked(v) for k, v in unrolled_tree.items()}
    return unrolled_tree


def test_scanned_equals_unrolled_and_remat_equals_plain():
    """Same seed, same parameters; scanned / rematerialised stacks give the same outputs and gradients.

    encoder_decoder exercises both stacks (encoder layers, decoder layers with cross-attention).
    """
    base = jf.tiny("encoder_decoder", dropout_rate=0.1)  # two layers per stack
    variants = {
        "plain": base,
        "scan": base.replace(scan_layers=True),  # remat "auto": dots_saveable in a scan
        "scan_none": base.replace(scan_layers=True, remat="none"),
        "remat": base.replace(remat="full"),
    }
    src, tgt = ids(0), ids(1)
    results = {}
    for name, cfg in variants.items():
        model = jf.build_model(cfg)
        graphdef, params = nnx.split(model)

        def loss(params, graphdef=graphdef):
            out = forward(nnx.merge(graphdef, params), src, tgt, dropout_rng=jax.random.key(7))
            return jnp.mean(out.astype(jnp.float32) ** 2), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        results[name] = (nnx.to_pure_dict(params), out, nnx.to_pure_dict(grads))
    ref_params, ref_out, ref_grads = results["plain"]
    for name, (params, out, grads) in results.items():
        if "scan" in name:
            ref_p, ref_g = stacked(ref_params), stacked(ref_grads)
        else:
            ref_p, ref_g = ref_params, ref_grads
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), params, ref_p)
        np.testing.assert_allclose(out, ref_out, atol=1e-5, err_msg=name)
        jax.tree.map(lambda a, b, n=name: np.testing.assert_allclose(a, b, atol=1e-5, err_msg=n), grads, ref_g)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_backward_under_jit(mode, dtype):
    cfg = jf.tiny(mode, dtype=dtype, num_classes=4 if mode == "encoder_only" else 0, dropout_rate=0.1)
    model = jf.build_model(cfg)
    graphdef, params = nnx.split(model)
    src, tgt = ids(0), ids(1)

    @jax.jit
    def grads(params):
        def loss(params):
            m = nnx.merge(graphdef, params)
            out = forward(m, src, tgt, dropout_rng=jax.random.key(0))
            extra = m.classify(src).astype(jnp.float32).sum() if mode == "encoder_only" else 0.0
            return jax.nn.logsumexp(out.astype(jnp.float32), -1).mean() + extra, out

        return jax.grad(loss, has_aux=True)(params)

    g, out = grads(params)
    assert out.shape == (B, T, V) and out.dtype == jnp.dtype(dtype)
    leaves = jax.tree.leaves(g)
    assert all(x.dtype == jnp.float32 for x in leaves), "parameters (and their gradients) stay float32"
    assert all(np.all(np.isfinite(x)) for x in leaves)
    assert sum(float(jnp.abs(x).sum()) > 0 for x in leaves) == len(leaves), "every parameter gets a gradient"


def test_log_softmax_generator_and_separate_encode_decode():
    model = jf.build_model(jf.tiny("encoder_decoder"))
    src, tgt = ids(0), ids(1)
    memory = model.encode(src)
    logits = model.decode(memory, src, tgt)
    np.testing.assert_allclose(logits, model(src, tgt), atol=1e-6)
    logp = model.decode(memory, src, tgt, log_softmax=True)
    np.testing.assert_allclose(jnp.exp(logp).sum(-1), 1.0, atol=1e-5)


def analytic_param_count(D, F, H, V, L_enc, L_dec):
    """Counted from the paper's dimensions, with biases and one shared embedding matrix."""
    attention = 4 * (D * D + D)  # Q, K, V, O projections: weight + bias (H * K = D)
    ffn = D * F + F + F * D + D
    norm = 2 * D  # LayerNorm scale + bias
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    return V * D + L_enc * encoder_layer + L_dec * decoder_layer  # tied output, no final norm (post-norm)


@pytest.mark.parametrize(
    "preset, dims, approx",
    [(jf.paper_base, dict(D=512, F=2048, H=8), 63.1e6), (jf.paper_big, dict(D=1024, F=4096, H=16), 214e6)],
)
def test_paper_parameter_counts(preset, dims, approx):
    cfg = preset(vocab_size=37_000)
    abstract = nnx.eval_shape(lambda: jf.Transformer(cfg, rngs=nnx.Rngs(0)))
    n = jf.count_params(abstract)
    assert n == analytic_param_count(V=37_000, L_enc=6, L_dec=6, **dims)
    assert abs(n - approx) / approx < 0.003


@pytest.mark.parametrize(
    "preset, published",  # parameter counts of the published checkpoints (Hugging Face's model cards)
    [
        (jf.bert_base, 109.5e6),  # bert-base-uncased without its NSP head and pooler
        (jf.gpt2_small, 124.4e6),
        (jf.bart_base, 139.4e6),
        (jf.t5_small, 60.5e6),
        (jf.t5_v1_1_small, 76.9e6),
        (jf.llama, 6.74e9),
    ],
)
def test_presets_have_the_published_sizes(preset, published):
    cfg = preset()
    abstract = nnx.eval_shape(lambda: jf.Transformer(cfg, rngs=nnx.Rngs(0)))
    assert abs(jf.count_params(abstract) - published) / published < 0.01


def test_logical_axis_names_on_every_parameter():
    model = jf.build_model(jf.tiny("encoder_decoder", scan_layers=True))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = var.get_metadata().get("out_sharding")
        assert names is not None and len(names) == var[...].ndim, path
        if "stack" in path:
            assert names[0] == "layers", path


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(num_heads=6), "model.num_heads"),
        (dict(mode="decoder"), "model.mode"),
        (dict(d_ff=-1), "model.d_ff"),
        (dict(dropout_rate=1.0), "model.dropout_rate"),
        (dict(num_kv_heads=3, num_heads=4, d_model=16), "model.num_kv_heads"),
        (dict(num_layers=4), "num_layers"),
        (dict(vocab_size="100"), "model.vocab_size"),
        (dict(num_classes=3), "model.num_classes"),
        (dict(activation="gelu_new"), "model.activation"),
        (dict(position_offset=2), "model.position_offset"),  # needs learned positions
        (dict(position="learned", position_offset=-1), "model.position_offset"),
        (dict(position="relative", relative_buckets=2), "model.relative_buckets"),
        (dict(position="relative", relative_max_distance=8), "model.relative_max_distance"),
        (dict(mode="decoder_only", num_encoder_layers=0, type_vocab_size=2), "model.type_vocab_size"),
        (dict(mode="encoder_only", num_decoder_layers=0, logits_bias=True), "model.logits_bias"),
        (dict(tie_output=False, scale_tied_logits=True), "model.scale_tied_logits"),
    ],
)
def test_invalid_configs_name_the_field(changes, field):
    with pytest.raises((jf.ConfigError, TypeError), match=field):
        jf.paper_base(**changes)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"b2": 1.5}, "train.b2"),
        ({"b1": float("nan")}, "train.b1"),
        ({"learning_rate": float("inf")}, "train.learning_rate"),
        ({"eps": 0.0}, "train.eps"),
        ({"peak_flops": -1.0}, "train.peak_flops"),
    ],
)
def test_invalid_optimizer_settings_name_the_field(changes, field):
    from jaxformer.config import TrainConfig

    with pytest.raises(jf.ConfigError, match=field):
        TrainConfig(**changes)


@pytest.mark.parametrize("position", ["sinusoidal", "learned"])
def test_input_longer_than_max_len_is_refused_not_nan(position):
    """A table position past model.max_len would be clamped into wrong logits: refused at trace time."""
    model = jf.build_model(jf.tiny("decoder_only", position=position, max_len=8))
    with pytest.raises(ValueError, match=r"9 positions exceed model\.max_len=8"):
        model(jnp.ones((1, 9), jnp.int32))
    assert model(jnp.ones((1, 8), jnp.int32)).shape == (1, 8, V)


T5_ARCH = dict(position="relative", scale_attention=False, norm="rmsnorm", norm_position="pre", use_bias=False)


FUSED_SEGMENTS = jnp.array([[1, 1, 1, 2, 2, 3, 3, 3], [1, 1, 2, 2, 2, 0, 0, 0]])
ARCHS = {"paper": {}, "t5": T5_ARCH}


@functools.cache
def fused_loss_and_grads(mode: str, impl: str, arch: str) -> list:
    """The logits and parameter gradients of a weighted sum of the logits, for padding told by lengths
    and by packed segments. Kept: the reference ("naive") of a mode and arch serves both fused paths."""
    lengths, segs = jnp.array([T, 5]), FUSED_SEGMENTS
    src, tgt = jnp.where(segs > 0, ids(0), 0), jnp.where(segs > 0, ids(1), 0) if mode == "encoder_decoder" else None
    weights = jax.random.normal(jax.random.key(5), (B, T, V))
    model = jf.build_model(jf.tiny(mode, vocab_size=V, attention_impl=impl, **ARCHS[arch]), seed=3)

    def loss(model, kw):
        logits = forward(model, src, tgt, **kw)
        return (logits.astype(jnp.float32) * weights).sum(), logits

    out = []
    with jax.default_matmul_precision("highest"):
        for kw in ({"lengths": lengths}, {"segments": segs} | ({"tgt_segments": segs} if tgt is not None else {})):
            (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model, kw)
            out.append((logits, jax.tree.leaves(nnx.state(grads, nnx.Param))))
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", ["xla", "cudnn"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_fused_attention_equals_reference_in_every_mode(mode, impl, arch, cudnn_checked):
    """The fused paths, told padding (lengths) or packing (segments) as structure, give the reference's
    logits and gradients in every mode, also with T5's relative-position bias and unscaled logits.
    "cudnn" runs on CPU through JAX's own cuDNN argument checks (conftest's `cudnn_checked`), so a
    mask or bias cuDNN would reject fails here. (The reference is computed once for both paths.)"""
    segs = FUSED_SEGMENTS
    ref, fused = fused_loss_and_grads(mode, "naive", arch), fused_loss_and_grads(mode, impl, arch)
    for (ref_logits, ref_grads), (logits, grads) in zip(ref, fused, strict=True):
        real = (segs > 0)[..., None]
        np.testing.assert_allclose(jnp.where(real, logits, 0), jnp.where(real, ref_logits, 0), atol=1e-5)
        # Gradients reach ~80. XLA:CPU picks its math functions by the processor (Intel's or AMD's) and
        # vectorises for its width: on an AMD EPYC a gradient of ~2 moved by ~60 float32 ulps (1.4e-5).
        for g, rg in zip(grads, ref_grads, strict=True):
            np.testing.assert_allclose(g, rg, atol=5e-5, rtol=1e-5)
    assert (len(cudnn_checked) > 0) == (impl == "cudnn")


def test_matmul_precision_reaches_every_matrix_product():
    """model.matmul_precision is traced into every dot of the model; "default" keeps JAX's setting."""

    def precisions(setting, ambient):
        model = jf.build_model(jf.tiny("encoder_decoder", matmul_precision=setting))
        with jax.default_matmul_precision(ambient):
            text = nnx.jit(lambda m, x: m(x, x)).lower(model, ids(0)).as_text()
        return set(re.findall(r"precision = \[(\w+), \w+\]", text)), text.count("dot_general")

    found, dots = precisions("highest", "bfloat16")
    assert found == {"HIGHEST"} and dots > 10
    assert precisions("high", "highest")[0] == {"HIGH"}
    assert precisions("default", "highest")[0] == {"HIGHEST"}
    with pytest.raises(jf.ConfigError, match=r"model\.matmul_precision"):
        jf.tiny(matmul_precision="tf32")


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs an NVIDIA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_auto_attention_compiles_to_cudnn_flash_attention_on_gpu(mode):
    """On a GPU in bfloat16, "auto" puts cuDNN's fused attention (forward and backward) in the training step."""
    from jaxformer import config as C
    from jaxformer.state import init_state
    from jaxformer.train import make_steps

    objective = {"encoder_only": "mlm", "decoder_only": "lm", "encoder_decoder": "seq2seq"}[mode]
    model = jf.tiny(mode, vocab_size=V, d_model=64, num_heads=2, max_len=64, dtype="bfloat16", attention_impl="auto")
    cfg = C.Config(model=model, train=C.TrainConfig(objective=objective, batch_size=2), data=C.DataConfig(max_len=64))
    graphdef, state, optimizer = init_state(cfg)
    batch = {k: jnp.ones((2, 64), jnp.int32) for k in ("inputs", "targets", "src")}
    batch |= {"weights": jnp.ones((2, 64)), "src_lengths": jnp.array([64, 40], jnp.int32)}
    hlo = jax.jit(make_steps(graphdef, cfg, optimizer)[0]).lower(state, batch).compile().as_text()
    assert "__cudnn$fmha" in hlo
