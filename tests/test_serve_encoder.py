"""`jaxformer serve` of an encoder_only model: OpenAI's `/v1/embeddings`, each input's final hidden states
averaged over its positions. The real `openai` client (which asks for base64) and plain JSON floats get
the model's own mean states of each input alone (no padding, no batch); malformed requests get a 400
naming the field, and the server answers on; a generating route on this model, or embeddings of a model
that generates, are refused by name."""

import base64
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

openai = pytest.importorskip("openai", reason='the test extra is not installed: pip install -e ".[test]"')
pytest.importorskip("uvicorn", reason='the test extra is not installed: pip install -e ".[test]"')

from servers import Server  # noqa: E402

from jaxformer.config import Config, DataConfig, EngineConfig, ServeConfig, TrainConfig, tiny  # noqa: E402
from jaxformer.data import ByteTokenizer  # noqa: E402
from jaxformer.engine import Engine  # noqa: E402

MODEL, MAX_LEN = "tiny-encoder", 48


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A step-0 workdir of a tiny byte-level encoder (masked-LM), served; and its model."""
    from jaxformer.checkpoint import start_workdir
    from jaxformer.state import state_factory

    cfg = Config(
        model=tiny("encoder_only", vocab_size=260, d_model=32, d_ff=64, num_encoder_layers=1, max_len=MAX_LEN),
        data=DataConfig(source="files", files=("a.txt",), tokenizer="byte", max_len=MAX_LEN),
        train=TrainConfig(objective="mlm"),
    )
    path = tmp_path_factory.mktemp("serve-embed") / "run"
    start_workdir(path, cfg, jax.jit(state_factory(cfg)[1])())
    engine = Engine.from_workdir(path, EngineConfig(max_slots=2))
    server = Server(engine, ServeConfig(), MODEL)
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
