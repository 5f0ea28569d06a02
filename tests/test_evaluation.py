"""The model `jaxformer` of lm-evaluation-harness against independent figures: a continuation's
log-likelihood is the sum of the model's token log-probabilities (one forward pass, read by hand);
`loglikelihood_rolling` of a document is the perplexity `jaxformer eval` reports on it (the training's
loss sums); greedy `generate_until` is `decode.generate` cut at the same stop strings; and on a tiny
GPT-2 and a tiny T5, every example's answers equal those of the harness's own `hf` model on the
PyTorch weights (golden files: scripts/make_lm_eval_golden.py); the harness's own client for
OpenAI-compatible servers against `jaxformer serve` on a workdir gives the numbers the model `jaxformer`
gives on it."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("lm_eval", reason="the eval extra is not installed: pip install -e '.[eval]'")

from lm_eval.api.instance import Instance

from jaxformer import decode
from jaxformer.config import DecodeConfig, TrainConfig, tiny
from jaxformer.evaluation import run
from jaxformer.evaluation.harness import HarnessError, JaxformerLM
from jaxformer.models import build_model

GOLDEN = pathlib.Path(__file__).parent / "golden" / "lm_eval"


class Chars:
    """One id per character of a small alphabet (the harness's text rules need text, V stays small)."""

    pad_id, bos_id, eos_id = 0, 1, 2
    alphabet = " \nabcdefghijklmnopqrstuvwxyz.,:'"

    def encode(self, text):
        return [3 + self.alphabet.index(c) for c in text.lower() if c in self.alphabet]

    def decode(self, ids):
        return "".join(self.alphabet[i - 3] for i in ids if 3 <= i < 3 + len(self.alphabet))


V = 3 + len(Chars.alphabet)


@pytest.fixture(scope="module")
def lm():
    """Two layers, parameters x3 (as test_engine's model): continuations that depend on the context."""
    model = build_model(tiny("decoder_only", vocab_size=V, max_len=64), seed=3)
    nnx.update(model, jax.tree.map(lambda x: 3.0 * x, nnx.state(model, nnx.Param)))
    return JaxformerLM(model=model, tokenizer=Chars(), batch_size=4, max_gen_toks=12)


def requests(kind, *args):
    return [Instance(kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def token_logprobs(model, rows):
    """log p(ids[t] | ids[:t]) for t >= 1 of each row, and the argmax before each, from one forward pass
    over the rows right-padded (causal: what follows a position never changes it)."""
    T = max(map(len, rows))
    ids = np.asarray([r + [0] * (T - len(r)) for r in rows], np.int32)
    logp = np.asarray(jax.jit(lambda x: jax.nn.log_softmax(model(x).astype(jnp.float32), axis=-1))(ids))
    return [(logp[b, np.arange(len(r) - 1), r[1:]], logp[b, : len(r) - 1].argmax(-1)) for b, r in enumerate(rows)]


def test_loglikelihood_is_the_sum_of_token_logprobs(lm):
    tok, model = lm.tok, lm.model
    pairs = [("to be or not ", "to be"), ("a", "b"), ("the king:", " is dead."), ("", "all is well")]
    got = lm.loglikelihood(requests("loglikelihood", *pairs))
    rows, splits = [], []
    for context, continuation in pairs:
        context_ids = tok.encode(context.rstrip()) or [tok.eos_id]  # an empty context: the prefix token (EOS)
        continuation_ids = tok.encode(context[len(context.rstrip()) :] + continuation)  # its trailing space moves
        rows.append(context_ids + continuation_ids)
        splits.append(len(context_ids))
    for (ll, greedy), (logp, argmax), row, n in zip(got, token_logprobs(model, rows), rows, splits, strict=True):
        np.testing.assert_allclose(ll, logp[n - 1 :].sum(), rtol=1e-5, atol=1e-5)
        assert greedy == bool((argmax[n - 1 :] == row[n:]).all())


def test_loglikelihood_rolling_is_evals_perplexity(lm):
    """`jaxformer eval` reads a document as its corpus lays it out: after the EOS that ends the one before."""
    from jaxformer.train import loss_sums, summarize

    docs = ["the quality of mercy is not strained.", "now is the winter of our discontent"]
    got = lm.loglikelihood_rolling(requests("loglikelihood_rolling", *[(d,) for d in docs]))
    for doc, ll in zip(docs, got, strict=True):
        window = np.asarray([[lm.tok.eos_id, *lm.tok.encode(doc)]], np.int32)
        batch = {"inputs": window[:, :-1], "targets": window[:, 1:], "weights": np.ones_like(window[:, 1:], np.float32)}
        sums = jax.jit(lambda b: loss_sums(lm.model, TrainConfig(objective="lm"), b, None)[1])(batch)
        perplexity = float(summarize(sums)["perplexity"])  # compared as logs: this model's is ~1e8, exp widens
        np.testing.assert_allclose(-ll / (window.shape[1] - 1), np.log(perplexity), rtol=1e-6)


def test_greedy_generate_until_is_generate_cut_at_the_stops(lm):
    tok = lm.tok
    contexts = ["to be or not", "the king", "a"]
    settings = DecodeConfig(strategy="greedy", max_new_tokens=12)
    out = decode.generate(lm.model, [tok.encode(c) for c in contexts], settings, eos_id=tok.eos_id)
    whole = [tok.decode(decode.strip_after_eos(row[0], tok.eos_id)) for row in out.tokens]
    # Stops met mid-way (two characters the reference writes, a character of it), and one never met.
    stops = [[whole[0][4:6]], ["zzz", whole[1][3]], ["zzz"]]
    got = lm.generate_until(
        requests("generate_until", *[(c, {"until": u}) for c, u in zip(contexts, stops, strict=True)])
    )
    for text, reference, until in zip(got, whole, stops, strict=True):
        for stop in until:
            reference = reference.split(stop)[0]
        assert text == reference
    assert len(got[0]) <= 4 and len(got[1]) <= 3 and got[2] == whole[2]


def test_generation_longer_than_the_model_is_refused(lm):
    with pytest.raises(HarnessError, match=r"max_gen_toks=64 new tokens; the model's context is model\.max_len=64"):
        lm.generate_until(requests("generate_until", ("to be", {"until": ["\n"], "max_gen_toks": 64})))


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_golden_hf_model_answers(name):
    """Each example's answers, as the harness's `hf` model gives them on the PyTorch weights."""
    golden = json.loads((GOLDEN / name / "samples.json").read_text())
    lm = JaxformerLM(hf=str(GOLDEN / name), batch_size=8)
    results = run.evaluate(lm, list(golden["samples"]), limit=8, log_samples=True)
    for task, samples in golden["samples"].items():
        ours = {s["doc_id"]: s["resps"] for s in results["samples"][task]}
        for sample in samples:
            theirs, mine = sample["resps"], ours[sample["doc_id"]]
            if isinstance(theirs[0][0], list):  # loglikelihood: [[(ll, is_greedy)] per choice]
                np.testing.assert_allclose([r[0][0] for r in mine], [r[0][0] for r in theirs], rtol=1e-4)
                assert [r[0][1] for r in mine] == [r[0][1] for r in theirs]
            else:
                assert mine == theirs, (task, sample["doc_id"])
        for metric, value in golden["metrics"][task].items():
            assert results["results"][task][metric] == pytest.approx(value), (task, metric)


def test_train_evals_metrics_are_the_tasks_scores(lm):
    """What train.evals logs beside the loss: TASK/METRIC, accuracy recounted from loglikelihood."""
    docs = [json.loads(line) for line in (run.TASKS_DIR / "shakespeare_cloze.jsonl").read_text().splitlines()[:2]]
    got = run.harness_metrics(lm.model, lm.tok, ["shakespeare_cloze"], limit=2)
    assert sorted(got) == ["shakespeare_cloze/acc", "shakespeare_cloze/acc_norm"]
    right = 0
    for doc in docs:
        scores = lm.loglikelihood(requests("loglikelihood", *[(doc["context"], "\n" + c) for c in doc["choices"]]))
        right += int(np.argmax([ll for ll, _ in scores]) == doc["answer"])
    assert got["shakespeare_cloze/acc"] == right / len(docs)


def test_an_encoder_only_model_is_refused_naming_what_it_can_do():
    model = build_model(tiny("encoder_only", vocab_size=V, max_len=16, num_classes=2))
    with pytest.raises(HarnessError, match=r"^an encoder_only model has no next-token distribution: .+Engine\.score$"):
        JaxformerLM(model=model, tokenizer=Chars())


def test_train_evals_runs_inside_fit_and_logs_what_eval_tasks_gives(tmp_path, capsys):
    """train.evals inside `fit`: at step 2 metrics.jsonl holds the task's metrics, equal to those
    `jaxformer eval --tasks` gives on the checkpoint that run saved (the same weights, another route)."""
    from jaxformer import cli
    from jaxformer.config import apply_overrides, load_experiment
    from jaxformer.train import fit

    cfg = apply_overrides(
        load_experiment("experiments/lm_shakespeare.py"),
        ["model.d_model=16", "model.num_heads=2", "model.d_ff=32", "model.num_decoder_layers=1",
         "data.max_examples=64", "train.steps=2", "train.batch_size=4", "train.eval_every=2",
         "train.eval_batches=1", "train.num_samples=0", "train.evals=shakespeare_cloze", "train.evals_limit=4"],
    )  # fmt: skip
    fit(cfg, tmp_path / "w", quiet=True)
    logged = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    at_end = next(r for r in logged if r["split"] == "eval" and r["step"] == 2)
    out = tmp_path / "results.json"
    argv = ["eval", "--workdir", str(tmp_path / "w"), "--tasks", "shakespeare_cloze", "--limit", "4"]
    assert cli.main([*argv, "--output", str(out)]) == 0
    capsys.readouterr()
    results = json.loads(out.read_text())["results"]["shakespeare_cloze"]
    for metric in ("acc", "acc_norm"):
        assert at_end[f"shakespeare_cloze/{metric}"] == pytest.approx(results[f"{metric},none"]), metric


@pytest.fixture(scope="module")
def gpt2_served(tmp_path_factory):
    """The tiny GPT-2 imported as a workdir (its tokenizer files in W/hf), `jaxformer serve`'s app on it
    (uvicorn in a thread, a free port of 127.0.0.1), and the native model on the same workdir with the
    same engine settings (so the two share their compilations)."""
    for extra in ("uvicorn", "starlette", "openai", "aiohttp", "tenacity", "transformers"):
        pytest.importorskip(extra, reason=f"{extra}: the serve, eval and test extras")
    from servers import Server

    from jaxformer.config import EngineConfig, ServeConfig
    from jaxformer.engine import Engine
    from jaxformer.interop.hf_workdir import import_hf

    workdir = tmp_path_factory.mktemp("served") / "gpt2"
    import_hf(GOLDEN / "gpt2", workdir)
    settings = EngineConfig(max_slots=8, page_size=8)
    engine = Engine.from_workdir(workdir, settings)
    server = Server(engine, ServeConfig(), "tiny-gpt2")
    native = JaxformerLM(workdir=str(workdir), batch_size=8, engine=settings)
    yield workdir, f"{server.url}/v1/completions", engine.max_context, native
    server.stop()


def test_lm_evals_openai_client_through_serve_gives_the_native_models_numbers(gpt2_served):
    """lm-eval's `local-completions` (HTTP, `echo` + `logprobs` for log-likelihoods, the Hugging Face
    tokenizer cutting contexts) against `jaxformer serve`, and the model `jaxformer`, on one workdir:
    every example's answers and every metric agree, on a multiple-choice task and a generation task."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    workdir, url, max_context, native = gpt2_served
    # max_length: the client keeps one position for the token it asks for (max_tokens=1) beside the prompt.
    client = LocalCompletionsAPI(
        model="tiny-gpt2", base_url=url, tokenizer=str(workdir / "hf"), tokenizer_backend="huggingface",
        max_length=max_context, batch_size=8, max_retries=1,
    )  # fmt: skip
    tasks = ["shakespeare_cloze", "instruct_exact"]
    served, ours = (run.evaluate(lm, tasks, limit=4, log_samples=True) for lm in (client, native))
    for task in tasks:
        theirs = {s["doc_id"]: s["resps"] for s in served["samples"][task]}
        for sample in ours["samples"][task]:
            mine, got = sample["resps"], theirs[sample["doc_id"]]
            if isinstance(mine[0][0], list | tuple):  # loglikelihood: [[(ll, is_greedy)] per choice]
                np.testing.assert_allclose([r[0][0] for r in got], [r[0][0] for r in mine], rtol=1e-6)
                assert [r[0][1] for r in got] == [r[0][1] for r in mine]
            else:
                assert got == mine, (task, sample["doc_id"])
        assert served["results"][task] == ours["results"][task]  # acc and acc_norm, or exact_match
    # The tasks' continuations are nobody's greedy choice: ask for greedy ones (each context's own
    # generation), so that is_greedy is seen true as well as false through both routes.
    contexts = ["KING HENRY:", "to be or not"]
    greedy = native.generate_until(
        requests("generate_until", *[(c, {"until": ["zzz"], "max_gen_toks": 6}) for c in contexts])
    )
    asked = requests("loglikelihood", *zip(contexts, greedy, strict=True))
    got, mine = client.loglikelihood(asked), native.loglikelihood(asked)
    np.testing.assert_allclose([g[0] for g in got], [m[0] for m in mine], rtol=1e-6)
    assert [g[1] for g in got] == [m[1] for m in mine] and any(m[1] for m in mine)
