"""Structured outputs (`jaxformer.engine.guided`): each tokenizer's token bytes spell its own encodings
(byte, SentencePiece, and Hugging Face's byte-level, Metaspace and byte-fallback decoders); greedy decoding
held to a regular expression equals an independent reference that asks the `regex` library, at each step,
which bytes keep the output a prefix of a match (partial matching), over whole-sequence logits, and held to a
context-free grammar (nested brackets) equals one written for that language; sampled and JSON-schema outputs
match their expression and validate against their schema (jsonschema); bad patterns, schemas and
combinations are refused naming the field."""

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
import regex
from flax import nnx

from jaxformer.config import EngineConfig, tiny
from jaxformer.data.tokenizers import ByteTokenizer, HFTokenizer, SentencePieceTokenizer, SymbolTokenizer
from jaxformer.engine import Engine, EngineError, SamplingParams
from jaxformer.models import build_model

GOLDEN = "tests/golden/lm_eval"
TEXTS = ["Hello world, ünïcödé €5!", " to be,\nor not to be ", '{"a": [1, 2.5e-3, true, null]}']
BYTE = ByteTokenizer()


def _hf(tmp_path, decoder: str):
    """A small Hugging Face tokenizer written as a tokenizer.json: "metaspace" (T5's: BPE trained here) or
    "fallback" (Llama 2's: "▁" for the space, characters without a token as their UTF-8 byte pieces)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    specials = ["<unk>", "<s>", "</s>"]
    if decoder == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=specials)
        tok.train_from_iterator([t.strip() for t in TEXTS] * 5, trainer)
    else:
        pieces = [*specials, *(f"<0x{b:02X}>" for b in range(256)), *sorted(set("".join(TEXTS)) - {" "}), "▁"]
        merges = [("▁", "t"), ("▁t", "o"), ("b", "e")]
        vocab = {p: i for i, p in enumerate(pieces + ["".join(m) for m in merges])}
        tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    tok.add_special_tokens(specials)
    tmp_path.mkdir()
    tok.save(str(tmp_path / "tokenizer.json"))
    return HFTokenizer(tmp_path)


def test_token_bytes_spell_each_tokenizers_own_encodings(tmp_path):
    """The bytes of a text's tokens, one after another, are what `decode` makes of them (SentencePiece and
    Metaspace: after the space their first "▁" stands for, which `decode` drops), the text itself for the
    lossless ones (byte, byte-level); specials have none; a
    decoder that joins words itself (WordPiece) and a symbols tokenizer are refused, saying why."""
    spm = SentencePieceTokenizer.train([t.strip() for t in TEXTS] * 20, tmp_path / "spm" / "t.model", 60)
    metaspace, fallback = _hf(tmp_path / "m", "metaspace"), _hf(tmp_path / "f", "fallback")
    for tok in (BYTE, spm, HFTokenizer(f"{GOLDEN}/gpt2"), metaspace, fallback):
        table = tok.token_bytes()
        specials = {tok.bos_id, tok.eos_id, tok.pad_id} - {None}
        assert not specials & set(table), type(tok).__name__
        for text in TEXTS:
            ids = tok.encode(text)
            spelled, decoded = b"".join(table[i] for i in ids).decode(), tok.decode(ids)
            dropped = tok in (spm, metaspace, fallback) and spelled.startswith(" ")  # the first "▁"'s space
            assert spelled[dropped:] == decoded, (type(tok).__name__, text, spelled)
            assert decoded == text or tok in (spm, metaspace, fallback)  # byte and byte-level: lossless
    ids = fallback.encode("a→b")  # a character it never saw: its UTF-8 bytes as byte pieces
    assert [fallback.tokenizer.id_to_token(i) for i in ids][-4:-1] == ["<0xE2>", "<0x86>", "<0x92>"]
    assert b"".join(fallback.token_bytes()[i] for i in ids) == " a→b".encode()
    from tokenizers import Tokenizer, decoders, models

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    (tmp_path / "w").mkdir()
    wordpiece.save(str(tmp_path / "w" / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"decoder \(WordPiece\) does not write tokens as bytes"):
        HFTokenizer(tmp_path / "w").token_bytes()
    with pytest.raises(ValueError, match="numbers, not text"):
        SymbolTokenizer(10).token_bytes()


@pytest.fixture(scope="module")
def model():
    """A two-layer decoder over the byte vocabulary, parameters x3 (its continuations depend on the context)."""
    model = build_model(tiny("decoder_only", vocab_size=BYTE.vocab_size, max_len=96), seed=3)
    nnx.update(model, jax.tree.map(lambda x: 3.0 * x, nnx.state(model, nnx.Param)))
    return model


def _engine(model, decode_steps: int = 3) -> Engine:
    cfg = EngineConfig(page_size=8, num_pages=64, max_slots=4, prefill_chunk=16, decode_steps=decode_steps)
    return Engine(model, cfg, tokenizer=BYTE, eos_id=BYTE.eos_id)


def _reference(model, prompt: list[int], prefix_ok, whole, n: int) -> list[int]:
    """Greedy decoding held to a language: at each step the likeliest byte after which the text is still a
    prefix of a sentence (`prefix_ok(text)`), or EOS where it is a sentence (`whole(text)`), by one forward
    pass over the whole sequence; it ends at EOS, at a sentence that no byte extends, or after n tokens."""
    forward = nnx.jit(lambda m, x: m(x))
    out = []
    while len(out) < n:
        text = BYTE.decode(out).encode()
        ok = [b + 4 for b in range(256) if prefix_ok(text + bytes([b]))]
        if not ok:
            break
        ok += [BYTE.eos_id] if whole(text) else []
        ids = np.zeros((1, 96), np.int32)
        ids[0, : len(prompt) + len(out)] = prompt + out
        x = np.asarray(forward(model, jnp.asarray(ids)), np.float32)[0, len(prompt) + len(out) - 1]
        token = max(ok, key=lambda t: x[t])
        if token == BYTE.eos_id:
            break
        out.append(int(token))
    return out


def _by_regex(pattern: str | None) -> tuple:
    """A regular expression's (prefix_ok, whole), by the `regex` library's partial and full matching."""
    if pattern is None:
        return lambda text: True, lambda text: False
    compiled = regex.compile(pattern.encode())
    return lambda text: compiled.fullmatch(text, partial=True) is not None, lambda text: bool(compiled.fullmatch(text))


# ASCII, no negated classes (`regex` reads bytes, the guide UTF-8 characters); "(ab)+" goes on from a whole match.
PATTERNS = ["(yes|no|maybe)", "[a-f]{2,6}!?", "[0-9]{3}-[0-9]{2}", "(ab)+c?", "[0-9]+([.][0-9]+)?", None]


def test_a_regex_holds_greedy_decoding_as_partial_matching_says(model):
    """Greedy tokens under each expression (and a free row beside them, decoded one step a call too) equal
    the partial-matching reference; each output matches its expression whole; the guide changes what greedy
    decoding gives."""
    prompts = [BYTE.encode(t) for t in ("Answer: ", "Code ", "Number: ", "x", "Pi is ", "Free text ")]
    params = [SamplingParams(max_tokens=12, regex=p) for p in PATTERNS]
    outs = _engine(model).generate(prompts, params)
    for prompt, pattern, out in zip(prompts, PATTERNS, outs, strict=True):
        assert out.token_ids == _reference(model, prompt, *_by_regex(pattern), 12), (pattern, out.text)
        if pattern is not None:
            assert re.fullmatch(pattern, out.text), (pattern, out)
            assert out.token_ids != _reference(model, prompt, *_by_regex(None), 12)[: len(out.token_ids)]


def test_a_grammar_holds_greedy_decoding_to_its_language(model):
    """A context-free grammar (brackets nested to any depth around an x: no regular expression says it), in
    Lark's syntax and in GBNF: greedy tokens equal a reference written for that language."""

    def prefix_ok(text: bytes) -> bool:  # "["*n, then "x", then at most n "]"
        opened = len(text) - len(text.lstrip(b"["))
        rest = text[opened:]
        return rest == b"" or (rest[:1] == b"x" and rest[1:] == b"]" * (len(rest) - 1) and len(rest) - 1 <= opened)

    def whole(text: bytes) -> bool:
        n = (len(text) - 1) // 2
        return text == b"[" * n + b"x" + b"]" * n

    prompt = BYTE.encode("Nest: ")
    want = _reference(model, prompt, prefix_ok, whole, 16)
    lark, gbnf = 'start: "[" start "]" | "x"', 'root ::= "[" root "]" | "x"'
    outs = _engine(model).generate([prompt] * 2, [SamplingParams(max_tokens=16, grammar=g) for g in (lark, gbnf)])
    assert [o.token_ids for o in outs] == [want, want] and b"x" in BYTE.decode(want).encode(), outs


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer"},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "color"],
}


