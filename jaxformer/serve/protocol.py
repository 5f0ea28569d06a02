"""OpenAI's request and response shapes: a request body checked field by field into what the engine is
asked (a `Job`), errors as OpenAI writes them, and text handed out as the tokens come.

Nothing here touches the engine's state or the network: the app (`jaxformer.serve.app`) does. The
engine's names are imported where they are used, so that this package imports (and its reference page
builds) on an install whose engine does not load.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid

from jaxformer.data import templates
from jaxformer.serve import forms, tools

MAX_CHOICES = 128  # prompts x n of one request: more is a batch job (Engine.generate), not an HTTP call
MAX_STOPS = 4  # as OpenAI
MAX_STOP_TOKEN_IDS = 64  # vLLM's `stop_token_ids` of one request at most
MAX_BAD_WORDS = 256  # vLLM's `bad_words` of one request at most
# Fields OpenAI defines that change nothing here at their default value (anything else is refused, as
# OpenAI refuses what it does not know: "Unrecognized request argument supplied").
_NEUTRAL = {
    "suffix": (None, ""),
    "functions": (None,),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "service_tier": (None, "auto", "default"),
}
# Bookkeeping fields, no effect here, each of OpenAI's type (`metadata`: string keys and values).
_IGNORED = {"user": str, "metadata": dict, "store": bool, "safety_identifier": str, "prompt_cache_key": str}
_JSON_TYPE = {str: "a string", dict: "an object of string keys and values", bool: "true or false"}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop", "seed",
           "min_p", "ignore_eos", "min_tokens", "frequency_penalty", "presence_penalty", "repetition_penalty",
           "logit_bias", "stop_token_ids", "allowed_token_ids", "truncate_prompt_tokens",
           "include_stop_str_in_output", "bad_words", "prompt_logprobs", *forms.GUIDED}  # fmt: skip
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "logprobs", "best_of", "suffix", "user"}
CHAT_FIELDS = (
    _COMMON
    | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
    | {"add_generation_prompt", "continue_final_message"}  # vLLM's: the prompt's end (`chat_prompt`)
    | set(_NEUTRAL)
    | set(_IGNORED)
)


class APIError(Exception):
    """A request answered with an error: its HTTP status and OpenAI's error body.

    Args:
        status: the HTTP status (4xx: the client's fault, 5xx: the server's).
        message: what was wrong, for a person.
        param: the request field at fault, or None.
        code: a short machine-readable code, or None.
        kind: OpenAI's error type ("invalid_request_error", "authentication_error", "server_error").
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        """The response body, as OpenAI writes errors.

        Returns:
            {"error": {"message", "type", "param", "code"}}.
        """
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = "invalid_value") -> APIError:
    """A 400 naming the field at fault.

    Args:
        param: the field.
        message: what is wrong with it.
        code: OpenAI's code.

    Returns:
        The error to raise.
    """
    return APIError(400, f"{param}: {message}" if param else message, param, code)


