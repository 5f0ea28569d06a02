"""Instruction data: records written in a template, the loss on the response tokens (and EOS) only.

The weights are checked against the records read with `json` and tokenized here; the loss against
changed targets; packed rows against each example alone; and a tiny model trained on the shipped
file lowers its held-out response loss.
"""

import dataclasses
import json
import pathlib
import re
import typing
import warnings

import jax
import numpy as np
import pytest
from flax import nnx

from jaxformer import cli
from jaxformer import config as C
from jaxformer.data import DataError, build_dataset, templates
from jaxformer.data.pipeline import Batches
from jaxformer.data.sources import CORPORA
from jaxformer.data.tokenizers import ByteTokenizer
from jaxformer.models import Transformer
from jaxformer.train import loss_sums

TASKS = CORPORA / "instruct_tasks.jsonl"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Reverse: abc"},
    {"role": "assistant", "content": "cba"},
    {"role": "user", "content": "Upper: cba"},
    {"role": "assistant", "content": "CBA"},
]


def cfg_for(template: str, pack: bool, max_len: int = 96) -> C.Config:
    return C.Config(
        model=C.tiny("decoder_only", vocab_size=260, max_len=max_len, dropout_rate=0.0),
        data=C.DataConfig(source="files", files=(str(TASKS),), template=template, max_len=max_len, pack=pack),
        train=C.TrainConfig(objective="lm", batch_size=8),
    )


@pytest.fixture(scope="module", params=[False, True], ids=["unpacked", "packed"])
def batch(request):
    cfg = cfg_for("chatml", request.param, max_len=160)  # the longest chat record: 138 bytes
    return cfg, build_dataset(cfg).train.get(2)


def test_the_templates_write_a_multi_turn_record_exactly():
    """The last assistant turn is the response; the rest, earlier answers included, the prompt."""
    row = {"messages": CHAT}
    assert templates.to_pair(templates.get("alpaca"), row, ("prompt", "response")) == (
        "Be brief.\n\n### Instruction:\nReverse: abc\n\n### Response:\ncba\n\n### Instruction:\nUpper: cba\n\n"
        "### Response:\n",
        "CBA",
    )
    assert templates.to_pair(templates.get("chatml"), row, ("prompt", "response")) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nReverse: abc<|im_end|>\n"
        "<|im_start|>assistant\ncba<|im_end|>\n<|im_start|>user\nUpper: cba<|im_end|>\n<|im_start|>assistant\n",
        "CBA<|im_end|>",
    )
    pair = {"q": "Sort: cab", "a": "abc"}
    assert templates.to_pair(templates.get("alpaca"), pair, ("q", "a")) == (
        "### Instruction:\nSort: cab\n\n### Response:\n",
        "abc",
    )


def test_the_config_offers_the_templates_there_are():
    names = set(typing.get_args(typing.get_type_hints(C.DataConfig)["template"]))
    assert names == {"none", *templates.TEMPLATES}


def expected_weights(template: str) -> dict[tuple, np.ndarray]:
    """Every record of the shipped file as its full token sequence -> the weights of its targets,
    built from the file read with `json` and the byte tokenizer (not the pipeline)."""
    tok, t = ByteTokenizer(), templates.get(template)
    out = {}
    for line in TASKS.read_text().splitlines():
        row = json.loads(line)
        if "messages" in row:
            prompt, response = t.conversation(row["messages"][:-1]), row["messages"][-1]["content"] + t.end
        else:
            prompt, response = t.prompt(row["prompt"]), row["response"] + t.end
        p, r = tok.encode(prompt), [*tok.encode(response), tok.eos_id]
        out[tuple(p + r)] = np.asarray([0.0] * (len(p) - 1) + [1.0] * len(r), np.float32)
    return out