def test_json_schema_and_sampled_outputs_match_and_validate(model):
    """A JSON schema's outputs, greedy and sampled (temperature 1.5, several seeds), parse and validate
    against the schema by jsonschema, written as json.dumps writes them; sampled outputs of an expression
    match it whole and differ."""
    engine = _engine(model, decode_steps=1)
    prompts = [BYTE.encode("JSON: ")] * 4
    params = [SamplingParams(max_tokens=90, json_schema=SCHEMA, temperature=t, seed=s) for t, s in
              [(0.0, None), (1.5, 1), (1.5, 2), (1.5, 3)]]  # fmt: skip
    for out in engine.generate(prompts, params):
        assert out.finish_reason == "stop", out
        jsonschema.validate(value := json.loads(out.text), SCHEMA)
        assert out.text == json.dumps(value, ensure_ascii=False)
    pattern = "[a-c]{1,4}(-[0-9]{2})?"
    outs = engine.generate(prompts, [SamplingParams(max_tokens=8, regex=pattern, temperature=2.0, seed=s) for s in
                                     range(4)])  # fmt: skip
    assert all(re.fullmatch(pattern, o.text) for o in outs) and len({o.text for o in outs}) > 1, outs


def test_bad_patterns_schemas_and_combinations_are_refused_by_name(model):
    for kw, match in [
        (dict(regex=""), "regex must be a non-empty string"),
        (dict(json_schema="{bad"), "json_schema is not JSON"),
        (dict(json_schema=[1]), "json_schema must be a JSON object"),
        (dict(regex="a", json_schema={}), "json_schema and regex both hold the output"),
        (dict(grammar=3), "grammar must be a non-empty string"),
        (dict(regex="a", ignore_eos=True), "ignore_eos cannot be set with regex"),
    ]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    engine = _engine(model)
    for kw, field, match in [
        (dict(regex="(a"), "regex", r'regex cannot be followed: .*invalid regex "\(a".*\n.*unclosed group$'),
        (dict(regex="(?=a)b"), "regex", "look-around, including look-ahead and look-behind, is not supported"),
        (dict(json_schema={"type": "frob"}), "json_schema", "json_schema cannot be followed: Invalid type: frob"),
        (
            dict(json_schema={"type": "object", "required": ["b"], "additionalProperties": False}),
            "json_schema",
            "unsatisfiable",
        ),
        (dict(grammar='start: "a" undefined_rule'), "grammar", "grammar cannot be followed: .*undefined_rule"),
    ]:
        with pytest.raises(EngineError, match=re.compile(match, re.S)) as e:
            engine.add_request([5, 6], SamplingParams(**kw))
        assert e.value.field == field
    plain = Engine(engine.model, engine.cfg, eos_id=BYTE.eos_id)  # no tokenizer
    with pytest.raises(EngineError, match="regex needs an engine with a tokenizer and an EOS id"):
        plain.add_request([5, 6], SamplingParams(regex="a"))
    assert not engine.has_unfinished()