@dataclasses.dataclass
class Job:
    """What one HTTP request asks of the engine: prompts x n generations.

    Attributes:
        chat: a chat completion (else a text completion).
        prompts: each prompt's token ids.
        prompt_texts: each prompt's text (echo).
        params: the sampling settings of each of the n choices of a prompt.
        stream: answer by server-sent events.
        include_usage: a last streamed chunk with the token counts.
        continuous_usage: and each streamed chunk with its choice's counts so far (vLLM's).
        echo: the prompt's text before the completion's.
        logprobs: each chosen token's log-probability.
        stop: the stop strings (the template's end marker included).
        score_prompt: echo with logprobs: each prompt token's log-probability too (a forward pass).
        top_logprobs: how many most likely tokens each position lists, the prompt's (scored) and the new
            ones' (0 to the engine's MAX_TOP_LOGPROBS).
        prompt_logprobs: vLLM's: each prompt token's log-probability and rank, and this many likeliest tokens
            at each position (a forward pass), or None.
        generate: new tokens are asked for (false: echo with max_tokens 0, the prompt alone).
        model: the model the request names (the served model's id, or a LoRA adapter's name).
        adapter: the engine's adapter it runs (None: the base).
        sources: each prompt is an encoder_decoder model's source, the answer its output from BOS (a
            translation), not a prompt the answer continues.
        guided_by: the request's field that holds the output to a form (`forms.guided_by`, or "tools"), or None.
        tools: a chat's tools and its choice among them (`jaxformer.serve.tools`), or None.
        shown_stops: the stop strings the answer keeps (vLLM's include_stop_str_in_output: the request's own,
            never a chat template's end).
        respond: the Responses API request this chat came from (answered as a Response), or None.
        conversation: a Responses request's input items, those of the conversation it continues first (kept
            with its Response where it is stored: `jaxformer.serve.stored`).
        response_id: a background Response's id, given when it was queued; None: a new one when it ends.
    """

    chat: bool
    prompts: list[list[int]]
    prompt_texts: list[str]
    params: list  # [SamplingParams]
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: bool
    stop: tuple[str, ...]
    score_prompt: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    generate: bool = True
    model: str = ""
    adapter: str | None = None
    sources: bool = False
    guided_by: str | None = None
    tools: tools.Tools | None = None
    shown_stops: tuple[str, ...] = ()
    respond: dict | None = None
    conversation: list | None = None
    response_id: str | None = None
    continuous_usage: bool = False

    @property
    def n(self) -> int:
        """Choices per prompt."""
        return len(self.params)


def is_int(v: object) -> bool:
    """Whether a JSON value is an integer (true and false are not).

    Args:
        v: the value.

    Returns:
        True for an int that is not a bool.
    """
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int(body: dict, name: str, default, lo: int, hi: int):
    v = body.get(name)
    if v is None:
        return default
    if not is_int(v):
        raise bad(name, f"an integer is expected, got {type(v).__name__} {v!r}", "invalid_type")
    if not lo <= v <= hi:
        raise bad(name, f"must be in [{lo}, {hi}], got {v}")
    return v


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise bad(name, f"a number is expected, got {type(v).__name__} {v!r}", "invalid_type")
    if not (lo < v if lo_open else lo <= v) or v > hi:
        raise bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def _top_logprobs(body: dict, name: str, default: int | None) -> int | None:
    from jaxformer.engine.requests import MAX_TOP_LOGPROBS  # the most the engine lists

    return _int(body, name, default, 0, MAX_TOP_LOGPROBS)


def flag(body: dict, name: str, default: bool = False) -> bool:
    """A body's true-or-false field.

    Args:
        body: the request body.
        name: the field.
        default: its value where it is missing or null.

    Returns:
        The value.

    Raises:
        APIError: a value that is not true or false.
    """
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"true or false is expected, got {type(v).__name__} {v!r}", "invalid_type")
    return v


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", "a string or a list of strings is expected", "invalid_type")
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise bad("stop", f"at most {MAX_STOPS} non-empty strings, got {stops!r}")
    return tuple(stops)


def check_fields(body: dict, known: set[str]) -> None:
    """Refuse fields OpenAI does not define for this route, and defined ones this server cannot honour.

    Args:
        body: the request body.
        known: the route's fields.

    Raises:
        APIError: the first such field.
    """
    for name in body:
        if name not in known:
            raise bad(name, f"unrecognized request argument supplied: {name}", "unknown_parameter")
        if name in _NEUTRAL and body[name] not in _NEUTRAL[name] and body[name] != {}:
            raise bad(name, f"not supported by this server (only its default: {_NEUTRAL[name][0]!r})", "unsupported")
        if (kind := _IGNORED.get(name)) and (value := body[name]) is not None:
            typed = isinstance(value, kind) and (
                kind is not dict or all(isinstance(x, str) for x in (*value, *value.values()))
            )
            if not typed:
                raise bad(name, f"{_JSON_TYPE[kind]} is expected, got {type(value).__name__} {value!r}", "invalid_type")


