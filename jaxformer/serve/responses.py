"""OpenAI's Responses API (`POST /v1/responses`, which vLLM serves too): a request read as the chat it is
(`instructions` a system message, `input` a string or a list of messages, earlier function calls and their
outputs; function `tools` and `tool_choice` as the chat's, `jaxformer.serve.tools`) and answered as a
Response object, its output a message and the function calls found, whole or as its stream of typed events.

A request may continue a stored response's conversation (`previous_response_id`, `jaxformer.serve.stored`);
built-in tools (web search, files) are refused. The chat route's checks run on the chat, and their errors
name the Responses fields (`input[i]`, `max_output_tokens`, `text.format`, `tools[i].name`).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator

from jaxformer.serve.protocol import APIError, bad, new_id, now

# Responses' fields: those read, and the bookkeeping ones passed to the chat as they are.
FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "text",
          "tools", "tool_choice", "parallel_tool_calls", "top_logprobs", "include", "metadata", "user", "store",
          "safety_identifier", "prompt_cache_key", "previous_response_id"}  # fmt: skip
LOGPROBS = "message.output_text.logprobs"  # the `include` that asks for the message's log-probabilities
# Fields this server cannot honour, taken at these values only.
_NEUTRAL = {"truncation": (None, "disabled"), "reasoning": (None,),
            "include": (None, [], [LOGPROBS]), "background": (None, False, True),
            "service_tier": (None, "auto", "default")}  # fmt: skip
FIELDS |= set(_NEUTRAL)
_ROLES = ("user", "assistant", "system", "developer")
_PARTS = {"input_text", "output_text", "text"}  # the text parts of a message's content
# The chat's field named in an error -> the Responses field it came from.
_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def as_chat(body: dict, before: list[dict] = ()) -> tuple[dict, list[list[str]]]:
    """A Responses request as the /v1/chat/completions body it asks for.

    Args:
        body: the request body (fields checked, the model named).
        before: the conversation it continues (its previous response's: `stored.Store.conversation`), whose
            items come after its `instructions` and before its `input`.

    Returns:
        (the chat body, where each of its messages came from: the input items ("input[3]"; an assistant's
        calls, each call's; "previous_response_id" for those of the conversation it continues), for `renamed`).

    Raises:
        APIError: a field this server cannot honour, or an input item that is not a message of text, a
            function call or a function call's output.
    """
    for field, ok in _NEUTRAL.items():
        if body.get(field) not in ok:
            raise bad(field, f"not supported by this server (only {' or '.join(map(json.dumps, ok))})", "unsupported")
    messages, origin = [], []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise bad(
                "instructions", f"a string is expected, got {type(body['instructions']).__name__}", "invalid_type"
            )
        messages.append({"role": "system", "content": body["instructions"]})
        origin.append(["instructions"])
    given, items = body.get("input"), [(item, "previous_response_id") for item in before]
    if isinstance(given, str):
        items.append(({"role": "user", "content": given}, "input"))
    elif isinstance(given, list) and given:
        items += [(item, f"input[{i}]") for i, item in enumerate(given)]
    else:
        raise bad("input", "a string or a non-empty list of messages is expected", "invalid_type")
    for item, where in items:
        m = _message(item, where)
        last = messages[-1] if messages else {}
        if "tool_calls" in m and "tool_calls" in last and not last["content"]:  # parallel calls: one message
            last["tool_calls"] += m["tool_calls"]
            origin[-1].append(where)
        else:
            messages.append(m)
            origin.append([where])
    chat = {"model": body["model"], "messages": messages}
    chat |= {k: body[k] for k in ("temperature", "top_p", "stream", "metadata", "user", "store", "safety_identifier",
                                  "prompt_cache_key", "parallel_tool_calls") if k in body}  # fmt: skip
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    chat |= _tools(body)
    if body.get("include") == [LOGPROBS] or body.get("top_logprobs"):  # the message's tokens', and the likeliest
        if chat.get("tools"):
            raise bad("include", "log-probabilities are served for a message's text, not beside tools", "unsupported")
        chat |= {"logprobs": True, "top_logprobs": body.get("top_logprobs") or 0}
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
    return chat, origin


def _tools(body: dict) -> dict:
    """`tools` (function tools, flat: {"type": "function", "name", ...}) and `tool_choice` ({"type":
    "function", "name"} for one) in the chat's forms, where given; the chat's checks check the rest."""
    out = {}
    given = body.get("tools")
    if isinstance(given, list):
        out["tools"] = []
        for i, t in enumerate(given):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else type(t).__name__
                raise bad(f"tools[{i}]", f"only function tools are served here, got {kind!r}", "unsupported")
            out["tools"].append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    elif given is not None:
        out["tools"] = given  # the chat's check names it
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif isinstance(choice, dict):
        raise bad("tool_choice", '"none", "auto", "required" or {"type": "function", "name": ...} is expected, got '
                  f"{json.dumps(choice)[:80]}")  # fmt: skip
    return out | ({} if choice is None else {"tool_choice": choice})


def _message(item, where: str) -> dict:
    """One input item as a chat message: a message of text ({"role", "content"}, its content a string or text
    parts), a function call (an assistant's `tool_calls`), or a function call's output (a "tool" message)."""
    kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
    if kind in ("function_call", "function_call_output"):
        fields = ("call_id", "name", "arguments") if kind == "function_call" else ("call_id", "output")
        for field in fields:
            if not isinstance(item.get(field), str):
                raise bad(f"{where}.{field}", f"a string is expected, got {type(item.get(field)).__name__}",
                          "invalid_type")  # fmt: skip
        if kind == "function_call_output":
            return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
        call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                "arguments": item["arguments"]}}  # fmt: skip
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind != "message":
        raise bad(where, f"a message {{role, content}}, a function_call or a function_call_output is expected, got "
                  f"{kind!r}", "invalid_type")  # fmt: skip
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


# A chat field's place and its rest -> the Responses item's field (a call's and its output's own names; a
# tool message's role, which only its place in the conversation can make wrong: the item itself).
_MESSAGE = re.compile(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\])?(.*)")
_CALL_FIELDS = {".function.arguments": ".arguments", ".function.name": ".name", ".id": ".call_id",
                ".tool_call_id": ".call_id", ".role": ""}  # fmt: skip


def renamed(e: APIError, origin: list[list[str]]) -> APIError:
    """The chat route's error in the Responses' names (`messages[2]` is the input item it came from,
    `tools[0].function.name` is `tools[0].name`, and so on).

    Args:
        e: the error the chat's checks raised.
        origin: where each chat message came from (`as_chat`'s).

    Returns:
        The error to answer.
    """
    name = e.param or ""
    if name in _NAMES:
        name = _NAMES[name]
    elif (m := _MESSAGE.fullmatch(name)) and int(m[1]) < len(origin):
        items = origin[int(m[1])]
        name = items[min(int(m[2] or 0), len(items) - 1)] + _CALL_FIELDS.get(m[3], m[3])
    elif name.startswith("tools[") and ".function" in name:
        name = name.replace(".function", "", 1)
    else:
        return e
    message = name + e.message.removeprefix(e.param) if e.message.startswith(e.param) else e.message
    return APIError(e.status, message, name, e.code, e.kind)


def response(
    rid: str, created: int, model: str, body: dict, output: list[dict], finish: str | None, usage: dict | None
) -> dict:
    """A Response object: its output items (`message_item`, `call_item`) and status ("completed"; "incomplete"
    where the answer reached max_output_tokens; "in_progress" while `finish` is None).

    Args:
        rid: its id ("resp_...").
        created: its creation time (seconds).
        model: the model the request named.
        body: the request body (its settings are echoed back, as OpenAI's are).
        output: its output items so far.
        finish: the choice's finish reason, or None while it runs.
        usage: the chat's usage (prompt_tokens, completion_tokens), or None while it runs.

    Returns:
        The object.
    """
    status = "in_progress" if finish is None else ("incomplete" if finish == "length" else "completed")
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
        "tools": body.get("tools") or [], "text": body.get("text") or {"format": {"type": "text"}},
        "truncation": "disabled", "previous_response_id": body.get("previous_response_id"), "reasoning": None,
        "store": body.get("store", True) is not False, "background": body.get("background") is True, "usage": tokens,
    }  # fmt: skip


def outputs(rid: str, content: str | None, calls: list[dict], finish: str, logprobs: list | None = None) -> list[dict]:
    """A whole answer's output items: its message (unless it is calls alone), then its function calls.

    Args:
        rid: the response's id.
        content: the answer's text (under tools, the text before its calls), or None.
        calls: the calls found in it (the chat's `tool_calls` entries).
        finish: the choice's finish reason.
        logprobs: its tokens' log-probabilities, as a chat's `logprobs.content` lists them, where asked.

    Returns:
        The items.
    """
    status = "incomplete" if finish == "length" else "completed"
    message = [message_item(rid, content or "", status, logprobs)] if content or not calls else []
    return message + [call_item(c, "completed") for c in calls]


def _part(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}


def message_item(rid: str, text: str, status: str, logprobs: list | None = None) -> dict:
    """The Response's message: the answer's text, id'd after the response.

    Args:
        rid: the response's id.
        text: the text.
        status: "in_progress", "completed" or "incomplete".
        logprobs: its tokens' log-probabilities ({"token", "logprob", "bytes", "top_logprobs"}), where asked.

    Returns:
        The item.
    """
    return {"id": "msg_" + rid.removeprefix("resp_"), "type": "message", "status": status, "role": "assistant",
            "content": [_part(text, logprobs)]}  # fmt: skip


def call_item(call: dict, status: str) -> dict:
    """A function call of the Response: one of the chat's `tool_calls` entries, id'd after its call id.

    Args:
        call: {"id", "function": {"name", "arguments"}}.
        status: "in_progress" or "completed".

    Returns:
        The item.
    """
    f = call["function"]
    return {"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call", "status": status,
            "call_id": call["id"], "name": f["name"], "arguments": f["arguments"]}  # fmt: skip


class Events:
    """A Response's stream: OpenAI's typed server-sent events, numbered: its message's text, then each
    function call's arguments as they come, each item added when it begins and done when the next begins or
    the answer ends.

    Args:
        model: the model the request named.
        body: the request body.
    """

    def __init__(self, model: str, body: dict):
        self.rid, self.created, self.model, self.body = new_id("resp"), now(), model, body
        self.items: list[dict] = []  # the output items begun, the last one open
        self.open = False
        self.whole: dict | None = None  # the Response, once ended
        self.failure: APIError | None = None  # what failed, where the stream ended in an error
        self.sent: list[str] = []  # every event so far, its sequence number its index: `follow` reads them
        self.ended = False  # no event follows (`finish`)
        self._grew = asyncio.Event()  # set, and replaced, when an event is added or the stream ends

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": len(self.sent)} | fields
        self.sent.append(f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n")
        self._grew.set()
        self._grew = asyncio.Event()
        return self.sent[-1]

    def finish(self) -> None:
        """Say that no event follows: `follow` ends once it has given the last."""
        self.ended = True
        self._grew.set()

    async def follow(self, after: int = -1) -> AsyncIterator[str]:
        """The events after sequence number `after`, those sent already, then each as it comes, until the
        stream ends (`finish`): a background Response's stream, read when it is created and again by
        `GET /v1/responses/{id}?stream=true&starting_after=N`, by as many readers as ask.

        Args:
            after: the last sequence number the reader has (-1: none).

        Returns:
            The events' texts, as they come.
        """
        at = after + 1
        while True:
            grew = self._grew
            while at < len(self.sent):
                yield self.sent[at]
                at += 1
            if self.ended:
                return
            await grew.wait()

    def _at(self) -> dict:
        item = self.items[-1]
        return {"item_id": item["id"], "output_index": len(self.items) - 1} | (
            {"content_index": 0} if item["type"] == "message" else {}
        )

    def _begin(self, item: dict) -> str:
        """Close the open item, then add `item` (in progress)."""
        out = self._close("completed")
        self.items.append(item)
        self.open = True
        added = dict(item, content=[]) if item["type"] == "message" else item
        out += self._event("response.output_item.added", output_index=len(self.items) - 1, item=added)
        if item["type"] == "message":
            out += self._event("response.content_part.added", **self._at(), part=_part(""))
        return out

    def _close(self, status: str) -> str:
        """The open item's events of its end, if one is open."""
        if not self.open:
            return ""
        self.open, item = False, self.items[-1]
        item["status"] = status if item["type"] == "message" else "completed"
        if item["type"] == "message":
            part = item["content"][0]
            out = self._event("response.output_text.done", **self._at(), text=part["text"], logprobs=part["logprobs"])
            out += self._event("response.content_part.done", **self._at(), part=part)
        else:
            out = self._event("response.function_call_arguments.done", **self._at(), arguments=item["arguments"])
        return out + self._event("response.output_item.done", output_index=len(self.items) - 1, item=item)

    def start(self) -> str:
        """The events before the answer: the response created (queued, in the background) and in progress.

        Returns:
            The events.
        """
        started = response(self.rid, self.created, self.model, self.body, [], None, None)
        created = started | {"status": "queued"} if started["background"] else started
        return self._event("response.created", response=created) + self._event("response.in_progress", response=started)

    def delta(self, text: str, logprobs: list | None = None) -> str:
        """A piece of the message's text (the message added first, where none is open).

        Args:
            text: the piece.
            logprobs: the log-probabilities of the tokens that came with it, where asked.

        Returns:
            The events.
        """
        out = "" if self.open and self.items[-1]["type"] == "message" else self._begin(
            message_item(self.rid, "", "in_progress"))  # fmt: skip
        part = self.items[-1]["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs or []
        return out + self._event("response.output_text.delta", **self._at(), delta=text, logprobs=logprobs or [])

    def chat_delta(self, delta: dict) -> str:
        """A streamed chat delta under tools (`tools.CallStream`'s): its content as the message's text, each
        call's head as a function call added, its arguments as that call's.

        Args:
            delta: {"content": ...} or {"tool_calls": [{"index", "id"?, "function": {"name"?, "arguments"}}]}.

        Returns:
            The events.
        """
        out = self.delta(delta["content"]) if delta.get("content") else ""
        for c in delta.get("tool_calls") or ():
            if c.get("id") is not None:  # a call's head: its item begins
                head = {"id": c["id"], "function": {"name": c["function"]["name"], "arguments": ""}}
                out += self._begin(call_item(head, "in_progress"))
            piece = c["function"].get("arguments") or ""
            if piece:
                self.items[-1]["arguments"] += piece
                out += self._event("response.function_call_arguments.delta", **self._at(), delta=piece)
        return out

    def end(self, finish: str, usage: dict) -> str:
        """The events after the answer: the open item done (the message added first where nothing was), the
        response completed (or incomplete, at max_output_tokens).

        Args:
            finish: the choice's finish reason.
            usage: the chat's usage.

        Returns:
            The events.
        """
        out = "" if self.items else self._begin(message_item(self.rid, "", "in_progress"))
        status = "incomplete" if finish == "length" else "completed"
        out += self._close(status)
        self.whole = whole = response(self.rid, self.created, self.model, self.body, self.items, finish, usage)
        kind = "response.completed" if whole["status"] == "completed" else "response.incomplete"
        return out + self._event(kind, response=whole)

    def error(self, e: APIError) -> str:
        """The stream's end on a failure.

        Args:
            e: what failed.

        Returns:
            The event.
        """
        self.failure = e
        return self._event("error", code=e.code, message=e.message, param=e.param)