def test_forced_tokens_are_taken_at_once_and_change_nothing(model):
    """The tokens a JSON schema forces (its keys and punctuation) are taken without a call each, computed
    as a prefill chunk: the greedy output is the same tokens (the reference: one step a token, every
    token by the guide's mask, none taken at once) in fewer of the engine's calls."""
    prompt, params = BYTE.encode("JSON: "), SamplingParams(max_tokens=90, json_schema=SCHEMA)
    counts = []
    for jump in (True, False):
        engine, calls = _engine(model, decode_steps=1), []
        run = engine._call
        engine._call = lambda *a, run=run, calls=calls, **k: calls.append(1) or run(*a, **k)
        if not jump:  # the reference: each guide forces nothing
            make = engine.guides.guide
            engine.guides.guide = lambda p, make=make: _forcing_nothing(make(p))
        out = engine.generate([prompt], [params])[0]
        counts.append((out.token_ids, len(calls)))
    (jumped, n_jumped), (stepped, n_stepped) = counts
    assert jumped == stepped and n_stepped >= len(stepped), counts
    assert 2 * n_jumped <= n_stepped, (n_jumped, n_stepped)  # 11 calls against 56 when written
    engine, calls = _engine(model), []  # a form's forced start joins the prompt: one choice is taken whole
    run = engine._call
    engine._call = lambda *a, **k: calls.append(1) or run(*a, **k)
    one = SamplingParams(max_tokens=5, choices=((40, 41, 42),), logprobs=True, top_logprobs=1)
    out = engine.generate([prompt], [one])[0]
    assert (out.token_ids, out.logprobs, out.finish_reason, calls) == ([40, 41, 42], [0.0] * 3, "stop", [])
    assert out.top_logprobs == [[(t, 0.0)] for t in (40, 41, 42)]


