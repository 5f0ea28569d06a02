"""An encoder_only model's routes, their request and response shapes: OpenAI's /v1/embeddings (each input's
final hidden states averaged) and vLLM's /classify (SGLang's /v1/classify: a classification head's classes).
The app runs them (`Engine.score`); the checks and errors are `protocol`'s.
"""

from __future__ import annotations

import base64
import math
import struct

from jaxformer.serve.protocol import bad, id_lists, new_id, now

MAX_INPUTS = 2048  # an embeddings or classify request's inputs at most (OpenAI's for embeddings)
EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}
CLASSIFY_FIELDS = {"model", "input", "user"}


def scored_inputs(body: dict, tok, max_context: int) -> list[list[int]]:
    """The token ids of a body's `input` (/v1/embeddings, /v1/classify): a string, a list of strings, a list
    of token ids or a list of such lists, at most MAX_INPUTS, each within the context.

    Args:
        body: the request body (fields checked, the model named already).
        tok (Tokenizer): the model's tokenizer.
        max_context: the tokens an input may hold at most.

    Returns:
        The token ids of each input.

    Raises:
        APIError: a missing or mistyped input, too many, or one over the context.
    """
    inputs, _ = id_lists(body, "input", tok)
    if len(inputs) > MAX_INPUTS:
        raise bad("input", f"{len(inputs)} inputs: at most {MAX_INPUTS} in one request")
    for i, ids in enumerate(inputs):
        if len(ids) > max_context:
            where = f"input[{i}]" if len(inputs) > 1 else "input"
            raise bad(where, f"{len(ids)} tokens: the model's context is {max_context}", "context_length_exceeded")
    return inputs


def classify_body(logprobs: list[list[float]], labels: tuple[str, ...], model: str, tokens: int) -> dict:
    """vLLM's answer to /classify (SGLang's /v1/classify): each input's class probabilities and the
    likeliest class's name.

    Args:
        logprobs: each input's C class log-probabilities, in input order.
        labels: the C class names, by index.
        model: the model the request named.
        tokens: the inputs' tokens in all.

    Returns:
        The body.
    """
    data = []
    for i, row in enumerate(logprobs):
        probs = [math.exp(x) for x in row]
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": labels[best], "probs": probs, "num_classes": len(probs)})
    usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    return {"id": new_id("classify"), "object": "list", "created": now(), "model": model, "data": data, "usage": usage}


def embedding_inputs(body: dict, tok, max_context: int, width: int) -> tuple[list[list[int]], bool]:
    """A /v1/embeddings body (fields checked, the model named already): its inputs' token ids, and whether
    the vectors go back in base64 (`encoding_format`: little-endian float32s, as OpenAI's).

    Args:
        body: the request body.
        tok (Tokenizer): the model's tokenizer.
        max_context: the tokens an input may hold at most.
        width: the embedding's size (`dimensions`, if given, must be it: no shortening).

    Returns:
        (token ids per input, base64).

    Raises:
        APIError: a missing, mistyped or out-of-range field, or an input over the context.
    """
    inputs = scored_inputs(body, tok, max_context)
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad("encoding_format", f"'float' or 'base64', got {encoding!r}")
    if body.get("dimensions") not in (None, width):
        raise bad("dimensions", f"this model's embeddings have {width} dimensions, not shortened", "unsupported")
    return inputs, encoding == "base64"


def embeddings_body(vectors: list[list[float]], base64_: bool, model: str, tokens: int) -> dict:
    """OpenAI's answer to /v1/embeddings.

    Args:
        vectors: one embedding per input, in input order.
        base64_: each as base64 of its little-endian float32s, else a list of numbers.
        model: the model the request named.
        tokens: the inputs' tokens in all.

    Returns:
        The body.
    """
    as_base64 = lambda v: base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii")
    data = [{"object": "embedding", "index": i, "embedding": as_base64(v) if base64_ else v}
            for i, v in enumerate(vectors)]  # fmt: skip
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
