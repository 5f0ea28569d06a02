"""Context parallelism (jaxformer/ring.py) against one device's attention, on 8 CPU devices.

Ring attention over 2, 4 and 8 devices, for causal and bidirectional self-attention and for
cross-attention, each with the sequence laid out contiguously and zig-zag or striped, with padded
queries and keys and packed segments (and the all-gather strategy on a few of them), equals
`functional.dot_product_attention` on the whole sequence: outputs and the gradients of q, k and v,
float32. The cases run in one process of their own (8 devices must be set before JAX starts), which
prints the largest errors as JSON; the layouts are data there, so one compile serves them all.
"""

from __future__ import annotations

import functools
import json
import sys

import processes
import pytest

# The grid: {causal, bidirectional, cross} x rings {2, 4, 8} x the layouts that apply, every case
# with padded queries and keys (q and kv lengths), rings 4 and 8 with packed segments too. Causal
# attention is laid contiguous, zig-zag (the model's `context_layout`) and striped; bidirectional
# contiguous and striped (any order must give the same result: masks come from positions);
# cross-attention with queries contiguous or zig-zag over contiguous keys, as seq2seq's decoder lays
# its target over the source. Then the all-gather strategy, and a data axis beside the ring.
# (name, strategy, ring size, query layout, key layout, causal, T, S, segments, data-parallel ways)
KINDS = {
    "causal": (True, 32, ("contiguous", "zigzag", "striped")),
    "bidirectional": (False, 32, ("contiguous", "striped")),
    "cross": (False, 16, ("contiguous", "zigzag")),
}
CASES = [
    (f"ring{n} {kind} {layout}", "ring", n, layout, "contiguous" if kind == "cross" else layout, causal, T,
     32, n > 2, 1)
    for kind, (causal, T, layouts) in KINDS.items() for n in (2, 4, 8) for layout in layouts
] + [
    ("allgather2 bidirectional", "allgather", 2, "contiguous", "contiguous", False, 32, 32, False, 1),
    ("allgather4 causal zigzag", "allgather", 4, "zigzag", "zigzag", True, 32, 32, True, 1),
    ("allgather8 cross", "allgather", 8, "contiguous", "contiguous", False, 16, 32, True, 1),
    ("ring4 x data2 causal zigzag", "ring", 4, "zigzag", "zigzag", True, 32, 32, True, 2),
] + [
    # A fused kernel inside the ring (`ring.fused_kernel`), here with XLA standing in for cuDNN's two
    # calls under the same contract (`ring.reference_fwd_call`): each block told its kind. Plain
    # rows give the kinds that need no mask (contiguous: full, causal, skipped; zig-zag: causal and the
    # two halves; striped: causal and masked); padded and packed ones send most blocks to the bias.
    (f"fused ring{n} {kind} {layout}{' padded' if padded else ''}", "fused", n, layout,
     "contiguous" if kind == "cross" else layout, causal, T, 32, padded and n > 2, 1, padded)
    for kind, (causal, T, layouts) in KINDS.items() for n in (4,) for layout in layouts
    for padded in (False, True)
] + [
    # A sliding window of 6 over blocks of 8 (contiguous) or 2 x 4 (zig-zag): the diagonal block is
    # cut by it, the one before partly seen, older ones skipped; packed and padded rows as above.
    ("ring4 causal contiguous window6", "ring", 4, "contiguous", "contiguous", True, 32, 32, True, 1, True, 6),
    ("fused ring4 causal zigzag window6", "fused", 4, "zigzag", "zigzag", True, 32, 32, False, 1, False, 6),
    ("allgather4 causal zigzag window6", "allgather", 4, "zigzag", "zigzag", True, 32, 32, True, 1, True, 6),
]  # fmt: skip
CASES = [c if len(c) >= 11 else (*c, True) for c in CASES]  # (..., padded): q and kv lengths given
CASES = [c if len(c) == 12 else (*c, 0) for c in CASES]  # (..., window): 0, none


@functools.cache
def contract_kernel():
    """`ring.fused_kernel` with XLA standing in for a fused attention's two calls, under cuDNN's
    conventions (`ring.reference_fwd_call`)."""
    from jaxformer import ring

    return ring.KERNELS["reference"]()


