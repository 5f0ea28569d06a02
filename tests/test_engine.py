"""The inference engine against `decode.generate` and naive references: the paged cache's gather and
write equal a dense cache, a call's decoding steps over its rows' pages read once equal the steps
that gather them each time (to the bit), greedy outputs equal generate's token for token (prefix
sharing on and off, two page sizes, more requests than slots, a pool small enough to preempt, one or
several decoding steps a call; a latent-attention decoder's latent pages; a windowed model releasing
the pages behind its window in a pool smaller than a request, and one with a global layer keeping
them), sampling is reproducible and independent of the batch, bad
requests are refused naming what is wrong, and the steps compile a few bucketed shapes (rows and
pages), each once, for every mix of requests. On TPU (libtpu's compiler, and Pallas's interpreter on
this CPU) a decode step runs the Pallas paged kernel where it serves, and it equals the gather."""

import collections
import dataclasses
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxformer import decode
from jaxformer.attention import cache as kv_cache
from jaxformer.attention import mla
from jaxformer.config import ConfigError, DecodeConfig, EngineConfig, MLAConfig, tiny
from jaxformer.engine import Engine, EngineError, SamplingParams, paged
from jaxformer.engine import engine as engine_module
from jaxformer.engine import steps as engine_steps
from jaxformer.models import build_model

V = 48


@pytest.fixture(scope="module")
def model():
    """Two layers, parameters x3: at its initial scale a model this small repeats one token whatever
    came before; larger weights make its continuations depend on the context, as the tests need."""
    model = build_model(tiny("decoder_only", vocab_size=V, max_len=64), seed=3)
    nnx.update(model, jax.tree.map(lambda x: 3.0 * x, nnx.state(model, nnx.Param)))
    return model


def _prompts():
    rng = np.random.default_rng(0)
    system = rng.integers(2, V, 12).tolist()  # a shared prefix: three pages of 4, one and a half of 8
    return [
        [*system, 5, 6, 7],
        rng.integers(2, V, 3).tolist(),
        [*system, 9],
        rng.integers(2, V, 20).tolist(),
        [7],
        [*system, 5, 6, 7, 8, 9, 10, 11, 12, 13],
    ]


def _reference(model, prompts, n, eos_id):
    out = decode.generate(model, prompts, DecodeConfig(strategy="greedy", max_new_tokens=n), eos_id=eos_id)
    return [decode.strip_after_eos(row[0], eos_id) for row in out.tokens]


@pytest.fixture(scope="module")
def eos_id(model):
    """An id the model's greedy continuations reach mid-way, so that some stop at EOS and some do not."""
    first = _reference(model, _prompts(), 10, None)
    return int(first[0][4])


# ----------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize("latent", [False, True])
def test_paged_view_equals_the_dense_cache(latent):
    """Writing positions into pages then reading a row's pages gives the dense cache [B, G, S, K]
    that writing the same positions into slots gives (slot s = position s); a latent pool [N, page, K]
    (no heads' axis, latent attention's) gives [B, S, K] the same way."""
    rng = np.random.default_rng(1)
    N, page, G, K, B, P = 9, 4, 2, 3, 2, 3
    heads = () if latent else (G,)
    pool = jnp.zeros((N, page, K) if latent else (G, N, page, K))
    table = np.array([[3, 7, 1], [5, 2, 0]], np.int32)  # row 1 holds two pages
    dense = np.zeros((B, *heads, P * page, K), np.float32)
    for start, T in ((0, 5), (5, 3), (8, 1)):  # a chunk, another, a decode step
        positions = start + np.arange(T)[None].repeat(B, 0)
        valid = positions < np.array([[12], [8]])
        new = rng.normal(size=(B, T, *heads, K)).astype(np.float32)
        page_BT, offset_BT = kv_cache.page_slots(jnp.asarray(table), jnp.asarray(positions), jnp.asarray(valid), page)
        pool = kv_cache.write_pages(pool, jnp.asarray(new), page_BT, offset_BT)
        for b in range(B):
            for t in range(T):
                if valid[b, t]:
                    dense[b, ..., positions[b, t], :] = new[b, t]
    view = np.asarray(kv_cache.read_pages(pool, jnp.asarray(table)))  # [B, G, S, K] or [B, S, K]
    np.testing.assert_array_equal(view[0], dense[0])
    np.testing.assert_array_equal(view[1, ..., :8, :], dense[1, ..., :8, :])  # its third entry is scratch page 0


@pytest.mark.parametrize("latent", [False, True])
def test_decoding_steps_over_rows_gathered_once_equal_the_gather_at_every_step(latent):
    """A call's decoding steps read the rows' pages once (`paged.gather_rows`) and write each step's keys
    and values there as into the pages: three steps of two prefilled rows (4 heads over 2 kv heads, or
    latent attention), row 1 stopping after its first, give the logits of every real step and the pools
    of the steps that gather the pages at each step, to the bit, and the rows end as the pages' view."""
    mla_cfg = MLAConfig(kv_lora_rank=8, rope_head_dim=4)
    extra = {"position": "rope", "use_bias": False, "mla": mla_cfg} if latent else {"num_kv_heads": 2}
    mcfg = tiny("decoder_only", vocab_size=V, max_len=64, d_model=32, num_heads=4, **extra)
    model = build_model(mcfg, seed=3)
    table = jnp.asarray([[3, 7, 1, 0], [5, 2, 8, 0]], jnp.int32)  # 12 positions a row; scratch page 0 last
    rng, lengths = np.random.default_rng(5), jnp.asarray([6, 9])
    ids = jnp.asarray(rng.integers(2, V, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    prefill = nnx.jit(
        lambda m: paged.paged_step(
            m, paged.empty_pools(mcfg, 9, 4), table, ids, positions, positions < lengths[:, None]
        )
    )
    _, pools, _ = prefill(model)
    new_ids = jnp.asarray(rng.integers(2, V, (2, 3)), jnp.int32)

    def steps(model, pools, gathered):
        rows, logits = (paged.gather_rows(pools, table) if gathered else None), []
        for i in range(3):
            valid = jnp.asarray([[True], [i == 0]])
            out, pools, rows = paged.paged_step(
                model, pools, table, new_ids[:, i : i + 1], lengths[:, None] + i, valid, rows=rows
            )
            logits.append(out[:, 0])
        return jnp.stack(logits, 1), pools, rows

    want, want_pools, none = nnx.jit(lambda m, p: steps(m, p, False))(model, pools)
    got, got_pools, rows = nnx.jit(lambda m, p: steps(m, p, True))(model, pools)
    assert none is None
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1, 0]), np.asarray(want[1, 0]))  # row 1's one real step
    jax.tree.map(np.testing.assert_array_equal, got_pools, want_pools)
    for layer_rows, pool in zip(rows, got_pools, strict=True):  # its real slots: not scratch page 0's
        for name, r in layer_rows.items():
            np.testing.assert_array_equal(
                np.asarray(r)[..., :12, :], np.asarray(kv_cache.read_pages(pool[name], table))[..., :12, :]
            )


def test_decode_step_logits_at_one_position_equal_the_full_logits(model):
    """`decode_step(..., logits_at_B=)` (a prefill chunk's head on its last real position only) gives the
    row of the full [B, T, V] logits at that position, and the same cache."""
    ids = jnp.asarray(np.random.default_rng(2).integers(2, V, (2, 5)), jnp.int32)
    positions = jnp.asarray([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]], jnp.int32)
    at = jnp.asarray([4, 1], jnp.int32)

    @nnx.jit
    def both(model):  # the two steps in one program
        full, cache = model.decode_step(model.init_cache(2, 16), ids, positions)
        return full, cache, *model.decode_step(model.init_cache(2, 16), ids, positions, logits_at_B=at)

    full, cache, one, cache_one = both(model)
    np.testing.assert_allclose(np.asarray(one[:, 0]), np.asarray(full[[0, 1], [4, 1]]), rtol=1e-6, atol=1e-6)
    jax.tree.map(np.testing.assert_array_equal, cache_one, cache)


def test_row_filters_equal_decode_filters():
    """Per-row min-p, top-k and top-p equal `decode.min_p_filter`, `top_k_filter` and `top_p_filter`
    applied row by row, in that order."""
    logits = jax.random.normal(jax.random.key(0), (6, 11)) * 2
    top_k, top_p = np.array([0, 3, 1, 5, 0, 6]), np.array([1.0, 0.9, 0.5, 0.3, 1.0, 0.8], np.float32)
    min_p = np.array([0.0, 0.0, 0.0, 0.2, 0.1, 0.05], np.float32)
    got = paged.filter_rows(logits, jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(min_p))
    for b in range(6):
        want = decode.min_p_filter(logits[b : b + 1], float(min_p[b]))
        want = decode.top_p_filter(decode.top_k_filter(want, int(top_k[b])), float(top_p[b]))
        np.testing.assert_array_equal(np.asarray(got[b]), np.asarray(want[0]))
    assert np.isinf(np.asarray(got[4])).sum() > 0  # min-p alone dropped some


# ----------------------------------------------------------------------------- greedy equals generate


