"""From a DataConfig to deterministic, step-indexed batches of numpy arrays.

A split is a set of fixed-shape arrays; `Batches.get(step)` returns the batch of a
step as a pure function of (seed, step): epoch e uses the permutation seeded by
(seed, e). So the iterator's whole position is the step number, which makes exact
resume trivial, and any process can compute its slice of any step.

Batch keys by objective (all int32 unless noted; weights float32):
  lm        inputs [B, T], targets [B, T], weights [B, T]
  seq2seq   src [B, S], src_lengths [B], inputs [B, T] (BOS + target[:-1]), targets [B, T], weights [B, T]
  mlm       inputs [B, T] (masked), targets [B, T], weights [B, T] (1 on masked positions)
  classify  src [B, S], src_lengths [B], label [B]
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable

import numpy as np

from jaxformer.config import Config
from jaxformer.data import sources
from jaxformer.data.sources import DataError
from jaxformer.data.tokenizers import ByteTokenizer, HFTokenizer, SentencePieceTokenizer, SymbolTokenizer

# A workdir made by `jaxformer import-hf` keeps the pretrained model's tokenizer and config.json here.
HF_DIR = "hf"


@dataclasses.dataclass
class Batches:
    """Fixed-shape examples, or a generator for synthetic tasks, served by step.

    With `lengths` and `buckets`, each epoch's batches group examples of similar length
    (sorted within shuffled chunks of 32 batches), and each batch is cut to the smallest
    bucket width that holds its longest example: few shapes to compile, little padding.
    """

    arrays: dict[str, np.ndarray] | None
    batch_size: int
    seed: int
    generate: Callable[[np.random.Generator, int], dict[str, np.ndarray]] | None = None
    transform: Callable[[dict, np.random.Generator], dict] | None = None
    lengths: np.ndarray | None = None  # [N] tokens of each example's longest sequence
    buckets: tuple[int, ...] = ()  # widths a batch's sequences are cut to (ascending)
    _epoch: tuple[int, list] | None = dataclasses.field(default=None, repr=False)

    @property
    def num_examples(self) -> int:
        return 0 if self.arrays is None else len(next(iter(self.arrays.values())))

    def __len__(self) -> int:
        """Batches per epoch (what does not fill a batch is dropped)."""
        if self.arrays is None:
            return 1 << 62
        chunk = 32 * self.batch_size
        full, rest = divmod(self.num_examples, chunk)
        return full * 32 + rest // self.batch_size

    def _batches_of_epoch(self, epoch: int) -> list[np.ndarray]:
        if self._epoch is None or self._epoch[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch, 1 << 20])
            order = rng.permutation(self.num_examples)
            B, batches = self.batch_size, []
            for start in range(0, self.num_examples, 32 * B):
                idx = order[start : start + 32 * B]
                if self.lengths is not None:
                    idx = idx[np.argsort(self.lengths[idx], kind="stable")]
                batches += [np.sort(idx[i : i + B]) for i in range(0, len(idx) - B + 1, B)]
            self._epoch = (epoch, [batches[i] for i in rng.permutation(len(batches))])
        return self._epoch[1]

    def get(self, step: int, part: slice | None = None) -> dict[str, np.ndarray]:
        """The batch of `step`, or only its rows `part` (a process's share of the global batch).

        The part is cut after the batch-wide choices (bucket width, random masking), so the
        shares of all processes put together equal the whole batch.
        """
        rng = np.random.default_rng([self.seed, step])
        if self.arrays is None:
            batch = self.generate(rng, self.batch_size)
        else:
            epoch, index = divmod(step, len(self))
            rows = self._batches_of_epoch(epoch)[index]
            width = None
            if self.buckets:
                longest = int(self.lengths[rows].max())
                width = next((w for w in self.buckets if w >= longest), self.buckets[-1])
            if part is not None and self.transform is None:
                rows, part = rows[part], None  # read only this share
            batch = {k: v[rows, :width] if v.ndim == 2 else v[rows] for k, v in self.arrays.items()}
        batch = self.transform(batch, rng) if self.transform else batch
        return batch if part is None else {k: v[part] for k, v in batch.items()}


@dataclasses.dataclass
class Dataset:
    tokenizer: object
    train: Batches
    val: Batches
    test: Batches
    sample_sources: list[str]  # a few held-out inputs for greedy samples at evaluation
    sample_references: list[str]
    labels: tuple[str, ...] = ()  # classification: the class names, by index


def build_dataset(cfg: Config, workdir: str | pathlib.Path | None = None) -> Dataset:
    """Read, split, tokenize and batch the configured source; trains/loads SentencePiece in workdir."""
    d, t = cfg.data, cfg.train
    if d.source in ("copy", "reverse"):
        return _synthetic(cfg)
    src = source_of(cfg)
    path = ", ".join(src.files)
    records, labels = sources.read(src, labelled=t.objective == "classify")
    if len(labels) > cfg.model.num_classes and t.objective == "classify":
        named = ", ".join(labels)
        raise DataError(f"{path}: {len(labels)} labels ({named}) but model.num_classes={cfg.model.num_classes}")
    texts_of = lambda rs: [x for r in rs for x in r[1 : 3 if t.objective == "seq2seq" else 2]]
    if d.max_examples:
        records = records[: d.max_examples]
    train, val, test = sources.split(records, d.val_fraction, d.test_fraction, d.split_seed, path)
    tok = _tokenizer(cfg, texts_of(train), workdir)
    if tok.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"{path}: the {d.tokenizer} tokenizer has {tok.vocab_size} ids but model.vocab_size={cfg.model.vocab_size}"
        )

    def encode(split_records):
        return _encode(cfg, tok, split_records, path)

    transform = _mlm_masking(cfg, tok) if t.objective == "mlm" else None
    buckets = bucket_widths(d.max_len, d.length_buckets) if t.objective in ("seq2seq", "classify") else ()

    def mk(arrays, seed):
        lengths = arrays.pop("lengths", None)
        return Batches(arrays, t.batch_size, seed, transform=transform, lengths=lengths, buckets=buckets)

    arrays = [encode(s) for s in (train, val, test)]
    for name, a in zip(("train", "validation", "test"), arrays, strict=True):
        n = len(next(iter(a.values())))
        if n < t.batch_size:
            raise DataError(f"{path}: the {name} split has {n} sequences, fewer than batch_size={t.batch_size}")
    samples = test[: max(t.num_samples, 1)]
    if t.objective == "seq2seq":
        src_texts, refs = [r[1] for r in samples], [r[2] for r in samples]
    elif t.objective == "classify":
        src_texts, refs = [r[1] for r in samples], [labels[r[2]] for r in samples]
    else:
        src_texts, refs = [r[1][:80] for r in samples], [r[1][80:200] for r in samples]
    splits = mk(arrays[0], t.seed), mk(arrays[1], 1_000 + t.seed), mk(arrays[2], 2_000 + t.seed)
    return Dataset(tok, *splits, src_texts, refs, labels)


def source_of(cfg: Config) -> sources.Source:
    """The configured data as a `Source`: a shipped corpus (its file replaced by `data.path`) or the user's files."""
    d, objective = cfg.data, cfg.train.objective
    if d.source == "files":
        fields = d.fields or sources.FIELDS[objective]
        src = sources.Source(d.files, fields, d.format, d.text_unit, d.labels, min_words=d.min_words or 0)
    else:
        src = sources.SHIPPED[d.source]
        if d.path:
            src = dataclasses.replace(src, files=(d.path,))
        if d.min_words is not None:
            src = dataclasses.replace(src, min_words=d.min_words)
        if d.fields:
            src = dataclasses.replace(src, fields=d.fields)
    return src


def load_tokenizer(cfg: Config, workdir: str | pathlib.Path):
    """The tokenizer a run in `workdir` was trained with (no corpus is read)."""
    if cfg.data.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.data.tokenizer == "symbols":
        return SymbolTokenizer(cfg.data.synthetic_vocab)
    if cfg.data.tokenizer == "hf":
        return HFTokenizer(pathlib.Path(workdir) / HF_DIR)
    model_file = pathlib.Path(workdir) / "tokenizer.model"
    if not model_file.is_file():
        raise DataError(f"{model_file} does not exist: train in this workdir first")
    return SentencePieceTokenizer(model_file)


def _tokenizer(cfg: Config, train_texts: list[str], workdir):
    """The run's tokenizer: SentencePiece is trained on `train_texts` the first time (a resumed run
    keeps the one it was trained with); the others are loaded as `load_tokenizer` does."""
    if cfg.data.tokenizer == "symbols":
        raise DataError(f"data.tokenizer='symbols' is for the copy/reverse tasks, not {cfg.data.source}")
    model_file = pathlib.Path(workdir or ".") / "tokenizer.model"
    if cfg.data.tokenizer == "sentencepiece" and not model_file.is_file():
        return SentencePieceTokenizer.train(train_texts, model_file, cfg.data.spm_vocab_size, cfg.data.spm_model_type)
    return load_tokenizer(cfg, workdir or ".")


def bucket_widths(max_len: int, n: int) -> tuple[int, ...]:
    """n widths up to max_len, evenly spaced and rounded up to multiples of 8."""
    return tuple(sorted({min(max_len, -(-max_len * (i + 1) // n // 8) * 8) for i in range(n)}))


def fit_length(ids: list[int], max_len: int, policy: str, where: str) -> list[int]:
    """Truncate or reject a sequence longer than max_len, by config."""
    if len(ids) <= max_len:
        return ids
    if policy == "reject":
        raise DataError(f"{where}: sequence of {len(ids)} tokens exceeds data.max_len={max_len} (data.too_long=reject)")
    return ids[:max_len]


def pad_to(rows: list[list[int]], length: int, pad_id: int) -> np.ndarray:
    out = np.full((len(rows), length), pad_id, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _encode(cfg: Config, tok, records, path) -> dict[str, np.ndarray]:
    d, objective = cfg.data, cfg.train.objective
    L = d.max_len
    if objective in ("lm", "mlm"):
        # One token stream (EOS between paragraphs), cut into windows: packing without padding.
        stream = [i for r in records for i in [*tok.encode(r[1]), tok.eos_id]]
        width = L + 1 if objective == "lm" else L
        n = len(stream) // width
        if n == 0:
            raise DataError(f"{path}: too little text for one window of {width} tokens")
        windows = np.asarray(stream[: n * width], np.int32).reshape(n, width)
        if objective == "mlm":
            return {"tokens": windows}
        # Every position of a window is text: a real token that shares the pad id still counts.
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:], "weights": np.ones((n, L), np.float32)}
    if objective == "classify":
        rows = [fit_length([tok.bos_id, *tok.encode(r[1])], L, d.too_long, r[0]) for r in records]
        labels = np.asarray([r[2] for r in records], np.int32)
        lengths = np.asarray([len(r) for r in rows], np.int32)
        return {"src": pad_to(rows, L, tok.pad_id), "src_lengths": lengths, "label": labels, "lengths": lengths}
    srcs = [fit_length([*tok.encode(r[1]), tok.eos_id], L, d.too_long, r[0]) for r in records]
    tgts = [fit_length([*tok.encode(r[2]), tok.eos_id], L, d.too_long, r[0]) for r in records]
    lengths = np.asarray([max(len(a), len(b)) for a, b in zip(srcs, tgts, strict=True)])
    return _seq2seq_arrays(srcs, tgts, L, tok) | {"lengths": lengths}


def _seq2seq_arrays(srcs, tgts, L, tok) -> dict[str, np.ndarray]:
    targets = pad_to(tgts, L, tok.pad_id)
    inputs = np.concatenate([np.full((len(tgts), 1), tok.bos_id, np.int32), targets[:, :-1]], axis=1)
    tgt_lengths = np.asarray([len(t) for t in tgts], np.int32)
    real = np.arange(L)[None] < tgt_lengths[:, None]  # [B, L]: padding is said, not read off an id
    return {
        "src": pad_to(srcs, L, tok.pad_id),
        "src_lengths": np.asarray([len(s) for s in srcs], np.int32),
        "inputs": np.where(real, inputs, tok.pad_id).astype(np.int32),
        "targets": targets,
        "weights": real.astype(np.float32),
    }


def _mlm_masking(cfg: Config, tok):
    """BERT masking, drawn from the step's generator: p of the tokens are chosen;
    of those 80% become [MASK], 10% a random token, 10% stay; loss on the chosen only."""
    p = cfg.train.mlm_probability

    def transform(batch, rng):
        tokens = batch["tokens"]
        chosen = (rng.random(tokens.shape) < p) & (tokens != tok.pad_id)
        action = rng.random(tokens.shape)
        random_ids = rng.integers(tok.first_real, tok.vocab_size, tokens.shape, dtype=np.int32)
        inputs = np.where(chosen & (action < 0.8), tok.mask_id, tokens)
        inputs = np.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, inputs)
        return {"inputs": inputs.astype(np.int32), "targets": tokens, "weights": chosen.astype(np.float32)}

    return transform


def _synthetic(cfg: Config) -> Dataset:
    """The Annotated Transformer's copy (or reverse) task: random symbols 2..V-1, target = source."""
    d, t = cfg.data, cfg.train
    tok = SymbolTokenizer(d.synthetic_vocab)
    if t.objective != "seq2seq":
        raise DataError(f"data.source={d.source} is a seq2seq task; train.objective={t.objective}")

    def generate(rng, n):
        src = rng.integers(2, d.synthetic_vocab, (n, d.synthetic_len), dtype=np.int32)
        tgt = src[:, ::-1] if d.source == "reverse" else src
        return _seq2seq_arrays(list(src), list(tgt), d.synthetic_len, tok)

    held_out = generate(np.random.default_rng([d.split_seed, 99]), max(t.num_samples, 1))
    samples = [tok.decode(s) for s in held_out["src"]]
    refs = [tok.decode(s) for s in held_out["targets"]]
    mk = lambda seed: Batches(None, t.batch_size, seed, generate=generate)
    return Dataset(tok, mk(t.seed), mk(1_000 + t.seed), mk(2_000 + t.seed), samples, refs)
