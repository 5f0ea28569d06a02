"""vLLM's `/tokenize` and `/detokenize`: a prompt, or a chat's messages, as the token ids the generation
routes feed the model (so that a client counts what fits in the context before it asks), and ids back as
text. Neither runs the model.
"""

from __future__ import annotations

from jaxformer.serve.protocol import bad, chat_prompt, flag, is_int

# vLLM's fields of the two forms of /tokenize (a completion's prompt, or a chat's messages) and of /detokenize.
TOKENIZE_FIELDS = {"model", "prompt", "messages", "tools", "add_special_tokens", "add_generation_prompt",
                   "continue_final_message", "return_token_strs"}  # fmt: skip
DETOKENIZE_FIELDS = {"model", "tokens"}


def tokenize_body(body: dict, tok, max_context: int, template) -> dict:
    """A /tokenize body's answer: `{"count", "max_model_len", "tokens", "token_strs"}`, as vLLM's.

    The ids are those the generation routes feed the model for the same prompt: a completion's `prompt`
    (a string) encoded as it is, with no special tokens added (`add_special_tokens` true is refused); a
    chat's `messages` (and `tools`) written in the workdir's chat template, ending with the assistant's
    opening unless `add_generation_prompt` is false, or with the last message left open
    (`continue_final_message`; `protocol.chat_prompt`).

    Args:
        body: the request body (fields checked, the model named if at all).
        tok (Tokenizer): the model's tokenizer.
        max_context: the model's context (prompt + max_tokens).
        template (str | Template | None): the chat template, or its name, or None.

    Returns:
        The response body; `token_strs` each id's text where `return_token_strs` is true, else None.

    Raises:
        APIError: neither or both of prompt and messages, a field of the wrong type, or an option this
            server cannot honour.
    """
    if ("prompt" in body) == ("messages" in body):
        raise bad("prompt", "give either prompt (a completion's) or messages (a chat's)")
    if flag(body, "add_special_tokens"):
        raise bad("add_special_tokens", "this server feeds prompts as their text encodes, with no special tokens "
                  "added: false only", "unsupported")  # fmt: skip
    if "prompt" in body:
        for field in ("tools", "add_generation_prompt", "continue_final_message"):
            if field in body:
                raise bad(field, "a chat's field: give messages, not prompt")
        if not isinstance(body["prompt"], str):
            raise bad("prompt", f"a string is expected, got {type(body['prompt']).__name__}", "invalid_type")
        text = body["prompt"]
    else:
        text = chat_prompt(body, template)[0]
    ids = tok.encode(text)
    strs = [tok.decode([i]) for i in ids] if flag(body, "return_token_strs") else None
    return {"count": len(ids), "max_model_len": max_context, "tokens": ids, "token_strs": strs}


def detokenize_body(body: dict, tok, vocab_size: int) -> dict:
    """A /detokenize body's answer: `{"prompt": the ids' text}`, as vLLM's.

    Args:
        body: the request body (fields checked).
        tok (Tokenizer): the model's tokenizer.
        vocab_size: the model's vocabulary (ids must lie in [0, vocab_size)).

    Returns:
        The response body.

    Raises:
        APIError: `tokens` missing, not a list of integers, or holding an id outside the vocabulary.
    """
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise bad("tokens", "a list of token ids is expected", "invalid_type")
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise bad("tokens", f"ids outside the vocabulary [0, {vocab_size}): {outside[:5]}")
    return {"prompt": tok.decode(ids)}