@pytest.mark.parametrize("page_size", [4, 8])
def test_greedy_equals_generate(model, eos_id, page_size):
    """Six prompts of 1 to 21 tokens through 3 slots, chunks of 8: the same tokens as generate's, with
    prefix sharing (which finds the shared prompt pages) and without."""
    prompts, n = _prompts(), 10
    want = _reference(model, prompts, n, eos_id)
    assert any(len(w) < n for w in want) and any(len(w) == n for w in want)  # EOS and length both end some
    assert max(len(set(w)) for w in want) >= 3  # continuations that depend on the context
    for sharing in (True, False):
        cfg = EngineConfig(page_size=page_size, num_pages=40, max_slots=3, prefill_chunk=8, prefix_sharing=sharing)
        engine = Engine(model, cfg, eos_id=eos_id)
        outs = engine.generate(prompts, SamplingParams(max_tokens=n))
        assert [o.token_ids for o in outs] == want, f"sharing={sharing}"
        assert [o.finish_reason for o in outs] == ["stop" if len(w) < n else "length" for w in want]
        stats = engine.stats()
        assert (stats["prefix_hits"] > 0) == sharing
        assert stats["running"] == stats["waiting"] == 0 and stats["pages_free"] == stats["pages_total"]
        c = model.cfg  # keys and values: 2 G K float32s a position and layer
        assert stats["cache_bytes_per_token"] == 2 * c.num_decoder_layers * c.kv_heads * c.dim_per_head * 4


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_prefill_chunks_of_one_position_equal_generate(model, eos_id, decode_steps):
    """`prefill_chunk=1`: a prompt is read one position a call, and those calls are prefill, not decoding
    (they once ran as decode steps, feeding back the tokens they drew in place of the prompt's: wrong
    tokens, no error); with one decoding step a call both take the same compiled program."""
    prompts, n = _prompts(), 6
    cfg = EngineConfig(page_size=4, num_pages=40, max_slots=3, prefill_chunk=1, decode_steps=decode_steps)
    outs = Engine(model, cfg, eos_id=eos_id).generate(prompts, SamplingParams(max_tokens=n))
    assert [o.token_ids for o in outs] == _reference(model, prompts, n, eos_id)


def test_ignore_eos_decodes_past_eos_to_max_tokens(model, eos_id):
    """`ignore_eos`: the EOS drawn is kept as a token and decoding goes on, as `generate` without an EOS
    id; the other requests of the batch still end at theirs."""
    prompts, n = _prompts()[:3], 10
    cfg = EngineConfig(page_size=4, num_pages=40, max_slots=3, prefill_chunk=8, decode_steps=3)
    params = [SamplingParams(max_tokens=n, ignore_eos=True), SamplingParams(max_tokens=n)] * 2
    outs = Engine(model, cfg, eos_id=eos_id).generate(prompts, params[:3])
    past = _reference(model, prompts, n, None)
    assert eos_id in outs[0].token_ids[:-1] or eos_id in outs[2].token_ids[:-1]  # an EOS mid-way, decoded past
    assert [outs[0].token_ids, outs[2].token_ids] == [past[0], past[2]]
    assert outs[1].token_ids == _reference(model, prompts[1:2], n, eos_id)[0]


def test_min_tokens_holds_back_eos_until_then(model, eos_id):
    """`min_tokens`: where greedy decoding would end at EOS before `min_tokens` new tokens, the request takes
    the likeliest other token there (the model's own logits over the prompt and the tokens before it, EOS
    left out) and goes on; past `min_tokens` EOS ends it again; `min_tokens` 0 changes nothing."""
    prompts, n = _prompts(), 10
    plain = _reference(model, prompts, n, eos_id)
    early = [i for i, w in enumerate(plain) if len(w) < 6]  # requests greedy ends at EOS within 5 tokens
    assert early, plain
    cfg = EngineConfig(page_size=4, num_pages=40, max_slots=3, prefill_chunk=8, decode_steps=3)  # shared shapes
    params = [SamplingParams(max_tokens=n, min_tokens=6 if i in early else 0) for i in range(len(prompts))]
    outs = Engine(model, cfg, eos_id=eos_id).generate(prompts, params)
    rows = [prompts[i] + plain[i] for i in early]  # each early request's context where greedy drew EOS
    ids = np.zeros((len(rows), max(map(len, rows))), np.int32)  # right-padded: causal, so no row sees its padding
    for r, row in enumerate(rows):
        ids[r, : len(row)] = row
    logits = np.asarray(model(jnp.asarray(ids)), np.float64)  # one forward pass for all of them
    for i, (out, want) in enumerate(zip(outs, plain, strict=True)):
        if i not in early:
            assert out.token_ids == want
            continue
        L = len(want)  # greedy drew EOS here
        assert out.token_ids[:L] == want and len(out.token_ids) >= 6 and eos_id not in out.token_ids
        at = logits[early.index(i), len(prompts[i]) + L - 1]
        at[eos_id] = -np.inf
        assert out.token_ids[L] == int(np.argmax(at))


PENALIZED = [  # (row's params): each penalty alone, all of them together, and a row without any beside them
    dict(presence_penalty=-2.0),  # negative: the output's tokens again
    dict(frequency_penalty=0.7),
    dict(repetition_penalty=1.6),
    dict(logit_bias={5: 4.0, 30: -100.0}),
    dict(),
    dict(presence_penalty=-0.5, frequency_penalty=2.0, repetition_penalty=0.8, logit_bias={7: 3.0}),
    dict(allowed_token_ids=(3, 11, 20, 41, 42)),  # vLLM's: only these drawn
]


def _penalized_reference(model, prompts, kwargs, n):
    """Greedy decoding with each row's penalties and biases applied to its logits as written in numpy
    (OpenAI's presence and frequency penalties over the output's counts, the repetition penalty over
    prompt and output, biases added), every step's logits from one forward pass over the whole sequence."""
    forward = nnx.jit(lambda m, x: m(x))
    outs = [[] for _ in prompts]
    for _ in range(n):
        rows = [p + o for p, o in zip(prompts, outs, strict=True)]
        ids = np.zeros((len(rows), 64), np.int32)  # right-padded to max_len: causal, so no row sees its padding
        for r, row in enumerate(rows):
            ids[r, : len(row)] = row
        logits = np.asarray(forward(model, jnp.asarray(ids)), np.float32)
        for r, (row, kw) in enumerate(zip(rows, kwargs, strict=True)):
            x = logits[r, len(row) - 1].copy()
            counts = np.bincount(outs[r], minlength=x.size).astype(np.float32)
            seen = (counts > 0) | np.isin(np.arange(x.size), prompts[r])
            rep = np.float32(kw.get("repetition_penalty", 1.0))
            x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
            x = x - np.float32(kw.get("frequency_penalty", 0.0)) * counts
            x = x - np.float32(kw.get("presence_penalty", 0.0)) * (counts > 0)
            for token, bias in kw.get("logit_bias", {}).items():
                x[token] += bias
            if "allowed_token_ids" in kw:
                x[~np.isin(np.arange(x.size), kw["allowed_token_ids"])] = -np.inf
            for word in kw.get("banned", ()):  # bad words' ids: the last one, after the ones before it
                if len(word) == 1 or outs[r][len(outs[r]) - len(word) + 1 :] == list(word[:-1]):
                    x[word[-1]] = -np.inf
            outs[r].append(int(np.argmax(x)))
    return outs


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_penalties_and_biases_change_the_logits_as_openai_and_vllm_define_them(model, decode_steps):
    """Presence, frequency and repetition penalties, logit biases and allowed ids, each alone and the first
    four together, beside a
    row with none (which keeps generate's tokens): greedy tokens equal a reference that applies them in numpy
    to the model's logits over the whole sequence, one or three decoding steps a call (the counts then grow
    inside the compiled loop); each penalty changes what greedy decoding gives; a bias of -100 bans a token;
    allowed ids are the only ones drawn."""
    prompts, n = [*_prompts(), _prompts()[3]], 8
    cfg = EngineConfig(page_size=4, num_pages=40, max_slots=3, prefill_chunk=8, decode_steps=decode_steps)
    params = [SamplingParams(max_tokens=n, **kw) for kw in PENALIZED]
    outs = Engine(model, cfg, eos_id=None).generate(prompts, params)
    want = _penalized_reference(model, prompts, PENALIZED, n)
    assert [o.token_ids for o in outs] == want
    plain = _reference(model, prompts, n, None)
    assert want[4] == plain[4] and all(want[i] != plain[i] for i in (0, 1, 2, 3, 5, 6)), (want, plain)
    assert set(want[6]) <= {3, 11, 20, 41, 42} and len(set(want[6])) > 1
    assert 30 not in want[3] and 30 in plain[3]


