"""Preference data: {prompt, chosen, rejected} records (JSONL) into batches of pairs by step.

A record is `{"prompt": str, "chosen": str, "rejected": str}` (`data.fields` renames the three), the
prompt written in `data.template` when one is set; or, conversational (TRL's form), `chosen` and
`rejected` are lists of messages ending with an assistant turn, with an optional `prompt` list of the
turns before them, written in `data.template` (required then). Each completion ends with the
template's end and the tokenizer's EOS. Every error names the file, the line and the field.

The records are read and tokenized when the run starts and held in memory (preference sets are small:
a 60k-pair set of 1k-token pairs is ~0.5 GB of int32), not prepared into shards as the other
objectives' data is; the batch of a step is still a function of (seed, step) (`data.pipeline.Batches`),
so a resumed run reads the same pairs. Rows are not packed: a row holds one completion after its
prompt, and the two rows of a pair must line up (packing pairs into shared rows would need the
segment-wise sums `functional.chunked_cross_entropy` does not give).

Batch keys (B pairs, T = data.max_len, S = data.src_max_len): inputs, targets, weights [B, 2, T]
(row 0 chosen, row 1 rejected; weights 1 on the completion's targets, its EOS too); encoder_decoder
adds src [B, S] and src_lengths [B], the prompt (+ EOS) as the source, the targets BOS-shifted.
"""

from __future__ import annotations

import pathlib

import numpy as np

from jaxformer.config import Config
from jaxformer.data import sources, templates
from jaxformer.data.layout import SPLITS, check_vocab, split_assignment
from jaxformer.data.pipeline import Batches, Dataset
from jaxformer.data.sources import DataError
from jaxformer.data.tokenizers import load_tokenizer

FIELDS = ("prompt", "chosen", "rejected")


def record_texts(row: dict, names: tuple[str, str, str], template: templates.Template | None) -> tuple[str, str, str]:
    """(prompt text, chosen text, rejected text) of one record, each completion ending with the
    template's end.

    Args:
        row: the record.
        names: its (prompt, chosen, rejected) fields.
        template: the template that writes the turns, or None (plain text, as given).

    Returns:
        (prompt, chosen, rejected).

    Raises:
        ValueError: a missing, non-string or empty field, a chat without a template or without a shared
            prompt, or a pair whose chosen equals its rejected.
    """
    p, c, r = names
    for name in (c, r):
        if row.get(name) is None:
            raise ValueError(f"no field {name!r} (a preference record has {p!r}, {c!r} and {r!r})")
    end = template.end if template is not None else ""
    if isinstance(row[c], list) or isinstance(row[r], list):  # conversational: lists of messages
        if template is None:
            raise ValueError(f"{c!r} and {r!r} hold messages: set data.template (alpaca, chatml) to write them")
        before = row.get(p) or []
        for name, turns in ((p, before), (c, row[c]), (r, row[r])):
            if not isinstance(turns, list):
                raise ValueError(f"field {name!r} is {type(turns).__name__}: a conversational record's {p!r}, {c!r} "
                                 f"and {r!r} are lists of messages")  # fmt: skip
        (prompt, chosen), (other, rejected) = (templates._chat_pair(template, before + row[n], n) for n in (c, r))
        if prompt != other:
            raise ValueError(f"{c!r} and {r!r} differ before their last assistant turn: a pair shares its prompt")
    else:
        if row.get(p) is None:
            raise ValueError(f"no field {p!r} (a preference record has {p!r}, {c!r} and {r!r})")
        for name in names:
            if not isinstance(row[name], str):
                raise ValueError(f"field {name!r} is {type(row[name]).__name__}, not a string")
        prompt = template.prompt(row[p]) if template is not None else row[p]
        chosen, rejected = row[c] + end, row[r] + end
    for name, text in ((c, chosen), (r, rejected)):
        if not text.removesuffix(end).strip():
            raise ValueError(f"field {name!r} is empty: nothing to prefer or reject")
    if chosen == rejected:
        raise ValueError(f"{c!r} equals {r!r}: the pair prefers nothing")
    return prompt, chosen, rejected


def read_pairs(cfg: Config) -> list[tuple[str, str, str, str]]:
    """The records of `cfg.data.files` as (where, prompt, chosen, rejected) texts, in file order.

    Args:
        cfg: the run's config (data.files, data.fields, data.template).

    Returns:
        The records.

    Raises:
        DataError: a file that is not there, a line that is not a JSON object, or a bad record,
            naming the file and line.
    """
    d = cfg.data
    names = tuple(d.fields) or FIELDS
    template = templates.get(d.template) if d.template != "none" else None
    src = sources.Source(d.files, names, format="jsonl")
    out = []
    for path in sources.expand(d.files):
        for where, row in sources.READERS["jsonl"](path, src, None):
            try:
                out.append((where, *record_texts(row, names, template)))
            except ValueError as e:
                raise DataError(f"{where}: {e}") from None
    if not out:
        raise DataError(f"{', '.join(d.files)}: no preference records")
    return out


