"""Parameters cast once before a decoding loop (`jaxformer.precast`): which parameters are cast, that the
step computes the same bits with them, and that `generate`'s and the engine's loops no longer cast a
float32 kernel at every step.

The reference is the step itself on the model as it is: the cast model's logits must equal its bits.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer import config as C
from jaxformer import decode, precast
from jaxformer.config import EngineConfig, MLAConfig
from jaxformer.engine import steps as engine_steps
from jaxformer.models import build_model

# Dimensions no activation of these tiny models shares with a kernel: D 24, F 40, V 53.
DIMS = dict(vocab_size=53, d_model=24, num_heads=2, d_ff=40, max_len=32, dropout_rate=0.0, dtype="bfloat16")
SIGMOID_MOE = C.MoEConfig(num_experts=4, experts_per_token=2, router="sigmoid_topk", balance_rate=1e-3)
MLA = MLAConfig(kv_lora_rank=8, q_lora_rank=6, rope_head_dim=4, nope_head_dim=6, v_head_dim=10)
CASES = {
    "gpt2": C.gpt2_small(**DIMS, num_decoder_layers=2),  # learned positions, tied output, biases, LayerNorm
    "llama_scanned": C.llama(**DIMS, num_decoder_layers=2, num_kv_heads=1, scan_layers=True),  # RMSNorm, SwiGLU
    "moe_sigmoid": C.llama(**DIMS, num_decoder_layers=2, moe=SIGMOID_MOE),  # a float32 router and balance bias
    "mla": C.llama(**DIMS, num_decoder_layers=2, mla=MLA),  # latent attention: its norms, its up-projections
    "t5": C.t5_small(**DIMS, num_encoder_layers=1, num_decoder_layers=2),  # relative-position bias, cross-attention
}


def _cast_step(cfg, seed=0):
    """(model, the cast model, a jitted step of either over one cache) for `cfg`, after a prefill."""
    model = decode.decodable(build_model(cfg, seed=seed))
    B, rng = 2, np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, 5)), jnp.int32)
    memory, src_lengths = None, None
    if cfg.mode == "encoder_decoder":
        src_lengths = jnp.asarray([6, 4], jnp.int32)
        memory = model.encode(jnp.asarray(rng.integers(3, cfg.vocab_size, (B, 6)), jnp.int32), src_lengths=src_lengths)
    make = lambda m: decode.cached_stepper(m, 12, memory, src_lengths)
    _, cache = make(model).start(prompt, jnp.asarray([5, 3], jnp.int32))
    tokens, positions = jnp.asarray([7, 9], jnp.int32), jnp.asarray([5, 3], jnp.int32)
    cast = precast.cast_once(model, cfg.dtype, lambda m, *a: make(m).step(*a), cache, tokens, positions)
    step = jax.jit(lambda m: make(m).step(cache, tokens, positions)[0])
    return model, cast, step


def _dtypes(model) -> dict[str, str]:
    return {"/".join(map(str, p)): str(v[...].dtype) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("case", list(CASES))
def test_cast_model_steps_to_the_same_bits(case):
    """The decoding step on the cast model gives the logits of the step on the model as it is, bit for
    bit; the kernels are cast, and what some use reads in float32 is not: norms' scales and biases, a
    router's kernel and balance bias, T5's relative-position table."""
    cfg = CASES[case]
    model, cast, step = _cast_step(cfg)
    np.testing.assert_array_equal(np.asarray(step(cast), np.float32), np.asarray(step(model), np.float32))
    before, after = _dtypes(model), _dtypes(cast)
    assert set(before.values()) == {"float32"}
    changed = {p for p in before if after[p] != before[p]}
    assert all(after[p] == "bfloat16" for p in changed)
    # The kernels the step reads (not the encoder's, nor those making the source's keys and values, which
    # the cache holds): an unread parameter has no use to say what it is read as, and stays as it is.
    read = [p for p in before if not p.startswith("encoder/") and not p.endswith(("cross_attn/k", "cross_attn/v"))]
    kernels = [p for p in read if p.endswith(("/q", "/k", "/v", "/o", "/wi", "/wo", "/wi_gate"))]
    assert kernels and set(kernels) <= changed, sorted(set(kernels) - changed)
    read_as_is = ("norm/scale", "norm/bias", "/router", "router_bias", "relative_bias/table", "kv_norm", "q_norm")
    kept = [p for p in before if p.endswith(read_as_is)]
    assert not set(kept) & changed, sorted(set(kept) & changed)
    if case == "moe_sigmoid":
        assert any(p.endswith("/router") for p in kept)  # the router's kernel, read in float32, stays float32
    if case == "gpt2":  # the tied embedding (gathered, then cast; cast for the output layer) and the positions
        assert {"decoder/embed/embedding", "decoder/positions/table"} <= changed
    if case == "t5":
        assert not {p for p in before if p.startswith("encoder/")} & changed


def test_float32_model_is_returned_untraced():
    """A model computing in its parameters' dtype has nothing to narrow: the model itself comes back
    and the step is never traced."""
    model = build_model(C.gpt2_small(**(DIMS | {"dtype": "float32"}), num_decoder_layers=1))

    def step(m):
        raise AssertionError("traced")

    assert precast.cast_once(model, "float32", step) is model


def test_a_parameter_read_as_it_is_anywhere_is_not_cast():
    """One use that reads the parameter uncast (beside a cast use, and through a gather, a reshape and a
    nested jit) keeps it float32; casts through selections alone cast it."""
    w = jnp.ones((4, 3), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda w: (w.astype(jnp.bfloat16), jnp.sum(w)))(w).jaxpr
    assert precast.cast_targets(jaxpr, jaxpr.invars[0]) is None
    ids = jnp.asarray([2, 0])

    def selected(w):
        rows = jax.jit(lambda w: jnp.take(w, ids, axis=0))(w).reshape(6).astype(jnp.bfloat16)
        return rows, w.T.astype(jnp.bfloat16)

    jaxpr = jax.make_jaxpr(selected)(w).jaxpr
    assert precast.cast_targets(jaxpr, jaxpr.invars[0]) == {np.dtype(jnp.bfloat16)}
    jaxpr = jax.make_jaxpr(lambda w: jnp.take(w, ids, axis=0) * 2)(w).jaxpr  # gathered, then read as it is
    assert precast.cast_targets(jaxpr, jaxpr.invars[0]) is None


def _loop_casts(jaxpr, shapes) -> int:
    """Casts, inside any loop body of `jaxpr` (nested calls followed), of a float32 array of one of
    `shapes` (the model's kernel shapes) to a narrower dtype."""
    count = collections.Counter()

    def walk(j, in_loop):
        for eqn in j.eqns:
            if in_loop and eqn.primitive.name == "convert_element_type":
                aval = eqn.invars[0].aval
                count["casts"] += aval.dtype == jnp.float32 and tuple(aval.shape) in shapes
            for sub in eqn.params.values():
                for s in sub if isinstance(sub, (tuple, list)) else (sub,):
                    if hasattr(s, "eqns") or hasattr(s, "jaxpr"):
                        walk(getattr(s, "jaxpr", s), in_loop or eqn.primitive.name in ("while", "scan"))

    walk(jaxpr, False)
    return count["casts"]


def _kernel_shapes(model) -> set:
    return {tuple(v[...].shape) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)) if v[...].ndim >= 2}


