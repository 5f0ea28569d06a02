"""Generation: the KV cache against recomputation, the searches against their definitions."""

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxformer as jf
from jaxformer import decode
from jaxformer.config import ConfigError, DecodeConfig, MLAConfig

V, BOS, EOS = 20, 1, 2
ROWS = [[5, 9, 3], [7, 4, 11, 6, 8, 12, 3], [13, 3, 17, 5, 9]]  # prompts / sources of different lengths


@pytest.fixture(scope="module", params=["decoder_only", "encoder_decoder"])
def model(request):
    return jf.build_model(jf.tiny(request.param, vocab_size=V, max_len=32), seed=1)


def run(model, rows, **settings):
    settings = DecodeConfig(max_new_tokens=8, extra_len=4, **settings)
    if model.cfg.mode == "decoder_only":
        return decode.generate(model, rows, settings, eos_id=EOS)
    return decode.translate(model, rows, settings, bos_id=BOS, eos_id=EOS)


# Gemma's interleaving: layer 0 local over the 3 latest positions (its cache a ring of 3 slots), layer 1 global
WINDOWED = dict(sliding_window=3, global_every=2, num_decoder_layers=2)


MLA = MLAConfig(kv_lora_rank=8, q_lora_rank=6, rope_head_dim=4, nope_head_dim=6, v_head_dim=10)


@pytest.mark.parametrize(
    "mode, dtype, atol, scan, position, window",
    [
        *(
            (mode, *case, 0)
            for mode in ("decoder_only", "encoder_decoder")
            for case in (
                ("float32", 2e-5, False, "rope"),
                ("bfloat16", 0.05, False, "rope"),
                ("float32", 2e-5, True, "rope"),
                ("float32", 2e-5, False, "relative"),
            )
        ),
        *((mode, "float32", 2e-5, True, "mla", 0) for mode in ("decoder_only", "encoder_decoder")),
        ("decoder_only", "float32", 2e-5, False, "rope", 3),
        ("decoder_only", "float32", 2e-5, False, "relative", 3),  # T5's bias read at the slots: no ring
    ],
)
def test_cached_logits_equal_recomputation_at_every_step(mode, dtype, atol, scan, position, window):
    """Prefill of 5 positions, then one position per step: logits == the full forward pass,
    with the layers unrolled or scanned (sliced out of their stacked parameters to decode),
    with rotary positions or T5's relative-position bias (read at the cache's slots), with a
    local layer whose cache is a ring of its window's 3 slots (12 positions: past 2 windows; the
    prefill, at given positions, attends over the ring and its own keys), or, with T5's bias, every slot,
    or with latent attention's cache of latents and rope keys (`model.mla`; the decoder's self-attention,
    its steps in the absorbed form).

    Measured: float32 within 1e-6; bfloat16 within 0.03 for logits up to |3.2|, about two
    bfloat16 ulps, as the two paths round their partial sums differently.
    """
    arch = {"mla": MLA, "position": "rope", "use_bias": False} if position == "mla" else {"position": position}
    cfg = jf.tiny(mode, vocab_size=V, max_len=32, dtype=dtype, scan_layers=scan, **arch,
                  **(WINDOWED if window else {}))  # fmt: skip
    model = jf.build_model(cfg, seed=2)
    tgt = jax.random.randint(jax.random.key(0), (2, 12), 3, V)
    src = jax.random.randint(jax.random.key(1), (2, 9), 3, V).at[1, 6:].set(0)  # row 1 has padding
    memory = model.encode(src) if mode == "encoder_decoder" else None
    full = model.decode(memory, src, tgt) if memory is not None else model(tgt)
    cache = model.init_cache(2, 16, memory, None if memory is None else src)
    step = nnx.jit(lambda model, cache, ids, positions: model.decode_step(cache, ids, positions))
    logits, cache = step(model, cache, tgt[:, :5], jnp.broadcast_to(jnp.arange(5), (2, 5)))
    steps = [logits]
    for t in range(5, 12):
        logits, cache = step(model, cache, tgt[:, t : t + 1], jnp.full((2, 1), t))
        steps.append(logits)
    cached = jnp.concatenate(steps, axis=1).astype(jnp.float32)
    np.testing.assert_allclose(cached, full.astype(jnp.float32), atol=atol)