def test_raw_logprobs_are_the_model_s_own_under_penalties_and_biases(model):
    """`logprobs_mode="raw"` (vLLM's default): under penalties and biases the tokens are still the penalized
    reference's, and their log-probabilities and the likeliest tokens are the model's own softmax over the
    tokens before them (one forward pass over the whole sequence); the default mode's differ from them."""
    prompts, n = _prompts()[:2], 6
    kw = PENALIZED[5]  # the three penalties and a bias
    params = SamplingParams(max_tokens=n, logprobs=True, top_logprobs=3, **kw)
    cfg = dict(page_size=4, num_pages=40, max_slots=2, prefill_chunk=8, decode_steps=3)
    raw = Engine(model, EngineConfig(**cfg, logprobs_mode="raw"), eos_id=None).generate(prompts, params)
    penalized = Engine(model, EngineConfig(**cfg), eos_id=None).generate(prompts, params)
    want = _penalized_reference(model, prompts, [kw, kw], n)
    assert [o.token_ids for o in raw] == [o.token_ids for o in penalized] == want
    for r, p in zip(raw, penalized, strict=True):
        logits = model.decode(None, None, jnp.asarray([r.prompt_ids + r.token_ids], jnp.int32))[0]
        logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)))
        at = np.arange(n) + len(r.prompt_ids) - 1  # the positions whose logits drew the new tokens
        # A paged cache and a whole-sequence pass agree to a few float32 ulps of logits up to ~26 in size.
        np.testing.assert_allclose(r.logprobs, logp[at, r.token_ids], rtol=1e-4, atol=1e-4)
        assert [[i for i, _ in top] for top in r.top_logprobs] == np.argsort(-logp[at], axis=1)[:, :3].tolist()
        top_logp = -np.sort(-logp[at], axis=1)[:, :3]
        np.testing.assert_allclose([[x for _, x in top] for top in r.top_logprobs], top_logp, rtol=1e-4, atol=1e-4)
        assert not np.allclose(p.logprobs, r.logprobs, atol=1e-3)
    with pytest.raises(ConfigError, match=r"engine\.logprobs_mode: one of \('penalized', 'raw'\), got 'processed'"):
        EngineConfig(logprobs_mode="processed")


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_stop_token_ids_end_a_request_as_eos_does(model, decode_steps):
    """`stop_token_ids`: a request ends ("stop") where greedy decoding draws one of them, the id left out,
    as at EOS; the other requests run on; ids never drawn change nothing."""
    prompts, n = _prompts()[:3], 10
    plain = _reference(model, prompts, n, None)
    stop = plain[0][3]  # drawn by row 0 at step 3 (or sooner)
    cfg = EngineConfig(page_size=4, num_pages=40, max_slots=3, prefill_chunk=8, decode_steps=decode_steps)
    never = next(t for t in range(V) if all(t not in w for w in plain))
    params = [SamplingParams(max_tokens=n, stop_token_ids=(stop,)), SamplingParams(max_tokens=n),
              SamplingParams(max_tokens=n, stop_token_ids=(never,))]  # fmt: skip
    outs = Engine(model, cfg, eos_id=None).generate(prompts, params)
    assert outs[0].token_ids == plain[0][: plain[0].index(stop)] and outs[0].finish_reason == "stop"
    assert [o.token_ids for o in outs[1:]] == plain[1:] and outs[2].finish_reason == "length"


def _chosen_reference(model, prompt, choices, eos_id, n):
    """Greedy decoding held to `choices` as written here: at each step the likeliest of the tokens that keep
    the output a prefix of a choice (EOS too where it is a whole one), by one forward pass over the whole
    sequence; it ends at EOS, or at a whole choice that none extends."""
    forward = nnx.jit(lambda m, x: m(x))
    out = []
    while len(out) < n:
        ids = np.zeros((1, 64), np.int32)
        ids[0, : len(prompt) + len(out)] = prompt + out
        x = np.asarray(forward(model, jnp.asarray(ids)), np.float32)[0, len(prompt) + len(out) - 1]
        ok = {c[len(out)] for c in choices if len(c) > len(out) and list(c[: len(out)]) == out}
        ok |= {eos_id} if tuple(out) in choices else set()
        token = max(ok, key=lambda t: x[t])
        if token == eos_id:
            break
        out.append(int(token))
        if not any(len(c) > len(out) and list(c[: len(out)]) == out for c in choices):
            break
    return out


def test_choices_hold_greedy_decoding_to_one_of_them(model, eos_id):
    """`choices` (vLLM's guided_choice, as ids): greedy tokens equal a reference that picks the likeliest
    allowed token over whole-sequence logits, whether a choice is a prefix of another (EOS may end it) or
    not; the rows without choices beside them, decoded one step a call too, keep generate's tokens; the
    constraint changes what greedy decoding gives."""
    prompts, n = _prompts(), 10
    plain = _reference(model, prompts, n, eos_id)
    choices = [
        ((*plain[0], 5, 6), tuple(plain[0])),  # one a prefix of another, where greedy draws EOS: it ends there
        ((5, 6, 7), (5, 9), (11,)),
        (),
        ((40, 41, 42, 43), (40, 41, 44)),
    ]
    cfg = EngineConfig(page_size=4, num_pages=40, max_slots=3, prefill_chunk=8, decode_steps=3)
    params = [SamplingParams(max_tokens=n, choices=c) for c in choices]
    outs = Engine(model, cfg, eos_id=eos_id).generate(prompts[:4], params)
    for i, (out, c) in enumerate(zip(outs, choices, strict=True)):
        if not c:
            assert out.token_ids == plain[i]
            continue
        want = _chosen_reference(model, prompts[i], c, eos_id, n)
        assert out.token_ids == want and tuple(want) in c and out.finish_reason == "stop", (i, out, want)
        assert (want == plain[i]) == (i == 0)
    # No EOS at all: a whole choice that none extends ends the request itself.
    out = Engine(model, cfg, eos_id=None).generate(prompts[1:2], SamplingParams(max_tokens=n, choices=choices[1]))[0]
    assert out.token_ids == _chosen_reference(model, prompts[1], choices[1], None, n) and out.finish_reason == "stop"


def test_a_penalty_or_bias_out_of_range_is_refused_by_name(model):
    for kw, match in [
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty="1"), "frequency_penalty must be int or float"),
        (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
        (dict(logit_bias={"5": 1.0}), "logit_bias keys must be token ids"),
        (dict(logit_bias={5: 101}), r"logit_bias\[5\] must be a number in \[-100, 100\]"),
        (dict(logit_bias=[(5, 1.0), (5, 2.0)]), "names a token id twice"),
        (dict(choices=[(5, 6), ()]), "choices must each be a non-empty sequence of token ids"),
        (dict(choices=[("a",)]), "choices must each be a non-empty sequence of token ids"),
        (dict(stop_token_ids=[-1]), r"stop_token_ids must be token ids \(ints >= 0\), got \[-1\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    engine = Engine(model, EngineConfig(page_size=4, num_pages=20, max_slots=2, prefill_chunk=8), eos_id=None)
    with pytest.raises(EngineError, match=r"logit_bias: token id 999 is outside the vocabulary"):
        engine.add_request([4, 5], SamplingParams(logit_bias={999: 1.0}))
    assert SamplingParams(logit_bias={9: -1, 2: 0.5}).logit_bias == ((2, 0.5), (9, -1.0))
    with pytest.raises(EngineError, match=r"choices\[1\] has 20 tokens .*at most max_tokens=16"):
        engine.add_request([4, 5], SamplingParams(choices=[(5,), (6,) * 20]))
    with pytest.raises(EngineError, match=r"choices\[0\] has 1 tokens \(ids up to 999\)"):
        engine.add_request([4, 5], SamplingParams(choices=[(999,)]))


@pytest.fixture(scope="module")
def mla_model():
    """The two-layer decoder with latent attention (`model.mla`: C = 8, R = 4), parameters x3 as `model`'s."""
    cfg = tiny("decoder_only", vocab_size=V, max_len=64, position="rope", use_bias=False,
               mla=MLAConfig(kv_lora_rank=8, rope_head_dim=4))  # fmt: skip
    model = build_model(cfg, seed=3)
    nnx.update(model, jax.tree.map(lambda x: 3.0 * x, nnx.state(model, nnx.Param)))
    return model


@pytest.fixture(scope="module")
def mla_want(mla_model):
    """generate's greedy tokens for `_prompts()` (10 at most) and an EOS id that ends row 0's mid-way, no other."""
    want = _reference(mla_model, _prompts(), 10, None)
    eos_id = next(t for t in want[0][1:] if sum(t in w for w in want) == 1)
    return [decode.strip_after_eos(w, eos_id) for w in want], eos_id


@pytest.mark.parametrize("page_size, decode_steps", [(4, 1), (8, 1), (8, 3)])
def test_latent_attention_greedy_equals_generate(mla_model, mla_want, page_size, decode_steps):
    """An MLA decoder served from latent pages (prefill chunks and decode steps in the absorbed form over
    the rows' pages; three steps a call over the rows' pages read once) gives generate's tokens (its
    plain-form prefill, absorbed decode over a dense latent cache), with prefix sharing finding the shared
    prompt pages; the pools hold (C + R) values a position and layer, `mla.cache_bytes_per_token`."""
    (want, eos_id), n = mla_want, 10
    assert any(len(w) < n for w in want) and any(len(w) == n for w in want)
    assert max(len(set(w)) for w in want) >= 3  # continuations that depend on the context
    cfg = EngineConfig(page_size=page_size, num_pages=40, max_slots=2, prefill_chunk=8, decode_steps=decode_steps)
    engine = Engine(mla_model, cfg, eos_id=eos_id)
    assert [o.token_ids for o in engine.generate(_prompts(), SamplingParams(max_tokens=n))] == want
    stats = engine.stats()
    assert stats["prefix_hits"] > 0 and stats["pages_free"] == stats["pages_total"]
    m = mla_model.cfg.mla
    assert stats["cache_bytes_per_token"] == 2 * mla.cache_bytes_per_token(m.kv_lora_rank, m.rope_head_dim, 4) == 96


def test_a_chunk_past_a_learned_position_table_leaves_the_pages_clean():
    """A prefill chunk wider than the model's learned position table (prefill_chunk 32, max_len 16): its
    padding positions lie past the table, whose rows there are NaN; they must not reach the scratch page
    every row reads (the engine answered 0s before padding read position 0)."""
    model = build_model(tiny("decoder_only", vocab_size=V, max_len=16, position="learned"), seed=3)
    nnx.update(model, jax.tree.map(lambda x: 3.0 * x, nnx.state(model, nnx.Param)))
    prompts = [[5, 9, 3, 7, 11], [4, 8, 12, 16, 20, 24, 28, 3, 6]]
    want = _reference(model, prompts, 5, None)
    engine = Engine(model, EngineConfig(page_size=4, num_pages=12, max_slots=2, prefill_chunk=32), eos_id=None)
    assert [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=5))] == want


