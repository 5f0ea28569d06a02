"""Tool calling in chat completions (`jaxformer.serve.tools`): the tools, earlier calls and tool results as
the prompt writes them (against a text written out by hand), the calls read back from an answer, and the
real `openai` client against a server of a tiny chatml model: a named function's and "required"'s calls
are held to the tools' schemas (checked by jsonschema), "auto"'s calls are parsed out of the answer, whole
and streamed alike.
"""

import json
import re

import jax
import pytest

openai = pytest.importorskip("openai", reason='the test extra is not installed: pip install -e ".[test]"')
jsonschema = pytest.importorskip("jsonschema", reason='the test extra is not installed: pip install -e ".[test]"')
pytest.importorskip("llguidance", reason='the serve extra is not installed: pip install -e ".[serve]"')

from servers import Server  # noqa: E402

from jaxformer.config import Config, DataConfig, EngineConfig, ServeConfig, TrainConfig, tiny  # noqa: E402
from jaxformer.data import templates  # noqa: E402
from jaxformer.engine import Engine  # noqa: E402
from jaxformer.serve import tools  # noqa: E402

MODEL = "tiny-tools"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 16},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast.", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Rain in Oslo?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A step-0 byte-level decoder in the chatml template, its context long enough for the tools' text."""
    from jaxformer.checkpoint import start_workdir
    from jaxformer.state import state_factory

    cfg = Config(
        model=tiny("decoder_only", vocab_size=260, d_model=32, d_ff=64, num_decoder_layers=1, max_len=1536),
        data=DataConfig(source="files", files=("chat.jsonl",), tokenizer="byte", template="chatml", max_len=1536),
        train=TrainConfig(objective="lm"),
    )
    path = tmp_path_factory.mktemp("tools") / "run"
    start_workdir(path, cfg, jax.jit(state_factory(cfg)[1])())
    engine = Engine.from_workdir(path, EngineConfig(max_slots=4, page_size=16, prefill_chunk=256))
    s = Server(engine, ServeConfig(), MODEL)
    yield s
    s.stop()


def test_the_prompt_writes_the_tools_the_calls_and_their_results():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Rain in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"CET"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    ]  # fmt: skip
    from jaxformer.serve import protocol

    given = tools.request_tools({"tools": TOOLS})
    text = templates.get("chatml").conversation(tools.with_tools(protocol.chat_turns(messages), given))
    lines = "\n".join(json.dumps(t) for t in TOOLS)
    expected = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to answer. Their "
        f"signatures are within <tools></tools>, one a line:\n<tools>\n{lines}\n</tools>\n\nTo call one, write "
        'its name and arguments as a JSON object within <tool_call></tool_call>:\n<tool_call>\n{"name": '
        '<function name>, "arguments": <arguments object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nRain in Oslo?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text == expected


def test_calls_are_read_back_all_or_nothing():
    auto = tools.request_tools({"tools": TOOLS})
    text = 'Looking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n<tool_call>{"name"'
    assert auto.answer(text, "stop")[1] == []  # the second call is cut short: all of it is text
    text = text[: text.rindex("<tool_call>")] + '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    content, calls, reason = auto.answer(text, "stop")  # the last call unclosed (a stop string or EOS cut it)
    assert content == "Looking.\n" and reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo"})]  # fmt: skip
    assert len({c["id"] for c in calls}) == 2
    for bad in [
        '<tool_call>{"name": "get_date", "arguments": {}}</tool_call>',  # not a tool given
        '<tool_call>{"name": "get_time", "arguments": "UTC"}</tool_call>',
        "<tool_call>not json</tool_call>",
    ]:
        assert auto.answer(bad, "stop") == (bad, [], "stop")  # fmt: skip
    single = tools.request_tools({"tools": TOOLS, "parallel_tool_calls": False})
    assert len(single.answer(text, "stop")[1]) == 1


def _calls(message) -> list[tuple[str, dict]]:
    found = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    for name, arguments in found:
        jsonschema.validate(arguments, SCHEMAS[name])
    return found


def test_a_named_function_and_required_calls_follow_the_tools_schemas(server):
    client = server.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                           max_tokens=80, temperature=0)  # fmt: skip
    choice = whole.choices[0]
    assert choice.message.content is None and choice.finish_reason == "stop"
    assert [name for name, _ in _calls(choice.message)] == ["get_weather"]
    arguments, ids = "", set()  # streamed: the call's head, then its arguments in pieces
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                                max_tokens=80, temperature=0, stream=True):  # fmt: skip
        for call in chunk.choices[0].delta.tool_calls or []:
            assert call.index == 0
            ids |= {call.id} - {None}
            arguments += call.function.arguments or ""
    assert arguments == choice.message.tool_calls[0].function.arguments and len(ids) == 1

    required = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=3, max_tokens=400,
                    temperature=1.0, seed=3)  # fmt: skip
    out = client.chat.completions.create(**required)
    for choice in out.choices:  # a random model's array may run to max_tokens: then it is the answer's text
        if choice.finish_reason == "length":
            assert choice.message.tool_calls is None and choice.message.content.startswith('[{"name": "get_')
        else:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert _calls(choice.message)
    assert {c.finish_reason for c in out.choices} == {"length", "tool_calls"}
    # Streamed, each call's head comes once its name is whole (its id with it), then its arguments in pieces.
    streamed, finishes, pieces = {}, {}, 0
    for chunk in client.chat.completions.create(**required, stream=True):
        for c in chunk.choices:
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
            for d in c.delta.tool_calls or []:
                head = streamed.setdefault(c.index, {}).setdefault(d.index, {"name": None, "arguments": ""})
                if d.id is not None:
                    assert head["name"] is None and d.type == "function"  # once
                    head["name"] = d.function.name
                head["arguments"] += d.function.arguments or ""
                pieces += 1
    for choice in out.choices:
        assert finishes[choice.index] == choice.finish_reason
        if choice.finish_reason == "tool_calls":
            calls = streamed[choice.index].values()
            assert [(h["name"], json.loads(h["arguments"])) for h in calls] == _calls(choice.message)
    assert pieces > 3 * sum(map(len, streamed.values()))  # the arguments in pieces, not whole
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=400, temperature=0)  # fmt: skip
    assert len(_calls(out.choices[0].message)) == 1
    lookaround = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)x"}}}  # not regular
    body = {"model": MODEL, "messages": ASK, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": lookaround}}]}  # fmt: skip
    status, answer = server.post("/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == "tools", answer
    assert answer["error"]["message"].startswith("the tools' parameters cannot be followed"), answer


def test_auto_parses_the_calls_out_of_the_answer_whole_and_streamed(server):
    """A model fine-tuned on the Hermes form writes its calls itself; here a regular expression holds the
    tiny model's answer to text and then a call, so that the parsing of a real answer is what is checked."""
    client = server.client()
    form = r'Let me see\.\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'
    ask = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0, extra_body={"guided_regex": form})
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me see.\n"
    assert [name for name, _ in _calls(whole.message)] == ["get_time"]
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta
        assert not (delta.content and "<" in delta.content)  # the call's text is never content
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert content == whole.message.content and finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]  # fmt: skip
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=12, temperature=0)
    assert plain.choices[0].message.tool_calls is None and re.fullmatch(r"[^<]*", plain.choices[0].message.content)
