"""The fields of a request that hold its output to a form, read into the engine's `SamplingParams` fields
(`choices`, `regex`, `json_schema`, `grammar`): OpenAI's `response_format`; vLLM's `structured_outputs`
object, its form since vLLM 0.12 (`{"json": schema}`, `{"regex": ...}`, `{"choice": [...]}`,
`{"grammar": ...}` or `{"json_object": true}`); and the `guided_json`, `guided_regex`, `guided_choice` and
`guided_grammar` fields it replaced, still accepted. At most one a request.

What they hold is compiled by the engine (`jaxformer.engine.guided`), which names the SamplingParams field
where it cannot; the app answers with the request's own name for it (`FormError.field`, `guided_by`).
"""

from __future__ import annotations

import json

MAX_GUIDED_CHOICES = 1024  # the texts of one choice at most
# The request's fields that hold an output to a form (at most one a request), and the SamplingParams field
# each sets (structured_outputs: by its key, `STRUCTURED`).
GUIDED = {"response_format": "json_schema", "structured_outputs": None, "guided_choice": "choices",
          "guided_regex": "regex", "guided_json": "json_schema", "guided_grammar": "grammar"}  # fmt: skip
STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choices", "grammar": "grammar",
              "json_object": "json_schema"}  # fmt: skip
# structured_outputs' options that change nothing here at these values: there is no other backend to fall
# back to, and a JSON answer's layout never has free whitespace (`jaxformer.engine.guided.JSON_LAYOUT`).
_OPTIONS = {"disable_fallback": (False, True), "disable_any_whitespace": (False, True),
            "disable_additional_properties": (False,), "whitespace_pattern": (None,),
            "structural_tag": (None,)}  # fmt: skip


class FormError(ValueError):
    """A malformed form field (the protocol answers it as a 400).

    Args:
        field: the request's field at fault ("structured_outputs.choice[1]").
        message: what is wrong.
        code: OpenAI's error code.
    """

    def __init__(self, field: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.field, self.code = field, code


def guided_by(body: dict) -> str | None:
    """The request's field that holds the output to a form (`GUIDED`; for `structured_outputs`, its key:
    "structured_outputs.regex"; OpenAI's response_format of type "text" holds nothing), or None.

    Args:
        body: the request body.

    Returns:
        The field's name.

    Raises:
        FormError: two such fields, or a structured_outputs that is not one form.
    """
    given = [f for f in GUIDED if body.get(f) is not None and body[f] != {"type": "text"}]
    if len(given) > 1:
        raise FormError(given[1], f"{given[0]} and {given[1]} both hold the output to a form: give one")
    if given != ["structured_outputs"]:
        return given[0] if given else None
    spec = body["structured_outputs"]
    if not isinstance(spec, dict):
        raise FormError("structured_outputs", f"an object is expected, got {type(spec).__name__}", "invalid_type")
    for option, neutral in _OPTIONS.items():
        if option in spec and spec[option] not in neutral:
            raise FormError(f"structured_outputs.{option}", f"only {' or '.join(map(json.dumps, neutral))} is "
                            f"supported, got {spec[option]!r}", "unsupported")  # fmt: skip
    unknown = sorted(set(spec) - set(STRUCTURED) - set(_OPTIONS))
    if unknown:
        raise FormError(f"structured_outputs.{unknown[0]}", f"not a key of structured_outputs (one of "
                        f"{', '.join(STRUCTURED)}, and its options {', '.join(_OPTIONS)})")  # fmt: skip
    keys = [k for k in STRUCTURED if spec.get(k) not in (None, False)]
    if len(keys) != 1:
        raise FormError("structured_outputs", f"exactly one of {', '.join(STRUCTURED)} is expected, got "
                        f"{', '.join(keys) or 'none'}")  # fmt: skip
    return f"structured_outputs.{keys[0]}"


def form_fields(body: dict, tok, max_tokens: int) -> dict:
    """The SamplingParams field of the request's form (`guided_by`), as keyword arguments.

    Args:
        body: the request body.
        tok (Tokenizer | None): the model's tokenizer, which writes a choice's texts as token ids.
        max_tokens: the request's new tokens at most (a choice longer than them is refused).

    Returns:
        {} or {SamplingParams field: value}.

    Raises:
        FormError: a field of the wrong form.
    """
    field = guided_by(body)
    if field is None:
        return {}
    kind = field.removeprefix("structured_outputs.")
    v = body["structured_outputs"][kind] if kind != field else body[field]
    if kind in ("guided_choice", "choice"):
        return {"choices": _choices(field, v, tok, max_tokens)}
    if kind == "json_object":
        if v is not True:
            raise FormError(field, f"true is expected, got {v!r}", "invalid_type")
        return {"json_schema": {"type": "object"}}
    if kind == "response_format":
        form = v.get("type") if isinstance(v, dict) else None
        if form == "json_object":
            return {"json_schema": {"type": "object"}}
        spec = v.get("json_schema") if form == "json_schema" else None
        if not (isinstance(spec, dict) and isinstance(spec.get("schema"), dict)):
            raise FormError(field, 'one of {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                            f'"json_schema": {{"name": ..., "schema": {{...}}}}}} is expected, got {v!r}')  # fmt: skip
        return {"json_schema": spec["schema"]}
    if kind in ("guided_json", "json"):
        try:
            schema = json.loads(v) if isinstance(v, str) else v
        except json.JSONDecodeError as e:
            raise FormError(field, f"a JSON schema's text is not JSON: {e}") from None
        if not isinstance(schema, dict):
            what = type(schema).__name__
            raise FormError(field, f"a JSON schema (an object, or its JSON text) is expected, got {what}")
        return {"json_schema": schema}
    if not (isinstance(v, str) and v):
        raise FormError(field, f"a non-empty string is expected, got {v!r}")
    return {STRUCTURED.get(kind) or GUIDED[kind]: v}


def _choices(field: str, v, tok, max_tokens: int) -> tuple[tuple[int, ...], ...]:
    """A choice's texts, each as the tokenizer writes it alone."""
    if not isinstance(v, list) or not v or len(v) > MAX_GUIDED_CHOICES:
        raise FormError(field, f"a list of 1 to {MAX_GUIDED_CHOICES} texts is expected, got {type(v).__name__}"
                        f"{f' of {len(v)}' if isinstance(v, list) else ''}", "invalid_type")  # fmt: skip
    out = []
    for i, text in enumerate(v):
        if not isinstance(text, str) or not text:
            raise FormError(f"{field}[{i}]", f"a non-empty string is expected, got {text!r}")
        ids = tuple(tok.encode(text))
        if len(ids) > max_tokens:
            raise FormError(f"{field}[{i}]", f"{len(ids)} tokens: more than max_tokens={max_tokens}")
        out.append(ids)
    return tuple(out)