def test_continuous_batching_admits_and_retires(model, eos_id):
    """More requests than slots: never more than max_slots run, a request is admitted as another retires
    (some run while others already finished), and every one ends."""
    engine = Engine(model, EngineConfig(page_size=4, num_pages=40, max_slots=2, prefill_chunk=8), eos_id=eos_id)
    ids = [engine.add_request(p, SamplingParams(max_tokens=3 + 2 * i)) for i, p in enumerate(_prompts())]
    finished_at, running_seen, step = {}, [], 0
    while engine.has_unfinished():
        for e in engine.step():
            if e.finished:
                finished_at[e.request_id] = step
        running_seen.append(engine.stats()["running"])
        step += 1
    assert max(running_seen) == 2 and sorted(finished_at) == sorted(ids)
    assert len(set(finished_at.values())) > 2  # retired across many steps, not as one batch


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_preemption_keeps_outputs(model, decode_steps):
    """A pool of 9 pages of 4 for 3 slots of up to 31 positions: requests are preempted (pages freed,
    recomputed later) and the outputs still equal generate's, one decode step a call or three."""
    prompts, n = _prompts(), 12
    cfg = EngineConfig(page_size=4, num_pages=10, max_slots=3, prefill_chunk=8, decode_steps=decode_steps)
    engine = Engine(model, cfg, eos_id=None)
    outs = engine.generate(prompts, SamplingParams(max_tokens=n))
    assert engine.stats()["preempted"] > 0
    assert [o.token_ids for o in outs] == _reference(model, prompts, n, None)


def test_copy_on_write_of_a_shared_page(model):
    """A prompt of exactly two pages already in the pool: the second request shares both pages,
    recomputes its last token into a copy of the last one, and both continue as generate does."""
    prompt = _prompts()[3][:8]
    engine = Engine(model, EngineConfig(page_size=4, num_pages=20, max_slots=2, prefill_chunk=8), eos_id=None)
    a = engine.add_request(prompt, SamplingParams(max_tokens=6))
    tokens = {a: engine.step()[0].token_ids}  # a's prompt computed: its two pages enter the prefix cache
    b = engine.add_request(prompt, SamplingParams(max_tokens=6))
    tokens[b] = []
    while engine.has_unfinished():
        for e in engine.step():
            tokens[e.request_id] += e.token_ids
    assert engine.stats()["prefix_hits"] == 2
    want = _reference(model, [prompt], 6, None)[0]
    assert tokens[a] == tokens[b] == want


def test_abort_frees_pages(model):
    engine = Engine(model, EngineConfig(page_size=4, num_pages=20, max_slots=2, prefill_chunk=8), eos_id=None)
    rid = engine.add_request(_prompts()[3], SamplingParams(max_tokens=20))
    waiting = engine.add_request([3, 4], SamplingParams(max_tokens=20))
    engine.step()
    assert engine.stats()["pages_free"] < engine.stats()["pages_total"]
    engine.abort(rid)
    engine.abort(waiting)
    engine.abort("no-such-request")  # a client gone after its end: nothing to do
    events = engine.step()
    assert {(e.request_id, e.finish_reason) for e in events} == {(rid, "abort"), (waiting, "abort")}
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert stats["pages_free"] == stats["pages_total"] and stats["running"] == 0


# ----------------------------------------------------------------------------- sampling


def test_sampling_is_reproducible_and_independent_of_the_batch(model):
    """A seeded request draws the same tokens alone and among other requests (other seeds, settings
    and lengths; three decode steps a call), and log-probabilities are those of the model's softmax (<= 0)."""
    p = SamplingParams(max_tokens=8, temperature=1.3, top_k=20, top_p=0.95, seed=7, logprobs=True)
    cfg = EngineConfig(page_size=4, num_pages=40, max_slots=4, prefill_chunk=8)
    alone = Engine(model, cfg, eos_id=None).generate([_prompts()[0]], p)[0]
    others = [SamplingParams(max_tokens=5, temperature=0.7, seed=s) for s in (1, 2)] + [SamplingParams(max_tokens=9)]
    three = dataclasses.replace(cfg, decode_steps=3)  # three decode steps a call: the same draws
    mixed = Engine(model, three, eos_id=None).generate([*_prompts()[1:4], _prompts()[0]], [*others, p])[-1]
    assert mixed.token_ids == alone.token_ids and len(alone.token_ids) == 8
    np.testing.assert_allclose(mixed.logprobs, alone.logprobs, rtol=1e-4)  # other batch shapes: float32 rounding
    assert all(lp <= 0 for lp in alone.logprobs)
    other_seed = Engine(model, cfg, eos_id=None).generate([_prompts()[0]], dataclasses.replace(p, seed=8))[0]
    assert other_seed.token_ids != alone.token_ids


def test_min_p_draws_only_tokens_near_the_likeliest(model):
    """`min_p` through the engine (three decoding steps a call, beside a request without it): every token
    drawn is at least min_p times as likely, under the temperature, as the step's likeliest, by the
    model's log-probabilities (top_logprobs=1 lists the likeliest's): logp - max logp >= T log(min_p); the
    same seeds without min_p draw some that are not. min_p = 1 keeps the likeliest alone: greedy's tokens."""
    cfg = EngineConfig(page_size=4, num_pages=60, max_slots=4, prefill_chunk=8, decode_steps=3)
    engine, prompts, T, m = Engine(model, cfg, eos_id=None), _prompts()[:3], 2.0, 0.3

    def gaps(min_p):
        params = [SamplingParams(max_tokens=10, temperature=T, min_p=min_p, seed=s, logprobs=True, top_logprobs=1)
                  for s in range(3)]  # fmt: skip
        outs = engine.generate([*prompts, prompts[0]], [*params, SamplingParams(max_tokens=6, temperature=1.0)])
        return [lp - top[0][1] for o in outs[:3] for lp, top in zip(o.logprobs, o.top_logprobs, strict=True)]

    assert min(gaps(m)) >= T * np.log(m) - 1e-4
    assert min(gaps(0.0)) < T * np.log(m)  # the check above bites
    greedy = engine.generate(prompts, SamplingParams(max_tokens=10))
    kept_one = engine.generate(
        prompts, [SamplingParams(max_tokens=10, temperature=1.0, min_p=1.0, seed=s) for s in range(3)]
    )
    assert [o.token_ids for o in kept_one] == [o.token_ids for o in greedy]


def test_top_logprobs_are_the_model_s_likeliest_tokens_at_each_step(model, eos_id):
    """A request asking for the likeliest tokens (greedy, and a seeded draw at three decoding steps a call,
    beside requests that do not ask) lists at each step the ids and log-probabilities of the model's own
    softmax over the tokens before it, likeliest first: `lax.top_k` of one full forward pass over the prompt
    and its output; the chosen token's log-probability is its entry there. The others' outputs are those
    of an engine whose rows ask for nothing."""
    n = 5
    asking = [SamplingParams(max_tokens=10, logprobs=True, top_logprobs=n),
              SamplingParams(max_tokens=8, temperature=1.1, seed=4, logprobs=True, top_logprobs=2)]  # fmt: skip
    plain = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=9, temperature=0.8, seed=1)]
    prompts = _prompts()[:4]
    cfg = EngineConfig(page_size=4, num_pages=40, max_slots=4, prefill_chunk=8, decode_steps=3)
    outs = Engine(model, cfg, eos_id=eos_id).generate(prompts, [asking[0], plain[0], asking[1], plain[1]])
    alone = Engine(model, cfg, eos_id=eos_id).generate([prompts[1], prompts[3]], plain)
    assert [o.token_ids for o in (outs[1], outs[3])] == [o.token_ids for o in alone]
    assert outs[1].top_logprobs is None and outs[1].logprobs is None
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) < 10  # ended at EOS: its entry is not listed
    for out, p in zip((outs[0], outs[2]), asking, strict=True):
        ids = out.prompt_ids + out.token_ids
        logits = model.decode(None, None, jnp.asarray([ids], jnp.int32))[0]
        want_logp, want_ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32)), p.top_logprobs)
        start = len(out.prompt_ids) - 1  # the position whose logits drew the first new token
        assert len(out.top_logprobs) == len(out.token_ids) == len(out.logprobs)
        for j, (top, token, lp) in enumerate(zip(out.top_logprobs, out.token_ids, out.logprobs, strict=True)):
            assert [i for i, _ in top] == np.asarray(want_ids[start + j]).tolist(), f"step {j}"
            np.testing.assert_allclose([x for _, x in top], want_logp[start + j], rtol=1e-5, atol=1e-5)
            if p.temperature == 0:
                assert top[0][0] == token and top[0][1] == lp
            elif token in dict(top):
                assert dict(top)[token] == lp


