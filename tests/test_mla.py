"""Multi-head latent attention (`model.mla`): the layer against a NumPy transcription of DeepSeek-V2's
equations, the absorbed form of decoding against the plain form, the latent cache's contents and bytes,
and gradients through the stack unrolled, scanned and rematerialised. (Cached generation against
recomputation: tests/test_decode.py; sharded against one device: tests/test_sharding.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxformer as jf
from jaxformer.attention import mla
from jaxformer.config import MLAConfig

V, B, T = 32, 2, 10
MLA = MLAConfig(kv_lora_rank=8, q_lora_rank=6, rope_head_dim=4, nope_head_dim=6, v_head_dim=10)


def config(**overrides):
    kw = dict(vocab_size=V, max_len=32, position="rope", use_bias=False, mla=MLA, norm="rmsnorm", norm_position="pre")
    return jf.tiny("decoder_only", **(kw | overrides))


@pytest.fixture(scope="module")
def model():
    return jf.build_model(config(), seed=3)


@pytest.fixture(scope="module")
def ids():
    return jax.random.randint(jax.random.key(0), (B, T), 3, V)


def numpy_rope(x, positions, base=10_000.0):
    """Rotate-half RoPE in float64: pairs (i, i + K/2) turned by position * base^(-2i/K)."""
    K = x.shape[-1]
    angles = positions[..., None] * base ** (-np.arange(0, K, 2) / K)  # [B, T, K/2]
    angles = angles[:, :, None, :] if x.ndim == 4 else angles
    x1, x2 = x[..., : K // 2], x[..., K // 2 :]
    return np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles), x2 * np.cos(angles) + x1 * np.sin(angles)], -1)


def numpy_mla(layer, x, eps):
    """DeepSeek-V2's equations (9)-(19), one head and one token at a time where they are written so, in
    float64: c_Q = x W_DQ, q = RMSNorm(c_Q) W_UQ; [c_KV, k_R] = x W_DKV; k_h = [RMSNorm(c_KV) W_UK_h,
    RoPE(k_R)], v_h = RMSNorm(c_KV) W_UV_h; causal softmax(q_h . k_h / sqrt(N + R)); o = [o_h] W_O."""
    p = {k: np.asarray(v[...], np.float64) for k, v in nnx.state(layer, nnx.Param).items()}
    m = layer.cfg.mla
    C, N = m.kv_lora_rank, m.nope_head_dim
    rms = lambda a, g: a / np.sqrt(np.mean(a * a, -1, keepdims=True) + eps) * g
    Bx, Tx, _ = x.shape
    pos = np.broadcast_to(np.arange(Tx, dtype=np.float64), (Bx, Tx))
    q = rms(x @ p["q_down"], p["q_norm"]) @ p["q_up"].reshape(p["q_up"].shape[0], -1)
    q = q.reshape(Bx, Tx, layer.cfg.num_heads, -1)
    q = np.concatenate([q[..., :N], numpy_rope(q[..., N:], pos)], -1)
    kv = x @ p["kv_down"]
    c, k_rope = rms(kv[..., :C], p["kv_norm"]), numpy_rope(kv[..., C:], pos)
    out = np.zeros((Bx, Tx, layer.cfg.num_heads, m.v_head_dim))
    for h in range(layer.cfg.num_heads):
        k_h = np.concatenate([c @ p["kv_up"][:, h, :N], k_rope], -1)  # [B, S, N + R]
        v_h = c @ p["kv_up"][:, h, N:]
        logits = np.einsum("btk,bsk->bts", q[:, :, h], k_h) / np.sqrt(m.qk_head_dim)
        logits = np.where(np.tril(np.ones((Tx, Tx), bool)), logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        out[:, :, h] = np.einsum("bts,bsv->btv", w / w.sum(-1, keepdims=True), v_h)
    return np.einsum("bthv,hvd->btd", out, p["out"])


def test_layer_equals_the_papers_equations(model):
    """The module's plain form (training's) against the NumPy transcription, float32 vs float64."""
    layer = model.decoder.stack.layers[0].self_attn
    x = jax.random.normal(jax.random.key(1), (B, T, model.cfg.d_model))
    with jax.default_matmul_precision("highest"):
        got = layer(x, mask=jf.functional.Mask(causal=True), positions_BT=jnp.broadcast_to(jnp.arange(T), (B, T)))
    want = numpy_mla(layer, np.asarray(x, np.float64), model.cfg.norm_eps)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_absorbed_form_equals_the_plain_form():
    """The pure functions on random tensors, a per-row causal offset over a longer cache: the absorbed
    form (W_UK folded into the queries, W_UV after the weighted sum of latents) against the plain form
    on the keys and values projected up, float32, within 1e-5 of the largest output. (Through the model:
    tests/test_decode.py's cached logits against recomputation, every MLA step absorbed.)"""
    H, C, N, R, Vh, S = 3, 5, 4, 2, 7, 9
    k = jax.random.split(jax.random.key(2), 5)
    q_nope, q_rope = jax.random.normal(k[0], (B, T, H, N)), jax.random.normal(k[1], (B, T, H, R))
    c, r = jax.random.normal(k[2], (B, S, C)), jax.random.normal(k[3], (B, S, R))
    kv_up = jax.random.normal(k[4], (C, H, N + Vh))
    mask = jf.functional.Mask(causal=True, q_offset=jnp.array([0, -3]))  # row 1: its first 3 queries see nothing
    with jax.default_matmul_precision("highest"):
        k_nope, v = jnp.einsum("BSC,CHX->BSHX", c, kv_up[..., :N]), jnp.einsum("BSC,CHX->BSHX", c, kv_up[..., N:])
        want = mla.plain_attention(q_nope, q_rope, k_nope, r, v, mask=mask, scale=0.3)
        got = mla.absorbed_attention(q_nope, q_rope, c, r, kv_up, mask=mask, scale=0.3)
    np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.max(jnp.abs(want))))
    assert float(jnp.max(jnp.abs(got[1, :3]))) == 0.0  # queries that see no slot: zeros, not the mean


