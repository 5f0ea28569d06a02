"""`jaxformer serve`: the OpenAI-compatible server, driven by the real `openai` client (and the page at `/`
by a headless Chromium) against a server started here on a free port of 127.0.0.1, uvicorn in a thread.

The engine is `jaxformer.engine.Engine.from_workdir` (8 slots, pages of 8 positions); the answers are
checked against `decode.generate` on the same weights.
"""

import asyncio
import contextlib
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import processes
import pytest

openai = pytest.importorskip("openai", reason='the test extra is not installed: pip install -e ".[test]"')
uvicorn = pytest.importorskip("uvicorn", reason='the test extra is not installed: pip install -e ".[test]"')

from servers import Server  # noqa: E402

from jaxformer import decode  # noqa: E402
from jaxformer.config import Config, DataConfig, DecodeConfig, EngineConfig, ServeConfig, TrainConfig, tiny  # noqa: E402
from jaxformer.data import ByteTokenizer, templates  # noqa: E402
from jaxformer.engine import Engine  # noqa: E402

MODEL = "tiny-chat"
KEY = "sk-test-key"
MAX_LEN = 160


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A step-0 workdir of a tiny byte-level decoder trained (nominally) in the chatml template."""
    from jaxformer.checkpoint import start_workdir
    from jaxformer.state import state_factory

    cfg = Config(
        model=tiny("decoder_only", vocab_size=260, d_model=32, d_ff=64, num_decoder_layers=1, max_len=MAX_LEN),
        data=DataConfig(source="files", files=("chat.jsonl",), tokenizer="byte", template="chatml", max_len=MAX_LEN),
        train=TrainConfig(objective="lm"),
    )
    path = tmp_path_factory.mktemp("serve") / "run"
    start_workdir(path, cfg, jax.jit(state_factory(cfg)[1])())
    return path


@pytest.fixture(scope="module")
def engine(workdir):
    """The engine the server runs, from the workdir."""
    return Engine.from_workdir(workdir, EngineConfig(max_slots=8, page_size=8))


@pytest.fixture(scope="module")
def reference(workdir):
    """Greedy continuations by `decode.generate` on the workdir's weights (what the engine must match)."""
    from flax import nnx

    from jaxformer.checkpoint import restore_workdir
    from jaxformer.config import read_config

    cfg = read_config(workdir / "config.json")
    graphdef, state, _ = restore_workdir(cfg, workdir)
    model, tok = nnx.merge(graphdef, state.weights), ByteTokenizer()

    @functools.cache
    def continuation(ids: tuple[int, ...], room: int) -> list[int]:
        out = decode.generate(model, [list(ids)], DecodeConfig(max_new_tokens=room), eos_id=tok.eos_id)
        return decode.strip_after_eos(out.tokens[0, 0], tok.eos_id)

    def greedy(ids: list[int], max_tokens: int) -> list[int]:
        # Greedy's first n tokens do not depend on how many follow: one compilation per 32 tokens of room.
        return continuation(tuple(ids), -(-max_tokens // 32) * 32)[:max_tokens]

    return greedy


@contextlib.contextmanager
def paced(server, seconds: float = 0.02):
    """The engine's steps slowed to one per `seconds` (tokens then come apart in time, as from a large
    model), and the ids of the requests it is asked to abort. Only the engine thread calls step and
    abort; the wrappers are put in place and taken away between its calls."""
    engine, aborted = server.runner.engine, []
    step, abort = engine.step, engine.abort

    def slow_step():
        time.sleep(seconds)
        return step()

    def recorded_abort(request_id):
        aborted.append(request_id)
        return abort(request_id)

    engine.step, engine.abort = slow_step, recorded_abort
    try:
        yield aborted
    finally:
        del engine.step, engine.abort  # the class's methods again


@pytest.fixture(scope="module")
def server(engine):
    s = Server(engine, ServeConfig(api_key=KEY), MODEL)
    yield s
    s.stop()


def ids_of(text: str) -> list[int]:
    return ByteTokenizer().encode(text)


def text_of(ids) -> str:
    return ByteTokenizer().decode(ids)


def test_a_completion_is_the_greedy_continuation_of_generate(server, reference):
    out = server.client().completions.create(model=MODEL, prompt="KING HENRY:", max_tokens=12, temperature=0)
    expected = reference(ids_of("KING HENRY:"), 12)
    assert out.choices[0].text == text_of(expected)
    assert out.choices[0].finish_reason == ("length" if len(expected) == 12 else "stop")
    assert out.usage.prompt_tokens == len("KING HENRY:") and out.usage.completion_tokens == len(expected)
    assert out.model == MODEL and out.object == "text_completion"


def test_token_id_prompts_several_prompts_and_n(server, reference):
    prompts = [ids_of("to be"), ids_of("or not")]
    out = server.client().completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        assert c.text == text_of(reference(prompts[c.index // 2], 5))


def test_chat_writes_the_messages_in_the_workdirs_template(server, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    bookkeeping = {"user": "tester", "metadata": {"run": "1"}, "store": False}  # OpenAI's types: no effect here
    out = server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, **bookkeeping
    )
    prompt = templates.get("chatml").conversation(messages)
    expected = text_of(reference(ids_of(prompt), 8)).split("<|im_end|>")[0]
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == expected
    assert out.usage.prompt_tokens == len(ids_of(prompt))


def test_the_responses_api_answers_as_the_chat_it_is(server):
    """OpenAI's Responses API through its own client: `instructions` and `input` (a string, or messages with
    text parts, an earlier answer's output_text among them) answer as the chat of those messages does, the
    usage counted alike, "incomplete" at max_output_tokens; streamed, its typed events come in order,
    numbered, their deltas the whole answer's text; `text.format` holds the answer to a JSON schema."""
    import jsonschema

    client = server.client()
    chat = lambda messages, n: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n,
                                                               temperature=0)  # fmt: skip
    got = client.responses.create(model=MODEL, instructions="Be brief.", input="Hi", max_output_tokens=8,
                                  temperature=0)  # fmt: skip
    want = chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], 8)
    assert got.output_text == want.choices[0].message.content and got.output[0].role == "assistant"
    assert (got.usage.input_tokens, got.usage.output_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)
    assert got.status == ("incomplete" if want.choices[0].finish_reason == "length" else "completed")
    assert got.status != "incomplete" or got.incomplete_details.reason == "max_output_tokens"
    items = [{"role": "developer", "content": "A."}, {"role": "user", "content": [{"type": "input_text",
             "text": "Hi"}]}, {"type": "message", "role": "assistant", "content": [{"type": "output_text",
             "text": "Yo."}]}, {"role": "user", "content": "Go"}]  # fmt: skip
    got = client.responses.create(model=MODEL, input=items, max_output_tokens=8, temperature=0)
    messages = [{"role": "system", "content": "A."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Yo."}, {"role": "user", "content": "Go"}]  # fmt: skip
    assert got.output_text == chat(messages, 8).choices[0].message.content
    events = list(client.responses.create(model=MODEL, input=items, max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == got.output_text == events[-1].response.output_text and len(kinds) > 8
    schema = {"name": "answer", "schema": ANSWER, "type": "json_schema", "strict": True}
    got = client.responses.create(model=MODEL, input="Well?", max_output_tokens=60, temperature=0,
                                  text={"format": schema})  # fmt: skip
    jsonschema.validate(json.loads(got.output_text), ANSWER)


def test_the_responses_api_returns_the_chat_s_log_probabilities(server):
    """The Responses API's `include: ["message.output_text.logprobs"]` and `top_logprobs`: the message's
    text part lists each token's log-probability and its likeliest tokens, as the chat's `logprobs.content`
    lists them for the same messages; streamed, the deltas' lists make the whole's."""
    client = server.client()
    ask = dict(model=MODEL, input="Hi", max_output_tokens=8, temperature=0, top_logprobs=2)
    got = client.responses.create(**ask, include=["message.output_text.logprobs"])
    want = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    listed = [lp.to_dict() for lp in got.output[0].content[0].logprobs]
    assert listed == [lp.to_dict() for lp in want.choices[0].logprobs.content] and len(listed) >= 1
    assert all(len(lp["top_logprobs"]) == 2 for lp in listed)
    events = list(client.responses.create(**ask, stream=True))  # top_logprobs alone asks too
    streamed = [lp.to_dict() for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == listed == [lp.to_dict() for lp in events[-1].response.output[0].content[0].logprobs]
    assert "".join(lp["token"] for lp in listed) == got.output_text


def _polled(client, rid: str, until=("completed", "incomplete", "failed", "cancelled")):
    """The stored Response `rid` once its status is one of `until` (a hang guard: a busy machine is slow)."""
    deadline = time.monotonic() + processes.HANG_GUARD_S
    while (got := client.responses.retrieve(rid)).status not in until:
        assert time.monotonic() < deadline, got.status
        time.sleep(0.05)
    return got


def test_a_background_response_is_queued_then_stored_when_it_ends_and_can_be_cancelled(server):
    """OpenAI's `background: true` through its own client: the Response comes back at once, queued, is in
    progress while it runs, and polling finds it ended with the answer a plain request gets; one cancelled
    while it runs (the engine slowed) is kept "cancelled" with its text so far and its engine requests
    freed, and a second cancel answers it as it is; one deleted while it runs is gone and freed too; a
    plain response cannot be cancelled, and background refuses store: false by name."""
    client = server.client()
    ask = dict(model=MODEL, input="Hi", max_output_tokens=8, temperature=0)
    plain = client.responses.create(**ask)
    queued = client.responses.create(**ask, background=True)
    assert queued.status in ("queued", "in_progress", "completed", "incomplete") and queued.background
    ended = _polled(client, queued.id)
    assert (ended.output_text, ended.status, ended.usage.output_tokens) == (plain.output_text, plain.status,
                                                                            plain.usage.output_tokens)  # fmt: skip
    assert ended.created_at == queued.created_at and ended.id == queued.id
    with paced(server, 0.5):  # each step half a second: the requests still run when the cancel comes
        running = client.responses.create(model=MODEL, input="Hi", max_output_tokens=100, temperature=0,
                                          background=True)  # fmt: skip
        assert client.responses.retrieve(running.id).status == "in_progress"
        cancelled = client.responses.cancel(running.id)
        assert cancelled.status == "cancelled" and client.responses.retrieve(running.id).status == "cancelled"
        assert client.responses.cancel(running.id).status == "cancelled"
        gone = client.responses.create(model=MODEL, input="Hi", max_output_tokens=100, background=True)
        client.responses.delete(gone.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone.id)
        server.idle()  # both cancelled requests' pages freed
    said = cancelled.output[0].content[0].text if cancelled.output else ""
    shared = min(len(said), len(plain.output_text))  # greedy: the one answer's start is the other's
    assert said[:shared] == plain.output_text[:shared]
    with pytest.raises(openai.BadRequestError, match="only a background response that runs"):
        client.responses.cancel(plain.id)
    with pytest.raises(openai.BadRequestError, match="needs the response stored") as caught:
        client.responses.create(**ask, background=True, store=False)
    assert caught.value.body["param"] == "background"


def test_a_background_stream_is_kept_and_read_again_after_any_event(server):
    """OpenAI's `background: true, stream: true` through its own client: the events a plain stream gets (the
    first response "queued"), numbered without a gap, its Response stored as it ended; read again from the
    store after event N (`retrieve(stream=True, starting_after=N)`), the same events after N. A client that
    stops reading while it runs (the engine slowed) stops nothing: a second reads on from the last event the
    first had, and the two make the whole stream, its text the plain request's. A response not made so has
    no stream to read again, and a malformed query is a 400 naming its parameter."""
    client = server.client()
    ask = dict(model=MODEL, input="Hi", max_output_tokens=8, temperature=0)
    plain = list(client.responses.create(**ask, stream=True))
    events = list(client.responses.create(**ask, stream=True, background=True))
    assert [e.type for e in events] == [e.type for e in plain]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "queued" and events[1].response.status == "in_progress"
    final = events[-1].response
    assert final.background and final.output_text == plain[-1].response.output_text and final.output_text
    assert client.responses.retrieve(final.id).to_dict() == final.to_dict()
    again = client.responses.retrieve(final.id, stream=True, starting_after=3)
    assert [e.to_dict() for e in again] == [e.to_dict() for e in events[4:]]
    assert [e.to_dict() for e in client.responses.retrieve(final.id, stream=True)] == [e.to_dict() for e in events]

    long = dict(model=MODEL, input="Once upon a time", max_output_tokens=64, temperature=0)
    want = client.responses.create(**long)
    assert want.usage.output_tokens == 64  # several calls of the engine's decoding steps
    with paced(server, 0.25):  # the answer still runs when the first reader stops
        stream = client.responses.create(**long, stream=True, background=True)
        read = iter(stream)
        first = [next(read) for _ in range(5)]  # created, in_progress, the message begun, a delta or two
        stream.close()
        rid = first[0].response.id
        assert client.responses.retrieve(rid).status == "in_progress"
        rest = list(client.responses.retrieve(rid, stream=True, starting_after=first[-1].sequence_number))
    whole = first + rest
    assert [e.sequence_number for e in whole] == list(range(len(whole)))
    assert whole[-1].response.output_text == want.output_text == client.responses.retrieve(rid).output_text
    said = "".join(e.delta for e in whole if e.type == "response.output_text.delta")
    assert said == want.output_text and whole[-1].response.usage.to_dict() == want.usage.to_dict()
    server.idle()

    bad = [(dict(stream=True), "stream"), (dict(stream=True, starting_after=-2), "starting_after"),
           (dict(starting_after=2), "starting_after"), (dict(extra_query={"page": 1}), "page")]  # fmt: skip
    for query, param in bad:
        target = want.id if param == "stream" else final.id
        with pytest.raises(openai.BadRequestError) as caught:
            list(client.responses.retrieve(target, **query))
        assert caught.value.body["param"] == param, caught.value.body


def test_the_store_keeps_the_most_recent_and_pages_their_input_items():
    """`stored.Store`: the oldest response forgotten beyond the capacity; `listing`'s pages by `after` and
    `limit`, both orders, and its malformed parameters refused by name; a store of capacity 0 keeps nothing
    and refuses to continue any response, saying how."""
    from jaxformer.serve import stored
    from jaxformer.serve.protocol import APIError

    store = stored.Store(2)
    items = stored.input_items([{"role": "user", "content": "a"}, {"type": "function_call_output", "call_id": "c",
                                "output": "1"}, {"id": "msg_mine", "role": "user", "content": "b"}])  # fmt: skip
    assert [i["id"][:4] for i in items] == ["msg_", "fco_", "msg_"] and items[2]["id"] == "msg_mine"
    [said] = stored.input_items("hi")
    assert said == {"id": said["id"], "type": "message", "role": "user", "content": [{"type": "input_text",
                    "text": "hi"}]} and said["id"].startswith("msg_")  # fmt: skip
    for rid in ("resp_1", "resp_2", "resp_3"):
        store.put({"id": rid, "output": [{"id": f"out_{rid}"}]}, items)
    assert len(store) == 2
    with pytest.raises(APIError, match="no response") as caught:
        store.get("resp_1")
    assert caught.value.status == 404
    assert [i["id"] for i in store.conversation("resp_3")] == [i["id"] for i in items] + ["out_resp_3"]
    ids = [i["id"] for i in items]
    page = store.listing("resp_2", {"order": "asc", "limit": "2"})
    assert ([i["id"] for i in page["data"]], page["has_more"], page["first_id"]) == (ids[:2], True, ids[0])
    assert [i["id"] for i in store.listing("resp_2", {"order": "asc", "after": ids[1]})["data"]] == ids[2:]
    assert [i["id"] for i in store.listing("resp_2", {})["data"]] == ids[::-1]
    for query, field in [({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                         ({"after": "msg_none"}, "after"), ({"colour": "red"}, "colour")]:  # fmt: skip
        with pytest.raises(APIError) as caught:
            store.listing("resp_2", query)
        assert (caught.value.status, caught.value.param) == (400, field)
    assert store.delete("resp_2") == {"id": "resp_2", "object": "response", "deleted": True} and len(store) == 1
    streams = stored.Store(stored.STREAMS_KEPT + 10)  # background streams' events: the last STREAMS_KEPT kept
    rids = [f"resp_{n}" for n in range(stored.STREAMS_KEPT + 2)]
    for rid in rids:
        streams.put({"id": rid, "output": []}, items, events=f"events of {rid}")
        streams.put({"id": rid, "output": [], "status": "completed"}, items)  # as it ends: its events kept
    assert [streams.get(rid).events for rid in rids[:3]] == [None, None, "events of resp_2"]
    assert streams.get(rids[-1]).events == f"events of {rids[-1]}" and streams.get(rids[0]).response["output"] == []
    with pytest.raises(APIError, match="among the last") as caught:
        stored.stream_query(streams.get(rids[0]), {"stream": "true"})
    assert caught.value.param == "stream" and stored.stream_query(streams.get(rids[-1]), {"stream": "true"}) == -1
    none = stored.Store(0)
    none.put({"id": "resp_1", "output": []}, items)
    with pytest.raises(APIError, match="--responses-store 0") as caught:
        none.conversation("resp_1")
    assert (caught.value.status, caught.value.param) == (400, "previous_response_id")


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(server, reference):
    """vLLM's `truncate_prompt_tokens`: a prompt longer than the context, cut to its last k tokens, is
    answered as those k tokens alone (`generate`'s greedy continuation) and counted as k, a completion's
    and a chat's (the cut from the conversation's start)."""
    client, long = server.client(), "KING HENRY: " * 20  # 240 tokens, the context 160
    out = client.completions.create(model=MODEL, prompt=long, max_tokens=6, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 10})  # fmt: skip
    assert out.choices[0].text == text_of(reference(ids_of(long)[-10:], 6)) and out.usage.prompt_tokens == 10
    messages = [{"role": "user", "content": long}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                         extra_body={"truncate_prompt_tokens": 30})  # fmt: skip
    kept = ids_of(templates.get("chatml").conversation(messages))[-30:]
    assert out.choices[0].message.content == text_of(reference(kept, 6)).split("<|im_end|>")[0]
    assert out.usage.prompt_tokens == 30


def test_chat_continues_a_prefilled_answer_or_leaves_the_opening_to_the_model(server, reference):
    """vLLM's `continue_final_message`: the last message, an assistant's, is left open and the answer
    continues it (the prompt: the turns before it, the assistant's opening, its text; the answer returned
    is the new text alone); `add_generation_prompt` false leaves out the assistant's opening. Each is
    `generate`'s greedy continuation of that text, up to the template's end, as /tokenize counts it."""
    client, chatml = server.client(), templates.get("chatml")
    asked = [{"role": "user", "content": "Hi"}]
    prefilled = [*asked, {"role": "assistant", "content": "Well, "}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    out = client.chat.completions.create(model=MODEL, messages=prefilled, max_tokens=8, temperature=0, extra_body=body)
    prompt = chatml.conversation(asked) + "Well, "
    assert out.choices[0].message.content == text_of(reference(ids_of(prompt), 8)).split("<|im_end|>")[0]
    assert out.usage.prompt_tokens == len(ids_of(prompt))
    assert server.post("/tokenize", {"messages": prefilled, **body})[1]["tokens"] == ids_of(prompt)
    out = client.chat.completions.create(model=MODEL, messages=asked, max_tokens=8, temperature=0,
                                         extra_body={"add_generation_prompt": False})  # fmt: skip
    prompt = chatml.conversation(asked).removesuffix("<|im_start|>assistant\n")
    assert out.choices[0].message.content == text_of(reference(ids_of(prompt), 8)).split("<|im_end|>")[0]
    assert out.usage.prompt_tokens == len(ids_of(prompt))


def test_streamed_answers_are_the_whole_answers_in_pieces(server):
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=10, temperature=0)
    pieces, finish, usage = [], None, None
    for chunk in client.completions.create(
        model=MODEL, prompt="ROMEO:", max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
    ):
        usage = chunk.usage or usage
        for c in chunk.choices:
            pieces.append(c.text)
            finish = c.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].text and finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    # vLLM's continuous_usage_stats: every chunk counts its choice's tokens so far, up to the whole answer's.
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=10, temperature=0, stream=True,
                                            stream_options=options))  # fmt: skip
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == counts[-2] == whole.usage.completion_tokens
    assert all(c.usage.prompt_tokens == whole.usage.prompt_tokens for c in chunks)
    chat = [{"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=10, temperature=0)
    deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=10, temperature=0, stream=True) if c.choices]  # fmt: skip
    assert "".join(deltas) == whole.choices[0].message.content


def test_a_stop_string_ends_the_text_before_it(server, reference):
    """A stop string ends the answer before it, whole or streamed; after it with vLLM's
    include_stop_str_in_output, which never shows a chat template's end."""
    full = text_of(reference(ids_of("KING:"), 12))
    stop = next((full[i : i + 2] for i in range(2, len(full) - 2) if full[i : i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"the continuation {full!r} has no two printable characters to stop at")
    client = server.client()
    out = client.completions.create(model=MODEL, prompt="KING:", max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].text == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="KING:", max_tokens=12, temperature=0, stop=stop, stream=True) if c.choices)  # fmt: skip
    assert streamed == out.choices[0].text
    shown = {"include_stop_str_in_output": True}  # vLLM's: the text ends after the stop string
    kept = client.completions.create(model=MODEL, prompt="KING:", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body=shown)  # fmt: skip
    assert kept.choices[0].text == out.choices[0].text + stop and kept.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="KING:", max_tokens=12, temperature=0, stop=stop, stream=True, extra_body=shown)
        if c.choices)  # fmt: skip
    assert streamed == kept.choices[0].text
    chat = dict(model=MODEL, messages=HI, max_tokens=40, temperature=0)  # a chat template's end is never shown
    answer = client.chat.completions.create(**chat).choices[0].message.content
    assert client.chat.completions.create(**chat, extra_body=shown).choices[0].message.content == answer


def test_ignore_eos_and_min_tokens_answer_max_tokens_where_the_model_draws_eos(server, reference):
    """vLLM's `ignore_eos` and `min_tokens` (extensions, as `top_k`): draws that end at EOS without them
    (the seed's) are each `max_tokens` long with them, EOS kept or held back; the greedy answer past EOS
    is `generate`'s continuation up to where it ends, and the text leaves EOS out. `min_p` = 1 keeps the
    likeliest token alone: a draw gives greedy's text."""
    client = server.client()
    plain = client.completions.create(model=MODEL, prompt=["KING:", "a"], max_tokens=24, n=2, temperature=1.0, seed=5)
    assert plain.usage.completion_tokens < 4 * 24  # some end at EOS
    out = client.completions.create(model=MODEL, prompt=["KING:", "a"], max_tokens=24, n=2, temperature=1.0,
                                    seed=5, extra_body={"ignore_eos": True})  # fmt: skip
    assert out.usage.completion_tokens == 4 * 24 and {c.finish_reason for c in out.choices} == {"length"}
    greedy = client.completions.create(model=MODEL, prompt="KING:", max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert greedy.choices[0].text.startswith(text_of(reference(ids_of("KING:"), 24)))
    held = client.completions.create(model=MODEL, prompt=["KING:", "a"], max_tokens=24, temperature=1.0,
                                     n=2, seed=5, extra_body={"min_tokens": 24})  # fmt: skip
    assert held.usage.completion_tokens == 4 * 24  # no EOS before 24 tokens: each runs to max_tokens
    greedy = client.completions.create(model=MODEL, prompt=["KING:", "a"], max_tokens=12, temperature=0)
    kept_one = client.completions.create(model=MODEL, prompt=["KING:", "a"], max_tokens=12, temperature=1.0, seed=5,
                                         extra_body={"min_p": 1.0})  # fmt: skip
    assert [c.text for c in kept_one.choices] == [c.text for c in greedy.choices]  # the likeliest token alone


def test_penalties_and_logit_bias_change_the_served_logits(server, engine, reference):
    """OpenAI's `logit_bias` and penalties reach the engine: banning greedy's next token (bias -100) gives the
    model's second likeliest there; a frequency penalty, presence penalty or (vLLM's) repetition penalty
    changes greedy's answer, which repeats tokens (the engine's tests hold each to a reference); with vLLM's
    `allowed_token_ids`, greedy answers with those tokens alone, first the likeliest of them."""
    client, ids = server.client(), ids_of("KING HENRY:")
    greedy = reference(ids, 16)
    banned = client.completions.create(model=MODEL, prompt="KING HENRY:", max_tokens=1, temperature=0,
                                       logit_bias={str(greedy[0]): -100})  # fmt: skip
    assert banned.choices[0].text == _likeliest(engine, ids, 2)[-1][1][0] != text_of(greedy[:1])
    assert max(greedy.count(t) for t in set(greedy)) > 2, "greedy repeats a token"
    for field, value in (("frequency_penalty", 2.0), ("presence_penalty", 2.0), ("repetition_penalty", 3.0)):
        out = client.completions.create(model=MODEL, prompt="KING HENRY:", max_tokens=16, temperature=0,
                                        extra_body={field: value})  # fmt: skip
        assert out.choices[0].text != text_of(greedy), field
    allowed = ids_of("KING")  # vLLM's allowed_token_ids: greedy's likeliest among them at each step
    out = client.completions.create(model=MODEL, prompt="KING HENRY:", max_tokens=8, temperature=0,
                                    extra_body={"allowed_token_ids": allowed})  # fmt: skip
    assert set(out.choices[0].text) <= set("KING") and out.choices[0].text != text_of(greedy[:8])
    first = next(t for t, _ in _likeliest(engine, ids, 300)[-1] if t in "KING")
    assert out.choices[0].text[0] == first


def test_bad_words_are_never_written(server, engine, reference):
    """vLLM's `bad_words`: greedy answers as a reference that, at each step of a forward pass over the whole
    sequence, bans a word's last token where the answer ends with the ones before it (a word of two bytes,
    from greedy's own answer; a word of one, banned everywhere); the words are nowhere in the answers."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    client, prompt = server.client(), ids_of("KING HENRY:")
    forward, model = nnx.jit(lambda m, x: m(x)), engine.model  # one shape: right-padded, causal
    greedy = text_of(reference(prompt, 16))
    word = next(
        w for i in range(1, len(greedy) - 1) if (w := greedy[i : i + 2]).isascii() and w.isprintable() and " " not in w
    )
    for words in ([word], [word[0]]):
        out = client.completions.create(model=MODEL, prompt="KING HENRY:", max_tokens=16, temperature=0,
                                        extra_body={"bad_words": words}).choices[0].text  # fmt: skip
        banned, ids = [ids_of(w) for w in words], []
        for _ in range(16):
            row = prompt + ids
            logits = np.array(forward(model, jnp.asarray([row + [0] * (MAX_LEN - len(row))]))[0, len(row) - 1])
            for w in banned:
                if ids[len(ids) - len(w) + 1 :] == w[:-1] or len(w) == 1:
                    logits[w[-1]] = -np.inf
            if (token := int(np.argmax(logits))) == ByteTokenizer().eos_id:
                break
            ids.append(token)
        assert out == text_of(ids) and all(w not in out for w in words), (words, out, greedy)  # greedy has both


def test_metrics_count_each_request_s_tokens_latencies_and_end_as_prometheus_reads_them(server, reference):
    """`/metrics` (open, as /health is), parsed by prometheus_client's parser: between two scrapes the prompt
    and generation token counters grow by the answers' usage, each choice ends once by its finish reason (a
    stream the client leaves: "abort"), each choice's latencies are observed once, and the engine's gauges
    read it idle afterwards."""
    before = server.metrics()
    client, m = server.client(), f"model_name={MODEL}"
    whole = client.completions.create(model=MODEL, prompt=["KING:", "ab"], max_tokens=6, temperature=0, n=2,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    stop = text_of(reference(ids_of("KING:"), 40))[3:5]  # within greedy's answer: it ends there
    stopped = client.completions.create(model=MODEL, prompt="KING:", max_tokens=40, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop"
    with paced(server, 0.05):  # a stream the client leaves after its first token (80 steps would take 4 s)
        stream = client.completions.create(model=MODEL, prompt="abc", max_tokens=80, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        next(iter(stream))
        stream.close()
        server.idle()
    after = server.metrics()
    grew = lambda name: after.get(name, 0.0) - before.get(name, 0.0)
    usage = [whole.usage, stopped.usage]  # a prompt's tokens once in usage, once a choice in the counter
    assert grew(f"jaxformer:prompt_tokens_total{{{m}}}") == 2 * len(ids_of("KING:ab")) + len(ids_of("KING:abc"))
    assert grew(f"jaxformer:generation_tokens_total{{{m}}}") >= sum(u.completion_tokens for u in usage) + 1
    assert grew(f"jaxformer:request_success_total{{finished_reason=length,{m}}}") == 4
    assert grew(f"jaxformer:request_success_total{{finished_reason=stop,{m}}}") == 1
    assert grew(f"jaxformer:request_success_total{{finished_reason=abort,{m}}}") == 1
    assert grew(f"jaxformer:e2e_request_latency_seconds_count{{{m}}}") == 6
    assert grew(f"jaxformer:time_to_first_token_seconds_count{{{m}}}") == 6
    assert grew(f"jaxformer:e2e_request_latency_seconds_sum{{{m}}}") > 0
    assert after[f"jaxformer:num_requests_running{{{m}}}"] == after[f"jaxformer:num_requests_waiting{{{m}}}"] == 0
    assert 0 <= after[f"jaxformer:kv_cache_usage_perc{{{m}}}"] < 1


def test_stop_token_ids_end_the_answer_before_the_id(server, reference):
    want = reference(ids_of("KING HENRY:"), 12)
    out = server.client().completions.create(model=MODEL, prompt="KING HENRY:", max_tokens=12, temperature=0,
                                             extra_body={"stop_token_ids": [want[4]]})  # fmt: skip
    assert out.choices[0].text == text_of(want[: want.index(want[4])]) and out.choices[0].finish_reason == "stop"


def test_guided_choice_answers_with_one_of_the_texts(server, engine):
    """vLLM's `guided_choice`: greedy answers the text whose first byte the model likes best at the prompt's
    end (the byte tokenizer writes each text one id a byte; their first bytes differ), sampled chat choices
    each answer one of the texts whole."""
    client, texts = server.client(), ["yes", "no", "maybe"]
    out = client.completions.create(model=MODEL, prompt="KING HENRY:", max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": texts})  # fmt: skip
    ranking = [text for text, _ in _likeliest(engine, ids_of("KING HENRY:"), 260)[-1]]
    first = next(t for t in ranking if t in ("y", "n", "m"))
    assert out.choices[0].text == {"y": "yes", "n": "no", "m": "maybe"}[first]
    assert out.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Well?"}], n=4,
                                          temperature=1.0, seed=3, extra_body={"guided_choice": texts})  # fmt: skip
    assert all(c.message.content in texts for c in chat.choices), [c.message.content for c in chat.choices]


ANSWER = {  # a schema whose every output is short: an enum and a bounded string, nothing else
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "why": {"type": "string", "maxLength": 5}},
    "required": ["answer", "why"],
    "additionalProperties": False,
}


def test_structured_outputs_follow_the_schema_regex_and_grammar(server):
    """OpenAI's `response_format` (a JSON schema; any JSON object) and vLLM's `guided_json`, `guided_regex` and
    `guided_grammar`: each answer, whole or streamed (the pieces the same answer), is JSON its schema
    accepts (by jsonschema), matches its expression, or is a sentence of its grammar."""
    import jsonschema

    client, messages = server.client(), [{"role": "user", "content": "Well?"}]
    form = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, n=2, temperature=1.0,
                                          seed=5, response_format=form)  # fmt: skip
    for choice in chat.choices:
        jsonschema.validate(json.loads(choice.message.content), ANSWER)
        assert choice.finish_reason == "stop"
    pieces = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                            response_format=form, stream=True)  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                           response_format=form).choices[0].message.content  # fmt: skip
    assert streamed == whole and jsonschema.validate(json.loads(whole), ANSWER) is None
    out = client.completions.create(model=MODEL, prompt="KING HENRY:", max_tokens=40, temperature=0,
                                    extra_body={"guided_json": json.dumps(ANSWER)})  # fmt: skip
    jsonschema.validate(json.loads(out.choices[0].text), ANSWER)
    anything = client.completions.create(model=MODEL, prompt="{", max_tokens=60, temperature=1.0, seed=1,
                                         extra_body={"response_format": {"type": "json_object"}})  # fmt: skip
    if anything.choices[0].finish_reason == "stop":  # an open-ended object may run to max_tokens
        assert isinstance(json.loads(anything.choices[0].text), dict)
    else:
        assert anything.choices[0].text.startswith("{")
    out = client.completions.create(model=MODEL, prompt="Date: ", max_tokens=12, temperature=1.0, seed=2,
                                    extra_body={"guided_regex": "20[0-9]{2}-(0[1-9]|1[0-2])"})  # fmt: skip
    assert re.fullmatch("20[0-9]{2}-(0[1-9]|1[0-2])", out.choices[0].text), out.choices[0].text
    out = client.completions.create(model=MODEL, prompt="Nest: ", max_tokens=24, temperature=0,
                                    extra_body={"guided_grammar": 'start: "(" start ")" | "x"'})  # fmt: skip
    text, n = out.choices[0].text, out.choices[0].text.count("(")
    if out.choices[0].finish_reason == "stop":  # a sentence, or (max_tokens reached) the start of one
        assert text == "(" * n + "x" + ")" * n, text
    else:
        assert re.fullmatch(r"\(*(x\)*)?", text) and text.count(")") <= n, text


@pytest.mark.parametrize(
    ("prompt", "old", "new"),
    [
        ("Date: ", {"guided_regex": "20[0-9]{2}-(0[1-9]|1[0-2])"}, {"regex": "20[0-9]{2}-(0[1-9]|1[0-2])"}),
        ("KING HENRY:", {"guided_json": ANSWER}, {"json": json.dumps(ANSWER), "disable_any_whitespace": True}),
        ("KING HENRY:", {"guided_choice": ["yes", "no", "maybe"]}, {"choice": ["yes", "no", "maybe"]}),
        ("Nest: ", {"guided_grammar": 'start: "(" start ")" | "x"'}, {"grammar": 'start: "(" start ")" | "x"'}),
        ("{", {"response_format": {"type": "json_object"}}, {"json_object": True, "disable_fallback": True}),
    ],
)
def test_vllm_s_structured_outputs_answer_as_the_fields_it_replaced(server, prompt, old, new):
    """vLLM's `structured_outputs` object (its form since vLLM 0.12; the `guided_*` fields before it, and
    OpenAI's response_format): each form, with its neutral options, gives the same answers as the field it
    replaced, greedy and sampled with one seed."""
    client = server.client()
    ask = dict(model=MODEL, prompt=prompt, max_tokens=24, n=2, temperature=1.0, seed=4)
    want = client.completions.create(**ask, extra_body=old)
    got = client.completions.create(**ask, extra_body={"structured_outputs": new})
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    greedy = dict(ask, n=1, temperature=0)
    got = client.completions.create(**greedy, extra_body={"structured_outputs": new}).choices[0].text
    assert got == client.completions.create(**greedy, extra_body=old).choices[0].text
    if "regex" in new:
        assert re.fullmatch(new["regex"], got), got


def test_logprobs_are_log_probabilities_of_the_chosen_tokens(server):
    out = server.client().completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=0)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == out.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs) and "".join(lp.tokens) == out.choices[0].text


def _likeliest(engine, ids: list[int], n: int) -> list[list[tuple[str, float]]]:
    """At each position of `ids`, the n likeliest next tokens' texts and log-probabilities by one forward
    pass of the served model, likeliest first (ties to the lower id)."""
    import jax.numpy as jnp
    import numpy as np

    logp = np.asarray(jax.nn.log_softmax(engine.model(jnp.asarray([ids]))[0].astype(jnp.float32)))
    order = np.argsort(-logp, axis=-1, kind="stable")[:, :n]
    return [[(text_of([int(i)]), float(row[i])) for i in top] for row, top in zip(logp, order, strict=True)]


def _assert_texts(got: dict, top: list[tuple[str, float]]) -> None:
    """A text completion's likeliest tokens at one position: `top`'s texts in order, each once, at its first
    (likeliest) log-probability."""
    import numpy as np

    once = {}
    for text, x in top:
        once.setdefault(text, x)
    assert list(got) == list(once)
    np.testing.assert_allclose(list(got.values()), list(once.values()), rtol=1e-5, atol=1e-5)


def test_top_logprobs_list_the_served_model_s_likeliest_tokens(server, engine, reference):
    """Chat's `top_logprobs` (whole and streamed) and a completion's `logprobs` = N list at each new token the
    N likeliest tokens under one forward pass of the served model over the prompt and the tokens before it,
    likeliest first, the chosen (greedy) one first; a completion's as {text: log-probability}, two ids of one
    text as the likelier's."""
    import numpy as np

    client = server.client()
    messages = [{"role": "user", "content": "Hi"}]
    ids = ids_of(templates.get("chatml").conversation(messages))
    want = _likeliest(engine, ids + reference(ids, 6), 3)[len(ids) - 1 :]
    ask = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    whole = client.chat.completions.create(**ask).choices[0].logprobs.content
    streamed = [e for c in client.chat.completions.create(**ask, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    assert len(whole) >= 1 and [e.model_dump() for e in streamed] == [e.model_dump() for e in whole]
    for entry, top in zip(whole, want, strict=False):
        assert [t.token for t in entry.top_logprobs] == [t for t, _ in top]
        assert [t.bytes for t in entry.top_logprobs] == [list(t.encode()) for t, _ in top]
        np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], [x for _, x in top], rtol=1e-5, atol=1e-5)
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob)
    ids = ids_of("KING:")
    want = _likeliest(engine, ids + reference(ids, 5), 4)[len(ids) - 1 :]
    lp = client.completions.create(model=MODEL, prompt="KING:", max_tokens=5, temperature=0, logprobs=4)
    lp = lp.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) >= 1
    for got, top in zip(lp.top_logprobs, want, strict=False):
        _assert_texts(got, top)


def test_64_concurrent_requests_of_mixed_lengths(server, reference):
    asynclient = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=processes.HANG_GUARD_S
    )
    words = ["a", "to be or", "KING HENRY: once more", "x" * 30, "the quick brown fox jumps"]
    jobs = [(words[i % 5] + str(i), 1 + (i * 7) % 13, i % 3 == 0) for i in range(64)]

    async def one(prompt, n, stream):
        if not stream:
            out = await asynclient.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
            return out.choices[0].text
        chunks = await asynclient.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                                     stream=True)  # fmt: skip
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(*j) for j in jobs))
        finally:
            await asynclient.close()

    texts = asyncio.run(all_of_them())
    for (prompt, n, _), text in zip(jobs, texts, strict=True):
        assert text == text_of(reference(ids_of(prompt), n)), prompt
    server.idle()