def pieces(batch: dict) -> list[tuple[int, np.ndarray]]:
    """(row, mask of its slots) of each example in a batch: a segment, or the row's real tokens."""
    if "segments" in batch:
        return [(b, batch["segments"][b] == s) for b in range(len(batch["inputs"])) for s in range(1, 99)
                if (batch["segments"][b] == s).any()]  # fmt: skip
    ends = [int(np.flatnonzero(row == ByteTokenizer().eos_id)[-1]) + 1 for row in batch["targets"]]
    return [(b, np.arange(batch["inputs"].shape[1]) < n) for b, n in enumerate(ends)]


def test_weights_are_one_on_the_response_and_eos_only(batch):
    _, batch = batch
    expected, found = expected_weights("chatml"), 0
    for b, at in pieces(batch):
        inputs, targets, weights = batch["inputs"][b][at], batch["targets"][b][at], batch["weights"][b][at]
        tokens = (inputs[0], *targets)
        assert tokens in expected, "every example is a whole record of the file (max_len holds them)"
        np.testing.assert_array_equal(weights, expected[tokens])
        assert (inputs[1:] == targets[:-1]).all()  # targets are the inputs shifted by one
        found += 1
    assert batch["weights"].sum() == sum(w.sum() for w in (batch["weights"][b][at] for b, at in pieces(batch)))
    assert found >= len(batch["inputs"])


def sums(cfg: C.Config, batch: dict) -> dict:
    """The loss sums of a fresh model (seed 0) over `batch`, in one compiled program (op by op, each of
    the model's operations was a program of its own, for each batch shape)."""
    graphdef, params = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(0)))
    at = jax.jit(lambda params, batch: loss_sums(nnx.merge(graphdef, params), cfg.train, batch, None)[1])
    with jax.default_matmul_precision("highest"):
        return {k: float(v) for k, v in at(params, batch).items()}


def test_the_loss_ignores_the_prompt_targets(batch):
    cfg, batch = batch
    before = sums(cfg, batch)
    prompt = np.argwhere((batch["weights"] == 0) & (batch["targets"] != 0))[3]  # a prompt token's target
    response = np.argwhere(batch["weights"] == 1)[1]
    for at, same in ((prompt, True), (response, False)):
        other = {**batch, "targets": batch["targets"].copy()}
        other["targets"][tuple(at)] = (other["targets"][tuple(at)] + 7) % 256 + 4  # another byte, inputs untouched
        after = sums(cfg, other)
        assert (after["nll"] == before["nll"]) is same
        assert after["count"] == before["count"]


def test_packed_rows_keep_each_example_in_its_own_segment():
    cfg = cfg_for("alpaca", pack=True, max_len=128)
    batch = build_dataset(cfg).train.get(1)
    seg, pos = batch["segments"], batch["positions"]
    assert seg.max() > 1, "rows hold several examples"
    parts = pieces(batch)
    for b, at in parts:  # one run of slots each, positions from 0
        assert np.ptp(np.flatnonzero(at)) == at.sum() - 1 and (pos[b][at] == np.arange(at.sum())).all()
    # Each example alone in its own row, from position 0: the same loss (no attention across segments).
    alone = {k: np.zeros((len(parts), seg.shape[1]), batch[k].dtype) for k in ("inputs", "targets", "weights")}
    for i, (b, at) in enumerate(parts):
        for k in alone:
            alone[k][i, : at.sum()] = batch[k][b][at]
    packed, reference = sums(cfg, batch), sums(cfg, alone)
    assert packed["count"] == reference["count"] == batch["weights"].sum()
    assert packed["nll"] == pytest.approx(reference["nll"], rel=1e-5)


