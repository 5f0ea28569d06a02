"""Packing: several examples share a row with segment ids and per-segment positions. A packed batch's
loss equals the loss of the same examples each alone in its own row (no attention crosses examples,
positions restart, no loss on padding), and packing fills translation rows far better than padding."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxformer import config as C
from jaxformer.data import build_dataset
from jaxformer.models import Transformer
from jaxformer.train import loss_sums, real_fraction


def cfg_for(source, objective, mode, pack, **data):
    model = C.tiny(mode, vocab_size=260, max_len=32, dropout_rate=0.0)
    return C.Config(
        model=model,
        data=C.DataConfig(source=source, max_len=32, pack=pack, **data),
        train=C.TrainConfig(objective=objective, batch_size=4),
    )


def sums(cfg, batch) -> dict:
    """The loss sums of a fresh model (seed 0) over `batch`, in one compiled program (op by op, each of
    the model's operations was a program of its own, for each batch shape)."""
    from flax import nnx

    graphdef, params = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(0)))
    at = jax.jit(lambda params, batch: loss_sums(nnx.merge(graphdef, params), cfg.train, batch, None)[1])
    with jax.default_matmul_precision("highest"):
        return {k: float(v) for k, v in at(params, batch).items()}


def alone(rows: list[np.ndarray], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def test_packed_lm_windows_equal_their_documents_alone():
    cfg = cfg_for("shakespeare", "lm", "decoder_only", pack=True, max_examples=300)
    batch = build_dataset(cfg).train.get(3)
    seg, inputs, targets, weights = batch["segments"], batch["inputs"], batch["targets"], batch["weights"]
    assert (seg > 0).all() and seg.max() > 1, "windows hold several documents"
    assert (batch["positions"][seg != np.roll(seg, 1, axis=1)] == 0).all()  # positions restart per segment
    # Reference: each segment of each window as its own row from position 0.
    pieces = [(b, s) for b in range(len(seg)) for s in np.unique(seg[b])]
    ins = alone([inputs[b][seg[b] == s] for b, s in pieces], inputs.shape[1])
    tgts = alone([targets[b][seg[b] == s] for b, s in pieces], inputs.shape[1])
    w = alone([weights[b][seg[b] == s] for b, s in pieces], inputs.shape[1]).astype(np.float32)
    packed, reference = sums(cfg, batch), sums(cfg, {"inputs": ins, "targets": tgts, "weights": w})
    assert packed["count"] == reference["count"] < weights.size  # no target across documents
    assert packed["nll"] == pytest.approx(reference["nll"], rel=1e-5)


@pytest.mark.parametrize("src_max_len", [None, 24])
def test_packed_pairs_equal_each_pair_alone_and_fill_the_rows(tmp_path, src_max_len):
    import json

    rng = np.random.default_rng(0)
    words = ["ab", "cde", "f", "ghij", "kl"]
    pairs = [[" ".join(rng.choice(words, n)) for n in rng.integers(1, 6, 2)] for _ in range(600)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"source": a, "target": b}) + "\n" for a, b in pairs))
    files = (str(tmp_path / "p.jsonl"),)
    cfg = cfg_for("files", "seq2seq", "encoder_decoder", pack=True, files=files, src_max_len=src_max_len)
    train = build_dataset(cfg).train
    batch, rows = train.get(2), train.rows(2)
    assert max(len(r) for r in rows) > 1, "rows hold several pairs"
    assert batch["src"].shape[1] == (src_max_len or 32) and batch["inputs"].shape[1] == 32  # each side its width
    unpacked = build_dataset(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pack=False))).train
    reference = unpacked.examples.take(np.concatenate(rows))  # the same pairs, one per row
    a, b = sums(cfg, batch), sums(cfg, reference)
    assert a["count"] == b["count"] and a["nll"] == pytest.approx(b["nll"], rel=1e-5)
    for k in ("src_segments", "tgt_segments"):  # each example's source and target share its segment
        assert [sorted(set(r[r > 0].tolist())) for r in batch[k]] == [list(range(1, len(r) + 1)) for r in rows]
    epoch = [train.get(s) for s in range(len(train))]
    src_fill = sum((b["src_segments"] > 0).sum() for b in epoch) / sum(b["src"].size for b in epoch)
    tgt_fill = sum(b["weights"].sum() for b in epoch) / sum(b["weights"].size for b in epoch)
    assert max(src_fill, tgt_fill) > 0.9  # the side that fills first is full
    real, slots = zip(*map(real_fraction, epoch), strict=True)
    padded = zip(*(real_fraction(unpacked.get(s)) for s in range(len(unpacked))), strict=True)
    assert sum(real) / sum(slots) > 0.75 > np.divide(*map(sum, padded))


def test_packed_mlm_keeps_segments_through_masking():
    cfg = cfg_for("shakespeare", "mlm", "encoder_only", pack=True, max_examples=300)
    batch = build_dataset(cfg).train.get(0)
    assert {"segments", "positions", "inputs", "targets", "weights"} <= batch.keys()
    assert batch["segments"].max() > 1