def test_decode_step_compiles_once_for_every_mix(model):
    """Greedy and sampled rows, prompts of many lengths, requests coming and going: steps compile only at
    power-of-two counts of rows and of pages (the pages the longest row reads), each shape once."""
    cfg = EngineConfig(page_size=4, num_pages=40, max_slots=5, prefill_chunk=8)  # 5 slots: no other test's shape
    before = collections.Counter(engine_module._LOWERED)
    engine = Engine(model, cfg, eos_id=None)
    params = [SamplingParams(max_tokens=4 + i, temperature=0.5 * (i % 2), top_k=i, seed=i) for i in range(6)]
    engine.generate(_prompts(), params)
    engine.generate(_prompts()[:2], SamplingParams(max_tokens=3, top_p=0.5, temperature=1.0))
    traced = engine_module._LOWERED - before
    assert set(traced.values()) == {1}  # no shape compiled twice
    assert (5, 1, 8) in traced and {width for _, width, _ in traced} <= {1, 8}  # decode steps, prefill chunks
    assert {rows for rows, _, _ in traced} <= {1, 2, 4, 5}  # powers of two, then max_slots
    assert {pages for _, _, pages in traced} == {8}  # 32 positions at least: the rows' 29 at most fit


def test_warmup_compiles_every_shape_the_stream_then_needs_and_leaves_the_outputs_alone(model):
    """After `warmup`, requests of every length, sampled and greedy, coming and going, compile nothing, and
    greedy outputs are still `generate`'s: the warm-up ran each executable once, on empty rows, which wrote
    only the scratch page."""
    cfg = EngineConfig(page_size=4, num_pages=40, max_slots=3, prefill_chunk=4, decode_steps=2)  # shapes of its own
    engine = Engine(model, cfg, eos_id=None)
    before = collections.Counter(engine_module._LOWERED)
    ran, call = [], engine._call

    def counted(x, *args):
        ran.append((*x["ids"].shape, x["table"].shape[1]))
        return call(x, *args)

    with mock.patch.object(engine, "_call", counted):
        shapes = engine.warmup()
    warmed = engine_module._LOWERED - before
    assert sorted(ran) == sorted(shape[:3] for shape in warmed)  # each executable run once
    assert shapes == len(warmed) == 2 * 3 * 2  # prefill and decode x rows 1, 2, 3 x pages 8, 16 (the context's)
    prompts, n = _prompts(), 6
    sampled = [SamplingParams(max_tokens=n, temperature=0.7, top_p=0.9, seed=i) for i in range(len(prompts))]
    greedy = engine.generate(prompts, SamplingParams(max_tokens=n))
    engine.generate(prompts, sampled)
    assert engine_module._LOWERED - before == warmed  # nothing compiled after the warm-up
    assert [o.token_ids for o in greedy] == _reference(model, prompts, n, None)
    engine.add_request([1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(EngineError, match="warm up before adding any"):
        engine.warmup()


def test_warmup_of_every_variant_leaves_nothing_for_logprobs_penalties_or_choices_to_compile(model):
    """`warmup(every_variant=True)` also compiles the variants a request's fields choose: after it, requests
    that list the likeliest tokens, apply penalties and biases, keep to choices (one step a decoding call)
    or do all at once, sampled, compile nothing; greedy outputs are still `generate`'s."""
    cfg = EngineConfig(page_size=64, num_pages=4, max_slots=1, prefill_chunk=4, decode_steps=2)
    engine = Engine(model, cfg, eos_id=None)
    # One row, one page (the context's 64 positions); calls: plain and top-logprobs (chunk, decode) 2 each,
    # penalized and both (chunk, decode, one-step decode) 3 each.
    assert engine.warmup(every_variant=True) == len(engine._compiled) == 2 + 2 + 3 + 3
    warmed, prompts, n = set(engine._compiled), _prompts()[:4], 5
    for params in [
        SamplingParams(max_tokens=n, logprobs=True, top_logprobs=3),
        SamplingParams(max_tokens=n, presence_penalty=0.5, logit_bias={5: 2.0}),
        SamplingParams(max_tokens=n, choices=[(5, 6, 7), (5, 8)]),
        SamplingParams(max_tokens=n, logprobs=True, top_logprobs=2, repetition_penalty=1.2, temperature=0.8, seed=1),
    ]:
        engine.generate(prompts, params)
    greedy = engine.generate(prompts, SamplingParams(max_tokens=n))
    assert set(engine._compiled) == warmed  # nothing compiled after the warm-up
    assert [o.token_ids for o in greedy] == _reference(model, prompts, n, None)


# ----------------------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], SamplingParams(), "prompt_ids is empty"),
        ([1, V], SamplingParams(), r"prompt_ids\[1\] = 48 is outside the vocabulary"),
        ([1, 2.5], SamplingParams(), r"prompt_ids\[1\] = 2.5 is not an integer"),
        (
            jnp.asarray([1.0, 2.0]),
            SamplingParams(),
            r"prompt_ids: a 1-D array of integer token ids, got float32 \(2,\)",
        ),
        (
            np.ones((1, 2), np.int32),
            SamplingParams(),
            r"prompt_ids: a 1-D array of integer token ids, got int32 \(1, 2\)",
        ),
        (jnp.asarray([1, V]), SamplingParams(), r"prompt_ids\[1\] = 48 is outside the vocabulary"),
        ([1] * 60, SamplingParams(max_tokens=5), "exceeds the context of 64"),
        ([1, 2], SamplingParams(stop=("x",)), "stop strings need a tokenizer"),
        ([1, 2], {"max_tokens": 3}, "params: a SamplingParams"),
    ],
)
def test_bad_requests_are_refused(model, prompt, params, match):
    engine = Engine(model, EngineConfig(num_pages=8), eos_id=None)
    with pytest.raises(EngineError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished()


def test_prompts_as_jax_and_numpy_arrays_are_their_ids(model):
    """A prompt given as a JAX or numpy array of integers is served as the list of its ids."""
    engine = Engine(model, EngineConfig(page_size=4, num_pages=20, max_slots=2, prefill_chunk=8), eos_id=None)
    prompts = _prompts()[:2]
    want = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=4))]
    arrays = [jnp.asarray(prompts[0]), np.asarray(prompts[1], np.int64)]
    assert [o.token_ids for o in engine.generate(arrays, SamplingParams(max_tokens=4))] == want


def test_a_request_over_the_pool_is_refused(model):
    engine = Engine(model, EngineConfig(page_size=4, num_pages=5), eos_id=None)
    with pytest.raises(EngineError, match=r"engine\.num_pages=5"):
        engine.add_request([1] * 10, SamplingParams(max_tokens=10))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": -3}, "max_tokens must be >= 1, got -3"),
        ({"max_tokens": 2.0}, "max_tokens must be int"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"bad_words": ("ok", " ")}, "bad_words must be non-blank strings"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\] \(0: off\), got 1.5"),
        ({"seed": -1}, "seed must be in"),
        ({"stop": ("",)}, "stop must hold non-empty strings"),
        ({"logprobs": 1}, "logprobs must be bool"),
        ({"logprobs": True, "top_logprobs": 21}, r"top_logprobs must be in \[0, 20\], got 21"),
        ({"top_logprobs": 3}, "top_logprobs = 3 needs logprobs=True"),
        ({"logprobs": True, "top_logprobs": 2.0}, "top_logprobs must be int"),
        ({"ignore_eos": 1}, "ignore_eos must be bool"),
        ({"max_tokens": 4, "min_tokens": 5}, r"min_tokens must be in \[0, max_tokens\], got 5"),
    ],
)
def test_sampling_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"page_size": 0}, "engine.page_size: must be >= 1"),
        ({"num_pages": 1}, "engine.num_pages: must be >= 2"),
        ({"max_slots": "4"}, "engine.max_slots"),
        ({"max_context": 1}, "engine.max_context"),
    ],
)
def test_engine_config_names_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kwargs)


class _Letters:
    """A tokenizer stand-in: id i is the letter chr(97 + i % 26)."""

    eos_id = None

    def decode(self, ids):
        return "".join(chr(97 + int(i) % 26) for i in ids)


class _Chars:
    """A tokenizer stand-in that encodes too: id i is the i-th of V distinct characters (a space: id 0)."""

    eos_id, chars = None, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUV"

    def decode(self, ids):
        return "".join(self.chars[int(i)] for i in ids)

    def encode(self, text):
        return [max(self.chars.find(c), 0) for c in text]


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_bad_words_are_never_written(model, decode_steps):
    """vLLM's `bad_words`: a word of two of greedy's own tokens (its first token drawn mid-call at three steps
    a call), one of a single token, and none, a row each, through one or three decoding steps a call (a
    request with a word of several tokens runs one): the tokens equal a reference that bans a word's last
    token where the output ends with the ones before it, over the whole sequence's logits, and differ from
    plain greedy's where a word was banned."""
    prompts, n, tok = _prompts()[:3], 10, _Chars()
    plain = _reference(model, prompts, n, None)
    words = [[plain[0][1:3]], [plain[1][2:3]], []]
    cfg = EngineConfig(page_size=4, num_pages=40, max_slots=3, prefill_chunk=8, decode_steps=decode_steps)
    params = [SamplingParams(max_tokens=n, bad_words=tuple(tok.decode(w) for w in ws)) for ws in words]
    outs = Engine(model, cfg, tokenizer=tok, eos_id=None).generate(prompts, params)
    want = _penalized_reference(model, prompts, [{"banned": ws} for ws in words], n)
    assert [o.token_ids for o in outs] == want
    assert want[0] != plain[0] and want[1] != plain[1] and want[2] == plain[2]