@pytest.mark.parametrize("strategy", ["greedy", "sample", "beam"])
def test_generation_with_cache_equals_recomputation(model, strategy):
    kw = {"strategy": strategy, "top_k": 5, "num_return": 2 if strategy == "beam" else 1}
    cached, recomputed = run(model, ROWS, **kw), run(model, ROWS, use_cache=False, **kw)
    np.testing.assert_array_equal(cached.tokens, recomputed.tokens)
    np.testing.assert_allclose(cached.scores, recomputed.scores, atol=1e-5)


@pytest.mark.parametrize("strategy", ["greedy", "sample"])
def test_a_local_layer_s_ring_cache_generates_as_recomputation(strategy):
    """Local and global layers interleaved (`WINDOWED`): generation over the local layer's ring of 3 slots
    (the padded prompts' prefill keeping each row's last 3 real positions) gives the tokens and scores of
    recomputing every prefix, 8 new tokens after prompts of 3 to 7 (past 2 windows)."""
    model = jf.build_model(jf.tiny("decoder_only", vocab_size=V, max_len=32, **WINDOWED), seed=1)
    kw = {"strategy": strategy, "top_k": 5}
    cached, recomputed = run(model, ROWS, **kw), run(model, ROWS, use_cache=False, **kw)
    np.testing.assert_array_equal(cached.tokens, recomputed.tokens)
    np.testing.assert_allclose(cached.scores, recomputed.scores, atol=1e-5)


def test_generation_with_the_latent_cache_equals_recomputation():
    """Latent attention (`model.mla`, queries straight from D): greedy search over the latent cache (the
    prompts' prefill in the plain form, every later step in the absorbed form) chooses the tokens
    recomputation does, with its scores."""
    cfg = jf.tiny("decoder_only", vocab_size=V, max_len=32, position="rope", use_bias=False,
                  mla=MLAConfig(kv_lora_rank=8, rope_head_dim=4, nope_head_dim=6, v_head_dim=10))  # fmt: skip
    model = jf.build_model(cfg, seed=1)
    cached, recomputed = run(model, ROWS), run(model, ROWS, use_cache=False)
    np.testing.assert_array_equal(cached.tokens, recomputed.tokens)
    np.testing.assert_allclose(cached.scores, recomputed.scores, atol=1e-5)


def test_a_local_layer_s_cache_holds_its_window_alone():
    """The local layer's keys and values take 3 slots (its window), the global layer's all 16: bytes
    of [B, G, slots, K] float32 for each."""
    model = jf.build_model(jf.tiny("decoder_only", vocab_size=V, max_len=32, **WINDOWED), seed=1)
    cfg, (local, global_) = model.cfg, model.init_cache(2, 16)["layers"]
    per_slot = 2 * cfg.kv_heads * cfg.dim_per_head * 4  # a row's key or value at one position, float32
    assert [local["self"][n].nbytes for n in "kv"] == [3 * per_slot] * 2
    assert [global_["self"][n].nbytes for n in "kv"] == [16 * per_slot] * 2


@pytest.mark.parametrize("mode", ["decoder_only", "encoder_decoder"])
def test_scanned_layers_decode_as_unrolled(mode):
    """Scanned layers, sliced out of their stacked parameters to decode, give the tokens and scores
    of unrolled layers; same seed, same parameters."""
    unrolled, scanned = (
        jf.build_model(jf.tiny(mode, vocab_size=V, max_len=32, scan_layers=scan), seed=1) for scan in (False, True)
    )
    for strategy in ("greedy", "beam"):
        a, b = run(unrolled, ROWS, strategy=strategy), run(scanned, ROWS, strategy=strategy)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.scores, b.scores, atol=1e-5)


