"""OpenAI's Responses API (`POST /v1/responses`, which vLLM serves too): a request read as the chat it is
(`instructions` a system message, `input` a string or a list of messages) and answered as a Response
object, whole or as its stream of typed events.

Stateless, as a server that stores nothing is: `previous_response_id` is refused (send the conversation as
`input`), and so are tools (served by /v1/chat/completions). The chat route's checks run on the chat, and
their errors name the Responses fields (`input`, `max_output_tokens`, `text.format`).
"""

from __future__ import annotations

import json

from jaxformer.serve.protocol import APIError, bad, new_id, now

# Responses' fields: those read, and the bookkeeping ones passed to the chat as they are.
FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "text",
          "metadata", "user", "store", "safety_identifier", "prompt_cache_key"}  # fmt: skip
# Fields this server cannot honour, taken at these values only.
_NEUTRAL = {"tools": (None, []), "tool_choice": (None, "auto", "none"), "parallel_tool_calls": (None, True, False),
            "previous_response_id": (None,), "truncation": (None, "disabled"), "reasoning": (None,),
            "include": (None, []), "background": (None, False), "service_tier": (None, "auto", "default"),
            "top_logprobs": (None, 0)}  # fmt: skip
FIELDS |= set(_NEUTRAL)
_ROLES = ("user", "assistant", "system", "developer")
_PARTS = {"input_text", "output_text", "text"}  # the text parts of a message's content
# The chat's field named in an error -> the Responses field it came from.
_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def as_chat(body: dict) -> dict:
    """A Responses request as the /v1/chat/completions body it asks for.

    Args:
        body: the request body (fields checked, the model named).

    Returns:
        The chat body.

    Raises:
        APIError: a field this server cannot honour, or an input that is not text messages.
    """
    for field, ok in _NEUTRAL.items():
        if body.get(field) not in ok:
            raise bad(field, f"not supported by this server (only {' or '.join(map(json.dumps, ok))})"
                      + (": send the whole conversation as input" if field == "previous_response_id" else ""),
                      "unsupported")  # fmt: skip
    messages = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise bad(
                "instructions", f"a string is expected, got {type(body['instructions']).__name__}", "invalid_type"
            )
        messages.append({"role": "system", "content": body["instructions"]})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        messages += [_message(item, f"input[{i}]") for i, item in enumerate(given)]
    else:
        raise bad("input", "a string or a non-empty list of messages is expected", "invalid_type")
    chat = {"model": body["model"], "messages": messages}
    chat |= {k: body[k] for k in ("temperature", "top_p", "stream", "metadata", "user", "store", "safety_identifier",
                                  "prompt_cache_key") if k in body}  # fmt: skip
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    text = body.get("text")
    if text is not None and (not isinstance(text, dict) or set(text) - {"format"}):
        raise bad("text", 'an object {"format": {...}} is expected', "invalid_type")
    form = None if text is None else text.get("format")
    if form is not None:
        if not isinstance(form, dict) or form.get("type") not in ("text", "json_object", "json_schema"):
            raise bad("text.format", 'one of {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                      f'"name": ..., "schema": {{...}}}} is expected, got {form!r}')  # fmt: skip
        if form["type"] == "json_schema":  # flat here; nested under "json_schema" in the chat's
            spec = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
            chat["response_format"] = {"type": "json_schema", "json_schema": spec}
        else:
            chat["response_format"] = {"type": form["type"]}
    return chat


def _message(item, where: str) -> dict:
    """One input item, a message of text ({"role", "content"}, its content a string or text parts), as a chat
    message."""
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise bad(where, f"a message {{role, content}} is expected, got {kind!r} (tools are not served here)",
                  "invalid_type")  # fmt: skip
    if item.get("role") not in _ROLES:
        raise bad(f"{where}.role", f"one of {', '.join(_ROLES)}, got {item.get('role')!r}")
    content = item.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") in _PARTS and isinstance(p.get("text"), str) for p in content):
            raise bad(f"{where}.content", "only text parts ({type: input_text or output_text, text}) are supported",
                      "invalid_type")  # fmt: skip
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad(f"{where}.content", f"a string or a list of text parts is expected, got {type(content).__name__}",
                  "invalid_type")  # fmt: skip
    return {"role": item["role"], "content": content}


