"""Tool calling in chat completions (OpenAI's `tools` and `tool_choice`): the tools written into the
conversation, the model's calls read back out of its answer.

The model sees the tools in its system turn, each function's signature a JSON line within <tools></tools>,
and calls one by writing `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes form that
Qwen and many fine-tunes use; a model fine-tuned on it calls tools by itself). Earlier calls in the history
are written back the same way, and a tool's result (a message of role "tool") as a user turn within
<tool_response></tool_response>.

- `tool_choice` "auto" (the default with tools): the answer is free; the calls found in it are returned
  as `tool_calls`, the text before the first one as `content`. Text that is not a whole set of valid calls
  stays content.
- "required": the answer is held (by the engine's JSON guide) to a JSON array of one or more calls, each
  {"name": one of the tools, "arguments": what its `parameters` schema accepts}.
- a named function ({"type": "function", "function": {"name": ...}}): the answer is held to that
  function's arguments, as vLLM does; finish_reason "stop", as OpenAI's for a forced call.
- "none": the tools are not shown to the model.

Any model gets valid calls with "required" or a named function, whatever it learned; "auto" needs one
fine-tuned to call tools in this form.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128  # as OpenAI
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


class ToolError(ValueError):
    """A malformed `tools`, `tool_choice` or tool message (the protocol answers it as a 400).

    Args:
        field: the request's field at fault ("tools[0].function.name").
        message: what is wrong.
    """

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class Tools:
    """A request's tools and its choice among them.

    Attributes:
        functions: each tool's {"name", "description"?, "parameters"?}, as the request gave them.
        choice: "auto", "required", or the name of the function that must be called.
        parallel: more than one call an answer (OpenAI's `parallel_tool_calls`).
    """

    functions: tuple[dict, ...]
    choice: str
    parallel: bool = True

    @property
    def named(self) -> str | None:
        """The function a named choice calls, or None."""
        return None if self.choice in ("auto", "required") else self.choice

    def schema(self) -> dict | None:
        """The JSON schema the answer is held to.

        Returns:
            A named function's arguments' schema, "required"'s array of calls, or None ("auto").
        """
        params = {f["name"]: f.get("parameters") or {"type": "object"} for f in self.functions}
        if self.named:
            return params[self.named]
        if self.choice == "auto":
            return None
        call = lambda name: {
            "type": "object", "properties": {"name": {"const": name}, "arguments": params[name]},
            "required": ["name", "arguments"], "additionalProperties": False,
        }  # fmt: skip
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [call(n) for n in params]}}
        return calls | ({} if self.parallel else {"maxItems": 1})

    def system_text(self) -> str:
        """What the system turn says of the tools.

        Returns:
            Their signatures, and how to call one.
        """
        lines = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in self.functions)
        return (
            "# Tools\n\nYou may call one or more functions to answer. Their signatures are within <tools></tools>, "
            f"one a line:\n<tools>\n{lines}\n</tools>\n\nTo call one, write its name and arguments as a JSON "
            f'object within {OPEN}{CLOSE}:\n{OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n'
            f"{CLOSE}"
        )

    def answer(self, text: str, finish_reason: str) -> tuple[str | None, list[dict], str]:
        """The answer's content, its calls (OpenAI's `tool_calls`) and its finish reason.

        Args:
            text: the answer's text.
            finish_reason: the engine's ("stop", "length").

        Returns:
            (content or None, calls, finish reason): a named function's call even when cut short (its
            arguments as far as they came, "length"); "required"'s calls, or the text as content where it
            was cut short; "auto"'s calls ("tool_calls") and the text before the first, or the text alone.
        """
        if self.named:
            return None, [call(self.named, text)], finish_reason
        if self.choice == "required":
            try:
                found = [call(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in json.loads(text)]
            except (json.JSONDecodeError, TypeError, KeyError):
                return text, [], finish_reason
            return None, found, "tool_calls"
        found = self.parse(text)
        if not found:
            return text, [], finish_reason
        content = text[: text.index(OPEN)]
        return content if content.strip() else None, found, "tool_calls"

    def parse(self, text: str) -> list[dict]:
        """The calls of an "auto" answer: each <tool_call> block's (the last may be unclosed, cut by a stop
        or EOS) {"name": a tool's, "arguments": an object}; none unless every block is one (all or nothing:
        a malformed call is the model's text, not half a call).

        Args:
            text: the answer's text.

        Returns:
            The calls (OpenAI's `tool_calls` entries), at most one without `parallel`.
        """
        names = {f["name"] for f in self.functions}
        found = []
        for body in _CALL.findall(text):
            try:
                c = json.loads(body)
            except json.JSONDecodeError:
                return []
            if not (isinstance(c, dict) and c.get("name") in names and isinstance(c.get("arguments"), dict)):
                return []
            found.append(call(c["name"], json.dumps(c["arguments"], ensure_ascii=False)))
        return found if self.parallel else found[:1]


def call(name: str, arguments: str) -> dict:
    """One entry of OpenAI's `tool_calls`.

    Args:
        name: the function's name.
        arguments: its arguments' JSON text.

    Returns:
        {"id", "type": "function", "function": {"name", "arguments"}}.
    """
    function = {"name": name, "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def request_tools(body: dict) -> Tools | None:
    """A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked.

    Args:
        body: the request body.

    Returns:
        The tools, or None: none given, or `tool_choice` "none".

    Raises:
        ToolError: a malformed tool, a duplicate name, or a choice of a tool not given.
    """
    given, choice = body.get("tools"), body.get("tool_choice")
    if given is None:
        if choice not in (None, "none"):
            raise ToolError("tool_choice", f"{json.dumps(choice)} needs tools: none were given")
        return None
    if not isinstance(given, list) or not 1 <= len(given) <= MAX_TOOLS:
        raise ToolError("tools", f"a list of 1 to {MAX_TOOLS} tools is expected")
    functions = []
    for i, t in enumerate(given):
        where = f"tools[{i}]"
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)):
            raise ToolError(where, 'a tool is {"type": "function", "function": {"name": ..., "parameters": {...}}}')
        f = t["function"]
        unknown = set(f) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ToolError(f"{where}.function", f"unknown field {sorted(unknown)[0]!r}")
        if not (isinstance(f.get("name"), str) and _NAME.fullmatch(f["name"])):
            raise ToolError(f"{where}.function.name", "1 to 64 letters, digits, _ or - are expected")
        if f["name"] in (g["name"] for g in functions):
            raise ToolError(f"{where}.function.name", f"{f['name']!r} is given twice")
        if not isinstance(f.get("description", ""), str):
            raise ToolError(f"{where}.function.description", "a string is expected")
        if not isinstance(f.get("parameters", {}), dict):
            raise ToolError(f"{where}.function.parameters", "a JSON schema (an object) is expected")
        functions.append({k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None})
    parallel = body.get("parallel_tool_calls")
    if parallel not in (None, True, False):
        raise ToolError("parallel_tool_calls", "true or false is expected")
    if choice == "none":
        return None
    if choice in (None, "auto", "required"):
        return Tools(tuple(functions), choice or "auto", parallel is not False)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolError("tool_choice", '"none", "auto", "required" or {"type": "function", "function": {"name": ...}} '
                        f"is expected, got {json.dumps(choice)[:80]}")  # fmt: skip
    if name not in (f["name"] for f in functions):
        raise ToolError("tool_choice", f"no tool is named {name!r}")
    return Tools(tuple(functions), name, parallel is not False)


def message_turn(m: dict, where: str) -> dict | None:
    """A tool message, or an assistant message with `tool_calls`, as the template's turn (text); None for
    any other message.

    Args:
        m: one message of the request.
        where: its place ("messages[3]"), for errors.

    Returns:
        {"role", "content"}, or None.

    Raises:
        ToolError: a malformed call or tool message.
    """
    if m.get("role") == "tool":
        if not isinstance(m.get("content"), str):
            raise ToolError(f"{where}.content", "a tool's result is a string")
        return {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    calls = m.get("tool_calls")
    if calls is None:
        return None
    if m.get("role") != "assistant" or not isinstance(calls, list):
        raise ToolError(f"{where}.tool_calls", "an assistant message's list of calls is expected")
    text = m.get("content") or ""
    if not isinstance(text, str):
        raise ToolError(f"{where}.content", "a string (or null) beside tool_calls is expected")
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("arguments"), str)):
            raise ToolError(f"{where}.tool_calls[{j}]", 'a call is {"type": "function", "function": {"name": ..., '
                            '"arguments": <JSON text>}}')  # fmt: skip
        try:
            arguments = json.loads(f["arguments"])
        except json.JSONDecodeError as e:
            raise ToolError(f"{where}.tool_calls[{j}].function.arguments", f"not JSON: {e}") from None
        if not isinstance(c.get("id"), str):
            raise ToolError(f"{where}.tool_calls[{j}].id", "a call's id (a string) is expected: its result names it")
        written = json.dumps({"name": f["name"], "arguments": arguments}, ensure_ascii=False)
        text += f"{chr(10) if text else ''}{OPEN}\n{written}\n{CLOSE}"
    return {"role": "assistant", "content": text}


def check_results(messages: list[dict]) -> None:
    """Each tool message answers, by its `tool_call_id`, a call of the assistant message before it not yet
    answered, and every call is answered before the conversation goes on, as OpenAI holds them.

    Args:
        messages: the request's messages, each checked alone already (`message_turn`).

    Raises:
        ToolError: a tool message with no call before it, or not naming one left to answer; a call left
            unanswered.
    """
    pending, asked = [], None  # the calls not yet answered; the message that made the last calls
    for i, m in enumerate(messages):
        if m.get("role") == "tool":
            if asked is None:
                raise ToolError(f"messages[{i}].role", "a tool message answers a call of the assistant message "
                                "before it, and none is")  # fmt: skip
            if m.get("tool_call_id") not in pending:
                raise ToolError(f"messages[{i}].tool_call_id", f"{m.get('tool_call_id')!r} is not the id of a call "
                                f"left to answer ({', '.join(pending) or 'none is'})")  # fmt: skip
            pending.remove(m["tool_call_id"])
            continue
        if pending:
            break
        pending = [c["id"] for c in m.get("tool_calls") or []]
        asked = i if pending else None
    if pending:
        raise ToolError(f"messages[{asked}].tool_calls", f"the calls {', '.join(pending)} are answered by no tool "
                        "message after it")  # fmt: skip


def with_tools(turns: list[dict], tools: Tools) -> list[dict]:
    """The conversation with the tools in its system turn (one added first where there is none).

    Args:
        turns: the template's turns.
        tools: the request's tools.

    Returns:
        The turns.
    """
    if turns[0]["role"] == "system":
        return [{"role": "system", "content": turns[0]["content"] + "\n\n" + tools.system_text()}, *turns[1:]]
    return [{"role": "system", "content": tools.system_text()}, *turns]


# The start of one of "required"'s calls as the JSON guide writes it, up to its arguments' first character.
_HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


class CallStream:
    """A streamed choice's deltas under tools: a named function's arguments as they come; "required"'s calls
    one by one, each call's head once its name is whole, then its arguments as they come; "auto"'s content up
    to the first <tool_call> (text that may be its start waits), and its calls at the end.

    Args:
        tools: the request's tools.
    """

    def __init__(self, tools: Tools):
        self.tools, self.text, self.shown = tools, "", 0
        self.head = call(tools.named, "") if tools.named else None
        # "required": the text read so far and its depth in brackets; inside a string, after a backslash; the
        # open call's `{`; its arguments' text not yet handed out from (None: not begun, or closed); calls begun.
        self.read = self.depth = self.opened = self.calls = 0
        self.quoted = self.escaped = False
        self.arguments = None

    def add(self, piece: str) -> dict:
        """The delta of a piece of the answer's text.

        Args:
            piece: the new text.

        Returns:
            OpenAI's chat delta ({} when nothing can be said yet).
        """
        self.text += piece
        if self.head is not None:  # the call's id, type and name, once
            first, self.head = self.head, None
            return {"tool_calls": [{"index": 0, **first, "function": {**first["function"], "arguments": piece}}]}
        if self.tools.named:
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} if piece else {}
        if self.tools.choice == "required":
            return self._required()
        at = self.text.find(OPEN, self.shown)
        safe = at if at >= 0 else len(self.text) - partial_end(self.text, OPEN)
        out, self.shown = self.text[self.shown : max(self.shown, safe)], max(self.shown, safe)
        return {"content": out} if out else {}

    def end(self, finish_reason: str) -> tuple[dict, str]:
        """The last delta and the finish reason, once the choice has ended.

        Args:
            finish_reason: the engine's.

        Returns:
            (delta, finish reason): the calls, or the text held back as content.
        """
        if self.tools.named:  # its arguments are all out
            return {}, finish_reason
        _, found, reason = self.tools.answer(self.text, finish_reason)
        if self.calls:  # "required"'s calls are out, as far as they came
            return {}, reason
        if found:
            return {"tool_calls": [{"index": i, **c} for i, c in enumerate(found)]}, reason
        rest = self.text[self.shown :]
        return ({"content": rest} if rest else {}), reason

    def _required(self) -> dict:
        """ "required"'s deltas for the text not yet read: the answer is `[{"name": ..., "arguments": ...}, ...]`,
        each call's name first, as the JSON guide writes it (its schema's order)."""
        out, t = [], self.text
        for k in range(self.read, len(t)):
            ch = t[k]
            if self.quoted:
                self.escaped, self.quoted = (False, True) if self.escaped else (ch == "\\", ch != '"')
                continue
            if ch == '"':
                self.quoted = True
            elif ch in "[{":
                self.depth += 1
                self.opened = k if self.depth == 2 else self.opened
            elif ch in "]}":
                if self.depth == 2 and self.arguments is not None:  # the call closes: the rest of its arguments
                    out.append({"index": self.calls - 1, "function": {"arguments": t[self.arguments : k]}})
                    self.arguments = None
                self.depth -= 1
            elif ch == " " and self.depth == 2 and self.arguments is None and (m := _HEAD.match(t, self.opened, k + 1)):
                first = call(json.loads(m.group(1)), "")
                out.append({"index": self.calls, **first})
                self.calls, self.arguments = self.calls + 1, k + 1
        self.read = len(t)
        if self.arguments is not None and self.arguments < len(t):  # the open call's arguments so far
            out.append({"index": self.calls - 1, "function": {"arguments": t[self.arguments :]}})
            self.arguments = len(t)
        out = [o for o in out if "id" in o or o["function"]["arguments"]]
        return {"tool_calls": out} if out else {}


def partial_end(text: str, tag: str) -> int:
    """How much of `text`'s end may be the start of `tag` (text a stream holds back until it knows).

    Args:
        text: the text so far.
        tag: the text looked for (a stop string, `<tool_call>`).

    Returns:
        The length of the longest end of `text` that begins `tag` (short of all of it), or 0.
    """
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)
