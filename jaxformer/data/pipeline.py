"""From a DataConfig to deterministic, step-indexed batches of numpy arrays.

A split is the prepared corpus' documents on disk (`prepare.py`); `Batches.get(step)` returns the
batch of a step as a pure function of (seed, step): epoch e takes grain's lazy shuffle of the
examples reseeded for e. So the iterator's whole position is the step number, which makes exact
resume trivial, and any process can read its rows of any step alone.

Batch keys by objective (all int32 unless noted; weights float32), S the source width
(data.src_max_len, else data.max_len) and T data.max_len, or smaller bucket widths:

- lm: inputs [B, T], targets [B, T], weights [B, T]; instruction data (data.template): one
  example a row, right-padded, weights 1 on the response's targets (its EOS too) only
- seq2seq: src [B, S], src_lengths [B], inputs [B, T] (BOS + `target[:-1]`), targets [B, T], weights [B, T]
- mlm: inputs [B, T] (masked), targets [B, T], weights [B, T] (1 on masked positions)
- classify: src [B, S], src_lengths [B], label [B]

Packed (data.pack, training only): lm/mlm add segments [B, T] and positions [B, T] (instruction
examples placed first-fit as pairs are, each its own segment); seq2seq has
src_segments, src_positions [B, S] and tgt_segments, tgt_positions [B, T] instead of src_lengths;
classify has src_segments, src_positions [B, S] instead of src_lengths, and label [B, N] (segment
n + 1's class) with weights [B, N] (1 where the row holds segment n + 1), N = data.max_segments.

The examples of each kind (`Documents`, `Windows`, `Pairs`, `Completions`, `Labelled`) and their
packing (`Packed`) live in `jaxformer.data.examples`; their names are re-exported here.
"""

from __future__ import annotations

import dataclasses
import pathlib
import warnings
from collections.abc import Callable, Iterator

import numpy as np

from jaxformer.config import Config
from jaxformer.data.examples import (
    Completions,
    Documents,
    Examples,
    Labelled,
    Packed,
    Pairs,
    Windows,
    _seq2seq_arrays,
    fullness,
)
from jaxformer.data.prepare import check_vocab, completions, prepare
from jaxformer.data.sources import DataError, source_of
from jaxformer.data.tokenizers import ByteTokenizer, SymbolTokenizer, load_tokenizer