def check_text(body: dict) -> None:
    """Refuse a string, or a key, that is not Unicode text: JSON's escapes can spell half a surrogate pair
    ("\\ud800"), which Python parses into a string that no tokenizer (and no UTF-8 answer) can encode.

    Args:
        body: the request body.

    Raises:
        APIError: naming the first field (as `messages[0].content`) that holds one.
    """

    def text(s: str) -> bool:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True

    def first(value, path: str) -> tuple[str, str] | None:  # (the field, the string at fault)
        if isinstance(value, str):
            return None if text(value) else (path, value)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            if isinstance(key, str) and not text(key):
                return path, key
            if found := first(item, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]"):
                return found
        return None

    if found := first(body, ""):
        field, s = found
        field = field.lstrip(".") or None
        raise bad(field, f"{'' if field else 'a key of the body: '}not Unicode text: {s!r} holds a lone surrogate")


def check_model(body: dict, model_name: str | tuple[str, ...]) -> str:
    """The request names one of this server's models (the base, or a LoRA adapter served beside it).

    Args:
        body: the request body.
        model_name: the served model's id, or the ids of all the served models.

    Returns:
        The model named.

    Raises:
        APIError: no model (400), or another one (404, as OpenAI answers).
    """
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
    served = ", ".join(f"`{n}`" for n in names)
    v = body.get("model")
    if not isinstance(v, str) or not v:
        raise bad("model", f"you must provide a model parameter (this server's: {served})", "invalid_type")
    if v not in names:
        raise APIError(404, f"The model `{v}` does not exist: this server serves {served}", "model",
                       "model_not_found")  # fmt: skip
    return v


def sampling(
    body: dict, max_tokens: int, stop: tuple[str, ...], logprobs: bool, n: int, top_logprobs: int = 0, tok=None
) -> list:
    """The engine's settings of each of the n choices (a given seed is each choice's seed + its index).

    Args:
        body: the request body (temperature, top_p, seed, the penalties, logit_bias, response_format; vLLM's
            extensions: top_k, min_p, ignore_eos, min_tokens, repetition_penalty, stop_token_ids,
            allowed_token_ids, bad_words and the form fields, `forms`).
        max_tokens: new tokens at most.
        stop: the stop strings.
        logprobs: return each chosen token's log-probability.
        n: choices per prompt.
        top_logprobs: and this many likeliest tokens' at each step (with `logprobs`).
        tok (Tokenizer | None): the model's tokenizer, which writes `guided_choice`'s texts as token ids.

    Returns:
        n SamplingParams (jaxformer.engine).

    Raises:
        APIError: a value out of range or of the wrong type.
    """
    from jaxformer.engine import SamplingParams

    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 0, 0, 1 << 30)
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    seed = _int(body, "seed", None, 0, (1 << 32) - n)  # the engine's seeds are 32 bits; choice i takes seed + i
    presence = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    logit_bias = _logit_bias(body)
    ignore_eos = flag(body, "ignore_eos")  # extensions, as vLLM's
    min_tokens = _int(body, "min_tokens", 0, 0, max_tokens)
    repetition = _number(body, "repetition_penalty", 1.0, 0.0, 1e4, lo_open=True)
    guide = form(forms.form_fields, body, tok, max_tokens)
    stop_ids = _ids(body, "stop_token_ids", MAX_STOP_TOKEN_IDS)
    allowed = _ids(body, "allowed_token_ids", 1 << 20)
    words = [] if body.get("bad_words") is None else body["bad_words"]
    if (
        not isinstance(words, list)
        or len(words) > MAX_BAD_WORDS
        or not all(isinstance(w, str) and w.strip() for w in words)
    ):
        raise bad("bad_words", f"a list of at most {MAX_BAD_WORDS} non-blank strings is expected", "invalid_type")
    try:
        return [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                min_p=min_p,
                seed=None if seed is None else seed + i,
                stop=stop,
                include_stop_str_in_output=flag(body, "include_stop_str_in_output"),
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                ignore_eos=ignore_eos,
                min_tokens=min_tokens,
                presence_penalty=presence,
                frequency_penalty=frequency,
                repetition_penalty=repetition,
                logit_bias=logit_bias,
                stop_token_ids=stop_ids,
                allowed_token_ids=allowed,
                bad_words=tuple(words),
                **guide,
            )
            for i in range(n)
        ]
    except ValueError as e:  # the engine's own check names the field
        raise bad(None, str(e)) from None


