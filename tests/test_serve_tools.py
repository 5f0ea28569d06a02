"""Tool calling in chat completions (`jaxformer.serve.tools`): the tools, earlier calls and tool results as
the prompt writes them (against a text written out by hand), the calls read back from an answer, and the
real `openai` client against a server of a tiny chatml model: a named function's and "required"'s calls
are held to the tools' schemas (checked by jsonschema), "auto"'s calls are parsed out of the answer, whole
and streamed alike. The Responses API's calls, and its stored conversations (`previous_response_id`), whose
turns this model's long context holds.
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


# The tools in the Responses API's flat form.
FLAT = [{"type": "function", **t["function"]} for t in TOOLS]


def test_the_responses_api_calls_tools_as_the_chat_does(server):
    """OpenAI's Responses API through its own client: function tools in its flat form and a named or
    "required" `tool_choice` give the chat's calls (the same greedy answer) as function_call items; streamed,
    each call's item is added, its arguments come in pieces that make the whole's, and it is done; a
    conversation with an earlier call and its output (input items) is answered as the chat of the
    assistant's tool_calls and the tool's message is."""
    client = server.client()
    base = dict(model=MODEL, max_output_tokens=80, temperature=0)
    chat = dict(model=MODEL, max_tokens=80, temperature=0)
    weather = {"type": "function", "function": {"name": "get_weather"}}
    named = client.responses.create(input=ASK, tools=FLAT, tool_choice={"type": "function", "name": "get_weather"},
                                    **base)  # fmt: skip
    want = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice=weather, **chat)
    [item] = named.output
    assert (item.type, item.name, item.status, named.status) == ("function_call", "get_weather", *["completed"] * 2)
    assert item.arguments == want.choices[0].message.tool_calls[0].function.arguments
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    jsonschema.validate(json.loads(item.arguments), WEATHER)
    required = client.responses.create(input=ASK, tools=FLAT, tool_choice="required", parallel_tool_calls=False, **base)
    want = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                          **chat)  # fmt: skip
    made = want.choices[0].message.tool_calls
    assert [(i.type, i.name, i.arguments) for i in required.output] == [
        ("function_call", c.function.name, c.function.arguments) for c in made]  # fmt: skip
    events = list(client.responses.create(input=ASK, tools=FLAT, tool_choice="required", parallel_tool_calls=False,
                                          stream=True, **base))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"], kinds
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"} and len(kinds) > 8, kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = events[-1].response.output
    assert pieces == events[-3].arguments == done[0].arguments == required.output[0].arguments
    assert events[2].item.id == done[0].id and done[0].name == required.output[0].name
    # A second turn: the call made and its output, as input items, answer as the chat's messages do.
    call = required.output[0]
    items = [*ASK, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": '{"rain": true}'}]  # fmt: skip
    then = client.responses.create(model=MODEL, input=items, tools=FLAT, max_output_tokens=12, temperature=0)
    calls = [{"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": call.call_id, "content": '{"rain": true}'}]  # fmt: skip
    want = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=12, temperature=0)
    assert then.output_text == want.choices[0].message.content and then.output[0].type == "message"
    assert then.usage.input_tokens == want.usage.prompt_tokens
    # The same turn continuing the stored response that made the call: its output (the call) comes back.
    chained = client.responses.create(model=MODEL, previous_response_id=required.id, input=items[-1:], tools=FLAT,
                                      max_output_tokens=12, temperature=0)  # fmt: skip
    assert (chained.output_text, chained.usage.input_tokens) == (then.output_text, then.usage.input_tokens)


def test_a_response_continues_a_stored_one_as_the_whole_conversation_would(server):
    """OpenAI's `previous_response_id` through its own client: a turn that names the previous response is
    answered as the chat of the whole conversation (its earlier input and output, then the new input; only
    the new turn's `instructions`), a chain of three turns and a streamed turn alike; each answer is kept:
    `retrieve` gives it back (a stream's, its final response), `input_items` lists what it answered, newest
    first, by pages; a deleted one, or one sent with `store: false`, is a 404, continued or retrieved, while
    the turns after a deleted one still hold the whole conversation."""
    client = server.client()
    turn = dict(model=MODEL, max_output_tokens=6, temperature=0)
    chat = lambda messages: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                            temperature=0)  # fmt: skip
    first = client.responses.create(instructions="Be brief.", input="Hi", **turn)
    second = client.responses.create(previous_response_id=first.id, input="Go", **turn)
    said = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Go"}]  # fmt: skip
    want = chat(said)
    assert second.output_text == want.choices[0].message.content and second.previous_response_id == first.id
    assert second.usage.input_tokens == want.usage.prompt_tokens
    said += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "On"}]
    third = client.responses.create(previous_response_id=second.id, instructions="X", input="On", **turn)
    want = chat([{"role": "system", "content": "X"}, *said])
    assert third.output_text == want.choices[0].message.content
    assert third.usage.input_tokens == want.usage.prompt_tokens > second.usage.input_tokens
    events = list(client.responses.create(previous_response_id=first.id, input="Go", stream=True, **turn))
    streamed = events[-1].response
    assert streamed.output_text == second.output_text and streamed.previous_response_id == first.id
    assert client.responses.retrieve(streamed.id).to_dict() == streamed.to_dict()
    assert client.responses.retrieve(second.id).to_dict() == second.to_dict()
    listed = client.responses.input_items.list(third.id, order="asc")
    texts = [(i.role, i.content[0].text) for i in listed.data]
    assert texts == [(m["role"], m["content"]) for m in said]
    assert listed.data[1].id == first.output[0].id and not listed.has_more
    newest = client.responses.input_items.list(third.id, limit=2)
    assert [i.id for i in newest.data] == [i.id for i in listed.data[::-1][:2]] and newest.has_more
    paged = client.responses.input_items.list(third.id, limit=2)  # the client asks for each page `after` the last
    assert [i.id for i in paged] == [i.id for i in listed.data[::-1]]
    assert client.responses.delete(first.id) is None  # the client reads nothing back from a DELETE
    with pytest.raises(openai.NotFoundError, match="no response"):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="no previous response") as caught:
        client.responses.create(previous_response_id=first.id, input="Go", **turn)
    assert caught.value.body["param"] == "previous_response_id"
    again = client.responses.create(previous_response_id=second.id, instructions="X", input="On", **turn)
    assert again.output_text == third.output_text
    unkept = client.responses.create(input="Hi", store=False, **turn)
    assert unkept.to_dict()["store"] is False and second.to_dict()["store"] is True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_a_responses_stream_adds_the_message_then_each_call_in_turn():
    """`responses.Events` fed the chat deltas of an "auto" answer (text, then two calls whole, as
    `tools.CallStream` gives them at the end): the message's item and part added with its first text and
    done when the first call begins, each call added and done in turn, numbered in order; the final response
    lists the three items as streamed."""
    from jaxformer.serve.responses import Events

    out = Events("m", {"model": "m"})
    calls = [tools.call("get_time", '{"zone": "UTC"}'), tools.call("get_weather", '{"city": "Oslo", "days": 2}')]
    stream = (out.start() + out.chat_delta({"content": "Let me "}) + out.chat_delta({"content": "see."})
              + out.chat_delta({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
              + out.end("tool_calls", {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}))  # fmt: skip
    events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [(e["type"].removeprefix("response."), e.get("output_index")) for e in events] == [
        ("created", None), ("in_progress", None), ("output_item.added", 0), ("content_part.added", 0),
        ("output_text.delta", 0), ("output_text.delta", 0), ("output_text.done", 0), ("content_part.done", 0),
        ("output_item.done", 0), ("output_item.added", 1), ("function_call_arguments.delta", 1),
        ("function_call_arguments.done", 1), ("output_item.done", 1), ("output_item.added", 2),
        ("function_call_arguments.delta", 2), ("function_call_arguments.done", 2), ("output_item.done", 2),
        ("completed", None)]  # fmt: skip
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Let me see." and final["status"] == "completed"
    assert [(i["call_id"], i["name"], i["arguments"], i["status"]) for i in final["output"][1:]] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"], "completed") for c in calls]  # fmt: skip
    assert [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"] == [
        i["id"] for i in final["output"]]  # fmt: skip