def test_a_client_that_goes_away_has_its_request_aborted_and_the_server_answers_on(server, reference):
    """Clients that leave mid-answer (three hang-ups, the openai client's close of a stream, its timeout)
    each have their request aborted, and the server answers on. Greedy, whose 80 tokens hold no EOS: a
    sampled answer may end early, in time for the client that times out (as draws vary with request ids)."""
    import http.client

    assert len(reference(ids_of("once"), 80)) == 80
    port = int(server.url.rsplit(":", 1)[1])
    body = json.dumps({"model": MODEL, "prompt": "once", "max_tokens": 80, "stream": True, "temperature": 0})
    with paced(server) as aborted:  # 80 tokens take 1.6 s: every client below leaves long before
        for _ in range(3):  # a client that reads the first event, then hangs up
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=processes.HANG_GUARD_S)
            conn.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})
            r = conn.getresponse()
            assert r.status == 200 and r.readline().startswith(b"data: {")
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
        greedy = {"model": MODEL, "prompt": "once", "max_tokens": 80, "temperature": 0}
        with server.client().completions.create(**greedy, stream=True) as stream:
            next(iter(stream))  # the openai client's own close, mid-stream
        with pytest.raises(openai.APITimeoutError):  # not streamed: the client gives up waiting
            server.client(timeout=0.3).completions.create(**greedy)
        health = server.idle()
        assert len(set(aborted)) == 5, aborted
    assert health["status"] == "ok" and server.runner.alive
    out = server.client().completions.create(model=MODEL, prompt="again", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_a_failing_engine_step_fails_its_requests_not_the_server(server):
    """A step that raises fails the requests it ran, whole, streamed, a Responses stream and a background
    Response alike, and the server answers on."""
    engine = server.runner.engine
    real = engine.step

    def broken():
        engine.step = real  # once
        raise RuntimeError("injected fault")

    engine.step = broken
    with pytest.raises(openai.InternalServerError, match="injected fault"):
        server.client().completions.create(model=MODEL, prompt="boom", max_tokens=3)
    server.idle()  # the failed request's abort is the engine's to finish first (a step of its own)
    engine.step = broken  # mid-stream: an error event, which the client raises
    with pytest.raises(openai.APIError, match="injected fault"):
        list(server.client().completions.create(model=MODEL, prompt="boom", max_tokens=3, stream=True))
    server.idle()
    engine.step = broken  # a Responses stream ends with the API's error event
    events = list(server.client().responses.create(model=MODEL, input="boom", max_output_tokens=3, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "error" and "injected" in events[-1].message
    server.idle()
    engine.step = broken  # a background Response is stored "failed", with the engine's error
    queued = server.client().responses.create(model=MODEL, input="boom", max_output_tokens=3, background=True)
    failed = _polled(server.client(), queued.id)
    assert failed.status == "failed" and "injected fault" in failed.error.message
    server.idle()
    engine.step = broken  # streamed too: the error event, kept, and the Response stored "failed"
    events = list(server.client().responses.create(model=MODEL, input="boom", max_output_tokens=3, stream=True,
                                                   background=True))  # fmt: skip
    assert events[-1].type == "error" and "injected" in events[-1].message
    rid = events[0].response.id
    assert [e.type for e in server.client().responses.retrieve(rid, stream=True)] == [e.type for e in events]
    assert _polled(server.client(), rid).status == "failed"
    assert server.runner.alive and server.runner.failures >= 4
    out = server.client().completions.create(model=MODEL, prompt="fine", max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_an_exception_while_answering_is_a_500_with_an_error_body_and_the_server_answers_on(server):
    state = server.app.state.server
    real = state.tok

    class Exploding:
        def __getattr__(self, name):
            return getattr(real, name)

        def encode(self, text):
            if "explode" in text:
                raise RuntimeError("the tokenizer broke")
            return real.encode(text)

    state.tok = Exploding()
    try:
        status, answer = server.post("/v1/completions", {"model": MODEL, "prompt": "explode"})
    finally:
        state.tok = real
    assert (
        status == 500 and answer["error"]["type"] == "server_error" and "tokenizer broke" in answer["error"]["message"]
    )
    assert server.client().completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1


UNFOLLOWABLE = {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}  # a schema llguidance refuses


HI = [{"role": "user", "content": "Hi"}]
HIDDEN = "include_obfuscation"  # OpenAI's stream_options field: random padding in each chunk
STRICT = "disable_additional_properties"  # vLLM's: an object schema without additionalProperties takes none


def so(spec, **more) -> dict:
    """A completion's body with vLLM's `structured_outputs`."""
    return {"model": MODEL, "prompt": "x", "structured_outputs": spec, **more}


BAD = [  # (body, HTTP status, the field named, a word of the message)
    (b"{not json", 400, None, "JSON"),
    (b"[1, 2]", 400, None, "object"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
    ({"prompt": "x"}, 400, "model", "model"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens", "[1,"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens", "[1,"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ({"model": MODEL, "prompt": "x", "max_tokens": True}, 400, "max_tokens", "integer"),
    ({"model": MODEL, "prompt": "x" * 150, "max_tokens": 20}, 400, "max_tokens", "context"),
    ({"model": MODEL, "prompt": 42}, 400, "prompt", "string"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt", "empty"),
    ({"model": MODEL, "prompt": [5, 99999]}, 400, "prompt", "ids"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature", "[0"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", "(0"),
    ({"model": MODEL, "prompt": "x", "min_p": 1.5}, 400, "min_p", "[0.0, 1.0]"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream", "true or false"),
    ({"model": MODEL, "prompt": "x", "stop": [1]}, 400, "stop", "string"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n", "[1,"),
    ({"model": MODEL, "prompt": "x", "n": 1000}, 400, "n", "[1,"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs", "[0, 20]"),
    ({"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs", "integer"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty", "[-2.0, 2.0]"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": "x"}, 400, "presence_penalty", "number"),
    ({"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "(0.0,"),
    ({"model": MODEL, "prompt": "x", "logit_bias": [1]}, 400, "logit_bias", "an object"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias", "token ids"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 200}}, 400, "logit_bias", "[-100, 100]"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias", "outside the vocabulary"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix", "not supported"),
    ({"model": MODEL, "prompt": "x", "guided_choice": "yes"}, 400, "guided_choice", "a list of 1 to 1024 texts"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids", "token ids"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": 5}, 400, "stop_token_ids", "a list of at most 64"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids", "outside the vocabulary"),
    ({"model": MODEL, "prompt": "x", "allowed_token_ids": [5, "a"]}, 400, "allowed_token_ids", "token ids"),
    ({"model": MODEL, "prompt": "x", "bad_words": "no"}, 400, "bad_words", "a list of at most 256 non-blank"),
    ({"model": MODEL, "prompt": "x", "bad_words": [" "]}, 400, "bad_words", "a list of at most 256 non-blank"),
    ({"model": MODEL, "prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", ">= 1, or -1"),
    ({"model": MODEL, "prompt": "x", "truncate_prompt_tokens": 10**6}, 400, "truncate_prompt_tokens", "[-1, 160]"),
    ({"model": MODEL, "prompt": "x", "allowed_token_ids": [99999]}, 400, "allowed_token_ids", "outside the vocab"),
    ({"model": MODEL, "prompt": "x", "guided_choice": ["a", ""]}, 400, "guided_choice[1]", "non-empty string"),
    ({"model": MODEL, "prompt": "x", "guided_choice": ["x" * 20]}, 400, "guided_choice[0]", "max_tokens=16"),
    ({"model": MODEL, "prompt": "x", "response_format": {"type": "json_schema"}}, 400, "response_format", "json_sch"),
    ({"model": MODEL, "prompt": "x", "response_format": {"type": "xml"}}, 400, "response_format", "is expected"),
    ({"model": MODEL, "prompt": "x", "response_format": UNFOLLOWABLE}, 400, "response_format", "cannot be followed"),
    ({"model": MODEL, "prompt": "x", "guided_json": {"type": "frob"}}, 400, "guided_json", "frob"),
    ({"model": MODEL, "prompt": "x", "guided_json": "{bad"}, 400, "guided_json", "not JSON"),
    ({"model": MODEL, "prompt": "x", "guided_regex": "(a"}, 400, "guided_regex", "unclosed group"),
    ({"model": MODEL, "prompt": "x", "guided_regex": ""}, 400, "guided_regex", "non-empty string"),
    ({"model": MODEL, "prompt": "x", "guided_grammar": 'start: "a" nowhere'}, 400, "guided_grammar", "nowhere"),
    ({"model": MODEL, "prompt": "x", "guided_regex": "a", "guided_json": {}}, 400, "guided_json", "both hold"),
    (so("json"), 400, "structured_outputs", "an object"),
    (so({}), 400, "structured_outputs", "got none"),
    (so({"regex": "a", "choice": ["a"]}), 400, "structured_outputs", "exactly one of"),
    (so({"xml": "a"}), 400, "structured_outputs.xml", "not a key"),
    (so({"regex": "a", "whitespace_pattern": " "}), 400, "structured_outputs.whitespace_pattern", "only null is"),
    (so({"json": {}, STRICT: True}), 400, f"structured_outputs.{STRICT}", "only false is supported"),
    (so({"regex": "(a"}), 400, "structured_outputs.regex", "unclosed group"),  # the engine's error, the request's name
    (so({"json": {"type": "frob"}}), 400, "structured_outputs.json", "frob"),
    (so({"json": "{bad"}), 400, "structured_outputs.json", "not JSON"),
    (so({"choice": ["a", ""]}), 400, "structured_outputs.choice[1]", "non-empty string"),
    (so({"json_object": 1}), 400, "structured_outputs.json_object", "true is expected"),
    (so({"regex": "a"}, guided_json={}), 400, "guided_json", "both hold"),
    ({"model": MODEL, "prompt": "x", "colour": "red"}, 400, "colour", "unrecognized"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    (
        {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {HIDDEN: True}},
        400,
        f"stream_options.{HIDDEN}",
        "false only",
    ),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "[1,"),  # without echo: nothing asked
    ({"model": MODEL, "prompt": "x", "max_tokens": -1, "echo": True}, 400, "max_tokens", "[0,"),
    ({"model": MODEL, "prompt": "x" * 160, "echo": True, "logprobs": 1, "max_tokens": 1}, 400, "prompt", "context"),
    (
        {"model": MODEL, "prompt": ["ab", "x" * 161], "echo": True, "logprobs": 0, "max_tokens": 0},
        400,
        "prompt[1]",
        "context",
    ),
    (
        {"model": MODEL, "prompt": [5, 99999], "echo": True, "logprobs": 1, "max_tokens": 0},
        400,
        "prompt",
        "vocabulary",
    ),
    ({"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1, "stream": True}, 400, "stream", "not streamed"),
    ({"model": MODEL, "prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", "not streamed"),
    ({"model": MODEL, "prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs", "[0, 20]"),
    ({"model": MODEL, "prompt": "x", "prompt_logprobs": "2"}, 400, "prompt_logprobs", "an integer"),
    ({"model": MODEL, "prompt": "a\ud800b"}, 400, "prompt", "lone surrogate"),  # JSON's "\ud800": half a pair
    ({"model": MODEL, "prompt": ["ok", "x"], "stop": ["\udfff"]}, 400, "stop[0]", "lone surrogate"),
    ({"model": MODEL, "prompt": "x", "\ud800": 1}, 400, None, "lone surrogate"),
    ({"model": MODEL, "prompt": "x", "seed": -1}, 400, "seed", "[0,"),
    ({"model": MODEL, "prompt": "x", "seed": 2**32 - 1, "n": 2}, 400, "seed", "[0, 4294967294]"),  # choice 1's 2**32
    ({"model": MODEL, "prompt": "x", "user": 5}, 400, "user", "a string is expected"),
    ({"model": MODEL, "prompt": "x", "ignore_eos": "yes"}, 400, "ignore_eos", "true or false"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens", "[0, 3]"),
]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def hi(**more) -> dict:
    """A chat's body, one user message, with `more` fields."""
    return {"model": MODEL, "messages": HI, **more}


BAD_CHAT = [
    (hi(continue_final_message=True), 400, "continue_final_message", "add_generation_prompt false"),
    (hi(continue_final_message=True, add_generation_prompt=False), 400, "continue_final_message", "the user's"),
    (hi(add_generation_prompt="no"), 400, "add_generation_prompt", "true or false"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
        "logprobs",
    ),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
        "[0, 20]",
    ),
    ({"model": MODEL, "messages": []}, 400, "messages", "non-empty"),
    ({"model": MODEL, "messages": "hi"}, 400, "messages", "list"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "wizard"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content", "string"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 200}]}, 400, "messages", "context"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "a\udc00"}]}, 400, "messages[0].content", "surrogate"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "tools[0]",
        "function",
    ),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": []}, 400, "tools", "1 to 128"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [TOOL, TOOL]},
        400,
        "tools[1].function.name",
        "twice",
    ),
    (
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "a b"}}],
        },
        400,
        "tools[0].function.name",
        "letters",
    ),
    (
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}],
        },
        400,
        "tools[0].function.parameters",
        "schema",
    ),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
        400,
        "tool_choice",
        "needs tools",
    ),
    (
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice",
        "no tool is named 'g'",
    ),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": "always"},
        400,
        "tool_choice",
        "is expected",
    ),
    (
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [TOOL],
            "tool_choice": "required",
            "guided_regex": "a",
        },
        400,
        "guided_regex",
        "both hold",
    ),
    ({"model": MODEL, "messages": [{"role": "tool", "content": 3}]}, 400, "messages[0].content", "string"),
    (
        {
            "model": MODEL,
            "messages": [
                {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}]}
            ],
        },
        400,
        "messages[0].tool_calls[0].function.arguments",
        "not JSON",
    ),
    (
        {"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [CALL | {"id": None}]}]},
        400,
        "messages[0].tool_calls[0].id",
        "id (a string)",
    ),
    (
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "a", "content": "r"}],
        },
        400,
        "messages[1].role",
        "answers a call",
    ),
    (
        {
            "model": MODEL,
            "messages": [
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "b", "content": "r"},
            ],
        },
        400,
        "messages[1].tool_call_id",
        "'b' is not the id of a call left to answer (a)",
    ),
    (
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [CALL, CALL | {"id": "b"}]},
                {"role": "tool", "tool_call_id": "a", "content": "r"},
                {"role": "user", "content": "y"},
            ],
        },
        400,
        "messages[1].tool_calls",
        "the calls b are answered by no tool message",
    ),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "x", "tool_calls": []}]},
        400,
        "messages[0].tool_calls",
        "assistant",
    ),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        "[1,",
    ),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "metadata": {"a": 1}}, 400, "metadata", "string"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "store": "yes"}, 400, "store", "true or false"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": "json"},
        400,
        "response_format",
        "is expected",
    ),
]