def form(read, body: dict, *args: object) -> object:
    """A form field read, its FormError a 400 naming the field.

    Args:
        read (Callable): `forms.guided_by` or `forms.form_fields`.
        body: the request body.
        *args: `read`'s other arguments.

    Returns:
        What `read` returns.

    Raises:
        APIError: the field is malformed.
    """
    try:
        return read(body, *args)
    except forms.FormError as e:
        raise bad(e.field, str(e), e.code) from None


def _ids(body: dict, name: str, most: int) -> tuple[int, ...]:
    """A field of token ids (vLLM's `stop_token_ids`, `allowed_token_ids`): a list of at most `most`."""
    v = [] if body.get(name) is None else body[name]
    if not isinstance(v, list) or len(v) > most or not all(is_int(t) and t >= 0 for t in v):
        raise bad(name, f"a list of at most {most} token ids is expected, got {v!r}"[:300])
    return tuple(v)


def _shown(body: dict) -> tuple[str, ...]:
    """The request's stop strings, where vLLM's `include_stop_str_in_output` keeps them in the answer."""
    return _stops(body) if flag(body, "include_stop_str_in_output") else ()


def _kept(body: dict, max_context: int) -> int | None:
    """vLLM's `truncate_prompt_tokens`: how many of the prompt's last tokens are kept (-1: the context's
    worth), or None (all)."""
    keep = _int(body, "truncate_prompt_tokens", None, -1, max_context)
    if keep == 0:
        raise bad("truncate_prompt_tokens", "must be >= 1, or -1 (the model's context)")
    return max_context if keep == -1 else keep


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's `logit_bias`: an object of token ids (as strings) to biases in [-100, 100]."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad("logit_bias", f"an object of token ids to biases is expected, got {type(v).__name__}", "invalid_type")
    out = {}
    for key, bias in v.items():
        if not (key.isascii() and key.isdigit()):
            raise bad("logit_bias", f"keys are token ids (as strings of digits), got {key!r}")
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise bad("logit_bias", f"the bias of token {key} must be a number in [-100, 100], got {bias!r}")
        out[int(key)] = float(bias)
    return out


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None, max_context: int, lo: int = 1) -> int | None:
    for name in names:
        if body.get(name) is not None:
            return _int(body, name, None, lo, max_context)
    return default


def _n(body: dict, prompts: int) -> int:
    n = _int(body, "n", 1, 1, MAX_CHOICES)
    if n * prompts > MAX_CHOICES:
        raise bad("n", f"{prompts} prompts x n={n} choices: at most {MAX_CHOICES} in one request")
    return n


def _prompt_logprobs(body: dict, stream: bool) -> int | None:
    """vLLM's `prompt_logprobs`: the likeliest tokens listed at each prompt position (0 to MAX_TOP_LOGPROBS:
    the prompt's own token alone), or None; answered whole, as vLLM does."""
    n = _top_logprobs(body, "prompt_logprobs", None)
    if n is not None and stream:
        raise bad("prompt_logprobs", "the prompt's log-probabilities are answered whole, not streamed", "unsupported")
    return n


def _stream_options(body: dict, stream: bool) -> dict:
    """`stream_options` as the Job's fields: OpenAI's `include_usage`, and vLLM's `continuous_usage_stats`
    (with it: each chunk's choice's counts so far)."""
    opts = body.get("stream_options")
    if opts is None:
        return {"include_usage": False}
    if not stream:
        raise bad("stream_options", "only allowed when stream is true")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats", "include_obfuscation"}:
        raise bad("stream_options", 'an object {"include_usage": true|false, "continuous_usage_stats": true|false} '
                  "is expected", "invalid_type")  # fmt: skip
    if flag(opts, "include_obfuscation"):
        raise bad("stream_options.include_obfuscation", "false only: this server pads no chunk", "unsupported")
    usage = flag(opts, "include_usage")
    return {"include_usage": usage, "continuous_usage": usage and flag(opts, "continuous_usage_stats")}