def test_beam_of_one_and_top_k_of_one_equal_greedy(model):
    """Beam 1 with alpha 0 and sampling from the top 1 both reduce to greedy decoding."""
    greedy = run(model, ROWS)
    beam = run(model, ROWS, strategy="beam", beam_size=1, length_penalty=0.0)
    sampled = run(model, ROWS, strategy="sample", top_k=1, temperature=0.7)
    np.testing.assert_array_equal(beam.tokens, greedy.tokens)
    np.testing.assert_allclose(beam.scores, greedy.scores, atol=1e-5)
    np.testing.assert_array_equal(sampled.tokens, greedy.tokens)


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_rows_do_not_depend_on_the_batch(model, strategy):
    """Prompts of different lengths decoded together == each decoded alone."""
    together = run(model, ROWS, strategy=strategy)
    for i, row in enumerate(ROWS):
        alone = run(model, [row], strategy=strategy)
        np.testing.assert_array_equal(alone.tokens[0], together.tokens[i])
        np.testing.assert_allclose(alone.scores[0], together.scores[i], atol=1e-5)


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_every_row_runs_to_max_len_whatever_the_padded_width(strategy):
    """Near model.max_len a prompt shorter than the batch's padded width still gets all the tokens that
    fit after it (no EOS: every row runs out), in beam search too: it used to return no hypothesis."""
    model = jf.build_model(jf.tiny("decoder_only", vocab_size=V, max_len=16), seed=1)
    rows = [[5, 9, 3, 4, 6], [7, 4, 11, 6, 8, 12, 3, 9, 10], [13]]  # padded to 16
    settings = DecodeConfig(strategy=strategy, max_new_tokens=12)
    together = decode.generate(model, rows, settings, eos_id=None)
    for i, row in enumerate(rows):
        alone = decode.generate(model, [row], settings, eos_id=None)  # padded to 8, 16 and 8
        fits = min(12, 16 - len(row))
        assert (together.tokens[i, 0, :fits] != 0).all() and (together.tokens[i, 0, fits:] == 0).all()
        assert np.isfinite(together.scores[i, 0])
        np.testing.assert_array_equal(alone.tokens[0, 0, :fits], together.tokens[i, 0, :fits])
        np.testing.assert_allclose(alone.scores[0, 0], together.scores[i, 0], atol=1e-5)


def test_a_sampled_row_does_not_depend_on_the_other_rows(model):
    """Each row draws with its own key: other prompts beside it (or none) leave its sample unchanged."""
    together = run(model, ROWS, strategy="sample", seed=5)
    others = run(model, [ROWS[0], [4, 4, 4, 4], ROWS[2]], strategy="sample", seed=5)
    alone = run(model, ROWS[:1], strategy="sample", seed=5)
    for got, row in ((others, 0), (others, 2), (alone, 0)):
        np.testing.assert_array_equal(got.tokens[row], together.tokens[row])
    assert not np.array_equal(together.tokens[0], together.tokens[2])


def test_generation_stops_at_eos_and_pads_after_it(model):
    from jaxformer.decode import _generate

    traced = _generate._cache_size()
    out = np.concatenate([run(model, ROWS, strategy="sample", seed=seed).tokens[:, 0] for seed in range(4)])
    assert _generate._cache_size() - traced <= 1, "the seed is the key, not a new program: one trace for all four"
    ended = 0
    for seq in out:
        ends = np.flatnonzero(seq == EOS)
        if ends.size:
            assert (seq[ends[0] + 1 :] == 0).all()
            ended += 1
    assert ended > 0  # the check above ran


def test_sampled_tokens_lie_in_the_top_k_and_top_p_sets():
    logits = jax.random.normal(jax.random.key(0), (4, 50)) * 2
    probs = np.asarray(jax.nn.softmax(logits))
    order = np.argsort(-probs, axis=-1)
    draws = jax.vmap(lambda k: decode.sample_logits(logits, k, top_k=7))(jax.random.split(jax.random.key(1), 300))
    for b in range(4):
        assert set(np.asarray(draws[:, b])) <= set(order[b, :7])
    p = 0.6
    draws = jax.vmap(lambda k: decode.sample_logits(logits, k, top_p=p))(jax.random.split(jax.random.key(2), 300))
    for b in range(4):
        mass_before = np.cumsum(probs[b, order[b]]) - probs[b, order[b]]
        nucleus = set(order[b, mass_before < p])  # smallest top set with mass >= p
        assert probs[b, list(nucleus)].sum() >= p
        assert set(np.asarray(draws[:, b])) <= nucleus
        assert len(set(np.asarray(draws[:, b]))) == len(nucleus) > 1  # it samples the whole nucleus


def min_p_then_top_p(probs: np.ndarray, min_p: float, top_p: float) -> set[int]:
    """The tokens vLLM's sampler keeps under min-p then top-p (its order), by NumPy on probabilities:
    those at least min_p times the likeliest's, then the smallest likeliest set of the renormalized
    rest whose mass reaches top_p."""
    kept = np.flatnonzero(probs >= min_p * probs.max())
    order = kept[np.argsort(-probs[kept])]
    rest = probs[order] / probs[order].sum()
    return set(order[np.cumsum(rest) - rest < top_p].tolist())