def test_raw_log_probabilities_of_forced_tokens_are_the_model_s_own(model):
    """Under `logprobs_mode="raw"` a request for log-probabilities draws the tokens its form forces by a
    step each (the only one allowed), as vLLM does: the tokens are those taken at once by default, and each
    token's log-probability and likeliest tokens are the model's own softmax over the tokens before it (one
    forward pass over the whole sequence), not the 0 of a forced token."""
    prompt = BYTE.encode("JSON: ")
    params = [SamplingParams(max_tokens=80, json_schema=SCHEMA, logprobs=True, top_logprobs=2),
              SamplingParams(max_tokens=5, choices=((40, 41, 42),), logprobs=True)]  # fmt: skip
    cfg = EngineConfig(page_size=8, num_pages=64, max_slots=4, prefill_chunk=16, decode_steps=3, logprobs_mode="raw")
    raw = Engine(model, cfg, tokenizer=BYTE, eos_id=BYTE.eos_id).generate([prompt] * 2, params)
    jumped = _engine(model).generate([prompt] * 2, params)
    assert [o.token_ids for o in raw] == [o.token_ids for o in jumped] and raw[1].token_ids == [40, 41, 42]
    forced = [i for i, x in enumerate(jumped[0].logprobs) if x == 0.0]
    assert len(forced) > len(jumped[0].token_ids) // 2 and jumped[1].logprobs == [0.0] * 3, jumped
    forward = nnx.jit(lambda m, x: m(x))
    for r in raw:
        ids = np.zeros((1, 96), np.int32)
        ids[0, : len(prompt) + len(r.token_ids)] = prompt + r.token_ids
        logp = np.asarray(jax.nn.log_softmax(forward(model, jnp.asarray(ids))[0].astype(jnp.float32)))
        at = np.arange(len(r.token_ids)) + len(prompt) - 1  # the positions whose logits give the new tokens
        np.testing.assert_allclose(r.logprobs, logp[at, r.token_ids], rtol=1e-4, atol=1e-4)
        assert min(np.abs(r.logprobs)) > 1e-3, r.logprobs  # none is a forced token's 0
        if r.top_logprobs:  # the model's two likeliest there, whatever the form allows
            assert [[i for i, _ in t] for t in r.top_logprobs] == np.argsort(-logp[at], axis=1)[:, :2].tolist()
            want = -np.sort(-logp[at], axis=1)[:, :2]
            np.testing.assert_allclose([[x for _, x in t] for t in r.top_logprobs], want, rtol=1e-4, atol=1e-4)


def _forcing_nothing(guide):
    guide.forced = lambda out: []
    return guide
