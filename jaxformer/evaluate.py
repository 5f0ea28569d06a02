"""Held-out evaluation of a trained model, each figure beside a baseline that needs no model.

lm        perplexity vs a unigram model fitted on the training split
seq2seq   BLEU (sacrebleu) of translations (decoded as `cfg.decode` says: the translation
          experiment uses the paper's beam search) vs copying the source; exact-sequence accuracy
classify  accuracy vs always predicting the majority class of the training split; the loss and
          cross-entropy (no perplexity: it means nothing for labels)
mlm       masked-token accuracy and perplexity vs the unigram model
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from jaxformer import decode
from jaxformer.data.pipeline import Batches


def _arrays(batches: Batches, num_batches: int) -> dict[str, np.ndarray]:
    """The first batches joined; length-bucketed ones are padded to one width per key (pad id 0,
    weight 0): sources and targets may have widths of their own. A split smaller than a batch gives
    its examples alone (not the padded batch's filler rows)."""
    parts = [batches.get(i) for i in range(min(num_batches, len(batches)))]
    widths = {k: max(p[k].shape[1] for p in parts) for k, v in parts[0].items() if v.ndim == 2}
    widen = lambda k, v: np.pad(v, ((0, 0), (0, widths[k] - v.shape[1]))) if v.ndim == 2 else v
    rows = slice(batches.num_examples) if batches.padded else slice(None)
    return {k: np.concatenate([widen(k, p[k]) for p in parts])[rows] for k in parts[0]}


def unigram_perplexity(train: Batches, test: dict, vocab_size: int) -> float:
    """Perplexity of add-one unigram frequencies from the training split on the test targets."""
    counts = np.ones(vocab_size)
    for i in range(min(len(train), 200)):
        b = train.get(i)
        np.add.at(counts, b["targets"][b["weights"] > 0], 1)
    logp = np.log(counts / counts.sum())
    w = test["weights"] > 0
    return float(np.exp(-logp[test["targets"][w]].mean()))


def evaluate_model(cfg, graphdef, params, data, eval_step, state, num_batches: int = 32) -> dict:
    """Figures on the test split, beside their baselines."""
    from jaxformer.layers import check_batch_ids
    from jaxformer.train import evaluate

    objective = cfg.train.objective
    n = min(num_batches, len(data.test))
    fetch = lambda i: check_batch_ids(data.test.get(i), cfg.model)
    # A classifier's perplexity (exp of its log loss over labels) is no figure anyone reads: left out.
    dropped = {"tokens", "perplexity"} if objective == "classify" else {"tokens"}
    out = {f"test_{k}": v for k, v in evaluate(eval_step, state, fetch, n).items() if k not in dropped}
    out["test_sequences"] = data.test.sequences(n)  # what the figures are measured on
    test = _arrays(data.test, num_batches)
    if objective in ("lm", "mlm"):
        out["unigram_perplexity"] = unigram_perplexity(data.train, test, cfg.model.vocab_size)
    if objective == "classify":
        batches = [data.train.get(i) for i in range(min(len(data.train), 200))]
        # Packed training rows: labels [B, N], of which the segments a row holds (weight 1) are real.
        train_labels = np.concatenate([b["label"][b["weights"] > 0] if "weights" in b else b["label"] for b in batches])
        majority = np.bincount(train_labels).argmax()
        out["majority_accuracy"] = float((test["label"] == majority).mean())
    if objective == "seq2seq":
        import sacrebleu

        tok, model = data.tokenizer, nnx.merge(graphdef, params)
        n = min(len(test["src"]), 512)
        hyps, refs, srcs = [], [], []
        for i in range(0, n, cfg.train.batch_size):
            src = [[int(t) for t in row if t != tok.pad_id] for row in test["src"][i : i + cfg.train.batch_size]]
            hyps += decode.translate_texts(model, tok, src, cfg.decode)
            refs += [tok.decode(decode.strip_after_eos(t, tok.eos_id)) for t in test["targets"][i : i + len(src)]]
            srcs += [tok.decode(decode.strip_after_eos(s, tok.eos_id)) for s in src]
        out["bleu"] = sacrebleu.corpus_bleu(hyps, [refs]).score
        out["copy_source_bleu"] = sacrebleu.corpus_bleu(srcs, [refs]).score
        out["sequence_accuracy"] = float(np.mean([h == r for h, r in zip(hyps, refs, strict=True)]))
        out["examples"] = [{"src": s, "ref": r, "hyp": h} for s, r, h in list(zip(srcs, refs, hyps, strict=True))[:3]]
    return out