@dataclasses.dataclass
class Batches:
    """Examples (memory-mapped from a prepared corpus), or a generator for synthetic tasks, served by step.

    The order of an epoch is grain's lazy global shuffle of the example indices (`MapDataset.shuffle`,
    reseeded each epoch by `repeat`): nothing of size N is held, so memory stays flat as the corpus
    grows. Batch i of an epoch takes positions `i*B .. i*B+B-1` of that epoch's order. With `buckets`,
    an epoch's order is cut into chunks of 32 batches whose examples are sorted by the first bucket
    that holds them (then by how full they make it: the longest side over its width), and each
    batch is cut to the first bucket whose widths hold its longest source and target: few shapes
    to compile, little padding.

    Attributes:
        examples: the examples, or None for a synthetic task's `generate`.
        batch_size: B, the global batch.
        seed: the shuffle's and the masking's seed.
        generate: (generator, B) -> a batch, for synthetic tasks.
        transform: (batch, one generator per row) -> batch (MLM masking).
        buckets: widths (one per side) a batch is cut to, ascending; empty: the full widths.
        _chunk: the last chunk's batches, cached.
    """

    examples: Examples | None
    batch_size: int
    seed: int
    generate: Callable[[np.random.Generator, int], dict[str, np.ndarray]] | None = None
    transform: Callable[[dict, list[np.random.Generator]], dict] | None = None  # per row generators
    buckets: tuple[tuple[int, ...], ...] = ()  # widths (one per side) a batch is cut to, ascending
    _chunk: tuple[int, list] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        if self.examples is not None:
            import grain

            self.order = grain.MapDataset.range(len(self.examples)).shuffle(seed=self.seed).repeat()

    @property
    def num_examples(self) -> int:
        """N, the examples of an epoch (0 for a synthetic task)."""
        return 0 if self.examples is None else len(self.examples)

    @property
    def padded(self) -> bool:
        """Fewer examples than a batch (a small held-out split): one batch of all N, whose rows N..B-1
        repeat example 0 with weight 0, so its summed metrics are those of the N examples exactly (the
        loss, cross-entropy and accuracy; MoE layers route the filler rows too, so the router's batch
        statistics, and with them an MoE model's auxiliary losses, count them)."""
        return (
            self.examples is not None and not isinstance(self.examples, Packed) and self.num_examples < self.batch_size
        )

    def __len__(self) -> int:
        """Batches per epoch (what does not fill a batch, or a packed chunk's batches, is dropped; a
        split smaller than a batch is one padded batch)."""
        if self.examples is None:
            return 1 << 62
        if self.padded:
            return 1
        if isinstance(self.examples, Packed):
            return self.examples.batches_per_epoch
        return self.num_examples // self.batch_size

    def sequences(self, num_batches: int) -> int:
        """The examples the first `num_batches` batches hold (a padded batch: its own examples only).

        Args:
            num_batches: how many batches, from the first.

        Returns:
            The count.
        """
        return self.num_examples if self.padded else num_batches * self.batch_size

    def rows(self, step: int) -> np.ndarray | list[np.ndarray]:
        """[B] the example indices of the batch of `step` (sorted), or for packed examples the B rows'
        lists of examples; the batches of an epoch never repeat an example, and what does not fill
        a batch at an epoch's end is left out.

        Args:
            step: the training step.

        Returns:
            [B] example indices, or B arrays of example indices (packed rows).
        """
        B, N = self.batch_size, self.num_examples
        if self.padded:  # every example, then example 0 again in the rows `get` weighs 0
            return np.pad(np.arange(N), (0, B - N))
        epoch, index = divmod(step, len(self))
        first = epoch * N  # grain's repeat reshuffles from each multiple of N on
        packed = isinstance(self.examples, Packed)
        if not self.buckets and not packed:
            return np.sort([self.order[p] for p in range(first + index * B, first + index * B + B)])
        chunk, slot = divmod(index, Packed.CHUNK if packed else 32)
        cached = self._chunk  # one read: grain threads may replace it meanwhile
        if packed and (cached is None or cached[0] != (epoch, chunk)):
            start, stop, rows = self.examples.chunk(chunk)
            idx = np.asarray([self.order[p] for p in range(first + start, first + stop)])
            placed = self.examples.plan(idx, rows)
            perm = np.random.default_rng([self.seed, epoch, chunk, 1 << 20]).permutation(len(placed))
            batches = [[placed[r] for r in perm[i : i + B]] for i in range(0, len(placed), B)]
            cached = self._chunk = ((epoch, chunk), batches)
        elif cached is None or cached[0] != (epoch, chunk):
            positions = range(first + chunk * 32 * B, first + min((chunk + 1) * 32 * B, N))
            idx = np.asarray([self.order[p] for p in positions])
            lengths = self.examples.side_lengths(idx)  # [sides, n]
            fits = (np.asarray(self.buckets)[:, :, None] >= lengths[None]).all(axis=1)  # [buckets, n]
            idx = idx[np.lexsort((fullness(self.examples, idx), fits.argmax(axis=0)))]  # by bucket, then fullness
            batches = [np.sort(idx[i : i + B]) for i in range(0, len(idx) - B + 1, B)]
            perm = np.random.default_rng([self.seed, epoch, chunk, 1 << 20]).permutation(len(batches))
            cached = self._chunk = ((epoch, chunk), [batches[i] for i in perm])
        return cached[1][slot]

    def get(self, step: int, part: slice | None = None) -> dict[str, np.ndarray]:
        """The batch of `step`, or only its rows `part` (a process's share of the global batch).

        Batch-wide choices (the bucket width) are made before the part is cut, and random masking
        draws each row from its own generator (seed, step, row), so a process reads only its rows
        and the shares of all processes put together equal the whole batch.

        Args:
            step: the training step.
            part: the rows to read, or None for all B.

        Returns:
            The batch's arrays by name (tokens, inputs, targets, weights, src, lengths, segments ...).
        """
        if self.examples is None:
            batch = self.generate(np.random.default_rng([self.seed, step]), self.batch_size)
            return batch if part is None else {k: v[part] for k, v in batch.items()}
        rows = self.rows(step)
        if isinstance(self.examples, Packed):  # B lists of examples, one per packed row
            return self.examples.take(rows[part] if part is not None else rows)
        widths = None
        if self.buckets:
            longest = self.examples.side_lengths(rows).max(axis=1)  # [sides]
            widths = next((w for w in self.buckets if (np.asarray(w) >= longest).all()), self.buckets[-1])
        index = np.arange(self.batch_size)[part if part is not None else slice(None)]
        batch = self.examples.take(rows[index], widths)
        if self.transform is not None:
            batch = self.transform(batch, [np.random.default_rng([self.seed, step, j]) for j in index])
        if self.padded:  # the filler rows count nothing (a classifier's unpacked batch gains its weights here)
            real = (index < self.num_examples).astype(np.float32)
            weights = batch.get("weights", np.ones(len(index), np.float32))
            batch["weights"] = weights * real.reshape(-1, *[1] * (weights.ndim - 1))
        return batch

    def stream(self, start: int, stop: int, part: slice | None = None, prefetch: int = 0) -> Iterator[dict]:
        """The batches of steps start..stop-1 (rows `part`), read ahead by `prefetch` grain threads.

        A grain `MapDataset` over the step numbers: batch s is `get(s, part)` whichever thread
        reads it and in whichever order, so a stream resumed at any step is the uninterrupted one.

        Args:
            start: the first step.
            stop: the step after the last.
            part: the rows to read, or None for all B.
            prefetch: threads reading ahead; 0: read each batch when asked for.

        Returns:
            The batches, in step order.
        """
        import grain

        steps = grain.MapDataset.range(start, stop).map(lambda s: self.get(s, part))
        if not prefetch:
            return (steps[i] for i in range(len(steps)))
        options = grain.ReadOptions(num_threads=prefetch, prefetch_buffer_size=2 * prefetch)
        return iter(steps.to_iter_dataset(options))


