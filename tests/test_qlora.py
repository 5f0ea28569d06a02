"""An int8 frozen base for LoRA (`lora.base="int8"`): the rounding stays within half a quantization
step, the logits stay within what those steps allow, the state holds int8 kernels (half of bfloat16),
only the adapters train, a run resumes exactly, merge reads it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer import config as C
from jaxformer import lora, quant
from jaxformer.checkpoint import Checkpointer, check_compatible
from jaxformer.decode import decodable
from jaxformer.models import Transformer
from jaxformer.state import init_state
from jaxformer.train import make_steps

ALL = ("q", "k", "v", "o", "wi", "wo")


def config(base="int8", **model) -> C.Config:
    return C.Config(
        model=C.tiny("decoder_only", scan_layers=True, **model),
        data=C.DataConfig(max_len=8),
        train=C.TrainConfig(objective="lm", batch_size=4, learning_rate=1e-2, schedule="constant", warmup_steps=0),
        lora=C.LoRAConfig(rank=4, targets=ALL, base=base),
        checkpoint=C.CheckpointConfig(async_save=False),
    )


def batch(seed=0, B=4, T=8):
    ids = jax.random.randint(jax.random.key(seed), (B, T), 2, 32)
    return {"inputs": ids, "targets": jnp.roll(ids, -1, 1), "weights": jnp.ones((B, T), jnp.float32)}


def test_int8_rounding_is_within_half_a_step_and_the_gradient_is_autodiffs():
    w = jax.random.normal(jax.random.key(0), (16, 3, 8)).at[:, 1, 2].set(0.0)  # [D, H, K], one channel all zero
    q, scale = quant.quantize(w, in_axes=(0,))
    assert q.dtype == jnp.int8 and scale.shape == (1, 3, 8) and int(jnp.abs(q).max()) == quant.INT8_MAX
    back = quant.dequantize(q, scale, jnp.float32)
    assert bool(jnp.all(jnp.abs(back - w) <= scale / 2 * (1 + 1e-6)))  # round to nearest: half a step at most
    assert bool(jnp.all(back[:, 1, 2] == 0))
    # The custom backward (dequantize again, transpose the einsum) against JAX's autodiff of the plain product.
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    plain = lambda x: jnp.sum(jnp.sin(jnp.einsum("BTD,DHK->BTHK", x, back)))
    ours = lambda x: jnp.sum(jnp.sin(quant.einsum("BTD,DHK->BTHK", x, q, scale, jnp.float32)))
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(jax.grad(ours)(x), jax.grad(plain)(x), rtol=1e-5, atol=1e-6)


def test_int8_base_logits_stay_within_the_quantization_steps_error():
    mcfg = C.tiny("decoder_only", scan_layers=True)
    base = Transformer(mcfg, rngs=nnx.Rngs(params=0))
    int8 = lora.quantize_base(Transformer(mcfg, rngs=nnx.Rngs(params=0)), C.LoRAConfig(rank=2, base="int8"))
    floats = {(id(m), n): getattr(m, n)[...] for m, n, _, _ in lora.kernels(base)}
    # Each kernel's relative (Frobenius) error, from its int8 values and scales against the float kernel.
    errors = []
    for (m, name), (fm, _, _, _) in zip(lora.quantized(int8), lora.kernels(base), strict=True):
        w = floats[(id(fm), name)]
        back = quant.dequantize(getattr(m, name)[...], getattr(m, f"{name}_scale")[...], jnp.float32)
        errors.append(float(jnp.linalg.norm(back - w) / jnp.linalg.norm(w)))
    assert len(errors) == 6 and max(errors) < 1 / 127  # a rounding error is below 1/254 of a channel's largest
    ids = jax.random.randint(jax.random.key(1), (2, 8), 2, 32)
    forward = nnx.jit(lambda model: model(ids))
    with jax.default_matmul_precision("highest"):
        expected, got = forward(base), forward(int8)
        decoded = forward(decodable(int8))  # decoding's unrolled copy: dequantized to float32, the same numbers
    rel = float(jnp.linalg.norm(got - expected) / jnp.linalg.norm(expected))
    # To first order each kernel moves the logits by its relative error at most, and the moves add up.
    bound = sum(errors)
    print(f"int8 base: logits relative error {rel:.4f} (kernels up to {max(errors):.4f}, bound {bound:.4f})")
    assert 0 < rel < bound
    np.testing.assert_allclose(decoded, got, rtol=1e-5, atol=1e-5)


def test_an_int8_base_holds_half_the_bytes_trains_only_its_adapters_and_resumes_exactly(tmp_path):
    cfg = config()
    graphdef, state, optimizer = init_state(cfg)
    flat = dict(nnx.to_flat_state(state.frozen))
    kernels = [p for p in flat if p[-1] in ALL]
    assert len(kernels) == 6 and all(flat[p][...].dtype == jnp.int8 for p in kernels)  # a byte: half of bfloat16
    scales = [p for p in flat if isinstance(flat[p], lora.QuantScale)]
    assert sorted((*p[:-1], p[-1].removesuffix("_scale")) for p in scales) == sorted(kernels)
    attention = ("decoder", "stack", "layers", "self_attn")
    q, q_scale = flat[(*attention, "q")], flat[(*attention, "q_scale")]
    assert q.get_metadata()["out_sharding"] == ("layers", "embed", "heads", "kv")
    assert q_scale.get_metadata()["out_sharding"] == ("layers", None, "heads", "kv")  # the kernel's output axes
    assert q_scale[...].shape == (2, 1, 2, 8) and q_scale[...].dtype == jnp.float32
    nbytes = lambda v: v[...].size * v[...].dtype.itemsize
    rest = [p for p in flat if p not in kernels and p not in scales]  # the embedding, norms, biases: float32 here
    assert sum(nbytes(flat[p]) for p in rest) == 4 * sum(flat[p][...].size for p in rest)

    step = jax.jit(make_steps(graphdef, cfg, optimizer)[0])
    states, losses = [state], []
    for _ in range(3):
        s, metrics = step(states[-1], batch())
        states.append(s)
        losses.append(float(metrics["loss"]))
    assert losses[2] < losses[0]  # gradients reach the adapters through the dequantized base
    jax.tree.map(np.testing.assert_array_equal, states[-1].frozen, state.frozen)
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), states[-1].params, state.params)
    assert all(jax.tree.leaves(nnx.state(moved, nnx.Any(nnx.PathContains("b")))))

    ckpt = Checkpointer(tmp_path, cfg)  # the int8 base and its scales are in the checkpoint
    ckpt.save(states[1])
    ckpt.wait()
    restored = ckpt.restore_latest(init_state(cfg)[1])
    ckpt.close()
    resumed = step(step(restored, batch())[0], batch())[0]
    jax.tree.map(np.testing.assert_array_equal, resumed, states[-1])

    ids = batch()["inputs"]
    expected = nnx.merge(graphdef, states[-1].weights)(ids)
    merged = lora.merge(nnx.merge(graphdef, states[-1].weights))  # dequantized, the update added, float32
    assert not lora.quantized(merged) and not list(lora.adapters(merged))
    assert all(getattr(m, n)[...].dtype == jnp.float32 for m, n, _, _ in lora.kernels(merged))
    np.testing.assert_allclose(merged(ids), expected, rtol=1e-5, atol=1e-5)

    with pytest.raises(C.ConfigError, match=r"lora\.base: checkpoint 'int8', config 'compute'"):
        check_compatible(cfg, dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, base="compute")), "ckpt")


def test_lora_base_is_validated_naming_the_field():
    with pytest.raises(C.ConfigError, match=r"lora\.base: 'int4' is not one of"):
        C.LoRAConfig(rank=4, base="int4")
    with pytest.raises(C.ConfigError, match=r"lora\.base: 'int8' quantizes the frozen base of a LoRA run"):
        C.LoRAConfig(rank=0, base="int8")