def id_lists(body: dict, name: str, tok) -> tuple[list[list[int]], list[str]]:
    """A field as OpenAI's prompts and inputs are given: a string, a list of token ids, or a list of either.

    Args:
        body: the request body.
        name: the field ("prompt", "input").
        tok (Tokenizer): the model's tokenizer.

    Returns:
        Each one's token ids, and each one's text; none empty.

    Raises:
        APIError: a missing, mistyped or empty value.
    """
    given = body.get(name)
    if isinstance(given, str) or (isinstance(given, list) and given and all(is_int(t) for t in given)):
        given = [given]
    if not isinstance(given, list) or not given:
        raise bad(name, "a string, a list of strings, a list of token ids or a list of them is expected",
                  "invalid_type")  # fmt: skip
    ids, texts = [], []
    for i, p in enumerate(given):
        if isinstance(p, str):
            ids.append(tok.encode(p))
            texts.append(p)
        elif isinstance(p, list) and all(is_int(t) for t in p):
            ids.append(list(p))
            texts.append(tok.decode(p))
        else:
            raise bad(f"{name}[{i}]" if len(given) > 1 else name, "a string or a list of token ids is expected",
                      "invalid_type")  # fmt: skip
        if not ids[-1]:
            raise bad(name, "empty: give at least one token" + (" to continue" if name == "prompt" else ""))
    return ids, texts


def completion_job(body: dict, tok, max_context: int) -> Job:
    """A /v1/completions body (fields checked, the model named already) as a Job.

    Args:
        body: the request body.
        tok (Tokenizer): the model's tokenizer.
        max_context: prompt + max_tokens must fit.

    Returns:
        The job.

    Raises:
        APIError: a missing, mistyped or out-of-range field.
    """
    prompts, texts = id_lists(body, "prompt", tok)
    if (keep := _kept(body, max_context)) is not None:  # the prompts over it cut, their texts with them
        texts = [tok.decode(ids[-keep:]) if len(ids) > keep else text for ids, text in zip(prompts, texts, strict=True)]
        prompts = [ids[-keep:] for ids in prompts]
    stream = flag(body, "stream")
    n = _n(body, len(prompts))
    if body.get("best_of") is not None and body["best_of"] != n:
        raise bad("best_of", f"only best_of = n ({n}) is supported (each choice is returned)", "unsupported")
    logprobs = _top_logprobs(body, "logprobs", None)  # the chosen token's log-probability and this many likeliest
    stop = _stops(body)
    echo = flag(body, "echo")
    # With echo, max_tokens 0 asks for the prompt alone (its log-probabilities: OpenAI's legacy scoring call).
    max_tokens = _max_tokens(body, ("max_tokens",), 16, max_context, lo=0 if echo else 1)
    score = echo and logprobs is not None
    if stream and (score or max_tokens == 0):
        raise bad("stream", "echo with logprobs or max_tokens=0 (the prompt scored) is answered whole, not streamed",
                  "unsupported")  # fmt: skip
    if score:
        for i, ids in enumerate(prompts):
            if len(ids) + max_tokens > max_context:
                raise bad(f"prompt[{i}]" if len(prompts) > 1 else "prompt",
                          f"{len(ids)} tokens + max_tokens={max_tokens}: the model's context is {max_context}",
                          "context_length_exceeded")  # fmt: skip
    return Job(
        chat=False, prompts=prompts, prompt_texts=texts,
        params=sampling(body, max(max_tokens, 1), stop, logprobs is not None, n, logprobs or 0, tok),
        stream=stream, **_stream_options(body, stream), echo=echo, prompt_logprobs=_prompt_logprobs(body, stream),
        logprobs=logprobs is not None, stop=stop, score_prompt=score, top_logprobs=logprobs or 0,
        generate=max_tokens > 0, guided_by=form(forms.guided_by, body), shown_stops=_shown(body),
    )  # fmt: skip