@pytest.mark.parametrize(("min_p", "top_p"), [(0.1, 1.0), (0.02, 0.7), (1.0, 1.0)])
def test_sampled_tokens_lie_in_the_min_p_set_and_cover_it(min_p, top_p):
    """`sample_logits(min_p=...)` draws from the tokens at least min_p times as likely as the likeliest
    (after the temperature), then under top-p, and from every one of them (300 draws a row); min_p = 1
    keeps the likeliest alone (greedy)."""
    logits = jax.random.normal(jax.random.key(0), (4, 50)) * 2
    temperature = 1.5
    probs = np.asarray(jax.nn.softmax(logits / temperature), np.float64)
    keys = jax.random.split(jax.random.key(3), 300)
    draws = np.asarray(jax.vmap(lambda k: decode.sample_logits(logits, k, temperature, top_p=top_p, min_p=min_p))(keys))
    for b in range(4):
        kept = min_p_then_top_p(probs[b], min_p, top_p)
        assert set(draws[:, b].tolist()) == kept, b
        assert len(kept) < 50  # the filter dropped tokens
    assert (min_p < 1) or (draws == np.argmax(probs, axis=-1)).all()


def test_wide_beam_finds_the_best_length_penalised_sequences():
    """V=5, 3 new tokens: every output is enumerated and scored with the full forward pass.

    A beam of 32 holds every candidate of every step here (at most 4 x 5 before the last), so
    beam search must return the exact best sequences.
    """
    model = jf.build_model(jf.tiny("decoder_only", vocab_size=5, max_len=16), seed=4)
    prompt, N, alpha = [BOS, 3], 3, 0.6
    candidates = []
    for n in range(1, N + 1):
        for seq in itertools.product(range(5), repeat=n):
            if EOS not in seq[:-1] and (n == N or seq[-1] == EOS):
                candidates.append(seq)
    ids = np.zeros((len(candidates), len(prompt) + N), np.int32)
    for i, seq in enumerate(candidates):
        ids[i, : len(prompt) + len(seq)] = prompt + list(seq)
    segments = (np.arange(ids.shape[1]) < np.asarray([[len(prompt) + len(s)] for s in candidates])).astype(np.int32)
    logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray(ids), segments=jnp.asarray(segments))))
    scores = []
    for i, seq in enumerate(candidates):
        total = sum(logp[i, len(prompt) - 1 + j, tok] for j, tok in enumerate(seq))
        scores.append(total / ((5 + len(seq)) / 6) ** alpha)
    best = np.argsort(scores)[::-1][:3]

    settings = DecodeConfig(strategy="beam", beam_size=32, length_penalty=alpha, max_new_tokens=N, num_return=3)
    out = decode.generate(model, [prompt], settings, eos_id=EOS)
    for rank, i in enumerate(best):
        got = [int(t) for t in out.tokens[0, rank][: len(candidates[i])]]
        assert got == list(candidates[i]), (rank, got, candidates[i])
        np.testing.assert_allclose(out.scores[0, rank], scores[i], atol=1e-5)


def test_bad_input_is_rejected(model):
    with pytest.raises(ValueError, match="1 is empty"):
        run(model, [[4, 5], []])
    with pytest.raises(ValueError, match="has 40 tokens"):
        run(model, [[4] * 40])
    with pytest.raises(ValueError, match="token id 25 at index 1 is outside the vocabulary"):
        run(model, [[4, 25]])
    with pytest.raises(ValueError, match=r"no (prompts|sources) given"):
        run(model, [])
    with pytest.raises(ValueError, match=r"eos_id: token id 20 is outside the vocabulary \[0, 20\)"):
        decode.generate(model, [[4]], eos_id=V) if model.cfg.mode == "decoder_only" else decode.translate(
            model, [[4]], bos_id=BOS, eos_id=V
        )
    if model.cfg.mode == "encoder_decoder":
        with pytest.raises(ValueError, match="bos_id: token id -1 is outside"):
            decode.translate(model, [[4]], bos_id=-1, eos_id=EOS)

    class Tok:
        unk_id, eos_id = 1, 2
        encode = staticmethod(lambda text: [1 if c == "?" else 4 for c in text])

    with pytest.raises(ValueError, match=r"prompt 0 .* outside the tokenizer's vocabulary"):
        decode.encode_texts(Tok, ["a?b"], "prompt")