@dataclasses.dataclass
class Dataset:
    """The configured data: its tokenizer, the three splits batched by step, samples and labels.

    Attributes:
        tokenizer: the tokenizer the ids come from.
        train: the training batches.
        val: the validation batches.
        test: the test batches.
        sample_sources: a few held-out inputs for greedy samples at evaluation.
        sample_references: their references.
        labels: classification: the class names, by index.
    """

    tokenizer: object
    train: Batches
    val: Batches
    test: Batches
    sample_sources: list[str]  # a few held-out inputs for greedy samples at evaluation
    sample_references: list[str]
    labels: tuple[str, ...] = ()  # classification: the class names, by index


def build_dataset(
    cfg: Config, workdir: str | pathlib.Path | None = None, progress: bool = False, own: bool = True
) -> Dataset:
    """The configured data, batched by step: prepared on disk the first time (`prepare.prepare`:
    read, checked, split, tokenized; SentencePiece trained in workdir), then memory-mapped.
    `own`: the workdir's training (not a reader such as eval) records the cache it uses.

    Args:
        cfg: the run's config (data, train, model.vocab_size).
        workdir: the run's directory (tokenizer, cache record), or None.
        progress: print progress while preparing.
        own: record the cache as the workdir's.

    Returns:
        The dataset.

    Raises:
        DataError: bad data, a tokenizer larger than the model's vocabulary, a split with fewer
            sequences than a batch, or instruction data none of whose responses fits data.max_len.
    """
    d, t = cfg.data, cfg.train
    if d.source in ("copy", "reverse"):  # config validation paired them with the symbols tokenizer, seq2seq
        return _synthetic(cfg)
    if d.tokenizer == "byte":  # its size is known: refused before the corpus is read
        check_vocab(cfg, ByteTokenizer(), source_of(cfg))
    prepared = prepare(cfg, workdir, progress=progress, own=own)
    tok = load_tokenizer(cfg, workdir or ".")
    check_vocab(cfg, tok, source_of(cfg))  # a cache found again was prepared for another model perhaps
    where = ", ".join(source_of(cfg).files)
    transform = _mlm_masking(cfg, tok) if t.objective == "mlm" else None
    S, T = d.src_len, d.max_len
    widths = {"seq2seq": (S, T), "classify": (S,)}.get(t.objective)
    buckets = bucket_widths(widths, d.length_buckets) if widths else ()

    def examples(split: str) -> Examples:
        pack = d.pack and split == "train"  # held-out batches stay one example per row (BLEU, samples)
        if completions(cfg):
            prompt, response = (Documents(*prepared.documents(split, f)) for f in ("prompt", "response"))
            answers = Completions(prompt, response, d.max_len, tok.pad_id)
            _check_answered(prompt, d.max_len, split, where)
            return Packed(answers, t.batch_size) if pack else answers
        if t.objective in ("lm", "mlm"):
            docs = Documents(*prepared.documents(split, "text"))
            return Windows(docs, d.max_len + 1 if t.objective == "lm" else d.max_len, t.objective, segments=pack)
        if t.objective == "seq2seq":
            src, tgt = (Documents(*prepared.documents(split, f)) for f in ("source", "target"))
            pairs = Pairs(src, tgt, S, T, tok)
            return Packed(pairs, t.batch_size) if pack else pairs
        texts = Labelled(Documents(*prepared.documents(split, "text")), prepared.labels(split), S, tok.pad_id)
        return Packed(texts, t.batch_size, d.max_segments) if pack else texts

    splits = []
    for name, seed in zip(("train", "validation", "test"), (t.seed, 1_000 + t.seed, 2_000 + t.seed), strict=True):
        ex = examples(name)
        # Training takes full batches; a held-out split smaller than a batch is evaluated as one padded batch.
        if len(ex) < t.batch_size if name == "train" else len(ex) == 0:
            text = t.objective in ("lm", "mlm") and not completions(cfg)
            what = "too little text" if text else "too few sequences"
            fix = f"; --set train.batch_size={len(ex)} (or fewer) fits it" if len(ex) else ""
            raise DataError(f"{where}: {what}: the {name} split has {len(ex)} sequences, fewer than "
                            f"batch_size={t.batch_size}{fix}")  # fmt: skip
        bucketed = buckets if not (d.pack and name == "train") else ()
        splits.append(Batches(ex, t.batch_size, seed, transform=transform, buckets=bucketed))
    return Dataset(tok, *splits, *prepared.samples(), prepared.label_names)