def classify_cfg(pack: bool, pooling: str = "first") -> C.Config:
    model = C.tiny("encoder_only", vocab_size=260, max_len=64, num_classes=8, pooling=pooling, dropout_rate=0.0)
    data = C.DataConfig(source="lohelp_apps", max_len=64, pack=pack, max_segments=4, max_examples=2000)
    return C.Config(model=model, data=data, train=C.TrainConfig(objective="classify", batch_size=4))


def test_segment_pool_is_each_segments_first_token_or_mean():
    from jaxformer import functional as F

    x = np.random.default_rng(0).normal(size=(2, 7, 3)).astype(np.float32)
    segments = np.array([[1, 1, 2, 2, 2, 0, 0], [1, 2, 2, 3, 3, 3, 3]])
    for how, pool in (("first", lambda v: v[0]), ("mean", lambda v: v.mean(0))):
        got = np.asarray(F.segment_pool(x, segments, 4, how))  # [B, N, D]
        for b, n in np.ndindex(2, 4):
            held = segments[b] == n + 1
            np.testing.assert_allclose(got[b, n], pool(x[b][held]) if held.any() else 0.0, atol=1e-6)


def test_packed_classification_equals_each_text_alone():
    from flax import nnx

    from jaxformer import functional as F
    from jaxformer.state import init_state
    from jaxformer.train import make_steps

    cfg = classify_cfg(pack=True, pooling="mean")
    train = build_dataset(cfg).train
    alone = build_dataset(classify_cfg(pack=False)).train.examples  # the same texts, one per row
    batch, rows = train.get(1), train.rows(1)
    assert max(map(len, rows)) > 1 and batch["label"].shape == batch["weights"].shape == (4, 4)
    reference = alone.take(np.concatenate(rows))
    held = batch["weights"] > 0  # [B, N], row-major: segment n + 1 of row b is rows[b][n]
    np.testing.assert_array_equal(batch["label"][held], reference["label"])
    graphdef, state, optimizer = init_state(cfg)

    @jax.jit
    def logits(params, packed, single):
        model = nnx.merge(graphdef, params)
        segments = {k: packed[k] for k in ("src_segments", "src_positions")}
        return model.classify(packed["src"], **segments, num_segments=4), model.classify(
            single["src"], src_lengths=single["src_lengths"]
        )

    packed, single = logits(state.params, batch, reference)
    np.testing.assert_allclose(np.asarray(packed)[held], single, atol=1e-5, rtol=0)  # each segment pooled alone
    # A training step on the packed rows: its loss is the mean over the same texts, one per row.
    expected = float(F.cross_entropy(single, reference["label"])[0].mean())
    _, metrics = jax.jit(make_steps(graphdef, cfg, optimizer)[0])(state, batch)
    assert float(metrics["tokens"]) == held.sum()  # only real segments count
    assert float(metrics["loss"]) == pytest.approx(expected, rel=1e-5)
    real, slots = real_fraction(batch)
    assert real == (batch["src_segments"] > 0).sum() == reference["src_lengths"].sum() and slots == batch["src"].size


def test_packed_classification_rows_hold_at_most_max_segments():
    cfg = classify_cfg(pack=True)
    with pytest.raises(C.ConfigError, match=r"data\.max_segments: 8 texts cannot share a row of 4 tokens"):
        C.Config(model=cfg.model, data=dataclasses.replace(cfg.data, max_segments=8, src_max_len=4), train=cfg.train)
    train = build_dataset(cfg).train
    counts = [len(r) for s in range(len(train)) for r in train.rows(s)]
    assert max(counts) <= 4 and sum(counts) > 0.95 * train.num_examples  # few texts left out


def test_a_packed_classification_run_trains_evaluates_and_reports_its_baseline(tmp_path):
    """To the end of `fit`: packed training rows, unpacked evaluation, and the majority-class
    baseline counted from the packed rows' real segments (it once failed on labels [B, N]); the
    workdir keeps the data's class names."""
    import json

    from jaxformer.evaluate import evaluate_model
    from jaxformer.train import fit

    cfg = classify_cfg(pack=True)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=4, eval_every=4, log_every=2))
    r = fit(cfg, tmp_path, quiet=True)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(0.5 < row.get("real_fraction", 0) <= 1 for row in rows), "the packed rows' real-token share is logged"
    held_out = evaluate_model(cfg, r["graphdef"], r["state"].params, r["data"], r["eval_step"], r["state"], 2)
    assert 0 <= held_out["majority_accuracy"] <= 1 and 0 <= held_out["test_accuracy"] <= 1
    labels = json.loads((tmp_path / "labels.json").read_text())  # the class names, kept for serving and export-hf
    assert labels == list(r["data"].labels) and len(labels) > 2
