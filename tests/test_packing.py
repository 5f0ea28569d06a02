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
    from flax import nnx

    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    with jax.default_matmul_precision("highest"):
        return {k: float(v) for k, v in loss_sums(model, cfg.train, batch, None)[1].items()}


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


def test_classification_is_not_packed():
    with pytest.raises(C.ConfigError, match=r"data\.pack: classification is not packed"):
        C.Config(
            model=C.tiny("encoder_only", vocab_size=260, max_len=32, num_classes=8),
            data=C.DataConfig(source="lohelp_apps", max_len=32, pack=True),
            train=C.TrainConfig(objective="classify", batch_size=4),
        )
