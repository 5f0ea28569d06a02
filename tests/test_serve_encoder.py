"""`jaxformer serve` of an encoder_only model: OpenAI's `/v1/embeddings`, each input's final hidden states
averaged over its positions. The real `openai` client (which asks for base64) and plain JSON floats get
the model's own mean states of each input alone (no padding, no batch); malformed requests get a 400
naming the field, and the server answers on; a generating route on this model, or embeddings of a model
that generates, are refused by name. A classifier's `/v1/classify` (vLLM's `/classify`): each input's
class probabilities as the model gives them alone, named by the workdir's class names."""

import base64
import struct

import jax
import jax.numpy as jnp
import numpy as np
import processes
import pytest
from flax import nnx

openai = pytest.importorskip("openai", reason='the test extra is not installed: pip install -e ".[test]"')
pytest.importorskip("uvicorn", reason='the test extra is not installed: pip install -e ".[test]"')

from servers import Server  # noqa: E402

from jaxformer.checkpoint import write_labels  # noqa: E402
from jaxformer.config import Config, DataConfig, EngineConfig, ServeConfig, TrainConfig, tiny  # noqa: E402
from jaxformer.data import ByteTokenizer  # noqa: E402
from jaxformer.engine import Engine  # noqa: E402

MODEL, MAX_LEN = "tiny-encoder", 48


def _encoder_workdir(path, num_classes: int = 0):
    """A step-0 workdir of a tiny byte-level encoder: masked-LM, or a classifier of `num_classes`."""
    from jaxformer.checkpoint import start_workdir
    from jaxformer.state import state_factory

    model = tiny("encoder_only", vocab_size=260, d_model=32, d_ff=64, num_encoder_layers=1, max_len=MAX_LEN,
                 num_classes=num_classes)  # fmt: skip
    cfg = Config(
        model=model,
        data=DataConfig(source="files", files=("a.txt",), tokenizer="byte", max_len=MAX_LEN),
        train=TrainConfig(objective="classify" if num_classes else "mlm"),
    )
    start_workdir(path, cfg, jax.jit(state_factory(cfg)[1])())
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A masked-LM encoder's workdir, served; and its model."""
    path = _encoder_workdir(tmp_path_factory.mktemp("serve-embed") / "run")
    engine = Engine.from_workdir(path, EngineConfig(max_slots=2))
    server = Server(engine, ServeConfig(), MODEL)
    yield server, engine.model
    server.stop()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A classifier's workdir of three classes, with the names a classify run keeps, served; and its model."""
    path = _encoder_workdir(tmp_path_factory.mktemp("serve-classify") / "run", num_classes=3)
    write_labels(path, ["bad", "fine", "good"])
    engine = Engine.from_workdir(path, EngineConfig(max_slots=2))
    server = Server(engine, ServeConfig(api_key="k"), "tiny-classifier")
    yield server, engine.model
    server.stop()


def _mean_states(model, ids: list[int]) -> np.ndarray:
    """The model's final hidden states of one input alone, averaged over its positions."""
    return np.asarray(nnx.jit(lambda m, x: m.hidden(x))(model, jnp.asarray([ids]))[0]).mean(0)


def test_embeddings_are_each_input_s_mean_final_states(served):
    server, model = served
    texts = ["KING HENRY:", "to be, or not to be", "a"]  # three inputs over two slots: two calls, padded
    ids = [ByteTokenizer().encode(t) for t in texts]
    want = [_mean_states(model, x) for x in ids]
    out = server.client().embeddings.create(model=MODEL, input=texts)  # the client asks for base64
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == MODEL
    for d, w in zip(out.data, want, strict=True):
        np.testing.assert_allclose(d.embedding, w, rtol=1e-5, atol=1e-5)
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    status, floats = server.post("/v1/embeddings", {"model": MODEL, "input": ids, "encoding_format": "float"})
    assert status == 200, floats
    for d, e in zip(floats["data"], out.data, strict=True):  # the same float32s, as JSON numbers
        assert d["object"] == "embedding" and np.float32(d["embedding"]).tolist() == e.embedding
    status, one = server.post("/v1/embeddings", {"model": MODEL, "input": texts[0], "encoding_format": "base64"})
    raw = base64.b64decode(one["data"][0]["embedding"])
    np.testing.assert_allclose(struct.unpack(f"<{len(raw) // 4}f", raw), want[0], rtol=1e-5, atol=1e-5)  # alone