RESPONSES = "/v1/responses"
UNFOLLOWED = {"type": "json_schema", "schema": {"type": 5}}  # UNFOLLOWABLE, in the Responses' flat form
FUNCTION_G = {"type": "function", "name": "g"}  # a Responses tool_choice of a function not given


def asked(**more) -> dict:
    """A Responses request's body, input "x", with `more` fields."""
    return {"model": MODEL, "input": "x", **more}


BAD_RESPONSES = [  # /v1/responses: (path, body, HTTP status, the field named, a word of the message)
    (RESPONSES, {"model": MODEL}, 400, "input", "a string or a non-empty list"),
    (RESPONSES, asked(previous_response_id="resp_1"), 404, "previous_response_id", "no previous response"),
    (RESPONSES, asked(previous_response_id=5), 400, "previous_response_id", "a string"),
    (RESPONSES, asked(tools=[{"type": "web_search"}]), 400, "tools[0]", "only function tools"),
    (RESPONSES, asked(tools=[{"type": "function", "name": "a b"}]), 400, "tools[0].name", "letters, digits"),
    (RESPONSES, asked(tools=[{"type": "function", "name": "f"}], tool_choice=FUNCTION_G), 400, "tool_choice", "'g'"),
    (RESPONSES, asked(tool_choice={"type": "file_search"}), 400, "tool_choice", "is expected"),
    (RESPONSES, asked(input=[{"type": "function_call_output"}]), 400, "input[0].call_id", "a string"),
    (RESPONSES, asked(input=[{"type": "reasoning"}]), 400, "input[0]", "a message"),
    (
        RESPONSES,
        asked(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]),
        400,
        "input[0].arguments",
        "not JSON",
    ),
    (
        RESPONSES,
        asked(input=[{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "c", "output": ""}]),
        400,
        "input[1]",
        "call",
    ),
    (
        RESPONSES,
        asked(input=[{"role": "user", "content": [{"type": "input_image"}]}]),
        400,
        "input[0].content",
        "text parts",
    ),
    (RESPONSES, asked(max_output_tokens=-1), 400, "max_output_tokens", "[1,"),
    (RESPONSES, asked(input="x" * 200), 400, "input", "context"),
    (RESPONSES, asked(text={"format": {"type": "xml"}}), 400, "text.format", "is expected"),
    (RESPONSES, asked(seed=1), 400, "seed", "unrecognized"),
    (RESPONSES, asked(text={"format": UNFOLLOWED}), 400, "text.format", "cannot be followed"),  # the engine's
    (RESPONSES, asked(text="json"), 400, "text", "an object"),
    (RESPONSES, asked(include=["reasoning.encrypted_content"]), 400, "include", "not supported"),
    (RESPONSES, asked(top_logprobs=21), 400, "top_logprobs", "[0, 20]"),
    (RESPONSES, asked(top_logprobs=1, tools=[{"type": "function", "name": "f"}]), 400, "include", "beside tools"),
]
BAD_TOKENIZE = [  # vLLM's /tokenize and /detokenize: (path, body, HTTP status, the field named, a word of the message)
    ("/tokenize", {"model": MODEL}, 400, "prompt", "either prompt"),
    ("/tokenize", {"prompt": "x", "messages": HI}, 400, "prompt", "either prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "a string"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": True}, 400, "add_special_tokens", "false only"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": False}, 400, "add_generation_prompt", "a chat's field"),
    ("/tokenize", {"messages": HI, "continue_final_message": True}, 400, "continue_final_message", "add_generation"),
    ("/tokenize", {"messages": "Hi"}, 400, "messages", "a non-empty list"),
    ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
    ("/tokenize", {"prompt": "x", "colour": 1}, 400, "colour", "unrecognized"),
    ("/detokenize", {}, 400, "tokens", "a list of token ids"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", "a list of token ids"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens", "a list of token ids"),
    ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens", "outside the vocabulary"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "word"),
    [("/v1/completions", *b) for b in BAD]
    + [("/v1/chat/completions", *b) for b in BAD_CHAT]
    + BAD_TOKENIZE
    + BAD_RESPONSES,
)
def test_a_bad_request_gets_a_4xx_with_openais_error_body(server, path, body, status, param, word):
    got, answer = server.post(path, body)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and word.lower() in error["message"].lower(), error


