"""`jaxformer serve` of an encoder_decoder model: each completion's prompt is a source and its answer the
model's output from BOS, `decode.translate`'s greedy tokens for it (whole, several prompts and streamed);
chat, echo and prompt_logprobs, which an answer that does not continue its prompt cannot honour, and a
source over the model's length are refused by name."""

import jax
import pytest

openai = pytest.importorskip("openai", reason='the test extra is not installed: pip install -e ".[test]"')
pytest.importorskip("uvicorn", reason='the test extra is not installed: pip install -e ".[test]"')

from servers import Server  # noqa: E402

from jaxformer import decode  # noqa: E402
from jaxformer.config import Config, DataConfig, DecodeConfig, EngineConfig, ServeConfig, TrainConfig, tiny  # noqa: E402
from jaxformer.data import ByteTokenizer  # noqa: E402
from jaxformer.engine import Engine  # noqa: E402

MODEL, MAX_LEN, TOK = "tiny-translator", 48, ByteTokenizer()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A step-0 workdir of a tiny byte-level encoder_decoder (weights x3: answers that depend on the
    source), served; and its model."""
    from flax import nnx

    from jaxformer.checkpoint import start_workdir
    from jaxformer.state import state_factory

    model = tiny("encoder_decoder", vocab_size=260, d_model=32, d_ff=64, num_encoder_layers=1, num_decoder_layers=1,
                 max_len=MAX_LEN, tie_output=False)  # fmt: skip
    cfg = Config(
        model=model,
        data=DataConfig(source="files", files=("pairs.tsv",), tokenizer="byte", max_len=MAX_LEN),
        train=TrainConfig(objective="seq2seq"),
    )
    graphdef, create, _ = state_factory(cfg)
    state = jax.jit(create)()
    state = state.replace(params=jax.tree.map(lambda x: 3.0 * x, state.params))
    path = tmp_path_factory.mktemp("serve-translate") / "run"
    start_workdir(path, cfg, state)
    engine = Engine.from_workdir(path, EngineConfig(max_slots=2, page_size=4, num_pages=40))
    server = Server(engine, ServeConfig(), MODEL)
    yield server, nnx.merge(graphdef, state.params)
    server.stop()


def _translations(model, texts: list[str], max_tokens: int) -> list[str]:
    """`decode.translate`'s greedy outputs of each source alone, cut to max_tokens, as text."""
    out = []
    for text in texts:
        ref = decode.translate(model, [TOK.encode(text)], DecodeConfig(strategy="greedy", extra_len=max_tokens),
                               bos_id=TOK.bos_id, eos_id=TOK.eos_id)  # fmt: skip
        out.append(TOK.decode(decode.strip_after_eos(ref.tokens[0][0][:max_tokens], TOK.eos_id)))
    return out


def test_a_completion_s_prompt_is_the_source_and_its_answer_translate_s(served):
    server, model = served
    sources = ["hello world", "the cat sat", "a"]  # three sources over two slots
    want = _translations(model, sources, 10)
    assert len(set(want)) == 3, want  # answers that depend on the source
    client = server.client()
    out = client.completions.create(model=MODEL, prompt=sources, max_tokens=10, temperature=0)
    assert [c.text for c in out.choices] == want
    assert out.usage.prompt_tokens == sum(len(TOK.encode(s)) for s in sources)
    stream = client.completions.create(model=MODEL, prompt=sources[0], max_tokens=10, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want[0]
    card = client.models.retrieve(MODEL).to_dict()
    assert card["mode"] == "encoder_decoder"  # the page offers completion only


@pytest.mark.parametrize(
    ("route", "body", "param", "message"),
    [
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "model", "not a conversation"),
        ("completions", {"prompt": "x", "echo": True}, "echo", "nothing to echo"),
        ("completions", {"prompt": "xy", "prompt_logprobs": 1}, "prompt_logprobs", "nothing to score"),
        ("completions", {"prompt": "x" * (MAX_LEN + 1)}, "prompt", f"the model's sources hold {MAX_LEN}"),
        ("completions", {"prompt": ["ok", "x" * (MAX_LEN + 1)]}, "prompt[1]", "sources hold"),
    ],
)
def test_what_a_translation_cannot_honour_is_a_400_naming_the_field(served, route, body, param, message):
    server, _ = served
    status, answer = server.post(f"/v1/{route}", {"model": MODEL, **body})
    assert status == 400 and answer["error"]["param"] == param and message in answer["error"]["message"], answer
    assert server.client().completions.create(model=MODEL, prompt="still here", max_tokens=2).choices[0].text
