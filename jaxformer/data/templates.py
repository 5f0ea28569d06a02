"""Instruction data: a template turns a record into (prompt text, response text).

A record is `{prompt, response}` (their names from data.fields) or the chat form `{"messages":
[{"role": ..., "content": ...}, ...]}`. A chat record is one example: its response is the last
assistant turn and its prompt the whole conversation before it, earlier assistant turns included as
context (they carry no loss). The response ends with the template's `end`; the tokenizer's EOS
follows it in the prepared data, and generation stops at that EOS.

Errors are ValueErrors without a place: `sources.iter_records` names the file and line.
"""

from __future__ import annotations

import dataclasses

ROLES = ("system", "user", "assistant")


@dataclasses.dataclass(frozen=True)
class Template:
    """How each role's turn is written: `turns[role]` = (text before the content, text after it).
    A prompt ends with the assistant's opening; a response is the content + `end`.

    Attributes:
        name: the template's name (`data.template`).
        turns: role -> (text before the content, text after it).
        end: what ends a response (before the tokenizer's EOS).
    """

    name: str
    turns: dict[str, tuple[str, str]]
    end: str

    def prompt(self, text: str) -> str:
        """A single user prompt, ready for the response (what `generate` feeds the model).

        Args:
            text: the user's prompt.

        Returns:
            The prompt text, ending with the assistant's opening.
        """
        return self.conversation([{"role": "user", "content": text}])

    def conversation(self, turns: list[dict]) -> str:
        """Turns written out, then the assistant's opening: the prompt of the next response.

        Args:
            turns: [{"role": ..., "content": ...}, ...].

        Returns:
            The prompt text.
        """
        return (
            "".join(self.turns[t["role"]][0] + t["content"] + self.turns[t["role"]][1] for t in turns)
            + (self.turns["assistant"][0])
        )


TEMPLATES = {
    # Alpaca (Taori et al. 2023) without its preamble: plain text that any tokenizer reads.
    "alpaca": Template(
        "alpaca",
        {"system": ("", "\n\n"), "user": ("### Instruction:\n", "\n\n"), "assistant": ("### Response:\n", "\n\n")},
        end="",
    ),
    # ChatML (OpenAI; Qwen, many fine-tunes): turns fenced by <|im_start|>role ... <|im_end|>.
    "chatml": Template(
        "chatml",
        {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES},
        end="<|im_end|>",
    ),
}


def get(name: str) -> Template:
    """A template by name (`TEMPLATES`).

    Args:
        name: "alpaca" or "chatml".

    Returns:
        The template.

    Raises:
        ValueError: an unknown name.
    """
    if name not in TEMPLATES:
        raise ValueError(f"unknown template {name!r} (known: {', '.join(TEMPLATES)})")
    return TEMPLATES[name]


def to_pair(template: Template, row: dict, fields: tuple[str, str], messages: str = "messages") -> tuple[str, str]:
    """(prompt text, response text) of a record: `fields` (prompt, response) or its chat `messages`.

    Args:
        template: the template that writes the turns.
        row: one record.
        fields: the names of its prompt and response fields.
        messages: the name of its chat field.

    Returns:
        (prompt text, response text + the template's end).

    Raises:
        ValueError: a missing or non-string field, or a chat that does not end with an assistant turn.
    """
    prompt, response = fields
    if messages in row and not (prompt in row and response in row):
        return _chat_pair(template, row[messages], messages)
    for name in fields:
        if row.get(name) is None:
            raise ValueError(
                f"no field {name!r} (an instruction record has {prompt!r} and {response!r}, or {messages!r})"
            )
        if not isinstance(row[name], str):
            raise ValueError(f"field {name!r} is {type(row[name]).__name__}, not a string")
    return template.prompt(row[prompt]), row[response] + template.end


def _chat_pair(template: Template, turns, field: str) -> tuple[str, str]:
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{field}: a non-empty list of {{'role': ..., 'content': ...}} is expected")
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or not isinstance(t.get("role"), str) or not isinstance(t.get("content"), str):
            raise ValueError(f"{field}[{i}]: a turn is {{'role': str, 'content': str}}, got {str(t)[:60]}")
        if t["role"] not in template.turns:
            known = ", ".join(template.turns)
            raise ValueError(f"{field}[{i}]: role {t['role']!r} is not one template {template.name!r} knows ({known})")
    last = max((i for i, t in enumerate(turns) if t["role"] == "assistant"), default=None)
    if last is None:
        raise ValueError(f"{field}: no assistant turn (nothing to learn)")
    if last != len(turns) - 1:
        raise ValueError(f"{field}[{last + 1}]: a {turns[last + 1]['role']} turn after the last assistant turn")
    return template.conversation(turns[:last]), turns[last]["content"] + template.end