@pytest.mark.parametrize("cast", [True, False])
def test_generate_loop_reads_kernels_cast_once(cast, monkeypatch):
    """`generate`'s while loop casts no float32 kernel (it did at every step: XLA's GPU compiler keeps
    such casts in the loop); with `cast_once` switched off the same count finds them, so the check can
    fail."""
    if not cast:
        monkeypatch.setattr(decode, "cast_once", lambda model, *a: model)
    model = build_model(CASES["llama_scanned"])
    graphdef, params = nnx.split(decode.decodable(model))
    settings = decode._program_settings(C.DecodeConfig(strategy="greedy"))
    prompt, lengths = jnp.ones((2, 8), jnp.int32), jnp.asarray([8, 5], jnp.int32)
    N = 4 if cast else 5  # a trace of its own (traces are cached by their static arguments)
    traced = decode._generate.trace(
        graphdef, params, prompt, lengths, jnp.asarray([N, N]), None, jax.random.key(0),
        settings=settings, num_new=N, length=8 + N, eos_id=-1, pad_id=0,
    )  # fmt: skip
    casts = _loop_casts(traced.jaxpr.jaxpr, _kernel_shapes(model))
    assert (casts == 0) if cast else (casts > 0), casts


@pytest.mark.parametrize("cast", [True, False])
def test_engine_decode_loop_reads_kernels_cast_once(cast, monkeypatch):
    """The engine stores its parameters cast (the plan made at construction from its programs), so its
    decode program (several steps a call, in a loop) casts no float32 kernel; with the plan switched
    off the same count finds the casts. Its greedy tokens are `generate`'s either way."""
    from jaxformer.engine import Engine, SamplingParams

    if not cast:
        monkeypatch.setattr(engine_steps, "cast_plan", lambda *a: {})
    model = build_model(CASES["gpt2"])
    steps = 3 if cast else 2  # a trace of its own (traces are cached by their static arguments)
    cfg = EngineConfig(page_size=4, num_pages=9, max_slots=2, decode_steps=steps)
    engine = Engine(model, cfg, eos_id=None)
    traced = engine_steps._forward.trace(engine._graphdef, *engine._inputs(engine._blank(2, 1, 2)), steps=steps)
    casts = _loop_casts(traced.jaxpr.jaxpr, _kernel_shapes(model))
    assert (casts == 0) if cast else (casts > 0), casts
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    got = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=5))]
    want = decode.generate(model, prompts, C.DecodeConfig(strategy="greedy", max_new_tokens=5), eos_id=None).tokens
    assert got == np.asarray(want)[:, 0].tolist()