def test_tokenize_gives_the_ids_the_generation_routes_feed_the_model(server):
    """vLLM's /tokenize: a completion's prompt gives its ids, and their count is the completion's
    prompt_tokens; a chat's messages (and tools) give the ids of the prompt written in the workdir's
    template, counted as the chat counts them, less the assistant's opening without the generation
    prompt; /detokenize gives the text back. The model may be left out, as vLLM allows."""
    client = server.client()
    got = server.post("/tokenize", {"model": MODEL, "prompt": "KING HENRY:", "return_token_strs": True})[1]
    assert got["tokens"] == ids_of("KING HENRY:") and got["max_model_len"] == MAX_LEN
    completion = client.completions.create(model=MODEL, prompt="KING HENRY:", max_tokens=1)
    assert got["count"] == completion.usage.prompt_tokens
    assert "".join(got["token_strs"]) == "KING HENRY:"
    assert server.post("/detokenize", {"model": MODEL, "tokens": got["tokens"]}) == (200, {"prompt": "KING HENRY:"})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    code, chat = server.post("/tokenize", {"messages": messages})
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert code == 200 and chat["count"] == answer.usage.prompt_tokens == len(chat["tokens"])
    assert chat["tokens"] == ids_of(templates.get("chatml").conversation(messages)) and chat["token_strs"] is None
    tool = {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {}}}
    tooled = server.post("/tokenize", {"messages": messages, "tools": [tool]})[1]  # the tools' prompt: over the context
    assert tooled["count"] > MAX_LEN and tooled["count"] == len(tooled["tokens"])
    with pytest.raises(openai.BadRequestError, match=f"the conversation is {tooled['count']} tokens"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, tools=[tool])
    bare = server.post("/tokenize", {"messages": messages, "add_generation_prompt": False})[1]
    assert chat["tokens"] == bare["tokens"] + ids_of("<|im_start|>assistant\n")