def chat_turns(messages) -> list[dict]:
    """OpenAI's chat messages as the template's turns ({"role", "content"}, text only).

    Args:
        messages (object): the request's "messages".

    Returns:
        The turns.

    Raises:
        APIError: not a non-empty list of messages, an unknown role, content that is not text, or tool
            results that do not answer the calls before them.
    """
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "a non-empty list of {role, content} messages is expected", "invalid_type")
    turns = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"}:
            raise bad(where, "a message is {role, content} (text only here)", "invalid_type")
        try:
            turn = tools.message_turn(m, where)  # a tool's result, or an assistant's calls
        except tools.ToolError as e:
            raise bad(e.field, str(e)) from None
        if turn is not None:  # consecutive tool results: one user turn
            tool_after_tool = m.get("role") == "tool" and messages[i - 1].get("role") == "tool" if i else False
            turns.append({"role": "user", "content": turns.pop()["content"] + "\n" + turn["content"]}
                         if tool_after_tool else turn)  # fmt: skip
            continue
        role, content = m.get("role"), m.get("content")
        role = "system" if role == "developer" else role
        if role not in templates.ROLES:
            raise bad(f"{where}.role", f"one of {', '.join(templates.ROLES)} (or developer), got {role!r}")
        if isinstance(content, list):  # content parts: text ones only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):  # fmt: skip
                raise bad(f"{where}.content", "only text parts ({type: text, text}) are supported", "invalid_type")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"{where}.content", f"a string is expected, got {type(content).__name__}", "invalid_type")
        turns.append({"role": role, "content": content})
    try:
        tools.check_results(messages)
    except tools.ToolError as e:
        raise bad(e.field, str(e)) from None
    return turns


def chat_prompt(body: dict, template) -> tuple[str, tools.Tools | None, templates.Template]:
    """The prompt a chat body's messages (and its tools) make in the workdir's chat template: ending with
    the assistant's opening (vLLM's `add_generation_prompt`, true by default), or (`continue_final_message`)
    with the last message, an assistant's, left open for the answer to continue (a prefilled answer).

    Args:
        body: the request body.
        template (str | Template | None): the template, or its name (data.template), or None.

    Returns:
        The prompt's text, the request's tools (or None), the template.

    Raises:
        APIError: a model without a template, malformed messages or tools, or a last message that cannot be
            continued.
    """
    if template in (None, "none"):
        raise APIError(400, "this model was not trained on a chat template (data.template=none): use /v1/completions",
                       "messages", "no_chat_template")  # fmt: skip
    t = template if isinstance(template, templates.Template) else templates.get(template)
    turns = chat_turns(body.get("messages"))
    try:
        given = tools.request_tools(body)
    except tools.ToolError as e:
        raise bad(e.field, str(e)) from None
    turns = turns if given is None else tools.with_tools(turns, given)
    opening = t.turns["assistant"][0]
    if flag(body, "continue_final_message"):
        if flag(body, "add_generation_prompt", True):
            raise bad("continue_final_message", "continues the last message: give add_generation_prompt false too")
        if turns[-1]["role"] != "assistant":
            raise bad("continue_final_message", f"the last message is the {turns[-1]['role']}'s: only an "
                      "assistant's is continued")  # fmt: skip
        return t.conversation(turns[:-1]) + turns[-1]["content"], given, t
    text = t.conversation(turns)
    return (text if flag(body, "add_generation_prompt", True) else text.removesuffix(opening)), given, t


