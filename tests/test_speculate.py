"""Speculative decoding by prompt lookup (`jaxformer.engine.speculate`): the drafts against a naive lookup,
and an engine that drafts against the same engine without drafts: the same tokens, greedy (and
`generate`'s) and sampled, beside requests it must not draft for, under preemption, in fewer calls of the
model, for a decoder and an encoder-decoder alike."""

import collections
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxformer import decode
from jaxformer.config import ConfigError, DecodeConfig, EngineConfig, tiny
from jaxformer.engine import Engine, SamplingParams, speculate
from jaxformer.engine import engine as engine_module
from jaxformer.models import build_model

V = 48


def _naive_draft(seq: list[int], k: int, longest: int, shortest: int) -> list[int]:
    for n in range(longest, shortest - 1, -1):
        if n > len(seq) - 1:
            continue
        tail = seq[-n:]
        starts = [i for i in range(len(seq) - n) if seq[i : i + n] == tail]  # occurrences ending before the last
        if starts:
            full = [i for i in starts if i + n + k <= len(seq)]
            at = (full or starts)[-1] + n
            return seq[at : at + k]
    return []


def test_a_draft_is_what_follows_the_latest_earlier_occurrence_of_the_longest_tail_found():
    rng = np.random.default_rng(0)
    for _ in range(400):
        seq = rng.integers(0, 3, rng.integers(1, 30)).tolist()  # 3 symbols: many repeats
        k, shortest = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        longest = shortest + int(rng.integers(0, 3))
        assert speculate.draft(seq, k, longest, shortest) == _naive_draft(seq, k, longest, shortest), (seq, k)
    assert speculate.draft([1, 2, 3, 9, 1, 2, 3], 3, 3, 1) == [9, 1, 2]
    assert speculate.draft([1, 2, 3, 4], 2, 3, 1) == []  # nothing repeats
    assert speculate.draft([5], 2, 3, 1) == []


def test_a_request_gets_k_drafts_unless_its_max_tokens_or_the_context_leave_fewer_or_a_penalty_shapes_it():
    @dataclasses.dataclass(eq=False)  # as the engine's requests: by identity
    class Request:
        params: SamplingParams
        out: list
        tokens: list
        guide: None = None
        banned: tuple = ()

    cfg = EngineConfig(speculative_tokens=3, prompt_lookup_min=1)
    request = lambda out=(), max_tokens=50, **params: Request(SamplingParams(max_tokens=max_tokens, **params),
                                                              list(out), [1, 2, 3] * 6 + list(out))  # fmt: skip
    plain, near_end, penalized = request(), request(out=[1, 2], max_tokens=4), request(presence_penalty=0.5)
    got = speculate.drafts([plain, near_end, penalized], cfg, max_context=64)
    assert got == {plain: [1, 2, 3], near_end: [3], penalized: []}  # 2 of 4 out: one draft, then the one drawn
    assert speculate.drafts([plain], cfg, max_context=20)[plain] == [1]  # 18 tokens: positions 18 and 19 left
    assert speculate.drafts([penalized], cfg, max_context=64) == {}  # nothing drafted: no check
    assert speculate.drafts([plain], EngineConfig(), max_context=64) == {}  # off


def test_a_row_takes_the_drafts_that_match_then_one_drawn():
    assert speculate.accepted(np.array([7, 8, 9, 1]), [7, 8, 9]) == 4  # every draft, then the one after
    assert speculate.accepted(np.array([7, 5, 9, 1]), [7, 8, 9]) == 2  # 7 taken, then the 5 drawn instead of 8
    assert speculate.accepted(np.array([4, 8, 9, 1]), [7, 8, 9]) == 1
    assert speculate.accepted(np.array([3]), []) == 1


@pytest.fixture(scope="module")
def model():
    """As test_engine's: two layers, parameters x3, so that continuations depend on the context."""
    model = build_model(tiny("decoder_only", vocab_size=V, max_len=64), seed=3)
    nnx.update(model, jax.tree.map(lambda x: 3.0 * x, nnx.state(model, nnx.Param)))
    return model


def _prompts():
    rng = np.random.default_rng(0)
    return [[5, 6, 7, 8] * 4, rng.integers(2, V, 6).tolist(), [9, 10, 11] * 3, rng.integers(2, V, 12).tolist(),
            [3, 4] * 5, [12, 13] * 3]  # fmt: skip


def _calls(engine) -> list:
    """Count the engine's calls of its compiled step."""
    calls, call = [], engine._call

    def counted(*args, **kwargs):
        calls.append(args)
        return call(*args, **kwargs)

    engine._call = counted
    return calls


