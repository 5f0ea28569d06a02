"""`jaxformer serve --lora NAME=WORKDIR`: a LoRA run's adapters served beside the base, a request's `model`
picking one. The real `openai` client gets the adapter's completion (the engine's own, which differs from
the base's), an unknown model gets OpenAI's `model_not_found`, and /v1/models lists the base and the adapter;
with `--lora-updates`, an adapter loaded while the server runs answers as one served from the start."""

import dataclasses
import time

import jax
import processes
import pytest
from flax import nnx

openai = pytest.importorskip("openai", reason='the test extra is not installed: pip install -e ".[test]"')
uvicorn = pytest.importorskip("uvicorn", reason='the test extra is not installed: pip install -e ".[test]"')

from servers import Server  # noqa: E402

from jaxformer import lora  # noqa: E402
from jaxformer.config import Config, DataConfig, EngineConfig, LoRAConfig, ServeConfig, TrainConfig, tiny  # noqa: E402
from jaxformer.engine import Engine, SamplingParams  # noqa: E402
from jaxformer.models import build_model  # noqa: E402

MODEL, ADAPTER, PROMPT = "tiny", "tuned", "KING:"


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """A step-0 workdir of a tiny byte-level decoder, and a LoRA run's of the same base with random B."""
    from jaxformer.checkpoint import start_workdir
    from jaxformer.state import start_state, state_factory

    model_cfg = tiny("decoder_only", vocab_size=260, d_model=32, d_ff=64, num_decoder_layers=1, max_len=64)
    data = DataConfig(source="files", files=("a.txt",), tokenizer="byte", max_len=64)
    cfg = Config(model=model_cfg, data=data, train=TrainConfig(objective="lm"))
    root = tmp_path_factory.mktemp("serve-lora")
    start_workdir(root / "base", cfg, jax.jit(state_factory(cfg)[1])())
    tuned = dataclasses.replace(cfg, lora=LoRAConfig(rank=2, targets=("q", "v")))
    model = lora.add_adapters(build_model(model_cfg, seed=tuned.train.seed), tuned.lora)  # the same base
    for i, (_, _, adapter) in enumerate(lora.adapters(model)):
        adapter.b[...] = jax.random.normal(jax.random.key(i), adapter.b.shape)
    start_workdir(root / "tuned", tuned, start_state(tuned, nnx.state(model, nnx.Param), state_factory(tuned)[2]))
    return root / "base", root / "tuned"


@pytest.fixture(scope="module")
def served(workdirs):
    """The engine's own greedy answers (base, adapter), then a server of it on a free port of 127.0.0.1."""
    base, tuned = workdirs
    engine = Engine.from_workdir(base, EngineConfig(max_slots=2, page_size=8, num_pages=32), adapters={ADAPTER: tuned})
    ids = engine.tokenizer.encode(PROMPT)
    # One request at a time, as the server's will run: one compiled shape for both.
    expected = [engine.generate([ids], SamplingParams(max_tokens=6), adapter=a)[0].text for a in (None, ADAPTER)]
    server = Server(engine, ServeConfig(), MODEL)
    yield server, dict(zip((MODEL, ADAPTER), expected, strict=True))
    server.stop()


