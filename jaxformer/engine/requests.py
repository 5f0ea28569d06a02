"""What a request to the engine is and what it gets back: how to decode it (SamplingParams, each field
checked with an error naming it), what one step produced for it (Event), its end (Output), and the error
of a request the engine cannot take (EngineError)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

MAX_TOP_LOGPROBS = 20  # the likeliest tokens a step lists at most (as vLLM's default `max_logprobs`)


def _is_id(t) -> bool:
    """A token id: an int (not a bool) >= 0."""
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


class EngineError(ValueError):
    """A request the engine cannot take (a prompt over the context, bad ids, ...); the message says what.

    Args:
        message: what is wrong.
        field: the SamplingParams field at fault, where one is (a server names it as the request's field).
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    Attributes:
        max_tokens: new tokens at most (finish_reason "length").
        temperature: 0: greedy; else softmax(logits / temperature).
        top_k: keep the k likeliest tokens (0: off).
        top_p: keep the nucleus of this probability mass (1: off).
        min_p: keep the tokens at least this fraction as likely as the likeliest (0: off; vLLM's `min_p`),
            applied before top-k and top-p, as vLLM applies it.
        seed: the request's sampling seed; None: from the engine's seed and the request id.
        stop: stop strings (finish_reason "stop"), matched on the detokenized text; the text ends before the
            first one found.
        include_stop_str_in_output: the text ends after that stop string instead (vLLM's).
        logprobs: return each chosen token's log-probability.
        top_logprobs: also list the likeliest tokens at each step, this many (0 to MAX_TOP_LOGPROBS; needs
            `logprobs`), likeliest first, with their log-probabilities under the model, as the chosen token's.
        min_tokens: no EOS is drawn before this many new tokens (vLLM's `min_tokens`; a stop string still
            ends the text, as `max_tokens` does); the log-probabilities there are of the model's softmax
            over the other tokens.
        ignore_eos: an EOS drawn is a token like any other, not the end (`max_tokens` or a stop string ends
            the request): outputs of a set length, as a throughput benchmark asks (vLLM's `ignore_eos`).
        presence_penalty: subtracted from the logit of every token the output holds already (OpenAI's, in
            [-2, 2]; 0: off).
        frequency_penalty: subtracted from a token's logit once for each time the output holds it (OpenAI's,
            in [-2, 2]; 0: off).
        repetition_penalty: the logits of the tokens of the prompt and the output so far divided by it where
            positive, multiplied where negative (vLLM's and Hugging Face's; > 1 discourages them; 1: off).
        logit_bias: {token id: bias} added to those logits at every step (OpenAI's, each in [-100, 100]; -100
            in effect bans a token); given as a mapping or (id, bias) pairs, kept as sorted pairs.
        allowed_token_ids: only these ids may be drawn (vLLM's `allowed_token_ids`; EOS too only if listed);
            () = all.
        bad_words: words never written (vLLM's `bad_words`): each as the tokenizer encodes it, and with a space
            before it; the last token of one is not drawn where the output ends with the ones before it.
            Needs a tokenizer; a request with a word of several tokens decodes one step a call.
        stop_token_ids: ids that end the request as EOS does ("stop", the id left out of the output; vLLM's
            `stop_token_ids`): a chat model's turn-end token that is not its EOS, say. `ignore_eos` and
            `min_tokens` concern EOS only.
        choices: the output is one of these token-id sequences (vLLM's `guided_choice`, as ids): each step
            draws only among the tokens that keep it a prefix of one, and it ends ("stop") once it is a whole
            one that no other extends (where one does, EOS may end it there); () = free.
        regex: the output's text matches this regular expression (vLLM's `guided_regex`; the syntax of
            Rust's `regex`, without look-around or back-references): each step draws only among the tokens
            that keep it a prefix of a match; EOS only where it matches whole; it ends ("stop") where no
            token may extend it. Needs an engine with a tokenizer (`jaxformer.engine.guided`).
        json_schema: the output is JSON that this schema (an object, or its JSON text) accepts (vLLM's
            `guided_json`, OpenAI's `response_format`), held as `regex` is.
        grammar: the output is a sentence of this context-free grammar, in Lark's syntax or GBNF (vLLM's
            `guided_grammar`; llguidance's dialect), held as `regex` is.

    At most one of `choices`, `regex`, `json_schema` and `grammar` holds an output, none with `ignore_eos`. The
    penalties, then the biases and the guide, change the logits every token is drawn from; a chosen token's
    log-probability (and the likeliest tokens') are under those logits, as `min_tokens`' are. A guided
    request decodes one step a call (its next tokens depend on each one drawn), and so do the requests
    decoding beside it.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    choices: tuple[tuple[int, ...], ...] = ()
    regex: str | None = None
    json_schema: str | None = None
    grammar: str | None = None

    def __post_init__(self):
        def need(ok, field, message):
            if not ok:
                raise ValueError(f"{field} {message}")

        def of(field, *types):
            value = getattr(self, field)
            ok = (isinstance(value, types) and not isinstance(value, bool)) or (bool in types and type(value) is bool)
            need(ok, field, f"must be {' or '.join(t.__name__ for t in types)}, got {value!r}")

        of("max_tokens", int)
        need(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        of("temperature", int, float)
        need(0 <= self.temperature < float("inf"), "temperature", f"must be >= 0 and finite, got {self.temperature}")
        of("top_k", int)
        need(self.top_k >= 0, "top_k", f"must be >= 0 (0: off), got {self.top_k}")
        of("top_p", int, float)
        need(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        of("min_p", int, float)
        need(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1] (0: off), got {self.min_p}")
        if self.seed is not None:
            of("seed", int)
            need(0 <= self.seed < 2**32, "seed", f"must be in [0, 2**32), got {self.seed}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        need(isinstance(stop, (tuple, list)), "stop", f"must be a tuple of strings, got {self.stop!r}")
        need(all(isinstance(s, str) and s for s in stop), "stop", f"must hold non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        of("logprobs", bool)
        of("top_logprobs", int)
        n = self.top_logprobs
        need(0 <= n <= MAX_TOP_LOGPROBS, "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {n}")
        need(self.logprobs or not n, "top_logprobs", f"= {n} needs logprobs=True")
        of("min_tokens", int)
        need(
            0 <= self.min_tokens <= self.max_tokens, "min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}"
        )
        of("ignore_eos", bool)
        of("include_stop_str_in_output", bool)
        for field in ("presence_penalty", "frequency_penalty"):
            of(field, int, float)
            need(-2 <= getattr(self, field) <= 2, field, f"must be in [-2, 2], got {getattr(self, field)}")
        of("repetition_penalty", int, float)
        r = self.repetition_penalty
        need(0 < r < float("inf"), "repetition_penalty", f"must be > 0 and finite (1: off), got {r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        need(isinstance(bias, (tuple, list, type({}.items()))), "logit_bias", f"must be a mapping of token id to "
             f"bias, got {self.logit_bias!r}")  # fmt: skip
        pairs = []
        for pair in bias:
            ok = isinstance(pair, (tuple, list)) and len(pair) == 2
            token, value = pair if ok else (None, None)
            ok = ok and _is_id(token)
            need(ok, "logit_bias", f"keys must be token ids (ints >= 0), got {pair!r}")
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and -100 <= value <= 100
            need(ok, f"logit_bias[{token}]", f"must be a number in [-100, 100], got {value!r}")
            pairs.append((token, float(value)))
        need(len({t for t, _ in pairs}) == len(pairs), "logit_bias", "names a token id twice")
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs)))
        words = (self.bad_words,) if isinstance(self.bad_words, str) else self.bad_words
        ok = isinstance(words, (tuple, list)) and all(isinstance(w, str) and w.strip() for w in words)
        need(ok, "bad_words", f"must be non-blank strings, got {self.bad_words!r}")
        object.__setattr__(self, "bad_words", tuple(words))
        for field in ("allowed_token_ids", "stop_token_ids"):
            ids = getattr(self, field)
            ok = isinstance(ids, (tuple, list)) and all(map(_is_id, ids))
            need(ok, field, f"must be token ids (ints >= 0), got {ids!r}")
            object.__setattr__(self, field, tuple(ids))
        need(isinstance(self.choices, (tuple, list)), "choices", f"must be token-id sequences, got {self.choices!r}")
        choices = []
        for c in self.choices:
            ok = isinstance(c, (tuple, list)) and len(c) > 0
            ok = ok and all(map(_is_id, c))
            need(ok, "choices", f"must each be a non-empty sequence of token ids (ints >= 0), got {c!r}")
            choices.append(tuple(c))
        object.__setattr__(self, "choices", tuple(dict.fromkeys(choices)))  # each once, in order
        for field in ("regex", "grammar"):
            value = getattr(self, field)
            ok = value is None or (isinstance(value, str) and value)
            need(ok, field, f"must be a non-empty string, got {value!r}")
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _schema_text(self.json_schema))
        given = [f for f in ("choices", "regex", "json_schema", "grammar") if getattr(self, f) not in ((), None)]
        if given:
            need(len(given) == 1, given[-1], f"and {given[0]} both hold the output: give one")
            need(not self.ignore_eos, "ignore_eos", f"cannot be set with {given[0]}: the output ends where it is whole")

    def check_ids(self, vocab_size: int) -> None:
        """The token ids of `logit_bias`, `allowed_token_ids`, `stop_token_ids` and `choices` are of a
        vocabulary of `vocab_size`, and every choice fits in `max_tokens`.

        Args:
            vocab_size: the model's vocabulary.

        Raises:
            EngineError: an id outside it, or a choice longer than max_tokens.
        """
        given = {"logit_bias": [t for t, _ in self.logit_bias], "allowed_token_ids": self.allowed_token_ids,
                 "stop_token_ids": self.stop_token_ids}  # fmt: skip
        for field, ids in given.items():
            if outside := [t for t in ids if t >= vocab_size]:
                raise EngineError(f"{field}: token id {outside[0]} is outside the vocabulary [0, {vocab_size})", field)
        for k, choice in enumerate(self.choices):
            if max(choice) >= vocab_size or len(choice) > self.max_tokens:
                raise EngineError(f"choices[{k}] has {len(choice)} tokens (ids up to {max(choice)}): at most "
                                  f"max_tokens={self.max_tokens}, ids in [0, {vocab_size})", "choices")  # fmt: skip

    @property
    def penalized(self) -> bool:
        """Whether a penalty, a bias, a set of allowed ids or a guide change this request's logits."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias
            or self.allowed_token_ids or self.bad_words or self.guided
        )  # fmt: skip

    @property
    def guided(self) -> bool:
        """Whether choices, a regular expression, a JSON schema or a grammar hold the output."""
        return bool(self.choices) or any(x is not None for x in (self.regex, self.json_schema, self.grammar))


def _schema_text(schema) -> str:
    """A JSON schema given as an object or as JSON text, as the JSON text a request keeps (the properties in
    the order given: the output keeps it)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema must be a JSON object (a schema), got {type(schema).__name__}")
    return json.dumps(schema)


def penalty_inputs(rows: list[tuple], R: int, V: int, eos_id: int | None) -> tuple[np.ndarray, ...]:
    """The compiled step's penalty and bias inputs (`paged.penalize`) for a call's rows: each row's count of
    every token in its output so far, the tokens of its prompt, its three penalties and its biases (-inf on
    the tokens outside its allowed ids and those its guide rules out next; EOS allowed where its output is
    whole already); the rows past
    those given (up to R) are left as they are (no penalty, no bias).

    Args:
        rows (list[tuple]): (row index, SamplingParams, prompt ids, output ids so far, guide or None, its bad
            words' ids, `guided.bad_word_ids`) of each request (`jaxformer.engine.guided`).
        R: the call's rows.
        V: the vocabulary's size.
        eos_id: the engine's EOS id (None: none).

    Returns:
        (counts [R, V] int32, seen [R, V] bool, presence, frequency and repetition [R] float32, bias [R, V]
        float32).
    """
    counts, seen, bias = np.zeros((R, V), np.int32), np.zeros((R, V), bool), np.zeros((R, V), np.float32)
    presence, frequency, repetition = np.zeros(R, np.float32), np.zeros(R, np.float32), np.ones(R, np.float32)
    for i, p, prompt, out, guide, banned in rows:
        np.add.at(counts[i], np.asarray(out, np.int64), 1)
        seen[i, np.asarray(prompt, np.int64)] = True
        presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        for token, b in p.logit_bias:
            bias[i, token] = b
        for word in banned:  # its last token, where the output ends with the ones before it
            if len(word) == 1 or tuple(out[-(len(word) - 1) :]) == word[:-1]:
                bias[i, word[-1]] = -np.inf
        if p.allowed_token_ids:
            barred = np.ones(V, bool)
            barred[np.asarray(p.allowed_token_ids, np.int64)] = False
            bias[i, barred] = -np.inf
        if guide is not None:
            tokens, whole = guide.allowed(out)
            ruled_out = np.ones(V, bool)
            ruled_out[np.asarray(tokens, np.int64)] = False
            if whole and eos_id is not None:
                ruled_out[eos_id] = False
            bias[i, ruled_out] = -np.inf
    return counts, seen, presence, frequency, repetition, bias


@dataclasses.dataclass
class Event:
    """What one engine step produced for one request.

    Attributes:
        request_id: the request.
        token_ids: the new token(s) this step (usually one; may be empty on finish).
        logprobs: their log-probabilities, if the request asked.
        finished: the request is done.
        finish_reason: "stop" (EOS or a stop string), "length", "abort", or None while running.
        top_logprobs: per new token, the likeliest tokens as (id, log-probability) pairs, if the request asked.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool
    finish_reason: str | None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclasses.dataclass
class Output:
    """A finished request.

    Attributes:
        request_id: the request.
        prompt_ids: its prompt.
        token_ids: generated ids, EOS excluded, cut before a stop string's tokens where possible.
        text: detokenized, when the engine has a tokenizer.
        logprobs: the tokens' log-probabilities, if asked.
        finish_reason: "stop", "length" or "abort".
        top_logprobs: per token, the likeliest tokens as (id, log-probability) pairs, if asked.
    """

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    logprobs: list[float] | None
    finish_reason: str
    top_logprobs: list[list[tuple[int, float]]] | None = None


def each(value: object, n: int, what: str, of: str) -> list:
    """`value` for each of n items.

    Args:
        value: a list or tuple of n values, or one value for all.
        n: the items' count.
        what: the values' name, for the error.
        of: the items' name, for the error.

    Returns:
        The n values.

    Raises:
        EngineError: a list or tuple whose length is not n.
    """
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(values) != n:
        raise EngineError(f"{len(values)} {what} for {n} {of}")
    return values
