"""Several LoRA adapters served by one engine: a mixed batch (rows on the base and on two adapters of
different ranks and targets, a prompt shared across them, prefix sharing on) gives, row by row, the
greedy tokens of `decode.generate` on the model with that adapter merged in (`lora.merge`); so do an
encoder_decoder's translations (`decode.translate`: the source encoded with the request's adapter) and
an encoder_only model's scores (its logits, one input alone); the batched update equals the one-adapter
maths row by row; bad adapters and unknown names are refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer import decode, lora
from jaxformer.config import DecodeConfig, EngineConfig, LoRAConfig, tiny
from jaxformer.engine import Engine, EngineError, SamplingParams
from jaxformer.engine.adapters import StackedAdapter, attach
from jaxformer.models import build_model

V, EOS = 48, 1


def _model(**changes):
    """A scanned two-layer decoder, parameters x3 (so continuations depend on the context)."""
    cfg = tiny("decoder_only", vocab_size=V, max_len=64, num_decoder_layers=2, scan_layers=True, **changes)
    model = build_model(cfg, seed=3)
    nnx.update(model, jax.tree.map(lambda x: 3.0 * x, nnx.state(model, nnx.Param)))
    return model


def _adapted(base, seed: int, **lora_cfg):
    """A copy of `base` with adapters whose B is random (a fresh adapter's B = 0 would change nothing)."""
    model = lora.add_adapters(nnx.clone(base), LoRAConfig(seed=seed, **lora_cfg))
    for i, (_, _, adapter) in enumerate(lora.adapters(model)):
        adapter.b[...] = 0.5 * jax.random.normal(jax.random.key(seed * 100 + i), adapter.b.shape)
    return model


@pytest.fixture(scope="module")
def models():
    base = _model()
    small = _adapted(base, 1, rank=2, targets=("q", "v"))
    wide = _adapted(base, 2, rank=4, alpha=8.0, targets=("q", "k", "v", "o", "wi", "wo", "embed"))
    return base, {"small": small, "wide": wide}


def test_rows_gather_their_own_adapter():
    """`lora_update_rows` (and the embedding's lookup and tied attend) equal the one-adapter maths row by row."""
    rng = np.random.default_rng(0)
    rng_normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
    a, b = rng_normal(3, 5, 2), rng_normal(3, 2, 4, 3)  # N=3 adapters of a [5] -> [4, 3] kernel
    scale, rows, x = np.array([0.0, 2.0, 0.5], np.float32), np.array([2, 0, 1, 2]), rng_normal(4, 6, 5)
    got = lora.lora_update_rows(x, a, b, scale, rows)
    for i, r in enumerate(rows):
        np.testing.assert_allclose(got[i], lora.lora_update(x[i], a[r], b[r], scale[r]), rtol=1e-5, atol=1e-6)
    ea, eb, ids = rng_normal(3, 7, 2), rng_normal(3, 2, 5), rng.integers(0, 7, (4, 6))
    looked, attended = (
        lora.lora_lookup_rows(ids, ea, eb, scale, rows, jnp.float32),
        lora.lora_attend_rows(x, ea, eb, scale, rows),
    )
    for i, r in enumerate(rows):
        w = ea[r] @ eb[r] * scale[r]  # [V, D], the merged update
        np.testing.assert_allclose(looked[i], w[ids[i]], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(attended[i], x[i] @ w.T, rtol=1e-5, atol=1e-5)


def test_a_mixed_batch_equals_each_merged_model(models):
    base, adapters = models
    rng = np.random.default_rng(0)
    system = rng.integers(2, V, 9).tolist()  # two whole pages of 4 shared by several prompts
    prompts = [[*system, 5, 6], rng.integers(2, V, 5).tolist(), [*system, 7], [*system, 5, 6, 8]]
    rows = [(0, None), (0, "small"), (0, "wide"), (2, "wide"), (1, None), (3, "small"), (2, None), (3, "wide"),
            (0, "small"), (3, None)]  # fmt: skip
    engine = Engine(base, EngineConfig(max_slots=2, page_size=4, num_pages=64), eos_id=EOS, adapters=adapters)
    assert engine.adapters == ("small", "wide")
    out = engine.generate([prompts[p] for p, _ in rows], SamplingParams(max_tokens=8), adapter=[a for _, a in rows])
    assert engine.prefix_hits > 0  # pages were shared (within an adapter)

    config = DecodeConfig(strategy="greedy", max_new_tokens=8)
    expected = {}
    for name, model in [(None, base), *adapters.items()]:
        merged = model if name is None else lora.merge(nnx.clone(model))
        tokens = decode.generate(merged, prompts, config, eos_id=EOS).tokens
        expected[name] = [decode.strip_after_eos(row[0], EOS) for row in tokens]
    for (p, name), o in zip(rows, out, strict=True):
        assert o.token_ids == expected[name][p], (p, name)
    for name in adapters:  # the adapters really change the model
        assert expected[name] != expected[None], name


def test_model_of_an_adapter_and_refusals(models):
    """`model_of(name)` (what the server scores prompts with) is the merged model; bad adapters are refused."""
    base, adapters = models
    engine = Engine(base, EngineConfig(max_slots=2, page_size=4, num_pages=16), eos_id=EOS, adapters=adapters)
    ids = jnp.asarray([[3, 4, 5, 6, 7]])
    merged = lora.merge(nnx.clone(adapters["wide"]))(ids)
    np.testing.assert_allclose(engine.model_of("wide")(ids), merged, rtol=1e-4, atol=1e-4 * np.abs(merged).max())
    with pytest.raises(EngineError, match=r"adapter 'nope' is not served by this engine \(its adapters: 'small'"):
        engine.add_request([3, 4], SamplingParams(), adapter="nope")
    # An adapter trained over an int8 base (lora.base="int8"): its A and B, served over the engine's base.
    plain = _adapted(base, 5, rank=2, targets=("q",))
    int8 = lora.quantize_base(nnx.clone(plain), LoRAConfig(rank=2, base="int8"))
    served = decode.decodable(nnx.clone(base))  # as the engine runs its base: unrolled
    assert tuple(attach(served, {"a": int8})) == ("a",)
    got = [m.a[...][1] for _, m in nnx.iter_modules(served) if isinstance(m, StackedAdapter)]  # layer by layer
    (_, _, adapter), *_ = lora.adapters(plain)
    assert len(got) == 2 and all(np.array_equal(x, y) for x, y in zip(got, adapter.a[...], strict=True))
    other = _adapted(_model(d_ff=48), 1, rank=2, targets=("q",))
    with pytest.raises(EngineError, match=r"adapters\['other'\]: model\.d_ff=48 differs from the served model's"):
        Engine(base, eos_id=EOS, adapters={"other": other})
    with pytest.raises(EngineError, match=r"adapters\['plain'\]: the model has no LoRA adapters"):
        Engine(base, eos_id=EOS, adapters={"plain": _model()})


def _scaled(mode: str, **changes):
    """A tiny model of `mode`, parameters x3 as `_model`'s."""
    model = build_model(tiny(mode, vocab_size=V, max_len=32, **changes), seed=5)
    nnx.update(model, jax.tree.map(lambda x: 3.0 * x, nnx.state(model, nnx.Param)))
    return model


def test_an_encoder_decoder_translates_each_source_with_its_own_adapter():
    """Two adapters targeting the encoder's, the decoder's and the cross-attention's kernels (the one of
    rank 4 the embedding too): each request's source is encoded and cross-attended with its adapter, and
    the outputs equal `decode.translate` on each merged model; the same source under two adapters (and
    the base) shares no pages."""
    base = _scaled("encoder_decoder", tie_output=False)
    adapters = {
        "small": _adapted(base, 1, rank=2, targets=("q", "v")),
        "wide": _adapted(base, 2, rank=4, alpha=8.0, targets=("q", "k", "v", "o", "wi", "wo", "embed")),
    }
    rng = np.random.default_rng(2)
    sources = [rng.integers(3, V, n).tolist() for n in (5, 9, 3)]
    rows = [(0, None), (0, "small"), (0, "wide"), (1, "wide"), (2, "small"), (1, None)]
    cfg = EngineConfig(page_size=4, num_pages=32, max_slots=2, prefill_chunk=4)
    engine = Engine(base, cfg, eos_id=2, bos_id=1, adapters=adapters)
    srcs, named = [sources[i] for i, _ in rows], [a for _, a in rows]
    outs = engine.generate([[]] * len(rows), SamplingParams(max_tokens=8), sources=srcs, adapter=named)
    settings = DecodeConfig(strategy="greedy", max_new_tokens=8)
    expected = {}
    for name, model in [(None, base), *adapters.items()]:
        merged = model if name is None else lora.merge(nnx.clone(model))
        tokens = decode.translate(merged, sources, settings, bos_id=1, eos_id=2).tokens
        expected[name] = [decode.strip_after_eos(row[0][:8], 2) for row in tokens]
    for (i, name), o in zip(rows, outs, strict=True):
        assert o.token_ids == expected[name][i], (i, name)
    for name in adapters:  # the adapters really change the translations
        assert expected[name] != expected[None], name
    # A decoder prompt of a whole page (BOS and 4 ids), in pairs admitted together: a page is shared only
    # by a request of the same source and the same adapter (the third pair's two requests, the first's).
    prompt, pairs = [1, 5, 6, 7, 8], [(0, "wide"), (1, None), (1, "wide"), (0, None), (0, "wide"), (1, None)]
    before = engine.prefix_hits
    srcs, named = [sources[i] for i, _ in pairs], [a for _, a in pairs]
    again = engine.generate([prompt] * 6, SamplingParams(max_tokens=1), sources=srcs, adapter=named)
    assert engine.prefix_hits - before == 2 and again[4].token_ids == again[0].token_ids


def test_an_encoder_only_model_scores_each_input_with_its_own_adapter():
    """One `score` call mixing the base and two adapters over padded inputs of mixed lengths: each input's
    class log-probabilities and masked-LM fills equal its merged model's on the input alone."""
    base = _scaled("encoder_only", num_classes=3)
    adapters = {
        "small": _adapted(base, 1, rank=2, targets=("q", "v")),
        "wide": _adapted(base, 2, rank=4, alpha=8.0, targets=("q", "k", "v", "o", "wi", "wo", "embed")),
    }
    rng = np.random.default_rng(3)
    inputs = [rng.integers(4, V, n).tolist() for n in (3, 9, 17, 5, 9)]
    named = [None, "small", "wide", "wide", None]
    engine = Engine(base, EngineConfig(max_slots=2), eos_id=None, adapters=adapters)
    classes = engine.score(inputs, "classify", adapter=named)
    fills = engine.score([[*x[:2], 3, *x[3:]] for x in inputs], "fill", mask_id=3, adapter=named)
    merged = {None: base} | {name: lora.merge(nnx.clone(model)) for name, model in adapters.items()}
    for x, name, c, f in zip(inputs, named, classes, fills, strict=True):
        model, ids = merged[name], jnp.asarray([[*x[:2], 3, *x[3:]]])
        want = jax.nn.log_softmax(model.classify(jnp.asarray([x])))[0]
        np.testing.assert_allclose(c, want, atol=1e-4)
        assert f[2] == int(jnp.argmax(model(ids)[0, 2]))
    assert classes[1] != engine.score([inputs[1]], "classify")[0]  # the adapter changes the scores
    with pytest.raises(EngineError, match="1 adapters for 5 inputs"):
        engine.score(inputs, "embed", adapter=("wide",))
    with pytest.raises(EngineError, match=r"adapter 'nope' is not served"):
        engine.score(inputs[:1], "embed", adapter="nope")


def test_the_stacks_carry_their_kernels_logical_axes_and_shard_as_they_do(models):
    """Each stack's A [N, in..., R] names the kernel's input axes, its B [N, R, out...] the kernel's output
    axes (adapter and rank axes unnamed); on a mesh with a tensor axis (TPU devices of a v5e:2x2 slice,
    compile-only), every stack is split as its kernel is, none left whole on each device."""
    base, adapters = models
    served = decode.decodable(nnx.clone(base))
    attach(served, adapters)
    stacks = [(m, name) for _, m in nnx.iter_modules(served) for name in dir(m) if name.endswith("_lora")]
    stacks = [(m, name[: -len("_lora")], getattr(m, name)) for m, name in stacks]
    assert len(stacks) == 13 and all(isinstance(s, StackedAdapter) for _, _, s in stacks)  # 2 layers x 6, embed
    for module, kernel_name, stack in stacks:
        names = getattr(module, kernel_name).get_metadata()["out_sharding"]
        cut = stack.a.ndim - 2
        assert stack.a.get_metadata()["out_sharding"] == (None, *names[:cut], None), kernel_name
        assert stack.b.get_metadata()["out_sharding"] == (None, None, *names[cut:]), kernel_name
    pytest.importorskip("libtpu")
    from jaxformer import sharding
    from jaxformer.config import MeshConfig
    from jaxformer.plan import parse_target

    mesh_cfg = MeshConfig(data=2, tensor=2)
    mesh = sharding.make_mesh(mesh_cfg, parse_target("tpu-v5e:2x2").devices())
    state = nnx.state(served)
    with sharding.use(mesh, sharding.rules_for(mesh_cfg)):
        shardings = dict(nnx.to_flat_state(sharding.state_shardings(state, mesh)))
    ndim = {path: v.ndim for path, v in nnx.to_flat_state(state)}
    spec = lambda path: (*shardings[path].spec, *(None,) * (ndim[path] - len(shardings[path].spec)))
    split = 0
    for path in shardings:
        if len(path) < 2 or not str(path[-2]).endswith("_lora") or path[-1] not in ("a", "b"):
            continue
        kernel, cut = spec((*path[:-2], path[-2][: -len("_lora")])), ndim[(*path[:-2], path[-2], "a")] - 2
        want = (None, *kernel[:cut], None) if path[-1] == "a" else (None, None, *kernel[cut:])
        assert spec(path) == want, path
        split += "tensor" in spec(path)
    assert split >= 12  # q, k, v (heads), o (heads), wi (ff) and wo (ff) of each layer at least


def test_adapters_loaded_and_unloaded_while_serving_answer_as_if_served_from_the_start(models):
    """`load_adapter` while a request of another adapter runs: the running request's tokens, and the new
    adapter's, equal those of an engine that served both from the start; `unload_adapter` refuses while
    a request of the adapter is live, then the others answer on unchanged (their places in the stacks
    closed up) and a request naming it is refused."""
    base, adapters = models
    cfg = EngineConfig(max_slots=2, page_size=4, num_pages=64)
    prompt, params = [3, 4, 5, 6, 7], SamplingParams(max_tokens=8)
    both = Engine(base, cfg, eos_id=EOS, adapters=adapters)
    want = {a: both.generate([prompt], params, adapter=a)[0].token_ids for a in ("small", "wide", None)}
    engine = Engine(base, cfg, eos_id=EOS, adapters={"small": adapters["small"]})
    first, got = engine.add_request(prompt, params, adapter="small"), {}

    def step():
        for event in engine.step():
            got[event.request_id] = got.get(event.request_id, []) + event.token_ids

    step()  # its prompt computed, a token drawn
    assert got[first]
    engine.load_adapter("wide", adapters["wide"])
    assert engine.adapters == ("small", "wide")
    second = engine.add_request(prompt, params, adapter="wide")
    with pytest.raises(EngineError, match=r"adapter 'small' has requests running or waiting"):
        engine.unload_adapter("small")
    while engine.has_unfinished():
        step()
    assert (got[first], got[second]) == (want["small"], want["wide"])
    with pytest.raises(EngineError, match=r"adapter 'wide' is already served"):
        engine.load_adapter("wide", adapters["wide"])
    third = engine.add_request(prompt, dataclasses.replace(params, max_tokens=20), adapter="wide")
    step()
    engine.unload_adapter("small")  # while a request of "wide", index 2 of the stacks until now, runs
    assert engine.adapters == ("wide",)
    while engine.has_unfinished():
        step()
    assert got[third][:8] == want["wide"]
    assert engine.generate([prompt], params)[0].token_ids == want[None]
    with pytest.raises(EngineError, match=r"adapter 'small' is not served by this engine"):
        engine.add_request(prompt, params, adapter="small")
    engine.unload_adapter("wide")  # none left: the base alone, without stacks
    assert engine.adapters == () and engine.generate([prompt], params)[0].token_ids == want[None]
    assert not any(isinstance(m, StackedAdapter) for _, m in nnx.iter_modules(engine.model))