def _ours(mesh, strategy, causal, window, q, k, v, q_order, kv_order, q_lengths, kv_lengths, q_seg, kv_seg):
    """Context-parallel attention of the sequence laid out in `q_order` / `kv_order` (int arrays, so
    that one compile serves every layout), its output put back in sequence order. Strategy "fused":
    the ring with `contract_kernel` inside."""
    import jax.numpy as jnp

    from jaxformer import ring

    (B, T), S = q.shape[:2], k.shape[1]
    lay = lambda x, order: None if x is None else jnp.take(x, order, axis=1)
    kernel = contract_kernel() if strategy == "fused" else "dense"
    strategy = "ring" if strategy == "fused" else strategy
    o = ring.context_attention(
        lay(q, q_order), lay(k, kv_order), lay(v, kv_order), mesh=mesh, strategy=strategy, causal=causal, kernel=kernel,
        q_index_BT=jnp.broadcast_to(q_order, (B, T)), kv_index_BS=jnp.broadcast_to(kv_order, (B, S)),
        q_segments_BT=lay(q_seg, q_order), kv_segments_BS=lay(kv_seg, kv_order),
        kv_lengths_B=kv_lengths, q_lengths_B=q_lengths, spec_BTHK=("data",), window=window,
    )  # fmt: skip
    return lay(o, jnp.argsort(q_order))


def _reference(causal, window, q, k, v, q_order, kv_order, q_lengths, kv_lengths, q_seg, kv_seg):
    """One device's attention over the whole sequence in its order (the layouts play no part)."""
    from jaxformer import functional as F

    mask = F.Mask(causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths, q_segments=q_seg, kv_segments=kv_seg,
                  window=window)  # fmt: skip
    return F.dot_product_attention(q, k, v, mask=mask)


def _out_and_grads(attend, statics, q, k, v, *rest):
    """The output and the gradients of q, k, v under a cotangent that is not O itself."""
    import jax
    import jax.numpy as jnp

    o, vjp = jax.vjp(lambda q, k, v: attend(*statics, q, k, v, *rest), q, k, v)
    return o, vjp(jnp.broadcast_to(jnp.cos(jnp.arange(o.shape[-1])), o.shape).astype(o.dtype))


@functools.cache
def _jitted():  # one jit: its cache compiles each (side, mesh, strategy, causal, shapes) once
    import jax

    return jax.jit(_out_and_grads, static_argnums=(0, 1))