def chat_job(body: dict, tok, max_context: int, template) -> Job:
    """A /v1/chat/completions body (fields checked, the model named already) as a Job: the messages
    written in the workdir's chat template, the answer stopped at the template's end (and at EOS).

    Args:
        body: the request body.
        tok (Tokenizer): the model's tokenizer.
        max_context: prompt + max_tokens must fit.
        template (str | Template | None): the template, or its name (data.template), or None.

    Returns:
        The job.

    Raises:
        APIError: a model without a template, or a missing, mistyped or out-of-range field.
    """
    text, given, t = chat_prompt(body, template)
    guided, schema = form(forms.guided_by, body), None if given is None else given.schema()
    if schema is not None and guided is not None:  # "required" or a named function hold it already
        raise bad(guided, f"tool_choice {json.dumps(body['tool_choice'])} and {guided} both hold the output "
                  "to a form: give one")  # fmt: skip
    ids = tok.encode(text)
    if (keep := _kept(body, max_context)) is not None and len(ids) > keep:
        ids = ids[-keep:]
        text = tok.decode(ids)
    stream = flag(body, "stream")
    n = _n(body, 1)
    logprobs = flag(body, "logprobs")
    top_logprobs = _top_logprobs(body, "top_logprobs", 0)
    if top_logprobs and not logprobs:  # as OpenAI
        raise bad("top_logprobs", "needs logprobs: true")
    stop = tuple(dict.fromkeys(_stops(body) + ((t.end,) if t.end else ())))
    room = max_context - len(ids)
    if room < 1:
        raise bad("messages", f"the conversation is {len(ids)} tokens: the model's context is {max_context}",
                  "context_length_exceeded")  # fmt: skip
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), room, max_context)
    params = sampling(body, max_tokens, stop, logprobs, n, top_logprobs, tok)
    if schema is not None:  # "required" or a named function: held to the calls
        try:
            params = [dataclasses.replace(p, json_schema=schema) for p in params]
        except ValueError as e:
            raise bad("tools", str(e)) from None
        guided = "tools"
    return Job(
        chat=True, prompts=[ids], prompt_texts=[text], params=params, stream=stream, echo=False,
        **_stream_options(body, stream), logprobs=logprobs, stop=stop, top_logprobs=top_logprobs,
        prompt_logprobs=_prompt_logprobs(body, stream), guided_by=guided, tools=given, shown_stops=_shown(body),
    )  # fmt: skip


class TextStream:
    """One choice's text as its tokens come: each piece once, none held back at the end. Text that may
    be the start of a stop string, or a character whose bytes have not all come, waits for the next
    tokens; at a stop string the text ends before it (or after it, one of `shown`).

    Args:
        tok (Tokenizer): decodes the ids.
        stops: the stop strings.
        eos_id (int | None): an id that ends the text and is not shown.
        shown: the stop strings the text keeps (vLLM's include_stop_str_in_output: the request's own).
    """

    def __init__(self, tok, stops: tuple[str, ...], eos_id: int | None, shown: tuple[str, ...] = ()):
        self.tok, self.stops, self.eos_id, self.shown = tok, stops, eos_id, shown
        self.ids: list[int] = []
        self.sent = 0  # characters handed out
        self.stopped = False

    def add(self, ids: list[int]) -> str:
        """The text these ids add that can be handed out now.

        Args:
            ids: the new token ids.

        Returns:
            The new text ("" if it must wait); `stopped` is set once a stop string shows.
        """
        if self.stopped:
            return ""
        self.ids += [i for i in ids if i != self.eos_id]
        text = self.tok.decode(self.ids)
        hits = [(i, i + len(s) * (s in self.shown)) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            self.stopped = True
            return self._out(text[: min(hits)[1]], len(text))
        safe = len(text.rstrip("\ufffd"))  # a character's first bytes: wait for the rest
        for s in self.stops:
            safe = min(safe, len(text) - tools.partial_end(text, s))
        return self._out(text, safe)

    def flush(self) -> str:
        """The text held back, once the choice has finished.

        Returns:
            The rest of the text.
        """
        return "" if self.stopped else self._out(self.tok.decode(self.ids), None)

    def _out(self, text: str, upto: int | None) -> str:
        piece = text[self.sent : upto]
        self.sent = max(self.sent, len(text) if upto is None else min(upto, len(text)))
        return piece


def new_id(prefix: str) -> str:
    """A response id as OpenAI writes them ("cmpl-...", "chatcmpl-...").

    Args:
        prefix: "cmpl" or "chatcmpl".

    Returns:
        The id.
    """
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    """The time in whole seconds (OpenAI's "created").

    Returns:
        Seconds since the epoch.
    """
    return int(time.time())