def test_a_stop_string_ends_the_request_and_is_cut(model):
    """The text of two greedy tokens as a stop string: the request ends there ("stop"), its text and
    tokens end before it, or (include_stop_str_in_output) after it."""
    prompt, tok = _prompts()[3], _Letters()
    want = _reference(model, [prompt], 10, None)[0]
    k = next(i for i in range(1, 8) if tok.decode(want).find(tok.decode(want[i : i + 2])) == i)
    stop = tok.decode(want[k : k + 2])
    engine = Engine(model, EngineConfig(page_size=4, num_pages=20, max_slots=2), tokenizer=tok, eos_id=None)
    out = engine.generate([prompt], SamplingParams(max_tokens=10, stop=(stop, "zzzzzz")))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == want[:k] and out.text == tok.decode(want[:k])
    kept = SamplingParams(max_tokens=10, stop=("zzzzzz", stop), include_stop_str_in_output=True)
    out = engine.generate([prompt], kept)[0]  # vLLM's include_stop_str_in_output: the text ends after it
    assert out.finish_reason == "stop"
    assert out.token_ids == want[: k + 2] and out.text == tok.decode(want[:k]) + stop


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_encoder_decoder_greedy_equals_translate(decode_steps):
    """encoder_decoder: each slot keeps its source's cross-attention keys and values; greedy outputs
    equal `decode.translate`'s for sources of mixed lengths through 2 slots, with a preemption, one
    decoding step a call or three."""
    model = build_model(tiny("encoder_decoder", vocab_size=V, max_len=32, tie_output=False), seed=5)  # tied: one token
    rng = np.random.default_rng(2)
    sources = [rng.integers(3, V, n).tolist() for n in (5, 11, 3, 8)]
    settings = DecodeConfig(strategy="greedy", extra_len=6)
    ref = decode.translate(model, sources, settings, bos_id=1, eos_id=2)
    num_new = min(16 + 6, 31)  # translate's budget: the padded source width + extra_len
    cfg = EngineConfig(page_size=4, num_pages=6, max_slots=2, prefill_chunk=4, decode_steps=decode_steps)
    engine = Engine(model, cfg, eos_id=2, bos_id=1)
    params = [SamplingParams(max_tokens=min(len(s) + 6, num_new)) for s in sources]
    outs = engine.generate([[]] * len(sources), params, sources=sources)
    want = [decode.strip_after_eos(row[0][: p.max_tokens], 2) for row, p in zip(ref.tokens, params, strict=True)]
    assert [o.token_ids for o in outs] == want
    assert max(len(set(w)) for w in want) >= 2 and engine.stats()["preempted"] > 0
    with pytest.raises(EngineError, match="needs a source"):
        engine.add_request([1], SamplingParams())


def test_from_workdir_reads_model_tokenizer_and_template(tmp_path):
    """An exported directory (config.json, params): the engine over it has the byte tokenizer, EOS and
    the data's chat template, and gives the model's own greedy tokens, as text too."""
    import json

    import orbax.checkpoint as ocp

    from jaxformer.config import Config, DataConfig, TrainConfig
    from jaxformer.data.tokenizers import ByteTokenizer

    tok = ByteTokenizer()
    mcfg = tiny("decoder_only", vocab_size=tok.vocab_size, max_len=32)
    run = Config(
        mcfg,
        TrainConfig(objective="lm"),
        DataConfig(source="files", files=("chat.jsonl",), tokenizer="byte", max_len=32, template="chatml"),
    )
    model = build_model(mcfg, seed=1)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "params", nnx.state(model, nnx.Param))
    (tmp_path / "config.json").write_text(json.dumps(run.to_dict()))
    engine = Engine.from_workdir(tmp_path, EngineConfig(page_size=4, num_pages=16, max_slots=2))
    assert (engine.eos_id, engine.chat_template, engine.max_context) == (tok.eos_id, "chatml", 32)
    prompt = tok.encode("Hi there")
    out = engine.generate([prompt], SamplingParams(max_tokens=6))[0]
    assert out.token_ids == _reference(model, [prompt], 6, tok.eos_id)[0]
    assert out.text == tok.decode(out.token_ids)


def test_a_model_with_lora_adapters_serves_merged(model):
    """Adapters with nonzero updates: the engine (which merges them, as decode does) gives generate's
    greedy tokens over the adapted model, and they differ from the base model's."""
    from jaxformer import lora
    from jaxformer.config import LoRAConfig

    adapted = lora.add_adapters(nnx.clone(model), LoRAConfig(rank=2, targets=("q", "v", "wo")))
    adapters = nnx.state(adapted, nnx.LoRAParam)
    nnx.update(adapted, jax.tree.map(lambda x: x + 0.5, adapters))  # B starts at zero: make it matter
    prompts = _prompts()[:4]
    want = _reference(adapted, prompts, 8, None)
    engine = Engine(adapted, EngineConfig(page_size=4, num_pages=40, max_slots=3, prefill_chunk=8), eos_id=None)
    assert [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=8))] == want
    assert want != _reference(model, prompts, 8, None)


@pytest.mark.parametrize(
    "d_model, kernel, impl, steps, width",
    [(256, True, "auto", 1, 1), (128, False, "auto", 1, 1), (256, False, "naive", 4, 1), (256, False, "auto", 1, 5)],
)
def test_the_paged_decode_step_compiles_for_a_tpu_slice(d_model, kernel, impl, steps, width):
    """libtpu's compiler, no chip: the decode step [slots, 1] over pools whose heads are split over the
    tensor axis of a v5e:2x2 slice compiles and keeps the pools' sharding. At head dim 128 it runs the
    Pallas paged-attention kernel (a Mosaic custom call) and gathers no page, its logits soft-capped
    inside it; at head dim 64, which the kernel cannot take, it gathers the pages by XLA; under the
    reference attention, four steps a call gather the rows' pages once, before the decoding loop.
    Speculative decoding's check ([slots, 5], every position drawing) gathers, as a prefill chunk does."""
    pytest.importorskip("libtpu")
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxformer import sharding
    from jaxformer.config import MeshConfig
    from jaxformer.layers import without_id_checks
    from jaxformer.plan import parse_target, with_shardings

    mesh_cfg = MeshConfig(data=2, tensor=2)
    mesh = sharding.make_mesh(mesh_cfg, parse_target("tpu-v5e:2x2").devices())
    mcfg = tiny(
        "decoder_only", vocab_size=128, d_model=d_model, num_heads=2, max_len=128, num_decoder_layers=1,
        attention_impl=impl, dtype="bfloat16", attention_softcap=30.0,
    )  # fmt: skip
    slots, pages, page = 8, 33, 16
    with sharding.use(mesh, sharding.rules_for(mesh_cfg)):
        abstract = nnx.eval_shape(lambda: without_id_checks(build_model(mcfg)))
        graphdef, params = nnx.split(abstract)
        params = with_shardings(params, sharding.state_shardings(params, mesh))
        heads = NamedSharding(mesh, PartitionSpec("tensor", None, None, None))
        pool = jax.ShapeDtypeStruct((mcfg.kv_heads, pages, page, mcfg.dim_per_head), mcfg.dtype, sharding=heads)
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)
        sampling = (jax.ShapeDtypeStruct((slots,), np.uint32), jax.ShapeDtypeStruct((slots,), np.float32))
        f32 = jax.ShapeDtypeStruct((slots,), np.float32)
        sampling = (*sampling, i32(slots), f32, f32, i32(), i32(slots))  # top-k, top-p, min-p, EOS, its first position
        compiled = engine_steps._forward.lower(
            graphdef, params, [{"k": pool, "v": pool}], i32(slots, 8), i32(slots, width), i32(slots, width),
            jax.ShapeDtypeStruct((slots, width), bool), i32(slots), sampling, None, i32(slots), steps=steps,
            verify=width > 1,
        ).compile()  # fmt: skip
    text = compiled.as_text()
    # The pages' gather takes whole pages of a head: slices of page * K values.
    pages_gather = f"slice_sizes={{1,{page * mcfg.dim_per_head}}}"
    assert ("tpu_custom_call" in text) == kernel and (pages_gather in text) == (not kernel)
    if steps > 1:  # gathered before the decoding loop, none in it
        assert pages_gather not in _loop_bodies(text)
    out_pools = compiled.output_shardings[-1]
    assert out_pools[0]["k"].spec == PartitionSpec("tensor")
    assert compiled.out_info[0].shape == (slots, max(steps, width))  # a token for each step, or each position


def test_a_call_s_decoding_loop_has_a_trip_count_the_compiler_knows(model):
    """A call of 4 decoding steps compiles to a loop of a known trip count (4), whatever its rows' steps:
    a count read from the rows would make a GPU wait on the host for the loop's predicate at each step."""
    engine = Engine(model, EngineConfig(page_size=4, num_pages=20, max_slots=2, decode_steps=4), eos_id=None)
    text = engine._lower(engine._blank(2, 1, 8), 4).compile().as_text()
    outer = [w for w in re.findall(r"while\(.*", text) if re.search(r'op_name="[^"]*_forward\)/while"', w)]
    assert len(outer) == 1 and '"known_trip_count":{"n":"4"}' in outer[0]