def case_errors(seed, strategy, n, q_layout, kv_layout, causal, T, S, segments, data, padded, window) -> dict:
    """The largest differences from one device's attention, of the outputs and of the gradients."""
    import jax
    import jax.numpy as jnp

    from jaxformer import ring

    B, H, G, K = 2, 4, 2, 8
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((data, n), ("data", "context"), axis_types=auto, devices=jax.devices()[: data * n])
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, T, H, K))
    k, v = jax.random.normal(kk, (B, S, G, K)), jax.random.normal(kv, (B, S, G, K))
    # the second row's last queries and keys are padding (by length), in every case
    lengths = (jnp.array([T, T - 3]), jnp.array([S, S - 5])) if padded else (None, None)
    # two documents a row, the second ending early: trailing keys and queries are padding (segment 0)
    seg = lambda L: jnp.stack([jnp.where(jnp.arange(L) < L // 3, 1, 2), jnp.where(jnp.arange(L) < L - 6, 1, 0)])
    segs = (seg(T), seg(S)) if segments else (None, None)
    orders = tuple(jnp.asarray(ring.layout_order(L, n, lay)) for L, lay in ((T, q_layout), (S, kv_layout)))
    o1, g1 = _jitted()(_ours, (mesh, strategy, causal, window), q, k, v, *orders, *lengths, *segs)
    o2, g2 = _jitted()(_reference, (causal, window), q, k, v, *orders, *lengths, *segs)
    return {
        "out": float(jnp.abs(o1 - o2).max()),
        "grad": max(float(jnp.abs(a - b).max()) for a, b in zip(g1, g2, strict=True)),
        "grad_scale": max(float(jnp.abs(b).max()) for b in g2),
    }


def zigzag_training_errors(mode: str, window: int = 0) -> dict:
    """The summed loss and the gradients of a (deterministic) step's loss with the sequence laid out
    zig-zag over a context axis of 4 beside a data axis of 2, against one device, contiguous;
    `window` > 0: the first of two layers local (`model.sliding_window`), the second global."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxformer import config as C
    from jaxformer import sharding
    from jaxformer.models import Transformer
    from jaxformer.train import laid_out, loss_sums

    objective = {"decoder_only": "lm", "encoder_decoder": "seq2seq"}[mode]
    window_fields = dict(sliding_window=window, global_every=2, num_decoder_layers=2) if window else {}
    cfg = C.Config(
        model=C.tiny(mode, num_heads=4, context_layout="zigzag", **window_fields), data=C.DataConfig(max_len=16),
        train=C.TrainConfig(objective=objective, batch_size=4), mesh=C.MeshConfig(data=2, context=4),
    )  # fmt: skip
    ids = lambda seed: jax.random.randint(jax.random.key(seed), (4, 16), 3, 32)
    segments = jnp.where(jnp.arange(16) < 10, 1, 2) * jnp.ones((4, 1), jnp.int32)  # two documents a row
    positions = jnp.where(jnp.arange(16) < 10, jnp.arange(16), jnp.arange(16) - 10) * jnp.ones((4, 1), jnp.int32)
    batch = {"inputs": ids(1), "targets": ids(2), "weights": (ids(3) > 8).astype(jnp.float32)}
    if mode == "decoder_only":  # packed rows: segments and their own positions move with the tokens
        batch |= {"segments": segments, "positions": positions}
    else:
        batch |= {"src": ids(4), "src_lengths": jnp.array([16, 12, 16, 5])}
    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params):
        return loss_sums(nnx.merge(graphdef, params), cfg.train, batch, None)

    (ref, ref_sums), ref_grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        (got, sums), grads = step(params)
        permutes = step.lower(params).as_text().count("collective_permute")
        key = "positions" if mode == "decoder_only" else "tgt_positions"
        laid = laid_out(batch, objective, "zigzag")[key][0].tolist()  # the order the step feeds the model
    return {
        "loss": float(abs(got - ref) / abs(ref)),
        "correct": float(abs(sums["correct"] - ref_sums["correct"])),
        "grad": max(
            float(jnp.abs(a - b).max()) for a, b in zip(*map(jax.tree.leaves, (grads, ref_grads)), strict=True)
        ),
        "permutes": permutes,
        "laid_out": laid,
    }


def decoding_errors(mode: str, data: int, window: int = 0) -> dict:
    """Cached decoding with the caches split by position over a context axis of 4 (beside `data`
    ways of batch): a prefill (decoder_only: a 16-token prompt through ring attention; encoder_decoder:
    a 16-token source encoded over the axis, BOS first) then greedy steps, each step's logits against
    one device's, and where the compiled step's collectives move bytes. `window` > 0: a local layer
    (`model.sliding_window`) before a global one; one device keeps the local layer's ring of `window` slots."""
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxformer import config as C
    from jaxformer import sharding
    from jaxformer.layers import without_id_checks
    from jaxformer.models import Transformer

    B, P, L = 4, 16, 22  # L: positions in the cache, rounded up to 24 slots (6 a device)
    cfg = C.Config(
        model=C.tiny(mode, num_heads=4, num_kv_heads=2, num_decoder_layers=1 + bool(window),
                     num_encoder_layers=int(data == 1), sliding_window=window, global_every=2 * bool(window)),
        data=C.DataConfig(max_len=P),
        train=C.TrainConfig(objective="lm" if mode == "decoder_only" else "seq2seq", batch_size=B),
        mesh=C.MeshConfig(data=data, context=4),
    )  # fmt: skip
    graphdef, params = nnx.split(without_id_checks(Transformer(cfg.model, rngs=nnx.Rngs(0))))
    ids = lambda seed, T: jax.random.randint(jax.random.key(seed), (B, T), 3, 32)
    src, src_lengths = ids(5, P), jnp.array([16, 11, 3, 16])

    def greedy():  # its own jitted functions each time: traced under the mesh in effect, or none
        @jax.jit
        def prefill(params):
            model = nnx.merge(graphdef, params)
            if mode == "decoder_only":
                return model.decode_step(model.init_cache(B, L), ids(6, P), None)
            memory = model.encode(src, src_lengths=src_lengths)
            cache = model.init_cache(B, L, memory, src_lengths=src_lengths)
            return model.decode_step(cache, jnp.ones((B, 1), jnp.int32), None)

        @jax.jit
        def step(params, cache, tokens_B, position):
            model = nnx.merge(graphdef, params)
            logits_B1V, cache = model.decode_step(cache, tokens_B[:, None], jnp.full((B, 1), position))
            return logits_B1V[:, 0], cache

        logits, cache = prefill(params)
        logits, position, out = logits[:, -1], logits.shape[1], {"logits": [], "tokens": []}
        tokens = jnp.argmax(logits, -1)
        compiled = step.lower(params, cache, tokens, position).compile()
        for t in range(3):
            out["logits"].append(logits)
            out["tokens"].append(tokens)
            logits, cache = compiled(params, cache, tokens, position + t)
            tokens = jnp.argmax(logits, -1)
        return out, cache, compiled.as_text()

    ref, *_ = greedy()
    devices = jax.devices()[: data * 4]
    with sharding.use(sharding.make_mesh(cfg.mesh, devices), sharding.rules_for(cfg.mesh)):
        got, cache, hlo = greedy()
    layer = cache["layers"][0]
    specs = {f"self {i}": str(c["self"]["k"].sharding.spec) for i, c in enumerate(cache["layers"])}
    if "memory" in layer:
        specs["memory"] = str(layer["memory"]["k"].sharding.spec)
    moved = {}  # collective -> the largest array it moves (bytes)
    for kind, shapes in re.findall(r"= (.*?) (all-gather|all-reduce|collective-permute|all-to-all)(?:-start)?\(", hlo):
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", kind):
            itemsize = 1 if dtype == "pred" else int(re.sub(r"\D", "", dtype)) // 8  # f32, s32, bf16
            size = int(np.prod([int(d) for d in dims.split(",") if d])) * itemsize
            moved[shapes] = max(moved.get(shapes, 0), size)
    return {
        "logits": max(float(jnp.abs(a - b).max()) for a, b in zip(got["logits"], ref["logits"], strict=True)),
        "tokens_equal": all(bool((a == b).all()) for a, b in zip(got["tokens"], ref["tokens"], strict=True)),
        "specs": specs,
        "moved": moved,
        "output_bytes": B * 4 * cfg.model.dim_per_head * 4,  # one position's attention output [B, H, K], f32
    }


def chunked_loss_gathers() -> dict:
    """All-gathers in the compiled loss and gradient of `chunked_cross_entropy` over a length split 4
    ways, with chunks cut from the whole length (blocks=1) or from each device's block (blocks=4)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxformer import functional as F

    mesh = jax.make_mesh((4,), ("context",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    split = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "context")))
    B, T, D, V = 2, 64, 8, 32
    h, labels, weights = split(jnp.ones((B, T, D))), split(jnp.ones((B, T), jnp.int32)), split(jnp.ones((B, T)))

    def gathers(blocks: int) -> int:
        loss = lambda h, w: F.chunked_cross_entropy(h, lambda x: x @ w, labels, weights, chunk=16, blocks=blocks)
        step = jax.jit(jax.grad(lambda h, w: loss(h, w)["loss"], argnums=(0, 1)))
        return step.lower(h, jnp.ones((D, V))).compile().as_text().count("all-gather(")

    return {blocks: gathers(blocks) for blocks in (1, 4)}


def run_cases() -> dict:
    import jax
    import jax.numpy as jnp

    from jaxformer import ring

    out = {name: case_errors(i, *case) for i, (name, *case) in enumerate(CASES)}
    out |= {f"zigzag {mode}": zigzag_training_errors(mode) for mode in ("decoder_only", "encoder_decoder")}
    out["zigzag decoder_only window"] = zigzag_training_errors("decoder_only", window=3)
    out["chunked loss gathers"] = chunked_loss_gathers()
    for mode, data in (("decoder_only", 2), ("encoder_decoder", 1)):
        out[f"decode {mode}"] = decoding_errors(mode, data, window=5 if mode == "decoder_only" else 0)
    mesh = jax.make_mesh((4,), ("context",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    x = jnp.zeros((1, 30, 2, 8))
    try:
        ring.context_attention(x, x, x, mesh=mesh)
    except ValueError as e:
        out["indivisible"] = str(e)
    return out


@pytest.fixture(scope="module")
def errors() -> dict:
    env = processes.cpu_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")  # elemental emitters: 61 -> 30 s
    proc = processes.run([sys.executable, __file__], env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_context_parallel_attention_equals_one_device(errors, case):
    """Outputs and gradients within 1e-5, absolute: the inputs are unit normals and the gradients at
    most ~10 in size (recorded as grad_scale), so this is float32 rounding, not a loose bound."""
    assert errors[case]["out"] <= 1e-5 and errors[case]["grad"] <= 1e-5, errors[case]


@pytest.mark.parametrize("mode", ["decoder_only", "encoder_decoder", "decoder_only window"])
def test_a_zigzag_layout_trains_as_one_device(errors, mode):
    """The step's loss (packed rows; seq2seq with padded sources) and its gradients with the causal
    sequence laid zig-zag over 4 devices (`model.context_layout`), against one device; "window":
    a local layer (`model.sliding_window=3`, by the packed rows' own positions) before a global one."""
    r = errors[f"zigzag {mode}"]
    assert r["loss"] <= 1e-5 and r["correct"] == 0 and r["grad"] <= 1e-5, r
    assert r["permutes"] > 0, "ring attention over the context axis"
    zigzag = [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]  # device i: blocks i and 7 - i of 8
    packed = [p if p < 10 else p - 10 for p in zigzag]  # decoder_only's rows hold two documents
    assert r["laid_out"] == (zigzag if mode == "encoder_decoder" else packed)


@pytest.mark.parametrize("mode", ["decoder_only", "encoder_decoder"])
def test_decoding_over_a_cache_split_by_position_equals_one_device(errors, mode):
    """Prefill (decoder_only: ring attention over the prompt, data x context; encoder_decoder: the
    source encoded over the context axis) and greedy steps against caches split over the context
    axis give one device's logits and tokens; the caches are split by position, and a compiled step
    moves nothing of them: its only collectives are the log-sum-exp all-reduces, each no larger than
    one position's attention output. decoder_only's first layer is local over 5 positions (6 slots a
    device: the steps' windows cross a device's edge, and leave two devices none): one device holds
    its ring of 5 slots, the context axis the whole cache with the window masked."""
    r = errors[f"decode {mode}"]
    assert r["logits"] <= 1e-5 and r["tokens_equal"], r
    assert all(spec.endswith("'context')") for spec in r["specs"].values()), r["specs"]
    assert set(r["moved"]) == {"all-reduce"} and r["moved"]["all-reduce"] <= r["output_bytes"], r


def test_the_chunked_loss_over_a_split_length_gathers_nothing(errors):
    """Chunks cut from each device's block of positions stay split as the hidden states are; chunks of
    the whole length gather each chunk's positions onto every device (and each computes every chunk).
    Their values agree: tests/test_functional.py; a training step: tests/test_sharding.py."""
    assert errors["chunked loss gathers"] == {"1": 1, "4": 0}, errors["chunked loss gathers"]


def test_a_sequence_the_context_axis_does_not_divide_is_refused(errors):
    assert errors["indivisible"] == "queries: length 30 is not divisible by the context axis (context=4)"


if __name__ == "__main__":
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    print(json.dumps(run_cases()))


def test_what_context_parallelism_cannot_split_is_refused_naming_the_field():
    from jaxformer import config as C

    def build(objective="lm", max_len=16, **model):
        mode = {"lm": "decoder_only", "mlm": "encoder_only", "seq2seq": "encoder_decoder"}[objective]
        return C.Config(
            model=C.tiny(mode, **model), data=C.DataConfig(max_len=max_len),
            train=C.TrainConfig(objective=objective, batch_size=4), mesh=C.MeshConfig(data=1, context=4),
        )  # fmt: skip

    build(context_layout="zigzag")  # 16 positions: 8 blocks of 2
    for kwargs, message in (
        (dict(objective="mlm", context_layout="zigzag"), r"model.context_layout: zigzag balances causal attention"),
        (dict(max_len=12, context_layout="zigzag"), r"data.max_len: 12 is not divisible by 2 x mesh.context=4"),
        (dict(max_len=18), r"data.max_len: 18 is not divisible by mesh.context=4"),
        (dict(position="relative"), r"mesh.context: context parallelism takes no relative position bias"),
        (dict(attention_dropout_rate=0.1), r"mesh.context: context parallelism applies no attention dropout"),
    ):
        with pytest.raises(C.ConfigError, match=message):
            build(**kwargs)


@pytest.mark.parametrize(
    "layout, causal, window, kinds",
    [
        ("contiguous", True, 0, {"SKIP", "FULL", "CAUSAL"}),
        ("zigzag", True, 0, {"CAUSAL", "KV_FRONT", "Q_BACK"}),
        ("striped", True, 0, {"CAUSAL", "MASKED"}),
        ("striped", False, 0, {"FULL"}),
        ("contiguous", True, 8, {"SKIP", "CAUSAL", "MASKED"}),
    ],
)
def test_each_layout_s_blocks_are_the_kinds_a_fused_kernel_needs_no_mask_for(layout, causal, window, kinds):
    """`ring.block_kind` of every (device, visiting block) pair of a ring of 4 over 32 positions, from
    the blocks' positions: the balanced zig-zag layout needs no mask array at all, striped one for the
    blocks from later devices (keys strictly before the queries' own), and any padding makes one.
    A sliding window of one block's length leaves each device its own block causal, the block
    before it cut (masked) and every older one skipped: never a FULL block."""
    import jax.numpy as jnp
    import numpy as np

    from jaxformer import ring

    n, T = 4, 32
    blocks = ring.layout_order(T, n, layout).reshape(n, T // n)
    names = {getattr(ring, k): k for k in ("SKIP", "FULL", "CAUSAL", "KV_FRONT", "Q_BACK", "MASKED")}

    def kind(q_pos, kv_pos, kv_length=T):
        vis = (kv_pos[None, :] <= q_pos[:, None]) if causal else np.ones((T // n, T // n), bool)
        if window:
            vis = vis & (kv_pos[None, :] > q_pos[:, None] - window)
        vis = vis & (kv_pos < kv_length)[None, :]
        return names[int(ring.block_kind(jnp.asarray(vis)[None, None, None], causal))]

    assert {kind(blocks[d], blocks[e]) for d in range(n) for e in range(n)} == kinds
    assert "MASKED" in {kind(blocks[d], blocks[e], kv_length=T - 3) for d in range(n) for e in range(n)}


def _block_contract_errors(kernel) -> dict:
    """A device's queries (256 positions) against two visiting key blocks of 256, as a ring of two
    lays a causal sequence of 512 zig-zag (device 0: its own block is CAUSAL, device 1's is Q_BACK;
    device 1: device 0's block is KV_FRONT), bidirectional (FULL), and with the last 40 keys padding
    (MASKED): each block attended by `kernel.fwd` and combined by log-sum-exp, then each block's
    `kernel.bwd` told the whole output and log-sum-exp, against attention over all 512 keys at once
    (`functional.dot_product_attention`, float32) and its autodiff. bfloat16 inputs. Returns the
    largest errors relative to the largest reference value, by case."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxformer import functional as F
    from jaxformer import ring

    B, H, G, K, n, L = 2, 4, 2, 64, 2, 256
    order = ring.layout_order(2 * L, n, "zigzag").reshape(n, L)
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (B, L, H, K), jnp.bfloat16)
    k, v = (jax.random.normal(x, (B, 2 * L, G, K), jnp.bfloat16) for x in (kk, kv))
    do = jax.random.normal(kd, (B, L, H, K), jnp.bfloat16)
    f32 = lambda x: x.astype(jnp.float32)
    # Each call jitted, the block's visibility an argument: every case of a kind of call (forward or backward,
    # causal or not) runs one compiled program. Called eagerly, each `lax.switch` over the kinds (the MASKED
    # branch closing over that block's visibility) compiled anew: 16 programs, 4 interpreted splash kernels each.
    fwd, bwd = (jax.jit(call, static_argnums=(5, 6)) for call in (kernel.fwd, kernel.bwd))

    @jax.jit
    def reference_and_grads(q, k, v, vis, do):  # attention over all keys at once and its autodiff
        reference = lambda q, k, v: F.dot_product_attention(f32(q), f32(k), f32(v), mask=vis[:, 0], scale=K**-0.5)
        out_ref, vjp = jax.vjp(reference, q, k, v)
        return out_ref, vjp(f32(do))

    errors = {}
    cases = [("zigzag device 0", 0, True, 2 * L), ("zigzag device 1", 1, True, 2 * L),
             ("bidirectional", 0, False, 2 * L), ("padded", 0, False, 2 * L - 40)]  # fmt: skip
    for case, device, causal, kv_length in cases:
        q_pos, kv_pos = order[device], np.concatenate([order[device], order[1 - device]])  # own block first
        vis = (kv_pos[None, :] <= q_pos[:, None]) if causal else np.ones((L, 2 * L), bool)
        vis = jnp.asarray(vis & (kv_pos < kv_length)[None, :])[None, None, None]  # [1, 1, 1, T, 2S]
        vis = jnp.broadcast_to(vis, (B, 1, 1, L, 2 * L))
        blocks = [(slice(0, L), vis[..., :L]), (slice(L, 2 * L), vis[..., L:])]

        out_ref, grads_ref = reference_and_grads(q, k, v, vis, do)
        parts, kinds = [], []
        for sl, vis_blk in blocks:
            kind = ring.block_kind(vis_blk, causal)
            kinds.append(int(kind))
            parts.append(fwd(q, k[:, sl], v[:, sl], vis_blk, kind, causal, K**-0.5))
        lse = jnp.logaddexp(parts[0][1], parts[1][1])  # [B, T, H]
        out = sum(o * jnp.exp(l - lse)[..., None] for o, l in parts)
        shares = [
            bwd(q, k[:, sl], v[:, sl], vis_blk, kind, causal, K**-0.5, out.astype(q.dtype), lse, do)
            for (sl, vis_blk), kind in zip(blocks, kinds, strict=True)
        ]  # (dq, dk, dv) of each block
        dq_both, dk_by_block, dv_by_block = zip(*shares, strict=True)
        grads = (sum(dq_both), jnp.concatenate(dk_by_block, axis=1), jnp.concatenate(dv_by_block, axis=1))
        rel = lambda a, b: float(jnp.abs(f32(a) - f32(b)).max() / jnp.abs(f32(b)).max())
        errors[case] = {
            "kinds": kinds,
            "out": rel(out, out_ref),
            "grad": max(rel(a, b) for a, b in zip(grads, grads_ref, strict=True)),
        }
    return errors


BLOCK_KINDS = {
    "zigzag device 0": ["CAUSAL", "Q_BACK"],
    "zigzag device 1": ["CAUSAL", "KV_FRONT"],
    "bidirectional": ["FULL", "FULL"],
    "padded": ["MASKED", "FULL"],
}


@pytest.mark.parametrize("kernel", ["reference", "splash", "cudnn"])
def test_a_fused_kernel_s_blocks_combine_to_attention_over_all_keys(kernel, monkeypatch):
    """The block contract of `ring.fused_kernel`, on one device (the ring's context axis needs several
    devices; the contract does not): with XLA standing in for a fused kernel's two calls
    (`ring.reference_fwd_call`), with splash attention's own kernels run by Pallas's interpreter
    (any backend; the half blocks are whole tiles of 128; its masked block, which splash cannot be
    told, attended by XLA 64 queries at a time), and with cuDNN's calls on an NVIDIA GPU. Outputs
    and gradients within 2% of the largest reference value: bfloat16 blocks against float32
    attention over all keys."""
    import jax

    from jaxformer import ring
    from jaxformer.attention import ring_kernels

    monkeypatch.setattr(ring_kernels, "MASKED_CHUNK", 64)  # 4 chunks of the 256 queries

    if kernel == "cudnn" and jax.default_backend() != "gpu":
        pytest.skip("cuDNN's fused attention needs an NVIDIA GPU")
    kernels = {
        "reference": contract_kernel,
        "splash": lambda: ring.fused_kernel(*ring._splash_calls(interpret=True), tile=ring.SPLASH_TILE, vma=False),
        "cudnn": ring.KERNELS["cudnn"],
    }
    errors = _block_contract_errors(kernels[kernel]())
    names = {getattr(ring, k): k for k in ("SKIP", "FULL", "CAUSAL", "KV_FRONT", "Q_BACK", "MASKED")}
    for case, e in errors.items():
        assert [names[k] for k in e["kinds"]] == BLOCK_KINDS[case], case
        assert e["out"] <= 2e-2 and e["grad"] <= 2e-2, (case, e)