def test_the_cache_holds_latents_and_rope_keys(model, ids):
    """Per layer {"c": [B, S, C], "r": [B, S, R]}: (C + R) * 4 bytes a token in float32, where a
    multi-head cache of the same width holds 2 * H * K * 4; the prefill wrote exactly the latents and
    rotated rope keys of its positions (what `latent` computes from the layer's input)."""
    cache = model.init_cache(B, 16)
    layer_cache = cache["layers"][0]["self"]
    assert {k: v.shape for k, v in layer_cache.items()} == {"c": (B, 16, 8), "r": (B, 16, 4)}
    per_token = sum(a.nbytes for a in jax.tree.leaves(cache["layers"])) / (B * 16 * model.cfg.num_decoder_layers)
    assert per_token == mla.cache_bytes_per_token(8, 4, 4) == 48
    mha = jf.build_model(config(mla=MLAConfig()), seed=3).init_cache(B, 16)["layers"][0]["self"]
    assert sum(a.nbytes for a in jax.tree.leaves(mha)) / (B * 16) == 2 * 2 * 8 * 4  # H=2, K=D/H=8
    _, cache = nnx.jit(lambda m, c, i: m.decode_step(c, i, None))(model, cache, ids[:, :4])  # a prefill: plain
    first = model.decoder.stack.layers[0]
    x = model.decoder.embed_inputs(ids[:, :4], jnp.broadcast_to(jnp.arange(4), (B, 4)), None)
    c, r = first.self_attn.latent(first.self_attn_res.norm(x), jnp.broadcast_to(jnp.arange(4), (B, 4)))
    np.testing.assert_allclose(cache["layers"][0]["self"]["c"][:, :4], c, atol=1e-6)
    np.testing.assert_allclose(cache["layers"][0]["self"]["r"][:, :4], r, atol=1e-6)
    assert float(jnp.abs(cache["layers"][0]["self"]["c"][:, 4:]).max()) == 0.0


def test_gradients_unrolled_scanned_and_rematerialised_agree(ids):
    """Queries straight from D (q_lora_rank=0, DeepSeek-V2-Lite's form): the loss and every gradient of
    the stack unrolled and scanned (stacked layers, one body) with full remat agree to 1e-5."""
    cfg = config(mla=MLAConfig(kv_lora_rank=8, rope_head_dim=4, nope_head_dim=6, v_head_dim=10))

    def loss_and_grads(model):
        loss = lambda m: jnp.mean(jax.nn.log_softmax(m(ids))[..., 0])
        with jax.default_matmul_precision("highest"):
            value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
        flat = {}
        for path, g in nnx.to_flat_state(grads):
            if "layers" in path and model.cfg.scan_layers:  # [L, ...] -> one entry per layer, as unrolled
                i = path.index("layers")
                for layer in range(g.shape[0]):
                    flat[(*path[: i + 1], layer, *path[i + 1 :])] = g[...][layer]
            else:
                flat[path] = g[...]
        return value, flat

    ref_loss, ref = loss_and_grads(jf.build_model(cfg, seed=4))
    assert "query" in str(list(ref)) and "q_down" not in str(list(ref))
    loss, grads = loss_and_grads(jf.build_model(cfg.replace(scan_layers=True, remat="full"), seed=4))
    assert abs(float(loss - ref_loss)) <= 1e-6
    assert grads.keys() == ref.keys()
    for path, g in grads.items():
        np.testing.assert_allclose(g, ref[path], atol=1e-5 * float(jnp.max(jnp.abs(ref[path]))) + 1e-8)


def test_training_flops_count_the_latent_projections(model):
    """`train.flops_per_example` of the MLA decoder against the multi-head one of the same D, H and T:
    the difference is 3 x (2 x the attention kernels' weights each layer, counted from the two models'
    parameters, plus the scores and values' 2 H (N + R + V) against 4 H K a position of context) a token."""
    from jaxformer.train import flops_per_example

    mha = jf.build_model(config(mla=MLAConfig()), seed=3)
    weights = lambda m: sum(
        v[...].size for k, v in nnx.to_flat_state(nnx.state(m.decoder.stack.layers[0].self_attn, nnx.Param))
        if not str(k[-1]).endswith("norm")
    )  # fmt: skip
    cfg, H, L = model.cfg, model.cfg.num_heads, model.cfg.num_decoder_layers
    per_position = 2 * H * MLA.qk_head_dim + 2 * H * MLA.v_head_dim - 4 * H * mha.cfg.dim_per_head
    want = 3 * T * L * (2 * (weights(model) - weights(mha)) + per_position * T)
    got = flops_per_example(cfg, "lm", 0, T) - flops_per_example(mha.cfg, "lm", 0, T)
    assert got == want
