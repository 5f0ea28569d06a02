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
"""

from __future__ import annotations

import dataclasses
import pathlib
import warnings
from collections.abc import Callable, Iterator

import numpy as np

from jaxformer.config import Config
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


class Documents:
    """One field of one split of a prepared corpus: document i is tokens[offsets[i]:offsets[i + 1]].

    Args:
        tokens (prepare.TokenFile): the split's tokens.
        offsets: [N + 1] int64 where each document starts.
    """

    def __init__(self, tokens, offsets: np.ndarray):
        self.tokens, self.offsets = tokens, offsets  # a prepare.TokenFile, [N + 1] int64

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self, rows: np.ndarray) -> np.ndarray:
        """The documents' lengths.

        Args:
            rows: [n] document indices.

        Returns:
            [n] int32.
        """
        return (self.offsets[rows + 1] - self.offsets[rows]).astype(np.int32)

    def document(self, i: int) -> np.ndarray:
        """Document i's tokens.

        Args:
            i: the document's index.

        Returns:
            [its length] int32.
        """
        return self.tokens.read(self.offsets[i], self.offsets[i + 1])

    def padded(self, rows: np.ndarray, width: int, pad_id: int) -> np.ndarray:
        """[len(rows), width] the documents of `rows`, right-padded with pad_id.

        Args:
            rows: [n] document indices.
            width: the row width (no document is longer).
            pad_id: the padding id.

        Returns:
            [n, width] int32.
        """
        out = np.full((len(rows), width), pad_id, np.int32)
        for i, r in enumerate(rows):
            doc = self.tokens.read(self.offsets[r], self.offsets[r + 1])
            out[i, : len(doc)] = doc
        return out


class Windows:
    """lm / mlm: the split's documents (each ending in EOS) as one stream cut into windows of
    `width` tokens: no padding, and the last window's remainder is dropped.

    Packed (`segments`): each document in a window is its own segment, with positions from 0 at
    its first token in the window, so attention never crosses documents (the document boundaries
    come from the offsets index, not from token ids); an LM predicts no token of the next document.

    Args:
        docs: the split's documents.
        width: tokens per window (an LM's T + 1: inputs and targets shifted by one).
        objective: "lm" or "mlm".
        segments: packed: segment ids and positions per document.
    """

    def __init__(self, docs: Documents, width: int, objective: str, segments: bool = False):
        self.docs, self.width, self.objective, self.segments = docs, width, objective, segments

    def __len__(self) -> int:
        return len(self.docs.tokens) // self.width

    def take(self, rows: np.ndarray, width: int | None = None) -> dict[str, np.ndarray]:
        """The windows `rows`: lm: inputs, targets, weights [B, T]; mlm: tokens [B, T]; packed: segments, positions.

        Args:
            rows: [B] window indices.
            width: unused (windows have one width); the batches' common signature.

        Returns:
            The batch's arrays by name.
        """
        at_BW = rows[:, None] * self.width + np.arange(self.width)  # stream index of each slot
        windows = self.docs.tokens.rows(rows * self.width, self.width)
        out = {}
        if self.segments:
            offsets = self.docs.offsets
            doc_BW = np.searchsorted(offsets, at_BW, side="right") - 1
            start_BW = np.maximum(np.asarray(offsets[doc_BW]), at_BW[:, :1])  # the document's first slot here
            out = {"segments": (doc_BW - doc_BW[:, :1] + 1).astype(np.int32), "positions": (at_BW - start_BW)}
        if self.objective == "mlm":
            return {"tokens": windows} | {k: v.astype(np.int32) for k, v in out.items()}
        # Every position of a window is text: a real token that shares the pad id still counts.
        weights = np.ones(windows[:, 1:].shape, np.float32)
        if self.segments:  # the last token of a document does not predict the next document's first
            weights = (doc_BW[:, 1:] == doc_BW[:, :-1]).astype(np.float32)
            out = {k: v[:, :-1].astype(np.int32) for k, v in out.items()}
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:], "weights": weights} | out


class Pairs:
    """seq2seq: (source, target) documents, each ending in EOS, at most S and T tokens.

    Args:
        src: the sources.
        tgt: the targets.
        S: the source width.
        T: the target width.
        tok (object): the tokenizer (pad and bos ids).
    """

    def __init__(self, src: Documents, tgt: Documents, S: int, T: int, tok):
        self.src, self.tgt, self.tok = src, tgt, tok
        self.widths = (S, T)

    def __len__(self) -> int:
        return len(self.src)

    def side_lengths(self, rows: np.ndarray) -> np.ndarray:
        """[2, len(rows)] source and target lengths.

        Args:
            rows: [n] example indices.

        Returns:
            [2, n] int32.
        """
        return np.stack([self.src.lengths(rows), self.tgt.lengths(rows)])

    def tokens(self) -> tuple[int, ...]:
        """Tokens of each side in all (the packer's mean lengths).

        Returns:
            (source tokens, target tokens).
        """
        return len(self.src.tokens), len(self.tgt.tokens)

    def take(self, rows: np.ndarray, widths: tuple[int, ...] | None = None) -> dict[str, np.ndarray]:
        """The pairs `rows`, right-padded: src [B, S], inputs, targets, weights [B, T] and the lengths.

        Args:
            rows: [B] pair indices.
            widths: (S, T) of a bucket, or None for the full widths.

        Returns:
            The batch's arrays by name.
        """
        pad, (S, T) = self.tok.pad_id, widths or self.widths
        src, tgt = self.src.padded(rows, S, pad), self.tgt.padded(rows, T, pad)
        return _seq2seq_arrays(src, self.src.lengths(rows), tgt, self.tgt.lengths(rows), self.tok.bos_id, pad)

    def pack(self, rows: list[np.ndarray]) -> dict[str, np.ndarray]:
        """Packed rows: each row's pairs one after the other, source and target of a pair under the
        same segment id (1, 2, ... in the row), positions from 0 in each.

        Args:
            rows: B arrays of pair indices, one per row.

        Returns:
            The batch's arrays by name (src, inputs, targets, weights and their segments and positions).
        """
        B, (S, T), tok = len(rows), self.widths, self.tok
        out = {k: np.zeros((B, S), np.int32) for k in ("src", "src_segments", "src_positions")}
        out |= {k: np.zeros((B, T), np.int32) for k in ("inputs", "targets", "tgt_segments", "tgt_positions")}
        out["src"][:], out["inputs"][:], out["targets"][:] = tok.pad_id, tok.pad_id, tok.pad_id
        weights = np.zeros((B, T), np.float32)
        for b, examples in enumerate(rows):
            s = t = 0
            for seg, i in enumerate(examples, start=1):
                src, tgt = self.src.document(i), self.tgt.document(i)
                out["src"][b, s : s + len(src)] = src
                out["src_segments"][b, s : s + len(src)] = seg
                out["src_positions"][b, s : s + len(src)] = np.arange(len(src))
                out["targets"][b, t : t + len(tgt)] = tgt
                out["inputs"][b, t : t + len(tgt)] = [tok.bos_id, *tgt[:-1]]
                out["tgt_segments"][b, t : t + len(tgt)] = seg
                out["tgt_positions"][b, t : t + len(tgt)] = np.arange(len(tgt))
                weights[b, t : t + len(tgt)] = 1.0
                s, t = s + len(src), t + len(tgt)
        return out | {"weights": weights}


class Completions:
    """lm instruction data: an example is prompt + response + EOS cut to T + 1 tokens; its inputs are
    those tokens but the last, its targets all but the first, and its weights 1 where the target is a
    response token (or the EOS): the model learns to answer, not to write prompts.

    Args:
        prompt: the prompts.
        response: the responses (each ending in EOS).
        T: the row width.
        pad_id: the padding id.
    """

    def __init__(self, prompt: Documents, response: Documents, T: int, pad_id: int):
        self.prompt, self.response, self.pad_id = prompt, response, pad_id
        self.widths = (T,)

    def __len__(self) -> int:
        return len(self.prompt)

    def side_lengths(self, rows: np.ndarray) -> np.ndarray:
        """[1, len(rows)] the input slots of each example (its tokens, cut to T + 1, less one).

        Args:
            rows: [n] example indices.

        Returns:
            [1, n].
        """
        total = self.prompt.lengths(rows) + self.response.lengths(rows)
        return np.minimum(total, self.widths[0] + 1)[None] - 1

    def tokens(self) -> tuple[int, ...]:
        """Input tokens in all (the packer's mean length).

        Returns:
            (tokens,).
        """
        return (len(self.prompt.tokens) + len(self.response.tokens) - len(self),)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs [n], targets [n], weights [n]) of example i, n = its tokens (at most T + 1) - 1.

        Args:
            i: the example's index.

        Returns:
            (inputs, targets, weights).
        """
        prompt = self.prompt.document(i)
        tokens = np.concatenate([prompt, self.response.document(i)])[: self.widths[0] + 1]
        weights = (np.arange(1, len(tokens)) >= len(prompt)).astype(np.float32)  # target j is token j + 1
        return tokens[:-1], tokens[1:], weights

    def take(self, rows: np.ndarray, widths: tuple[int, ...] | None = None) -> dict[str, np.ndarray]:
        """The examples `rows`, one per row, right-padded: inputs, targets, weights [B, T].

        Args:
            rows: [B] example indices.
            widths: unused (instruction data is not bucketed); the batches' common signature.

        Returns:
            The batch's arrays by name.
        """
        return self._rows([[r] for r in rows], segments=False)

    def pack(self, rows: list[np.ndarray]) -> dict[str, np.ndarray]:
        """Packed rows: each row's examples one after the other, each its own segment (1, 2, ... in
        the row) with positions from 0.

        Args:
            rows: B arrays of example indices, one per row.

        Returns:
            The batch's arrays by name (inputs, targets, weights, segments, positions).
        """
        return self._rows(rows, segments=True)

    def _rows(self, rows, segments: bool) -> dict[str, np.ndarray]:
        B, (T,) = len(rows), self.widths
        out = {k: np.full((B, T), self.pad_id, np.int32) for k in ("inputs", "targets")}
        out["weights"] = np.zeros((B, T), np.float32)
        if segments:
            out |= {k: np.zeros((B, T), np.int32) for k in ("segments", "positions")}
        for b, examples in enumerate(rows):
            t = 0
            for seg, i in enumerate(examples, start=1):
                inputs, targets, weights = self.example(int(i))
                at = slice(t, t + len(inputs))
                out["inputs"][b, at], out["targets"][b, at], out["weights"][b, at] = inputs, targets, weights
                if segments:
                    out["segments"][b, at], out["positions"][b, at] = seg, np.arange(len(inputs))
                t += len(inputs)
        return out


class Labelled:
    """classify: BOS + text (at most S tokens) and the class index.

    Args:
        docs: the texts.
        labels: [N] their class indices.
        S: the row width.
        pad_id: the padding id.
    """

    def __init__(self, docs: Documents, labels: np.ndarray, S: int, pad_id: int):
        self.docs, self.labels, self.pad_id = docs, labels, pad_id
        self.widths = (S,)

    def __len__(self) -> int:
        return len(self.docs)

    def side_lengths(self, rows: np.ndarray) -> np.ndarray:
        """[1, len(rows)] the texts' lengths.

        Args:
            rows: [n] example indices.

        Returns:
            [1, n] int32.
        """
        return self.docs.lengths(rows)[None]

    def tokens(self) -> tuple[int, ...]:
        """Tokens in all (the packer's mean length).

        Returns:
            (tokens,).
        """
        return (len(self.docs.tokens),)

    def take(self, rows: np.ndarray, widths: tuple[int, ...] | None = None) -> dict[str, np.ndarray]:
        """The texts `rows`, right-padded: src [B, S], src_lengths [B], label [B].

        Args:
            rows: [B] text indices.
            widths: (S,) of a bucket, or None for the full width.

        Returns:
            The batch's arrays by name.
        """
        (S,) = widths or self.widths
        src = self.docs.padded(rows, S, self.pad_id)
        return {"src": src, "src_lengths": self.docs.lengths(rows), "label": np.asarray(self.labels[rows], np.int32)}

    def pack(self, rows: list[np.ndarray], N: int) -> dict[str, np.ndarray]:
        """Packed rows of at most N texts: each text its segment (1, 2, ... in the row), positions
        from 0 in each; label [B, N] the class of segment n + 1 and weights [B, N] 1 where the row
        holds that segment.

        Args:
            rows: B arrays of text indices, one per row.
            N: the most texts a row holds (`data.max_segments`).

        Returns:
            The batch's arrays by name (src, src_segments, src_positions, label, weights).
        """
        (S,) = self.widths
        out = {k: np.zeros((len(rows), S), np.int32) for k in ("src", "src_segments", "src_positions")}
        out["src"][:] = self.pad_id
        labels, weights = np.zeros((len(rows), N), np.int32), np.zeros((len(rows), N), np.float32)
        for b, examples in enumerate(rows):
            s = 0
            for n, i in enumerate(examples):
                text = self.docs.document(i)
                out["src"][b, s : s + len(text)] = text
                out["src_segments"][b, s : s + len(text)] = n + 1
                out["src_positions"][b, s : s + len(text)] = np.arange(len(text))
                labels[b, n], weights[b, n] = self.labels[i], 1.0
                s += len(text)
        return out | {"label": labels, "weights": weights}


class Packed:
    """Packed training rows (seq2seq pairs, classification texts, instruction examples): an epoch's order is cut into
    chunks of `per_chunk` examples, each placed into CHUNK * B rows by first-fit decreasing (the
    fullest example first: its longest side over that side's width) into the first row where every
    side fits and that holds fewer than `max_segments` examples; an example that fits no row is
    left out of this epoch.

    `per_chunk` is the number of examples whose tokens fill FILL of the rows' slots on the side
    that fills first (from the corpus' mean lengths), or FILL of their segments: a little slack,
    so that few are left out. The epoch's last, partial chunk is packed into as many whole
    batches as its share of a chunk.

    Args:
        examples: the examples to pack.
        batch_size: B.
        max_segments: the most examples a row holds; None: as many as fit.
    """

    CHUNK = 8  # batches packed together: a larger chunk packs tighter (and costs more to plan)
    FILL = 0.98  # a chunk's tokens over its slots on the fuller side (1.0 leaves ~5% of pairs out)

    def __init__(self, examples: Pairs | Labelled | Completions, batch_size: int, max_segments: int | None = None):
        self.examples, self.widths, self.batch_size = examples, np.asarray(examples.widths), batch_size
        self.max_segments = max_segments  # None: as many as fit (pairs); classification: its label width
        N, rows = len(examples), self.CHUNK * batch_size
        mean = np.asarray(examples.tokens()) / max(N, 1)  # [sides] tokens per example
        fits = rows * self.FILL * min((self.widths / np.maximum(mean, 1.0)).min(), max_segments or np.inf)
        self.per_chunk = int(min(N, max(rows, fits)))
        full, tail = divmod(N, self.per_chunk)
        self.full_chunks, self.tail_batches = full, tail * self.CHUNK // self.per_chunk

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def batches_per_epoch(self) -> int:
        """The whole batches an epoch packs into."""
        return self.full_chunks * self.CHUNK + self.tail_batches

    def chunk(self, c: int) -> tuple[int, int, int]:
        """(start, stop, rows) of chunk c: its positions in the epoch's order and the rows they fill.

        Args:
            c: the chunk's index in the epoch.

        Returns:
            (start, stop, rows).
        """
        if c < self.full_chunks:
            return c * self.per_chunk, (c + 1) * self.per_chunk, self.CHUNK * self.batch_size
        return c * self.per_chunk, len(self), self.tail_batches * self.batch_size

    def plan(self, idx: np.ndarray, rows: int) -> list[np.ndarray]:
        """The examples `idx` placed into `rows` rows by first-fit decreasing.

        Args:
            idx: [n] example indices.
            rows: how many rows to fill.

        Returns:
            [rows] arrays of example indices (sorted); an example that fits no row is in none.
        """
        lengths = self.examples.side_lengths(idx)  # [sides, n]
        free = np.repeat(self.widths[:, None], rows, axis=1)  # [sides, rows]
        room = np.full(rows, self.max_segments or len(idx))  # examples a row may still take
        placed: list[list[int]] = [[] for _ in range(rows)]
        for i in np.argsort(-fullness(self.examples, idx), kind="stable"):
            fits = (free >= lengths[:, i : i + 1]).all(axis=0) & (room > 0)
            r = int(fits.argmax())
            if fits[r]:
                free[:, r] -= lengths[:, i]
                room[r] -= 1
                placed[r].append(int(idx[i]))
        return [np.asarray(sorted(p), np.int64) for p in placed]

    def take(self, rows: list[np.ndarray]) -> dict[str, np.ndarray]:
        """The packed rows (`plan`'s output) as a batch.

        Args:
            rows: B arrays of example indices, one per row.

        Returns:
            The batch's arrays by name.
        """
        if self.max_segments is None:
            return self.examples.pack(rows)
        return self.examples.pack(rows, self.max_segments)


def fullness(examples: Pairs | Labelled | Completions, rows: np.ndarray) -> np.ndarray:
    """[len(rows)] how full each example makes a row: its longest side over that side's width.

    Args:
        examples: the examples.
        rows: [n] example indices.

    Returns:
        [n] float64 in (0, 1].
    """
    widths = np.asarray(examples.widths, np.float64)[:, None]
    return (examples.side_lengths(rows) / widths).max(axis=0)


Examples = Windows | Pairs | Packed | Labelled | Completions


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


def _seq2seq_arrays(src_BS, src_lengths_B, targets_BT, tgt_lengths_B, bos_id: int, pad_id: int) -> dict:
    """A translation batch from right-padded sources and targets with their lengths."""
    B, T = targets_BT.shape
    inputs = np.concatenate([np.full((B, 1), bos_id, np.int32), targets_BT[:, :-1]], axis=1)
    real = np.arange(T)[None] < tgt_lengths_B[:, None]  # [B, T]: padding is said, not read off an id
    return {
        "src": src_BS.astype(np.int32),
        "src_lengths": src_lengths_B.astype(np.int32),
        "inputs": np.where(real, inputs, pad_id).astype(np.int32),
        "targets": targets_BT.astype(np.int32),
        "weights": real.astype(np.float32),
    }


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