BAD = [
    ({"model": MODEL, "input": ""}, "input", "empty"),
    ({"model": MODEL, "input": []}, "input", "a string, a list of strings"),
    ({"model": MODEL, "input": ["ok", 3]}, "input[1]", "a string or a list of token ids"),
    ({"model": MODEL, "input": "x" * (MAX_LEN + 1)}, "input", "context"),
    ({"model": MODEL, "input": [[5, 999]]}, "input", "vocabulary"),
    ({"model": MODEL, "input": ["x"] * 2049}, "input", "at most 2048"),
    ({"model": MODEL, "input": "x", "encoding_format": "hex"}, "encoding_format", "'float' or 'base64'"),
    ({"model": MODEL, "input": "x", "dimensions": 8}, "dimensions", "32 dimensions"),
    ({"model": MODEL, "input": "x", "user": 1}, "user", "a string"),
    ({"model": MODEL, "input": "x", "colour": "red"}, "colour", "unrecognized"),
    ({"model": "other", "input": "x"}, "model", "does not exist"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD)
def test_a_bad_embeddings_request_is_a_400_naming_the_field(served, body, param, message):
    server, _ = served
    status, answer = server.post("/v1/embeddings", body)
    assert status == (404 if param == "model" else 400), answer
    assert answer["error"]["param"] == param and message in answer["error"]["message"], answer


def test_an_encoder_generates_nothing_and_says_where_its_embeddings_are(served):
    server, _ = served
    for route, body in (
        ("completions", {"prompt": "x"}),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        status, answer = server.post(f"/v1/{route}", {"model": MODEL, **body})
        assert status == 400 and answer["error"]["code"] == "model_not_supported", answer
        assert "/v1/embeddings" in answer["error"]["message"]
    assert server.client().embeddings.create(model=MODEL, input="still here").data[0].embedding


def test_classify_gives_each_input_s_class_probabilities_and_names_the_likeliest(classifier):
    """vLLM's format at both paths: probs are the model's softmax over its classes on each input alone (no
    padding, no batch), label the likeliest's name from the workdir; ids in, the same answer."""
    server, model = classifier
    texts = ["what a great app", "meh", "it crashes on every start, twice a day"]  # two calls over two slots
    ids = [ByteTokenizer().encode(t) for t in texts]
    alone = nnx.jit(lambda m, x: jax.nn.softmax(m.classify(x)))
    want = [np.asarray(alone(model, jnp.asarray([x]))[0]) for x in ids]
    assert len({int(np.argmax(w)) for w in want}) > 1, "inputs the model tells apart"
    status, out = server.post("/v1/classify", {"model": "tiny-classifier", "input": texts})
    assert status == 200, out
    assert out["object"] == "list" and out["id"].startswith("classify-") and out["model"] == "tiny-classifier"
    assert out["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids)),
                            "completion_tokens": 0}  # fmt: skip
    for i, (d, w) in enumerate(zip(out["data"], want, strict=True)):
        assert d["index"] == i and d["num_classes"] == 3
        np.testing.assert_allclose(d["probs"], w, rtol=1e-5, atol=1e-6)
        assert d["label"] == ["bad", "fine", "good"][int(np.argmax(w))]
    status, same = server.post("/classify", {"model": "tiny-classifier", "input": ids})  # vLLM's path, token ids
    assert status == 200 and [d["probs"] for d in same["data"]] == [d["probs"] for d in out["data"]], same
    status, one = server.post("/v1/classify", {"model": "tiny-classifier", "input": texts[1]})
    assert status == 200 and one["data"][0]["label"] == out["data"][1]["label"], one
    assert server.post("/v1/classify", {"model": "tiny-classifier", "input": "x"}, key=None)[0] == 401


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"model": "tiny-classifier", "input": []}, "input", "a string, a list of strings"),
        ({"model": "tiny-classifier", "input": "x" * (MAX_LEN + 1)}, "input", "context"),
        ({"model": "tiny-classifier", "input": [[5, 999]]}, "input", "vocabulary"),
        ({"model": "tiny-classifier", "input": "x", "encoding_format": "float"}, "encoding_format", "unrecognized"),
    ],
)
def test_a_bad_classify_request_is_a_400_naming_the_field(classifier, body, param, message):
    server, _ = classifier
    status, answer = server.post("/v1/classify", body)
    assert status == 400 and answer["error"]["param"] == param and message in answer["error"]["message"], answer


def test_classify_of_a_model_without_classes_is_refused_and_a_classifier_generates_nothing(served, classifier):
    server, _ = served
    status, answer = server.post("/classify", {"model": MODEL, "input": "x"})
    assert status == 400 and answer["error"]["code"] == "model_not_supported", answer
    assert "no classification head" in answer["error"]["message"] and "/v1/embeddings" in answer["error"]["message"]
    server, _ = classifier
    status, answer = server.post("/v1/completions", {"model": "tiny-classifier", "prompt": "x"})
    assert status == 400 and "/v1/classify" in answer["error"]["message"], answer


def test_the_page_classifies_and_embeds_what_is_typed_in_a_headless_browser(classifier, browser):
    """The page at `/` of a classifier offers classify and embed, not chat or completion, and no sampling
    settings; typed text gets each class's probability, likeliest first, as /v1/classify gives them, then
    its embedding's size."""
    server, model = classifier
    page = browser.new_page()
    page.goto(server.url + "/")
    page.fill("#api_key", "k")
    page.dispatch_event("#api_key", "change")  # the page asks /v1/models again, with the key
    page.wait_for_function("document.getElementById('model').textContent.startsWith('tiny-classifier (encoder_only')")
    shown = {m: page.is_visible(f"#for-{m}") for m in ("chat", "completion", "classify", "embed")}
    assert shown == {"chat": False, "completion": False, "classify": True, "embed": True}
    assert not page.is_visible("#sampling") and page.is_checked("#mode-classify")
    page.fill("#prompt", "what a great app")
    page.click("#send")
    page.wait_for_selector("#status[data-done='1']", timeout=processes.HANG_GUARD_S * 1000)
    probs = jax.nn.softmax(model.classify(jnp.asarray([ByteTokenizer().encode("what a great app")])))[0]
    order = np.argsort(-np.asarray(probs), kind="stable")
    want = [f"{['bad', 'fine', 'good'][i]}: {100 * float(probs[i]):.1f}%" for i in order]
    assert page.eval_on_selector_all("#answer .class", "es => es.map(e => e.textContent)") == want
    assert page.inner_text("#status").startswith(f"class {['bad', 'fine', 'good'][order[0]]} in ")
    page.evaluate("document.getElementById('status').dataset.done = ''")
    page.check("#mode-embed")
    page.click("#send")
    page.wait_for_selector("#status[data-done='1']", timeout=processes.HANG_GUARD_S * 1000)
    assert page.inner_text("#answer").startswith("32 dimensions, norm ")
    page.close()