class PreferencePairs:
    """The tokenized pairs of a split; `take(rows)` gives their batch (the keys in the module's docstring).

    Args:
        prompts: each pair's prompt ids.
        completions: each pair's (chosen ids, rejected ids), EOS included.
        T: the target width (data.max_len).
        S: the source width (encoder_decoder; 0: decoder_only).
        tok (object): the tokenizer (pad, BOS, EOS ids).
    """

    def __init__(self, prompts: list[np.ndarray], completions: list[tuple[np.ndarray, np.ndarray]], T: int, S: int,
                 tok):  # fmt: skip
        self.prompts, self.completions, self.T, self.S, self.tok = prompts, completions, T, S, tok

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, rows: np.ndarray, widths: tuple[int, ...] | None = None) -> dict[str, np.ndarray]:
        """The pairs `rows`, right-padded.

        Args:
            rows: [B] pair indices.
            widths: unused (pairs are not bucketed); the batches' common signature.

        Returns:
            The batch's arrays by name.
        """
        B, T, pad = len(rows), self.T, self.tok.pad_id
        out = {k: np.full((B, 2, T), pad, np.int32) for k in ("inputs", "targets")}
        out["weights"] = np.zeros((B, 2, T), np.float32)
        if self.S:
            out |= {"src": np.full((B, self.S), pad, np.int32), "src_lengths": np.zeros(B, np.int32)}
        for b, i in enumerate(rows):
            prompt = self.prompts[int(i)]
            if self.S:
                out["src"][b, : len(prompt)], out["src_lengths"][b] = prompt, len(prompt)
            for j, completion in enumerate(self.completions[int(i)]):
                if self.S:  # the decoder reads BOS + the completion and predicts the completion
                    tokens, first = np.concatenate([[self.tok.bos_id], completion]), 0
                else:  # prompt + completion in one row; target t is token t + 1
                    tokens, first = np.concatenate([prompt, completion]), len(prompt) - 1
                n = len(tokens) - 1
                out["inputs"][b, j, :n], out["targets"][b, j, :n] = tokens[:-1], tokens[1:]
                out["weights"][b, j, first:n] = 1.0
        return out


def tokenize(cfg: Config, tok, records: list[tuple[str, str, str, str]]) -> tuple[list, list]:
    """(prompt ids, (chosen ids, rejected ids)) of each record, EOS after each completion (and after
    an encoder's prompt); a record longer than the model's widths is refused, naming it.

    Args:
        cfg: the run's config (model.mode, data.max_len, data.src_max_len).
        tok (object): the tokenizer.
        records: (where, prompt, chosen, rejected) texts.

    Returns:
        (prompts, completions).

    Raises:
        DataError: a record whose prompt and completion do not fit, naming its line and field.
    """
    d, names = cfg.data, tuple(cfg.data.fields) or FIELDS
    seq2seq = cfg.model.mode == "encoder_decoder"
    encode = lambda text, eos: np.asarray(tok.encode(text) + ([tok.eos_id] if eos else []), np.int32)
    prompts, completions = [], []
    for where, prompt_text, *texts in records:
        prompt = encode(prompt_text, seq2seq)
        if not len(prompt):  # the completion's first token would follow nothing
            raise DataError(f"{where}: field {names[0]!r} is empty: a completion follows a prompt")
        if seq2seq and len(prompt) > d.src_len:
            raise DataError(f"{where}: {names[0]!r} takes {len(prompt)} tokens (EOS included), more than "
                            f"data.src_max_len={d.src_len}")  # fmt: skip
        pair = tuple(encode(t, True) for t in texts)
        for name, ids in zip(names[1:], pair, strict=True):
            total, room, what = (len(ids), d.max_len, "") if seq2seq else (len(prompt) + len(ids), d.max_len + 1,
                                                                            f"{names[0]!r} and ")  # fmt: skip
            if total > room:
                raise DataError(f"{where}: {what}{name!r} take {total} tokens (EOS included), more than "
                                f"{'data.max_len' if seq2seq else 'data.max_len + 1'} = {room}")  # fmt: skip
        prompts.append(prompt)
        completions.append(pair)
    return prompts, completions


def build_pairs(
    cfg: Config, workdir: str | pathlib.Path | None = None, progress: bool = False, own: bool = True
) -> Dataset:
    """The preference pairs of `cfg`, split (data.val_fraction, data.test_fraction, data.split_seed) and
    batched by step, as `data.build_dataset` gives the other objectives' data.

    Args:
        cfg: the run's config.
        workdir: the run's directory (an imported model's tokenizer), or None.
        progress: unused (nothing is prepared on disk); `build_dataset`'s signature.
        own: unused (no cache is recorded); `build_dataset`'s signature.

    Returns:
        The dataset (no samples: pairs are scored, not decoded).

    Raises:
        DataError: bad records, a tokenizer larger than the model's vocabulary, or a training split
            smaller than a batch.
    """
    d, t = cfg.data, cfg.train
    where = ", ".join(d.files)
    tok = load_tokenizer(cfg, workdir or ".")
    check_vocab(cfg, tok, sources.Source(d.files, FIELDS))
    records = read_pairs(cfg)
    prompts, completions = tokenize(cfg, tok, records)
    assign = split_assignment(len(records), d.val_fraction, d.test_fraction, d.split_seed, where)
    S = d.src_len if cfg.model.mode == "encoder_decoder" else 0
    splits = []
    for k, (name, seed) in enumerate(zip(SPLITS, (t.seed, 1_000 + t.seed, 2_000 + t.seed), strict=True)):
        idx = np.flatnonzero(assign == k)
        pairs = PreferencePairs([prompts[i] for i in idx], [completions[i] for i in idx], d.max_len, S, tok)
        if name == "train" and len(pairs) < t.batch_size:
            fix = f"--set train.batch_size={len(pairs)} (or fewer) fits it"
            raise DataError(f"{where}: too few pairs: the train split has {len(pairs)}, fewer than "
                            f"batch_size={t.batch_size}; {fix}")  # fmt: skip
        splits.append(Batches(pairs, t.batch_size, seed))
    return Dataset(tok, *splits, [], [])