@pytest.mark.parametrize(("eos_id", "decode_steps"), [(None, 1), (30, 2)])
def test_speculation_gives_the_tokens_of_decoding_without_it_in_fewer_calls(model, eos_id, decode_steps, monkeypatch):
    """Greedy rows (equal to `generate`'s), sampled rows with their log-probabilities and likeliest tokens,
    a row with a presence penalty and one with a stop token (neither drafted for), a pool small enough to
    preempt, calls that check drafts between calls of `decode_steps` steps: every request's tokens equal
    those of the same engine without speculation, drafts were both taken and refused (counted as each
    check's own count says), and the model was called fewer times."""
    checked, accepted = [], speculate.accepted

    def tallied(drawn, drafted):  # each check's drafts and the tokens it took, tallied apart from the engine's
        checked.append((drafted, accepted(drawn, drafted)))
        return checked[-1][1]

    monkeypatch.setattr(speculate, "accepted", tallied)
    base = dict(page_size=4, num_pages=14, max_slots=4, prefill_chunk=8, decode_steps=decode_steps)
    prompts, n = _prompts(), 20
    params = [SamplingParams(max_tokens=n), SamplingParams(max_tokens=n, temperature=1.0, seed=5, logprobs=True,
              top_logprobs=2), SamplingParams(max_tokens=n), SamplingParams(max_tokens=7, presence_penalty=1.5),
              SamplingParams(max_tokens=n, temperature=0.8, top_k=5, seed=2), SamplingParams(max_tokens=n,
              stop_token_ids=[29])]  # fmt: skip
    plain = Engine(model, EngineConfig(**base), eos_id=eos_id)
    plain_calls = _calls(plain)
    want = plain.generate(prompts, params)
    engine = Engine(model, EngineConfig(**base, speculative_tokens=3, prompt_lookup_min=1), eos_id=eos_id)
    calls = _calls(engine)
    got = engine.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    for g, w in zip(got, want, strict=True):
        if w.logprobs is not None:  # drawn from a step over 4 positions against one: float32's rounding apart
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=2e-4)
            assert [[t for t, _ in top] for top in g.top_logprobs] == [[t for t, _ in top] for top in w.top_logprobs]
    greedy = [i for i, p in enumerate(params) if p.temperature == 0 and not p.penalized and not p.stop_token_ids]
    reference = decode.generate(model, [prompts[i] for i in greedy], DecodeConfig(strategy="greedy", max_new_tokens=n),
                                eos_id=eos_id)  # fmt: skip
    assert [got[i].token_ids for i in greedy] == [decode.strip_after_eos(r[0], eos_id) for r in reference.tokens]
    stats = engine.stats()
    assert 0 < stats["draft_accepted"] < stats["drafted"] and stats["preempted"] > 0
    tally = (sum(len(d) for d, _ in checked), sum(n - 1 for _, n in checked))
    assert (stats["drafted"], stats["draft_accepted"]) == tally
    decoding = lambda seen: sum(1 for x, steps, *_ in seen if x["ids"].shape[1] != 8)  # not a prefill chunk
    assert decoding(calls) < decoding(plain_calls), (len(calls), len(plain_calls))


def test_an_encoder_decoder_speculates_to_translate_s_tokens():
    """An encoder-decoder's drafts are checked against each row's source: greedy outputs equal
    `decode.translate`'s, drafts taken."""
    model = build_model(tiny("encoder_decoder", vocab_size=V, max_len=32, tie_output=False), seed=5)
    rng = np.random.default_rng(2)
    sources = [rng.integers(3, V, n).tolist() for n in (5, 11, 3, 8)]
    ref = decode.translate(model, sources, DecodeConfig(strategy="greedy", extra_len=12), bos_id=1, eos_id=2)
    cfg = EngineConfig(page_size=4, num_pages=24, max_slots=2, prefill_chunk=4, speculative_tokens=4,
                       prompt_lookup_min=1)  # fmt: skip
    engine = Engine(model, cfg, eos_id=2, bos_id=1)
    params = [SamplingParams(max_tokens=len(s) + 12) for s in sources]
    outs = engine.generate([[]] * len(sources), params, sources=sources)
    want = [decode.strip_after_eos(row[0][: p.max_tokens], 2) for row, p in zip(ref.tokens, params, strict=True)]
    assert [o.token_ids for o in outs] == want and engine.stats()["draft_accepted"] > 0


def test_warmup_compiles_the_check_and_serving_compiles_nothing_more(model):
    cfg = EngineConfig(page_size=4, num_pages=40, max_slots=3, prefill_chunk=4, speculative_tokens=2,
                       prompt_lookup_min=1)  # fmt: skip
    engine = Engine(model, cfg, eos_id=None)
    before = collections.Counter(engine_module._LOWERED)
    assert engine.warmup() == 3 * 3 * 2  # prefill, decode and the check x rows 1, 2, 3 x pages 8, 16
    warmed = engine_module._LOWERED - before
    engine.generate(_prompts(), SamplingParams(max_tokens=12))
    assert engine_module._LOWERED - before == warmed and engine.stats()["drafted"] > 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"speculative_tokens": -1}, r"engine\.speculative_tokens: must be >= 0, got -1"),
        ({"prompt_lookup_min": 0}, r"engine\.prompt_lookup_min: must be in \[1, prompt_lookup_max=4\], got 0"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, r"engine\.prompt_lookup_min: must be in \[1, "),
    ],
)
def test_the_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kwargs)


def test_the_server_s_metrics_count_the_tokens_drafted_and_taken():
    """`/metrics`' spec-decode counters (vLLM's names) read the engine's `drafted` and `draft_accepted`."""
    parser = pytest.importorskip("prometheus_client.parser", reason='the serve extra: pip install -e ".[serve]"')
    from jaxformer.serve.metrics import Metrics

    stats = {"running": 1, "waiting": 0, "pages_free": 3, "pages_total": 9, "preempted": 0, "prefix_hits": 2,
             "drafted": 7, "draft_accepted": 3}  # fmt: skip
    text = Metrics("m").render(stats).decode()
    read = {s.name: s.value for f in parser.text_string_to_metric_families(text) for s in f.samples}
    assert read["jaxformer:spec_decode_num_draft_tokens_total"] == 7
    assert read["jaxformer:spec_decode_num_accepted_tokens_total"] == 3