def _loop_bodies(hlo: str) -> str:
    """The text of every computation an HLO module's while loops run: their bodies and all they call."""
    blocks = {block.split(" ", 1)[0].lstrip("%"): block for block in re.split(r"\n(?=\S)", hlo)}
    todo, seen = re.findall(r"body=%([\w.-]+)", hlo), set()
    while todo:
        if (name := todo.pop()) not in seen and name in blocks:
            seen.add(name)
            todo += re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%([\w.-]+)", blocks[name])
    return "\n".join(blocks[name] for name in seen)


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_the_pallas_paged_kernel_equals_the_gather(softcap):
    """The Pallas paged kernel in TPU interpret mode (on this CPU) equals the gathered pages attended by
    the reference path: three rows of 12, 7 and 1 positions over 3 pages of 4, GQA (4 heads, 2 kv heads),
    with and without a soft cap on the logits. Inputs are ones bfloat16 holds: the interpreter's products,
    as the TPU's at default precision, round theirs to bfloat16 (up to 8e-3 off at arbitrary float32 inputs)."""
    from jax.experimental.pallas import tpu as pltpu

    from jaxformer.attention import paged_kernel
    from jaxformer.attention.kernels import dot_product_attention
    from jaxformer.attention.masks import Mask

    rng = np.random.default_rng(0)
    B, H, G, K, N, page = 3, 4, 2, 128, 9, 4
    held = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16).astype(jnp.float32)
    q, k, v = held(B, H, K), held(G, N, page, K), held(G, N, page, K)
    table = jnp.asarray([[3, 7, 1], [5, 2, 0], [8, 0, 0]], jnp.int32)
    lengths = jnp.asarray([12, 7, 1], jnp.int32)
    with pltpu.force_tpu_interpret_mode():
        out = paged_kernel.paged_attention(q, k, v, lengths, table, scale=None, softcap=softcap)
    k_dense, v_dense = kv_cache.read_pages(k, table), kv_cache.read_pages(v, table)
    mask = Mask(kv_lengths=lengths)
    want = dot_product_attention(
        q[:, None], k_dense, v_dense, kv_layout="BGSK", mask=mask, softcap=softcap, implementation="naive"
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(want[:, 0]), rtol=0, atol=1e-5)


def _decode_step_after_prefill(mcfg, page: int, table: list, lengths: tuple[int, int]):
    """A one-layer model of `mcfg` (seed 0) whose two rows were prefilled over pages of `page` by `table`,
    `lengths` positions each: a function running the next decoding step (ids 7 and 9) over those pools,
    (logits, pools). Each call traces anew (a fresh function), so a second call sees the settings then in
    force (a kernel chosen, an interpreter)."""
    model = build_model(mcfg, seed=0)
    zeros = jnp.zeros((mcfg.kv_heads, 8, page, mcfg.dim_per_head), mcfg.dtype)  # [G, N, page, K]
    table, T = jnp.asarray(table, jnp.int32), max(lengths)
    ids = jnp.asarray(np.random.default_rng(0).integers(2, V, (2, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    valid = positions < jnp.asarray(lengths)[:, None]
    _, pools, _ = nnx.jit(
        lambda model: paged.paged_step(model, [{"k": zeros, "v": zeros}], table, ids, positions, valid)
    )(model)
    new_ids, new_positions = jnp.asarray([[7], [9]], jnp.int32), jnp.asarray(lengths, jnp.int32)[:, None]
    return lambda: nnx.jit(
        lambda model, pools: paged.paged_step(model, pools, table, new_ids, new_positions, jnp.ones((2, 1), bool))[:2]
    )(model, pools)


def test_the_paged_step_through_the_pallas_kernel_equals_the_gather(monkeypatch):
    """The layer's wiring of the kernel (queries, scale, GQA, output projection): a decode step of a
    one-layer model (head dim 128, 2 heads over 1 kv head) after a prefill of two rows, with the kernel
    chosen as on a TPU and run by Pallas's TPU interpreter, gives the gathered step's logits and pools.
    Tolerance 2e-2 on logits of magnitude ~10: the interpreted kernel's products lose what bfloat16 drops
    (3.3e-3 measured); the scale left at 1 moves them by 2.0, the heads' outputs swapped by 0.93."""
    from jax.experimental.pallas import tpu as pltpu

    from jaxformer.attention import layer as attention_layer
    from jaxformer.attention import paged_kernel

    mcfg = tiny(
        "decoder_only", vocab_size=V, d_model=256, num_heads=2, num_kv_heads=1, max_len=32, num_decoder_layers=1,
        attention_impl="auto",
    )  # fmt: skip
    step = _decode_step_after_prefill(mcfg, page=4, table=[[1, 2, 3], [4, 5, 0]], lengths=(6, 3))
    want, want_pools = step()
    calls = []
    kernel = attention_layer.paged_attention
    monkeypatch.setattr(attention_layer, "paged_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    monkeypatch.setattr(paged_kernel, "_platform", lambda: "tpu")
    with jax.default_matmul_precision("default"), pltpu.force_tpu_interpret_mode():
        got, got_pools = step()
    assert calls  # the kernel ran
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-2)
    jax.tree.map(np.testing.assert_array_equal, got_pools, want_pools)


@pytest.mark.parametrize("pages, softcap", [(3, 0.0), (32, 0.0), (32, 5.0)])
def test_the_gpu_pallas_paged_kernel_equals_the_gather(pages, softcap):
    """The GPU's Pallas (Triton) paged kernel, run by Pallas's interpreter on this CPU, equals the gathered
    pages attended by the reference path: three rows of 12, 7 and 1 positions (and 300 at 32 pages a row:
    16 partitions of 2 pages combined), GQA (4 heads over 2 kv heads), pages of 16, with and without a
    soft cap on the logits."""
    from jaxformer.attention import paged_kernel
    from jaxformer.attention.kernels import dot_product_attention
    from jaxformer.attention.masks import Mask

    rng = np.random.default_rng(0)
    B, H, G, K, N, page = 3, 4, 2, 32, 100, 16
    q, k, v = (
        jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((B, H, K), (G, N, page, K), (G, N, page, K))
    )
    table = jnp.asarray(rng.permutation(np.arange(1, N))[: B * pages].reshape(B, pages), jnp.int32)
    lengths = jnp.asarray([12, 7, 1] if pages == 3 else [300, 7, 1], jnp.int32)
    assert paged_kernel.gpu_splits(pages, page) == ((3, 1) if pages == 3 else (16, 2))
    out = paged_kernel.paged_attention(q, k, v, lengths, table, scale=None, softcap=softcap, interpret=True)
    k_dense, v_dense = kv_cache.read_pages(k, table), kv_cache.read_pages(v, table)
    want = dot_product_attention(
        q[:, None], k_dense, v_dense, kv_layout="BGSK", mask=Mask(kv_lengths=lengths), softcap=softcap,
        implementation="naive",
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(out), np.asarray(want[:, 0]), rtol=0, atol=2e-5)


def test_the_gpu_paged_kernel_serves_what_triton_can_say(monkeypatch):
    """On a GPU the kernel serves a decoding step under "auto", soft cap or not; a head dim or a page size
    that is not a power of two of 16 or more is gathered, saying why; "cudnn" and prefill chunks gather
    without a word. On a TPU, a soft cap too, and a head dim of 128."""
    from jaxformer.attention import paged_kernel
    from jaxformer.attention.masks import Mask

    mask, bf16 = Mask(kv_lengths=jnp.ones((2,), jnp.int32)), jnp.bfloat16
    why = lambda impl, T=1, K=64, page=16, softcap=0.0: paged_kernel.paged_kernel_unservable(
        impl, mask, None, 0, softcap, (2, T, 4, K), 2, bf16, (), page
    )  # fmt: skip
    monkeypatch.setattr(paged_kernel, "_platform", lambda: "gpu")
    assert why("auto") is None and why("auto", softcap=30.0) is None
    assert "powers of two" in why("auto", K=80) and "powers of two" in why("auto", page=8)
    assert why("cudnn") == "" and why("auto", T=8) == "" and why("splash") == ""
    monkeypatch.setattr(paged_kernel, "_platform", lambda: "tpu")
    assert why("auto", K=128, softcap=30.0) is None and "multiple of 128" in why("auto", K=64)


def test_the_paged_step_through_the_gpu_kernel_equals_the_gather(monkeypatch):
    """The layer's wiring of the GPU kernel (queries, scale, soft cap, GQA, output projection): a decode
    step of a one-layer model (head dim 32, 4 heads over 2 kv heads, logits soft-capped at 5) after a
    prefill of two rows, with the kernel chosen as on a GPU and run by Pallas's interpreter, gives the
    gathered step's logits and pools."""
    from jaxformer.attention import layer as attention_layer
    from jaxformer.attention import paged_kernel

    mcfg = tiny(
        "decoder_only", vocab_size=V, d_model=128, num_heads=4, num_kv_heads=2, max_len=64, num_decoder_layers=1,
        attention_impl="auto", attention_softcap=5.0,
    )  # fmt: skip
    step = _decode_step_after_prefill(mcfg, page=16, table=[[1, 2], [4, 5]], lengths=(20, 3))
    want, want_pools = step()
    calls = []
    kernel = attention_layer.paged_attention
    interpreted = lambda *a, **k: calls.append(k["softcap"]) or kernel(*a, **k, interpret=True)
    monkeypatch.setattr(attention_layer, "paged_attention", interpreted)
    monkeypatch.setattr(paged_kernel, "_platform", lambda: "gpu")
    with jax.default_matmul_precision("default"):
        got, got_pools = step()
    assert calls == [5.0]  # the kernel ran, told the soft cap
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-4)
    jax.tree.map(np.testing.assert_array_equal, got_pools, want_pools)


def test_an_engine_whose_steps_take_the_gpu_kernel_gives_generate_s_greedy_tokens(monkeypatch):
    """The whole engine with its decoding steps attended as on a GPU (the Triton kernel, interpreted), head
    dim 16 over pages of 16, 5 prompts of 1 to 21 tokens through 3 slots: `generate`'s greedy tokens."""
    from jaxformer.attention import layer as attention_layer
    from jaxformer.attention import paged_kernel

    mcfg = tiny(
        "decoder_only", vocab_size=V, d_model=64, num_heads=4, num_kv_heads=2, max_len=64, attention_impl="auto"
    )
    model = build_model(mcfg, seed=3)
    nnx.update(model, jax.tree.map(lambda x: 3.0 * x, nnx.state(model, nnx.Param)))  # as the `model` fixture's
    rng = np.random.default_rng(0)
    system = rng.integers(2, V, 18).tolist()
    prompts = [[*system, 5, 6, 7], rng.integers(2, V, 3).tolist(), [*system, 9], [7], rng.integers(2, V, 20).tolist()]
    want = _reference(model, prompts, 10, None)
    assert max(len(set(w)) for w in want) >= 3  # continuations that depend on the context
    calls, kernel = [], attention_layer.paged_attention
    monkeypatch.setattr(
        attention_layer, "paged_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k, interpret=True)
    )
    monkeypatch.setattr(paged_kernel, "_platform", lambda: "gpu")
    with jax.default_matmul_precision("default"):
        engine = Engine(model, EngineConfig(page_size=16, num_pages=24, max_slots=3, prefill_chunk=8), eos_id=None)
        assert [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=10))] == want
    assert calls  # traced into the decoding steps