def test_the_openai_client_sees_bad_requests_as_its_errors_and_the_server_answers_on(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.post("/nowhere", body={}, cast_to=object)
    assert server.health()["status"] == "ok"
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_echo_with_logprobs_scores_the_prompt_by_the_models_forward_pass(server, engine, reference):
    """OpenAI's legacy scoring call (lm-eval's `local-completions` makes it): with echo and logprobs the
    prompt's tokens come first, the first one's log-probability null, each other's and the three likeliest
    tokens there (`logprobs` 3) as one forward pass of the served model gives them, then the new tokens' and
    their likeliest; max_tokens 0: the prompt alone."""
    import jax.numpy as jnp
    import numpy as np

    prompt = "KING HENRY: to be"
    ids = ids_of(prompt)
    logp = np.asarray(jax.nn.log_softmax(engine.model(jnp.asarray([ids]))[0].astype(jnp.float32)))
    expected = logp[np.arange(len(ids) - 1), ids[1:]]
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 3, "temperature": 0}
    status, alone = server.post("/v1/completions", body | {"max_tokens": 0})
    assert status == 200, alone
    status, more = server.post("/v1/completions", body | {"prompt": [ids], "max_tokens": 3})
    assert status == 200, more
    n = len(ids)
    for out, new in ((alone, 0), (more, 3)):
        choice, lp = out["choices"][0], out["choices"][0]["logprobs"]
        assert out["usage"]["prompt_tokens"] == n and out["usage"]["completion_tokens"] == new
        assert choice["text"] == prompt + (text_of(reference(ids, new)) if new else "")
        assert lp["tokens"][:n] == [text_of([t]) for t in ids] and len(lp["tokens"]) == n + new
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        np.testing.assert_allclose(lp["token_logprobs"][1:n], expected, rtol=1e-5, atol=1e-5)
        want = _likeliest(engine, ids + (reference(ids, new) if new else []), 3)
        for got, top in zip(lp["top_logprobs"][1:], want[: n + new - 1], strict=True):
            _assert_texts(got, top)
    assert choice["finish_reason"] == "length" and alone["choices"][0]["finish_reason"] == "length"