def test_beam_search_says_why_its_continuation_is_empty():
    """Open-ended text: a model whose next token is always "a" (p=0.5) or EOS (p=0.4), whatever
    came before. Greedy continues with "a"s; beam search's best is EOS at once (log 0.4 beats
    log 0.5 + log 0.4 even after the length penalty): the empty text comes with a warning saying
    why, where it came back in silence."""
    from jaxformer.data.tokenizers import ByteTokenizer

    tok = ByteTokenizer()
    cfg = jf.tiny("decoder_only", vocab_size=tok.vocab_size, max_len=16, tie_output=False, logits_bias=True)
    model = jf.build_model(cfg)
    model.lm_head.kernel[...] = jnp.zeros_like(model.lm_head.kernel[...])  # the logits are the bias alone
    a = tok.encode("a")[0]
    p_V = np.full(tok.vocab_size, 0.1 / (tok.vocab_size - 2))
    p_V[a], p_V[tok.eos_id] = 0.5, 0.4
    model.lm_head.bias[...] = jnp.log(jnp.asarray(p_V, jnp.float32))
    settings = DecodeConfig(max_new_tokens=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert decode.continue_texts(model, tok, ["KING:"], settings.replace(strategy="greedy"), True) == ["aaaa"]
    with pytest.warns(
        decode.EmptyContinuation, match=r"prompt 0: beam search's best continuation ends the text at once"
    ):
        out = decode.continue_texts(model, tok, ["KING:"], settings.replace(strategy="beam"), stop_at_eos=True)
    assert out[0].strip() == ""


@pytest.mark.parametrize(
    "field, value",
    [("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.1), ("min_p", 1.5), ("beam_size", 0), ("temperature", 0.0),
     ("top_k", -1), ("num_return", 5)],
)  # fmt: skip
def test_invalid_settings_name_their_field(field, value):
    with pytest.raises(ConfigError, match=f"decode.{field}"):
        DecodeConfig(strategy="beam", **{field: value})


def test_decoder_only_scores_and_continues_text_holding_the_pad_id():
    """pad_id is a real token of a decoder-only vocabulary (GPT-2's id 0 is "!"): scoring a text
    with `model(ids)` and decoding it step by step from the cache give the same log-probabilities,
    and a prompt holding the id continues as it does alone, cached or recomputed."""
    model = jf.build_model(jf.tiny("decoder_only", vocab_size=V, max_len=32), seed=4)
    assert model.cfg.pad_id == 0
    text = jnp.array([[5, 0, 9, 0, 0, 3, 7, 0], [0, 0, 4, 6, 0, 8, 2, 11]])
    scored = nnx.jit(lambda model, text: jax.nn.log_softmax(model(text)))(model, text)
    cache = model.init_cache(2, 8)
    step = nnx.jit(lambda model, cache, ids, positions: model.decode_step(cache, ids, positions))
    logits, cache = step(model, cache, text[:, :1], None)
    steps = [logits]
    for t in range(1, 8):
        logits, cache = step(model, cache, text[:, t : t + 1], jnp.full((2, 1), t))
        steps.append(logits)
    np.testing.assert_allclose(jax.nn.log_softmax(jnp.concatenate(steps, 1)), scored, atol=1e-5)
    prompt = [5, 0, 9, 0, 0]
    alone = run(model, [prompt])
    beside = run(model, [prompt, [3], [0, 0, 0, 0, 0, 0, 0, 0, 0]])
    recomputed = run(model, [prompt], use_cache=False)
    np.testing.assert_array_equal(beside.tokens[:1], alone.tokens)
    np.testing.assert_array_equal(recomputed.tokens, alone.tokens)
    np.testing.assert_allclose(beside.scores[:1], alone.scores, atol=1e-5)


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_generation_on_the_fused_paths_equals_the_reference(model, strategy, cudnn_checked):
    """Prefill, cached steps and cross-attention over padded sources on "xla" and "cudnn" (JAX's
    cuDNN checks on CPU) generate what the reference path does."""
    ref = run(model, ROWS, strategy=strategy)
    for impl in ("xla", "cudnn"):
        fused = jf.build_model(model.cfg.replace(attention_impl=impl), seed=1)
        out = run(fused, ROWS, strategy=strategy)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        np.testing.assert_allclose(out.scores, ref.scores, atol=1e-4)
    assert cudnn_checked