def test_encoder_only_scores_equal_the_model_on_each_input_alone():
    """encoder_only: class log-probabilities, masked-LM fills and mean embeddings of inputs of mixed
    lengths, batched and padded by the engine, equal the model's on each input alone (no padding)."""
    model = build_model(tiny("encoder_only", vocab_size=V, max_len=32, num_classes=3), seed=4)
    rng = np.random.default_rng(3)
    inputs = [rng.integers(4, V, n).tolist() for n in (3, 9, 17, 5)]
    inputs[1][2] = inputs[2][0] = inputs[2][7] = 3  # id 3: the mask
    engine = Engine(model, EngineConfig(max_slots=2), eos_id=None)
    classes, fills = engine.score(inputs, "classify"), engine.score(inputs, "fill", mask_id=3)
    embeddings = engine.score(inputs, "embed")
    # The model on one input alone, its three heads in one program (one compile per length, not per op).
    alone = nnx.jit(
        lambda model, ids: (jax.nn.log_softmax(model.classify(ids)), jnp.argmax(model(ids), -1), model.hidden(ids))
    )
    for x, c, f, e in zip(inputs, classes, fills, embeddings, strict=True):
        log_probs, pred, hidden = alone(model, jnp.asarray([x]))
        np.testing.assert_allclose(c, log_probs[0], atol=1e-5)
        pred = np.asarray(pred)[0]
        assert f == [int(p) if t == 3 else t for t, p in zip(x, pred, strict=True)]
        np.testing.assert_allclose(e, np.asarray(hidden)[0].mean(0), atol=1e-5)
    assert fills[2] != inputs[2] and fills[0] == inputs[0]
    with pytest.raises(EngineError, match=r"use Engine\.score"):
        engine.add_request([4, 5], SamplingParams())
    with pytest.raises(EngineError, match="kind must be"):
        engine.score(inputs, "summarize")


# ----------------------------------------------------------------------------- sliding windows


def _held_pages_are_counted(engine):
    """The allocator's invariant: each page's reference count is the number of running requests that
    hold it, a free page is held by none, and every page is either free or held."""
    holders = collections.Counter(p for r in engine._slots if r is not None for p in r.pages if p)
    refs = engine._alloc.refs
    assert all(refs[p] == n for p, n in holders.items()) and not set(holders) & set(engine._alloc.free)
    assert len(holders) + engine._alloc.num_free() == engine.cfg.num_pages - 1


@pytest.fixture(scope="module")
def windowed():
    """Two layers, each attending over its 6 latest positions (Mistral-style: no global layer),
    parameters x3 as `model`'s."""
    model = build_model(tiny("decoder_only", vocab_size=V, max_len=64, sliding_window=6), seed=5)
    nnx.update(model, jax.tree.map(lambda x: 3.0 * x, nnx.state(model, nnx.Param)))
    return model


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_a_windowed_model_releases_the_pages_behind_its_window(windowed, decode_steps):
    """Every layer local (window 6): a request holds at most ceil((6 + 4 - 2) / 4) + 1 = 3 pages of 4
    at once (chunks of 4), so a pool of 4 pages serves prompts + 24 new tokens (up to 10 pages each
    without releasing) and two slots that preempt each other; a prompt sharing another's first pages
    shares them, released only when no request holds them. The tokens are generate's (which keeps a
    ring of the window's slots), the allocator's counts stay consistent at every step, and the pool
    comes back whole; one decoding step a call, or three (whose schedule shares no prefix)."""
    rng = np.random.default_rng(4)
    prefix = rng.integers(2, V, 8).tolist()
    prompts = [[*prefix, 5, 9, 3], rng.integers(2, V, 5).tolist(), [*prefix, 7]]
    n = 24
    want = _reference(windowed, prompts, n, None)
    assert max(len(set(w)) for w in want) >= 3  # continuations that depend on the context
    cfg = EngineConfig(page_size=4, num_pages=5, max_slots=2, prefill_chunk=4, decode_steps=decode_steps)
    engine = Engine(windowed, cfg, eos_id=None)
    assert -(-(len(prompts[0]) + n) // 4) > engine.stats()["pages_total"]  # too small to keep every page
    ids = [engine.add_request(p, SamplingParams(max_tokens=n)) for p in prompts]
    out = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for e in engine.step():
            out[e.request_id] += e.token_ids
        _held_pages_are_counted(engine)
    assert [out[rid] for rid in ids] == want
    stats = engine.stats()
    assert stats["window_released"] > 0 and stats["preempted"] > 0
    assert stats["prefix_hits"] > 0 or decode_steps > 1  # three steps a call: a schedule that finds none
    assert stats["pages_free"] == stats["pages_total"]
    with pytest.raises(EngineError, match=r"need 5 pages at once; the pool has 4"):  # chunks of 12: 6 + 12 - 2
        Engine(windowed, EngineConfig(page_size=4, num_pages=5, prefill_chunk=12), eos_id=None).add_request(
            prompts[0], SamplingParams(max_tokens=n)
        )


def test_a_model_with_a_global_layer_keeps_its_pages():
    """Layer 1 global (`global_every=2`, Gemma 2's interleave): it reads every position, so no page is
    released, the tokens are generate's, and a pool too small for a whole request refuses it."""
    cfg = tiny("decoder_only", vocab_size=V, max_len=64, sliding_window=6, global_every=2)
    model = build_model(cfg, seed=5)
    nnx.update(model, jax.tree.map(lambda x: 3.0 * x, nnx.state(model, nnx.Param)))
    prompts = [np.random.default_rng(4).integers(2, V, 11).tolist()]
    engine = Engine(model, EngineConfig(page_size=4, num_pages=10, max_slots=2, prefill_chunk=4), eos_id=None)
    assert [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=24))] == _reference(
        model, prompts, 24, None
    )
    assert engine.stats()["window_released"] == 0
    with pytest.raises(EngineError, match=r"need 9 pages at once; the pool has 4"):
        Engine(model, EngineConfig(page_size=4, num_pages=5), eos_id=None).add_request(
            prompts[0], SamplingParams(max_tokens=24)
        )


def test_admission_counts_the_cached_pages_it_revives_and_the_pages_it_promised(model):
    """A pool whose free pages are, but for two, promised to a long prompt admitted first, and those two
    hold a finished request's prefix in the cache: a request sharing that prefix waits for pages instead of
    being admitted, then preempted at once (sharing its cached pages takes them off the free list; its
    first chunk needs one more). It runs when the long prompt ends, and every output is generate's."""
    prefix, rng = _prompts()[3][:8], np.random.default_rng(1)
    long_prompt, follower = rng.integers(2, V, 24).tolist(), [*prefix, 5, 6, 7, 8]
    cfg = EngineConfig(page_size=4, num_pages=9, max_slots=2, prefill_chunk=24)  # pages 1-8; page 0 is scratch
    engine = Engine(model, cfg, eos_id=None)
    first = engine.generate([prefix], SamplingParams(max_tokens=1))  # its two pages stay cached, on the free list
    outs = engine.generate([long_prompt, follower], SamplingParams(max_tokens=1))  # 6 pages, then 2 shared + 1
    stats = engine.stats()
    assert stats["prefix_hits"] == 2 and stats["preempted"] == 0, stats
    want = _reference(model, [prefix, long_prompt, follower], 1, None)
    assert [o.token_ids for o in first + outs] == want
