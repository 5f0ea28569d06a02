"""The examples of a split, read from a prepared corpus by row: documents, LM windows, seq2seq pairs,
instruction completions, labelled texts, and training rows packed with several of them.

Each kind answers `len`, and `take(rows, widths)` gives the batch arrays of its rows (the keys
`pipeline.py` lists by objective); `Batches` (in `pipeline.py`) chooses the rows of each step.
"""

from __future__ import annotations

import numpy as np


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