def _check_answered(prompt: Documents, T: int, split: str, where: str) -> None:
    """An instruction example is cut to T + 1 tokens from its end: one whose prompt alone fills them
    keeps no response token and adds nothing to the loss. None answered is an error (its loss would
    read 0.0); some, a warning saying how many."""
    lengths = prompt.lengths(np.arange(len(prompt)))
    cut = int((lengths > T).sum())
    if cut == len(lengths) and cut:
        raise DataError(
            f"{where}: no {split} example keeps a response token within data.max_len={T}: every prompt fills "
            f"it (the shortest takes {int(lengths.min())} tokens); raise data.max_len"
        )
    if cut:
        warnings.warn(
            f"{where}: {cut} of {len(lengths)} {split} examples keep no response token within data.max_len={T} "
            f"(their prompts fill it) and add nothing to the loss; raise data.max_len to keep them",
            stacklevel=2,
        )


def bucket_widths(widths: tuple[int, ...], n: int) -> tuple[tuple[int, ...], ...]:
    """n buckets: bucket i holds each side's width (i + 1) / n of its full width, rounded up to a
    multiple of 8 (repeats dropped); the last is the full widths.

    Args:
        widths: each side's full width.
        n: how many buckets (`data.length_buckets`).

    Returns:
        The buckets' widths, ascending.
    """
    cut = lambda L, i: min(L, -(-L * (i + 1) // n // 8) * 8)
    return tuple(sorted({tuple(cut(L, i) for L in widths) for i in range(n)}))


def _mlm_masking(cfg: Config, tok):
    """BERT masking, each row drawn from its own generator: p of the tokens are chosen;
    of those 80% become [MASK], 10% a random token, 10% stay; loss on the chosen only."""
    p = cfg.train.mlm_probability

    def transform(batch, rngs):
        tokens = batch["tokens"]  # [B, T]
        T = tokens.shape[1]
        draws = np.stack([np.stack([g.random(T), g.random(T), g.integers(tok.first_real, tok.vocab_size, T)])
                          for g in rngs])  # fmt: skip  # [B, 3, T]
        chosen = (draws[:, 0] < p) & (tokens != tok.pad_id)
        action, random_ids = draws[:, 1], draws[:, 2].astype(np.int32)
        inputs = np.where(chosen & (action < 0.8), tok.mask_id, tokens)
        inputs = np.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, inputs)
        rest = {k: v for k, v in batch.items() if k != "tokens"}  # packed: segments, positions
        return {"inputs": inputs.astype(np.int32), "targets": tokens, "weights": chosen.astype(np.float32)} | rest

    return transform


def _synthetic(cfg: Config) -> Dataset:
    """The Annotated Transformer's copy (or reverse) task: random symbols 2..V-1, target = source."""
    d, t = cfg.data, cfg.train
    tok = SymbolTokenizer(d.synthetic_vocab)

    def generate(rng, n):
        src = rng.integers(2, d.synthetic_vocab, (n, d.synthetic_len), dtype=np.int32)
        tgt = src[:, ::-1] if d.source == "reverse" else src
        lengths = np.full(n, d.synthetic_len, np.int32)
        return _seq2seq_arrays(src, lengths, np.ascontiguousarray(tgt), lengths, tok.bos_id, tok.pad_id)

    held_out = generate(np.random.default_rng([d.split_seed, 99]), max(t.num_samples, 1))
    samples = [tok.decode(s) for s in held_out["src"]]
    refs = [tok.decode(s) for s in held_out["targets"]]
    mk = lambda seed: Batches(None, t.batch_size, seed, generate=generate)
    return Dataset(tok, mk(t.seed), mk(1_000 + t.seed), mk(2_000 + t.seed), samples, refs)
