"""Structured outputs: a request's output held to one of a list of token-id sequences, to a regular
expression, to a JSON schema or to a context-free grammar (`SamplingParams.choices`, `regex`,
`json_schema`, `grammar`; vLLM's guided decoding, OpenAI's `response_format`); and kept from words it
must not write (`bad_words`, `bad_word_ids`).

A guide says, before each token is drawn, which tokens may come next and whether the output so far is
whole. The engine gives the others -inf logits (`requests.penalty_inputs`): EOS is allowed only where the
output is whole, and a whole output that no token may extend ends the request ("stop"). A guided request
decodes one step a call, as its next tokens depend on each one drawn. The tokens a guide forces after a
drawn one, or at the start (`forced`), are taken at once, without a call each, and computed as a prefill
chunk (at the start, with the prompt), each with log-probability 0; a request for the model's own
log-probabilities (`logprobs_mode="raw"`) draws them a step each instead.

Expressions, schemas and grammars are followed by llguidance (the Rust library behind vLLM's and SGLang's
"guidance" backends and llama.cpp's grammars): each request has a matcher over the tokenizer's vocabulary,
each token taken as its bytes (the tokenizers' `token_bytes`), which computes the next token's mask from a
lazily built automaton and an Earley parser, in about a millisecond a step; a malformed or unsupported
pattern is refused when the request is added, naming the field. A JSON schema's output is written without
free whitespace, as `json.dumps` writes it (", " and ": "); a schema's own "x-guidance" object overrides that
(llguidance's JSON options, e.g. {"whitespace_flexible": true}).

The text of a guided output is its tokens' bytes one after another, so it matches the pattern. One
difference: a SentencePiece tokenizer's `decode` drops the space of a first "▁" (its tokens' text starts
with one), so a pattern that allows a leading space may see it dropped from the text.
"""

from __future__ import annotations

import numpy as np

from jaxformer.engine.requests import EngineError, SamplingParams

# llguidance's JSON options for a schema's output: no free whitespace, separators as json.dumps writes them.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ChoiceGuide:
    """The output is one of `choices` (token-id sequences).

    Args:
        choices: the token-id sequences.
    """

    def __init__(self, choices: tuple[tuple[int, ...], ...]):
        self.choices = choices

    def allowed(self, out: list[int]) -> tuple[list[int], bool]:
        """The tokens that may follow `out` (keeping it a prefix of a choice), and whether it is one.

        Args:
            out: the output so far.

        Returns:
            (the next tokens, EOS aside; whole).
        """
        n, out = len(out), tuple(out)
        return sorted({c[n] for c in self.choices if len(c) > n and c[:n] == out}), out in self.choices

    def forced(self, out: list[int]) -> list[int]:
        """The tokens that every choice `out` begins goes on with, up to where they part or one ends.

        Args:
            out: the output so far.

        Returns:
            The forced tokens.
        """
        n, live = len(out), [c for c in self.choices if c[: len(out)] == tuple(out)]
        common = []
        while live and all(len(c) > n + len(common) for c in live) and len({c[n + len(common)] for c in live}) == 1:
            common.append(live[0][n + len(common)])
        return common


class GrammarGuide:
    """The output follows a regular expression, a JSON schema or a grammar: one request's llguidance matcher,
    moved on by each token drawn.

    Args:
        matcher (llguidance.LLMatcher): the request's matcher, at the start.
        vocab_size: the model's vocabulary.
        eos_id: the engine's EOS id.
    """

    def __init__(self, matcher, vocab_size: int, eos_id: int):
        self._matcher, self._V, self._eos_id, self._walked = matcher, vocab_size, eos_id, 0
        self._last = None  # the answer at `_walked` tokens

    def allowed(self, out: list[int]) -> tuple[np.ndarray, bool]:
        """The tokens that may follow `out`, and whether it is whole (EOS may end it).

        Args:
            out: the output so far (it only grows: the tokens past those seen move the matcher on).

        Returns:
            (the next tokens, EOS aside; whole).
        """
        if self._last is not None and len(out) == self._walked:  # asked again at the same place: the same mask
            return self._last
        for token in out[self._walked :]:
            self._matcher.consume_token(token)
        self._walked = len(out)
        if self._matcher.is_error():  # a token it did not allow (none is drawn): nothing goes on from it
            self._last = np.zeros(0, np.int64), False
            return self._last
        bits = np.frombuffer(self._matcher.compute_bitmask(), np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self._V]
        mask[self._eos_id] = 0
        self._last = np.flatnonzero(mask), self._matcher.is_accepting()
        return self._last

    def forced(self, out: list[int]) -> list[int]:
        """The tokens that must follow `out`, whatever is drawn (llguidance's fast-forward tokens: a JSON
        schema's fixed keys and punctuation, an expression's literal run), which the engine takes at once.

        Args:
            out: the output so far.

        Returns:
            The forced tokens (none where the next is a choice, or the output is whole).
        """
        self.allowed(out)  # the matcher moved on to `out`
        return [] if self._matcher.is_error() else [int(t) for t in self._matcher.compute_ff_tokens()]