def renamed(e: APIError) -> APIError:
    """The chat route's error in the Responses' names (`messages` is `input`, and so on).

    Args:
        e: the error the chat's checks raised.

    Returns:
        The error to answer.
    """
    if e.param not in _NAMES:
        return e
    name = _NAMES[e.param]
    message = name + e.message.removeprefix(e.param) if e.message.startswith(e.param) else e.message
    return APIError(e.status, message, name, e.code, e.kind)


def response(rid: str, created: int, model: str, body: dict, text: str, finish: str | None, usage: dict | None) -> dict:
    """A Response object: its one message (`text`) and status ("completed"; "incomplete" where the answer
    reached max_output_tokens; "in_progress" while `finish` is None).

    Args:
        rid: its id ("resp_...").
        created: its creation time (seconds).
        model: the model the request named.
        body: the request body (its settings are echoed back, as OpenAI's are).
        text: the answer so far.
        finish: the choice's finish reason, or None while it runs.
        usage: the chat's usage (prompt_tokens, completion_tokens), or None while it runs.

    Returns:
        The object.
    """
    status = "in_progress" if finish is None else ("incomplete" if finish == "length" else "completed")
    output = [] if finish is None else [_item(rid, text, status)]
    tokens = None
    if usage is not None:
        tokens = {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]}  # fmt: skip
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "model": model, "output": output,
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"), "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "tool_choice": body.get("tool_choice") or "auto",
        "tools": [], "text": body.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
        "previous_response_id": None, "reasoning": None, "usage": tokens,
    }  # fmt: skip


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item(rid: str, text: str, status: str) -> dict:
    """The Response's one output item: its message, id'd after the response."""
    return {"id": "msg_" + rid.removeprefix("resp_"), "type": "message", "status": status, "role": "assistant",
            "content": [_part(text)]}  # fmt: skip


class Events:
    """A Response's stream: OpenAI's typed server-sent events, numbered, for one message's text.

    Args:
        model: the model the request named.
        body: the request body.
    """

    def __init__(self, model: str, body: dict):
        self.rid, self.created, self.model, self.body = new_id("resp"), now(), model, body
        self.at = {"item_id": _item(self.rid, "", "in_progress")["id"], "output_index": 0, "content_index": 0}
        self.seq = 0
        self.text = ""

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.seq} | fields
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def start(self) -> str:
        """The events before the first text: the response created and in progress, its message and part added.

        Returns:
            The events.
        """
        started = response(self.rid, self.created, self.model, self.body, "", None, None)
        return (
            self._event("response.created", response=started)
            + self._event("response.in_progress", response=started)
            + self._event("response.output_item.added", output_index=0, item=_item(self.rid, "", "in_progress")
                          | {"content": []})
            + self._event("response.content_part.added", **self.at, part=_part(""))
        )  # fmt: skip

    def delta(self, text: str) -> str:
        """A piece of the text.

        Args:
            text: the piece.

        Returns:
            The event.
        """
        self.text += text
        return self._event("response.output_text.delta", **self.at, delta=text, logprobs=[])

    def end(self, finish: str, usage: dict) -> str:
        """The events after the last text: the text, its part and message done, the response completed (or
        incomplete, at max_output_tokens).

        Args:
            finish: the choice's finish reason.
            usage: the chat's usage.

        Returns:
            The events.
        """
        whole = response(self.rid, self.created, self.model, self.body, self.text, finish, usage)
        item = whole["output"][0]
        return (
            self._event("response.output_text.done", **self.at, text=self.text, logprobs=[])
            + self._event("response.content_part.done", **self.at, part=item["content"][0])
            + self._event("response.output_item.done", output_index=0, item=item)
            + self._event("response.completed" if whole["status"] == "completed" else "response.incomplete",
                          response=whole)
        )  # fmt: skip

    def error(self, e: APIError) -> str:
        """The stream's end on a failure.

        Args:
            e: what failed.

        Returns:
            The event.
        """
        return self._event("error", code=e.code, message=e.message, param=e.param)