def test_the_request_model_picks_the_adapter(served):
    server, expected = served
    client = server.client()
    assert expected[ADAPTER] != expected[MODEL]  # the adapter's B is not zero: it answers otherwise
    for name in (MODEL, ADAPTER):
        got = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0)
        assert (got.model, got.choices[0].text) == (name, expected[name])
    streamed = client.completions.create(model=ADAPTER, prompt=PROMPT, max_tokens=6, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected[ADAPTER]
    cards = client.models.list().data
    assert [(c.id, getattr(c, "parent", None)) for c in cards] == [(MODEL, None), (ADAPTER, MODEL)]
    assert client.models.retrieve(ADAPTER).id == ADAPTER
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other", prompt=PROMPT, max_tokens=2)
    assert e.value.code == "model_not_found" and "serves `tiny`, `tuned`" in e.value.message


def test_adapters_loaded_and_unloaded_while_serving(workdirs, served, monkeypatch):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (`--lora-updates`): a LoRA run's workdir
    loaded into a server of the base answers as the server that served it from the start does, and is
    listed; unloaded, it is a 404 again. Closed by default, behind the key, and bad names and paths are
    400s naming the field."""
    from jaxformer.config import ServeConfig

    base, tuned = workdirs
    _, expected = served
    engine = Engine.from_workdir(base, EngineConfig(max_slots=2, page_size=8, num_pages=32))
    closed = Server(engine, ServeConfig(), MODEL)
    try:
        status, answer = closed.post("/v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": str(tuned)})
        assert status == 404 and "--lora-updates" in answer["error"]["message"], answer
    finally:
        closed.stop()
    server = Server(engine, ServeConfig(api_key="k", lora_updates=True), MODEL)
    try:
        client, load = server.client(), {"lora_name": ADAPTER, "lora_path": str(tuned)}
        assert server.post("/v1/load_lora_adapter", load, key=None)[0] == 401
        for body, param, word in [
            ({"lora_name": "x", "lora_path": str(base)}, "lora_path", "no LoRA adapters"),
            ({"lora_name": "x", "lora_path": str(base / "nowhere")}, "lora_path", "does not exist"),
            ({"lora_name": " x", "lora_path": str(tuned)}, "lora_name", "surrounding spaces"),
            ({"lora_name": MODEL, "lora_path": str(tuned)}, "lora_name", "already served"),
            ({"lora_name": "x", "path": str(tuned)}, "path", "unrecognized"),
        ]:
            status, answer = server.post("/v1/load_lora_adapter", body)
            assert status == 400 and answer["error"]["param"] == param and word in answer["error"]["message"], answer
        # Loaded while a stream of the base runs: after its first step, the engine steps again only once the
        # adapter is in (the load is a command its thread takes between steps); the stream goes on unchanged.
        step, served_at = engine.step, []  # the adapters served at each step that had work

        def held():
            if served_at and not engine.adapters:
                time.sleep(0.01)
                return []
            if engine.has_unfinished():
                served_at.append(len(engine.adapters))
            return step()

        engine.step = held
        try:
            stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
            chunks = iter(stream)
            text = next(chunks).choices[0].text
            status, answer = server.post("/v1/load_lora_adapter", load)
            text += "".join(c.choices[0].text for c in chunks if c.choices)
        finally:
            del engine.step
        assert (status, answer) == (200, f"Success: LoRA adapter '{ADAPTER}' added successfully."), answer
        assert text.startswith(expected[MODEL]) and served_at[0] == 0 and 1 in served_at, (text, served_at)
        assert server.post("/v1/load_lora_adapter", load)[0] == 400  # already served
        assert [c.id for c in client.models.list().data] == [MODEL, ADAPTER]
        for name in (MODEL, ADAPTER):
            got = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0)
            assert got.choices[0].text == expected[name], name
        status, _ = server.post("/v1/unload_lora_adapter", {"lora_name": ADAPTER})
        assert status == 200 and [c.id for c in client.models.list().data] == [MODEL]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=ADAPTER, prompt=PROMPT, max_tokens=2)
        status, answer = server.post("/v1/unload_lora_adapter", {"lora_name": ADAPTER})
        assert status == 404 and answer["error"]["param"] == "lora_name", answer
        # A request that named the adapter just before it was unloaded (the name checked, then gone when the
        # engine takes the request): OpenAI's model_not_found too, not a 400.
        with monkeypatch.context() as m, pytest.raises(openai.NotFoundError) as e:
            m.setattr(type(server.app.state.server), "names", property(lambda _: (MODEL, ADAPTER)))  # as before
            client.completions.create(model=ADAPTER, prompt=PROMPT, max_tokens=2)
        assert e.value.code == "model_not_found" and "is not served by this engine" in e.value.message
        got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
        assert got.choices[0].text == expected[MODEL]
    finally:
        server.stop()


def test_the_page_offers_the_adapters_and_answers_with_the_one_chosen(served, browser):
    """The page at `/` lists the base and each adapter; a completion asked of the one chosen is its answer."""
    server, expected = served
    page = browser.new_page()
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model').textContent.startsWith('tiny')")
    options = page.eval_on_selector_all("#models option", "os => os.map(o => [o.value, o.textContent])")
    assert options == [[MODEL, MODEL], [ADAPTER, f"{ADAPTER} (LoRA of {MODEL})"]] and page.is_visible("#models")
    page.check("#mode-completion")
    page.fill("#max_tokens", "6")
    for name in (ADAPTER, MODEL):
        page.select_option("#models", name)
        page.fill("#prompt", PROMPT)
        page.click("#send")
        page.wait_for_selector("#status[data-done='1']", timeout=processes.HANG_GUARD_S * 1000)
        assert page.eval_on_selector("#answer", "e => e.textContent") == expected[name], name
    page.close()