class _Vocabulary:
    """A tokenizer as llguidance's TokenizerWrapper reads one: each id's bytes (b"" for the ids without, which
    are its special tokens), the EOS and BOS ids, and `__call__` to encode a text."""

    def __init__(self, tokenizer, vocab_size: int, eos_id: int):
        pieces = tokenizer.token_bytes()  # ValueError: a tokenizer whose tokens are not bytes
        self.tokens = [pieces.get(i, b"") if i != eos_id else b"" for i in range(vocab_size)]
        self.special_token_ids = [i for i, b in enumerate(self.tokens) if not b]
        self.eos_token_id, self.bos_token_id = eos_id, getattr(tokenizer, "bos_id", None)
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


class Guides:
    """An engine's guides: its vocabulary as llguidance reads it (made at the first guided request), and a
    matcher for each request that asks for one.

    Args:
        tokenizer (Tokenizer | None): the engine's tokenizer, whose `token_bytes` the matchers read.
        eos_id: the engine's EOS id.
        vocab_size: the model's vocabulary (ids past the tokenizer's are never allowed).
    """

    def __init__(self, tokenizer, eos_id: int | None, vocab_size: int):
        self._tokenizer, self._eos_id, self._V = tokenizer, eos_id, vocab_size
        self._lltokenizer = None

    def guide(self, params: SamplingParams) -> ChoiceGuide | GrammarGuide | None:
        """A new request's guide (None: its output is free).

        Args:
            params: the request's settings.

        Returns:
            Its guide, at the start.

        Raises:
            EngineError: a malformed or unsupported expression, schema or grammar, or an engine without a
                tokenizer whose tokens are bytes or without an EOS id; its `field` names the settings' field.
        """
        import llguidance

        if params.choices:
            return ChoiceGuide(params.choices)
        if params.regex is not None:
            field, spec = "regex", llguidance.LLMatcher.grammar_from_regex(params.regex)
        elif params.json_schema is not None:
            field = "json_schema"
            spec = llguidance.LLMatcher.grammar_from_json_schema(params.json_schema, defaults=JSON_LAYOUT)
        elif params.grammar is not None:
            try:
                field, spec = "grammar", llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF
            except ValueError as e:
                raise EngineError(f"grammar cannot be read as Lark or GBNF: {e}", "grammar") from None
        else:
            return None
        matcher = llguidance.LLMatcher(self._vocabulary(field), spec, log_level=0)
        if matcher.is_error():  # the error with its place, less the grammar llguidance wraps an expression in
            error = matcher.get_error().split("\n   1 | start: /")[0].rstrip()
            raise EngineError(f"{field} cannot be followed: {error}", field)
        return GrammarGuide(matcher, self._V, self._eos_id)

    def _vocabulary(self, field: str):
        """The tokenizer as llguidance reads it (llguidance.LLTokenizer), made once."""
        if self._lltokenizer is None:
            import llguidance

            if self._tokenizer is None or self._eos_id is None:
                raise EngineError(f"{field} needs an engine with a tokenizer and an EOS id", field)
            try:
                vocabulary = _Vocabulary(self._tokenizer, self._V, self._eos_id)
            except (AttributeError, ValueError) as e:
                raise EngineError(f"{field}: {e}", field) from None
            self._lltokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary))
        return self._lltokenizer


def bad_word_ids(words: tuple[str, ...], tok) -> tuple[tuple[int, ...], ...]:
    """`bad_words` as token ids, as vLLM reads them: each word as the tokenizer encodes it, and with a space
    before it where that encodes otherwise (a word in mid-text) in as many tokens.

    Args:
        words: the words.
        tok (Tokenizer): the engine's tokenizer.

    Returns:
        The id sequences, each once.
    """
    out = []
    for word in words:
        alone = tuple(tok.encode(word.lstrip()))
        spaced = tuple(tok.encode(" " + word.lstrip()))
        out += [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
    return tuple(dict.fromkeys(w for w in out if w))