def test_prompt_logprobs_rank_each_prompt_token_by_the_models_forward_pass(server, engine, reference):
    """vLLM's `prompt_logprobs`: for a completion (each choice) and a chat (the answer), the prompt's first
    position null, then at each position the prompt's token first, its log-probability and rank (the ids at
    least as likely, itself included) by one forward pass of the served model, then the k likeliest ranked
    1..k (k = 0: the prompt's token alone); the answer itself unchanged."""
    import jax.numpy as jnp
    import numpy as np

    def expected(ids: list[int], k: int) -> list:
        logp = np.asarray(jax.nn.log_softmax(engine.model(jnp.asarray([ids]))[0].astype(jnp.float32)))
        out = [None]
        for at, token in enumerate(ids[1:]):
            row = logp[at]
            entry = {str(token): (row[token], int((row >= row[token]).sum()), text_of([token]))}
            for r, i in enumerate(np.argsort(-row, kind="stable")[:k], 1):
                entry.setdefault(str(i), (row[i], r, text_of([int(i)])))
            out.append(entry)
        return out

    def check(got: list, want: list) -> None:
        assert len(got) == len(want) and got[0] is None
        for g, w in zip(got[1:], want[1:], strict=True):
            assert list(g) == list(w)  # the prompt's token first, then the likeliest in order
            for key, (lp, rank, text) in w.items():
                assert (g[key]["rank"], g[key]["decoded_token"]) == (rank, text), (g, w)
                np.testing.assert_allclose(g[key]["logprob"], lp, rtol=1e-5, atol=1e-5)

    prompt = "KING HENRY: to be"
    ids = ids_of(prompt)
    for k in (0, 3):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "n": 2, "prompt_logprobs": k}
        status, out = server.post("/v1/completions", body)
        assert status == 200, out
        for choice in out["choices"]:
            assert choice["text"] == text_of(reference(ids, 3))
            check(choice["prompt_logprobs"], expected(ids, k))
    ranks = [e[str(t)]["rank"] for e, t in zip(out["choices"][0]["prompt_logprobs"][1:], ids[1:], strict=True)]
    assert max(ranks) > 3, ranks  # counted over the vocabulary, not places in the top list
    messages = [{"role": "user", "content": "to be"}]
    status, chat = server.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                                         "temperature": 0, "prompt_logprobs": 2})  # fmt: skip
    assert status == 200, chat
    status, tokenized = server.post("/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200 and chat["usage"]["prompt_tokens"] == tokenized["count"], (chat, tokenized)
    check(chat["prompt_logprobs"], expected(tokenized["tokens"], 2))
    assert chat["choices"][0]["message"]["content"] == text_of(reference(tokenized["tokens"], 2))


@pytest.mark.parametrize("route", ["/v1/embeddings", "/v1/classify", "/classify"])
def test_embeddings_and_classes_of_a_model_that_generates_are_refused_by_name(server, route):
    status, answer = server.post(route, {"model": MODEL, "input": "x"})
    assert status == 400 and answer["error"]["code"] == "model_not_supported", answer
    assert "encoder_only" in answer["error"]["message"] and answer["error"]["param"] == "model"


def test_the_api_key_is_asked_for_and_checked(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(key="sk-wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
    for route, body in [("/v1/completions", {"model": MODEL, "prompt": "x"}), ("/tokenize", {"prompt": "x"}),
                        ("/detokenize", {"tokens": [5]})]:  # fmt: skip
        status, answer = server.post(route, body, key=None)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key", route
    assert [m.id for m in server.client().models.list()] == [MODEL]
    card = server.client().models.retrieve(MODEL).to_dict()
    assert card["id"] == MODEL and (card["mode"], card["max_context"]) == ("decoder_only", MAX_LEN)
    assert "labels" not in card  # a classifier's only
    assert server.health()["status"] == "ok"  # the health route is open


def test_without_a_key_the_server_answers_anyone(engine):
    # The module's server owns the engine (one thread only): this one borrows it after that server stopped.
    s = Server(engine, ServeConfig(), MODEL)
    try:
        assert [m.id for m in s.client(key=None).models.list()] == [MODEL]
    finally:
        s.stop()


def test_jaxformer_serve_serves_a_workdir_until_interrupted(workdir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [
        "serve",
        "--workdir",
        str(workdir),
        "--port",
        str(port),
        "--model-name",
        MODEL,
        "--set",
        "engine.max_slots=1",  # one row: --warmup compiles a prefill chunk and a decode step per page bucket
        "--warmup",
    ]
    env = dict(os.environ, JAXFORMER_API_KEY=KEY)  # the key from the environment, not the command line
    proc = subprocess.Popen([sys.executable, "-m", "jaxformer.cli", *argv], env=env, stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=processes.HANG_GUARD_S
        )
        deadline = time.monotonic() + processes.HANG_GUARD_S  # a hang guard: starting takes a busy machine long
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.1)
        assert [m.id for m in models] == [MODEL]
        out = client.completions.create(model=MODEL, prompt="KING", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="no", max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: uvicorn shuts down, the engine thread stops
        assert proc.wait(processes.HANG_GUARD_S) == 0
    assert re.search(r"warmed up: \d+ shapes of the step compiled and run", proc.stderr.read())  # before serving


def test_the_page_streams_an_answer_in_a_headless_browser(server, reference, browser):
    page = browser.new_page()
    page.goto(server.url + "/")
    page.fill("#api_key", KEY)
    page.dispatch_event("#api_key", "change")  # the page asks /v1/models again, with the key
    page.wait_for_function("document.getElementById('model').textContent.startsWith('tiny-chat')")
    assert not page.is_visible("#models")  # one model: nothing to choose (test_serve_adapters: several)
    # Count the answer's updates: a streamed answer shows up in pieces, not at once.
    page.evaluate("""() => { window.updates = 0;
        new MutationObserver(() => window.updates++).observe(document.getElementById("history"),
            {subtree: true, childList: true, characterData: true});
        new MutationObserver(() => window.updates++).observe(document.getElementById("answer"),
            {subtree: true, childList: true, characterData: true}); }""")
    page.check("#mode-completion")
    page.fill("#prompt", "KING HENRY:")
    page.fill("#max_tokens", "12")
    with paced(server, 0.05):  # tokens 50 ms apart: the page must show them as they come
        page.click("#send")
        page.wait_for_selector("#status[data-done='1']", timeout=processes.HANG_GUARD_S * 1000)
    expected = text_of(reference(ids_of("KING HENRY:"), 12))
    assert page.eval_on_selector("#answer", "e => e.textContent") == expected
    assert page.evaluate("window.updates") >= min(len(expected), 2)
    assert "tokens/s" in page.inner_text("#status")
    page.fill("#temperature", "1.5")  # sampled, but min_p = 1 keeps the likeliest token alone: greedy's answer
    page.fill("#min_p", "1")
    page.click("#send")
    page.wait_for_selector("#status[data-done='1']", timeout=processes.HANG_GUARD_S * 1000)
    assert page.eval_on_selector("#answer", "e => e.textContent") == expected
    page.fill("#temperature", "0")
    page.fill("#min_p", "0")
    page.check("#mode-chat")
    page.fill("#prompt", "Hi")
    page.press("#prompt", "Control+Enter")
    page.wait_for_selector(".turn.assistant", timeout=processes.HANG_GUARD_S * 1000)
    page.wait_for_selector("#status[data-done='1']", timeout=processes.HANG_GUARD_S * 1000)
    prompt = templates.get("chatml").conversation([{"role": "user", "content": "Hi"}])
    answer = text_of(reference(ids_of(prompt), MAX_LEN - len(prompt))).split("<|im_end|>")[0]
    assert page.eval_on_selector(".turn.assistant .content", "e => e.textContent") == answer
    # A structured output: the page's regex holds the completion; a schema that is not JSON is said so.
    page.check("#mode-completion")
    page.select_option("#guide", "regex")
    page.fill("#guide_text", "[0-9]{3}")
    page.fill("#prompt", "KING")
    page.click("#send")
    page.wait_for_selector("#status[data-done='1']", timeout=processes.HANG_GUARD_S * 1000)
    assert re.fullmatch("[0-9]{3}", page.eval_on_selector("#answer", "e => e.textContent"))
    page.select_option("#guide", "json")
    page.fill("#guide_text", "{not json")
    page.click("#send")
    page.wait_for_selector("#status[data-done='1']", timeout=processes.HANG_GUARD_S * 1000)
    assert page.inner_text("#answer").startswith("the JSON schema is not JSON")
    page.close()


def _batch_line(cid: str, url: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": MODEL, **body}}


def test_a_batch_file_is_answered_as_the_server_answers_and_a_rerun_answers_only_what_is_missing(
    workdir, reference, server, tmp_path, capsys
):
    """`jaxformer batch`: OpenAI's batch lines answered through the server's routes offline, each written as
    OpenAI's batch output line: a completion is `generate`'s greedy continuation, a chat and a Responses
    request are the server's answers to the same bodies (asked over HTTP), refusals keep the route's status and
    error; the output lost a line and the last written was cut short (a killed run): the rerun answers that
    request alone and keeps the rest as they were; a third run answers nothing."""
    from jaxformer import cli

    lines = [
        _batch_line("c1", "/v1/completions", prompt="KING HENRY:", max_tokens=12, temperature=0),
        _batch_line("c2", "/v1/completions", prompt=["ab", "KING:"], n=2, max_tokens=4, temperature=0),
        _batch_line("chat", "/v1/chat/completions", messages=HI, max_tokens=8, temperature=0),
        _batch_line("resp", "/v1/responses", input="Hi", max_output_tokens=5, temperature=0),
        _batch_line("bad", "/v1/completions", prompt="x", max_tokens=-1),
        _batch_line("emb", "/v1/embeddings", input="x"),
        {"custom_id": "who", "method": "POST", "url": "/v1/completions", "body": {"model": "gpt-4", "prompt": "x"}},
    ]
    inputs, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inputs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    command = ["batch", "--workdir", str(workdir), "--model-name", MODEL, "--input", str(inputs), "--output",
               str(output), "--set", "engine.page_size=8"]  # fmt: skip
    assert cli.main(command) == 0
    assert "7 answered" in capsys.readouterr().err
    got = {(line := json.loads(text))["custom_id"]: line for text in output.read_text().splitlines()}
    assert set(got) == {line["custom_id"] for line in lines} and len(output.read_text().splitlines()) == 7
    status = {cid: line["response"]["status_code"] for cid, line in got.items()}
    assert status == {"c1": 200, "c2": 200, "chat": 200, "resp": 200, "bad": 400, "emb": 400, "who": 404}
    assert all(line["id"].startswith("batch_req_") and line["response"]["request_id"] for line in got.values())
    body = lambda cid: got[cid]["response"]["body"]
    assert body("c1")["choices"][0]["text"] == text_of(reference(ids_of("KING HENRY:"), 12))
    twice = ["ab", "ab", "KING:", "KING:"]  # n=2 choices of each prompt, greedy
    assert [c["text"] for c in body("c2")["choices"]] == [text_of(reference(ids_of(p), 4)) for p in twice]
    client = server.client()
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    assert body("chat")["choices"][0]["message"]["content"] == chat.choices[0].message.content
    assert body("chat")["usage"] == chat.usage.to_dict()
    answer = client.responses.create(model=MODEL, input="Hi", max_output_tokens=5, temperature=0)
    assert body("resp")["output"][0]["content"][0]["text"] == answer.output_text
    assert got["bad"]["error"]["param"] == "max_tokens" and got["who"]["error"]["code"] == "model_not_found"
    assert got["c1"]["error"] is None and got["emb"]["error"] == body("emb")["error"]
    # A killed run: c1's line lost, and the last line cut short as it was written.
    kept = [text for text in output.read_text().splitlines(keepends=True) if '"c1"' not in text]
    output.write_text("".join(kept) + '{"id": "batch_req_1", "custom_id": "c1", "resp')
    assert cli.main(command) == 0
    assert "1 requests of 7 to answer (6 in" in capsys.readouterr().err
    again = output.read_text().splitlines(keepends=True)
    assert again[:6] == kept and json.loads(again[6])["response"]["body"]["choices"] == body("c1")["choices"]
    assert cli.main(command) == 0 and "answered in" in capsys.readouterr().err and output.read_text() == "".join(again)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("{nope", "2: not JSON"),
        (json.dumps(_batch_line("a", "/v1/completions", prompt="x")), "2: custom_id 'a' is line 1's too"),
        (json.dumps(_batch_line("b", "/v1/models")), "2: url: one of /v1/completions"),
        (json.dumps(_batch_line("b", "/v1/completions", prompt="x", stream=True)), "2: body.stream"),
        (json.dumps({**_batch_line("b", "/v1/completions"), "method": "GET"}), "2: method: only POST"),
        (json.dumps({**_batch_line("b", "/v1/completions"), "custom_id": 5}), "2: custom_id: a non-empty string"),
        (json.dumps({**_batch_line("b", "/v1/completions"), "extra": 1}), "2: unknown field 'extra'"),
        (json.dumps({**_batch_line("b", "/v1/completions"), "body": []}), "2: body: a JSON object"),
    ],
)
def test_a_batch_line_that_is_not_a_request_stops_the_batch_naming_it_before_anything_runs(tmp_path, capsys, line,
                                                                                              words):  # fmt: skip
    from jaxformer import cli

    inputs, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inputs.write_text(json.dumps(_batch_line("a", "/v1/completions", prompt="x")) + "\n" + line + "\n")
    command = ["batch", "--workdir", str(tmp_path / "nowhere"), "--input", str(inputs), "--output", str(output)]
    assert cli.main(command) == 2
    err = capsys.readouterr().err
    assert f"error: --input: {inputs}:{words}" in err, err
    assert not output.exists()  # nothing ran, no engine was made (the workdir is not one)


def test_section_overrides_parse_by_type_and_name_the_field():
    from jaxformer.config import ConfigError, apply_section_overrides

    cfg = apply_section_overrides(ServeConfig(), "serve", ["serve.port=9000", "serve.api_key=none"])
    assert (cfg.port, cfg.api_key) == (9000, None)
    with pytest.raises(ConfigError, match=r"serve\.prot: unknown field; did you mean serve\.port\?"):
        apply_section_overrides(ServeConfig(), "serve", ["serve.prot=1"])
    with pytest.raises(ConfigError, match=r"model\.d_model: here --set takes serve\.FIELD=VALUE"):
        apply_section_overrides(ServeConfig(), "serve", ["model.d_model=1"])
    with pytest.raises(ConfigError, match=r"serve\.port: a TCP port in \[1, 65535\], got 99999"):
        apply_section_overrides(ServeConfig(), "serve", ["serve.port=99999"])
    with pytest.raises(ConfigError, match=r"serve\.responses_store: a count >= 0, got -1"):
        apply_section_overrides(ServeConfig(), "serve", ["serve.responses_store=-1"])


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("héllo wörld ✓ done", (), "héllo wörld ✓ done"),  # multi-byte characters arrive byte by byte
        ("héllo wörld ✓ done", ("✓",), "héllo wörld "),
        ("abc<|im_end|>more", ("<|im_end|>",), "abc"),
        ("a<|im_x and on", ("<|im_end|>",), "a<|im_x and on"),  # a prefix of the stop string, then not
        ("ends with <|im", ("<|im_end|>",), "ends with <|im"),  # held back, then flushed at the end
        ("say END now<|im_end|>", ("END", "<|im_end|>"), "say END"),  # a stop the request keeps (shown)
        ("say it<|im_end|> END", ("END", "<|im_end|>"), "say it"),  # the template's end, never shown
    ],
)
def test_text_is_handed_out_once_whole_characters_only_and_cut_before_a_stop(text, stops, expected):
    from jaxformer.serve.protocol import TextStream

    tok = ByteTokenizer()
    stream, pieces = TextStream(tok, stops, tok.eos_id, shown=("END",)), []
    for i in [*tok.encode(text), tok.eos_id]:  # one token (here: one byte) at a time, as an engine gives them
        pieces.append(stream.add([i]))
        if stream.stopped:
            break
    pieces.append(stream.flush())
    assert "".join(pieces) == expected
    assert not any("\ufffd" in p for p in pieces)  # never half a character (and nothing taken back)