def test_a_split_smaller_than_a_batch_is_one_padded_batch_with_its_exact_metrics(tmp_path):
    """600 records leave 30 validation examples; at batch 64 they are one batch whose 34 filler rows weigh
    nothing: its summed metrics are those of the 30 examples as a batch of 30 (the reference)."""
    data = build_dataset(cfg_for("alpaca", pack=False), tmp_path)
    examples = data.val.examples
    N = len(examples)
    assert 0 < N < 64
    padded, alone = (Batches(examples, B, seed=1) for B in (64, N))
    assert padded.padded and not alone.padded and len(padded) == len(alone) == 1
    big, exact = padded.get(0), alone.get(0)
    assert big["weights"].shape[0] == 64 and not big["weights"][N:].any()
    cfg = cfg_for("alpaca", pack=False)
    got, want = sums(cfg, big), sums(cfg, exact)
    assert got["count"] == want["count"] == exact["weights"].sum() > 0
    for k in ("loss", "nll", "correct"):
        assert got[k] == pytest.approx(want[k], rel=1e-5), k
    with pytest.raises(DataError, match=r"the train split has \d+ sequences, fewer than batch_size=4096; "
                       r"--set train.batch_size=\d+ \(or fewer\) fits it"):  # fmt: skip
        build_dataset(dataclasses.replace(cfg, train=C.TrainConfig(objective="lm", batch_size=4096)), tmp_path)


def test_a_tiny_model_learns_to_answer(tmp_path, capsys):
    """Through the CLI: the held-out response loss falls well below the untrained model's, and
    `generate` answers in the template. 100 steps: the loss is on its plateau from about step 80 (2.94
    nats at 100, 2.93 at 200, from the untrained 5.59)."""
    workdir = tmp_path / "run"
    small = ["model.d_model=64", "model.d_ff=256", "model.num_heads=2", "train.steps=100", "train.eval_every=100",
             "train.num_samples=0", "train.learning_rate=3e-3", "checkpoint.every=100"]  # fmt: skip
    argv = ["train", "--config", "experiments/instruct_tiny.py", "--workdir", str(workdir)]
    assert cli.main([*argv, *(x for s in small for x in ("--set", s))]) == 0
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["split"] == "train" and r["step"] == 0)["nll"]  # before any update
    end = [r for r in records if r["split"] == "eval"][-1]["nll"]
    assert start > 4.5 and end < 0.6 * start, (start, end)
    capsys.readouterr()
    assert cli.main(["generate", "--workdir", str(workdir), "--prompt", "Upper: abc"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Upper: abc\n=> ") and "###" not in out  # the answer alone, stopped at EOS


def test_seq2seq_reads_the_prompt_as_source_and_the_response_as_target(tmp_path):
    cfg = cfg_for("alpaca", pack=False)
    cfg = dataclasses.replace(
        cfg,
        model=C.tiny("encoder_decoder", vocab_size=260, max_len=96),
        train=C.TrainConfig(objective="seq2seq", batch_size=8),
    )
    data = build_dataset(cfg, tmp_path)
    tok = data.tokenizer
    batch = data.val.get(0)
    src = tok.decode(batch["src"][0][: batch["src_lengths"][0] - 1])
    tgt = tok.decode(batch["targets"][0][batch["weights"][0] > 0][:-1])
    assert src.startswith("### Instruction:\n") and src.endswith("### Response:\n")
    assert tgt and "###" not in tgt and pathlib.Path(TASKS).read_text().count(json.dumps(tgt)) >= 1


def test_examples_whose_prompts_fill_the_window_are_not_dropped_in_silence(tmp_path):
    """Cut to max_len + 1 tokens, an example whose templated prompt alone fills them scores nothing:
    all such (held-out loss read 0.0, perplexity NaN) is an error, some a warning counting them."""
    records = [{"prompt": "x" * (50 if i % 4 else 5), "response": "ok"} for i in range(400)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = cfg_for("alpaca", pack=False, max_len=48)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, files=(str(path),)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_dataset(cfg, tmp_path / "some")
    said = [str(w.message) for w in caught]
    for split in ("train", "validation", "test"):  # each split counts its own
        assert any(re.search(rf"\d+ of \d+ {split} examples keep no response token within data.max_len=48", s)
                   for s in said), said  # fmt: skip
    records = [{"prompt": "x" * 50, "response": "ok"} for _ in range(400)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(DataError, match=r"no train example keeps a response token within data.max_len=48"):
        build_dataset(cfg, tmp_path / "all")
