"""Log-likelihoods of continuations by a batched, jitted forward pass: what lm-evaluation-harness's
`loglikelihood` requests ask of a model, in token ids (no harness needed here).

A request is (context ids, continuation ids). decoder_only: the harness's `hf` rule, the last
`max_len + 1` tokens of context + continuation, inputs all but the last, the continuation's
log-probabilities read at its positions. encoder_decoder: the context (its last `max_len` tokens) is
the source, the continuation the target, the decoder fed BOS and the continuation shifted by one.

Shapes are bucketed: `batch_size` rows, widths rounded up to a power of two (at least 16, at most the
model's max_len), so a few compilations serve every request; rows are sorted by length so a batch
pads little. Right padding is invisible to the scored positions (causal attention; sources carry
their lengths). Over several devices (one process), a batch's rows are split over them and the
weights copied to each (`batch_size` rounded up to a multiple of the device count).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

MIN_WIDTH = 16  # the narrowest bucket: short requests share one compilation


class ScoringError(ValueError):
    """A request the model cannot score (a continuation longer than its context, an empty one)."""


@functools.partial(jax.jit, static_argnames=("graphdef", "top_n"))
def _token_logprobs(graphdef, params, inputs_BT, targets_BT, lengths_B, src_BS, src_lengths_B, top_n=1):
    """log p(targets[b, t] | inputs[b, :t+1] (, source b)) [B, T] in float32, the `top_n` most likely ids at
    each position [B, T, top_n] (likeliest first; ties to the lower id, as argmax), their log-probabilities,
    and each target's rank [B, T] (the ids at least as likely, itself included: 1 for the likeliest; vLLM's)."""
    model = nnx.merge(graphdef, params)
    memory_BSD = None if src_BS is None else model.encode(src_BS, src_lengths=src_lengths_B)
    logits_BTV = model.decode(memory_BSD, src_BS, inputs_BT, src_lengths=src_lengths_B, tgt_lengths=lengths_B)
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32))  # float32: the harness sums these
    logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    top_logp_BTn, top_BTn = jax.lax.top_k(logp_BTV, top_n)
    rank_BT = jnp.sum(logp_BTV >= logp_BT[..., None], axis=-1, dtype=jnp.int32)
    return logp_BT, top_BTn, top_logp_BTn, rank_BT


def bucket(n: int, cap: int) -> int:
    """The compiled width for `n` positions: a power of two, at least MIN_WIDTH, at most `cap`.

    Args:
        n: positions needed.
        cap: the widest (the model's max_len).

    Returns:
        The width.
    """
    return min(max(MIN_WIDTH, 1 << max(n - 1, 0).bit_length()), cap)


@dataclasses.dataclass
class Scorer:
    """Sums of continuation log-probabilities under one model (decoder_only or encoder_decoder).

    Attributes:
        model (Transformer): the model.
        batch_size (int): rows per forward pass.
        bos_id (int | None): encoder_decoder: the id the decoder starts from.

    Raises:
        ScoringError: an encoder_only model (it has no next-token distribution).
    """

    model: object
    batch_size: int = 16
    bos_id: int | None = None

    def __post_init__(self):
        from jaxformer.layers import without_id_checks

        cfg = self.model.cfg
        if cfg.mode == "encoder_only":
            raise ScoringError(
                "an encoder_only model has no next-token distribution: it cannot score continuations "
                "(loglikelihood) nor generate; classify or fill masks with jaxformer.engine.Engine.score"
            )
        if cfg.mode == "encoder_decoder" and self.bos_id is None:
            raise ScoringError("an encoder_decoder model's decoder starts from a bos_id; none given")
        self.seq2seq = cfg.mode == "encoder_decoder"
        self.max_len, self.pad_id = cfg.max_len, cfg.pad_id
        own = nnx.merge(*nnx.split(self.model))  # the caller's modules keep their id checks
        self._graphdef, self._params = nnx.split(without_id_checks(own))
        self._rows = None  # one device: arrays go where JAX puts them
        if jax.device_count() > 1 and jax.process_count() == 1:  # rows split over the devices, weights on each
            n = jax.device_count()
            self.batch_size = -(-self.batch_size // n) * n
            mesh = jax.sharding.Mesh(np.array(jax.devices()), ("batch",))
            self._rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
            self._params = jax.device_put(self._params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    def rows(self, context: Sequence[int], continuation: Sequence[int]) -> tuple[list, list, list, int]:
        """One request as (decoder inputs, targets, source, first scored position), cut as the harness cuts.

        Args:
            context: the context's ids (at least one).
            continuation: the continuation's ids (at least one, at most max_len).

        Returns:
            (inputs, targets, source (empty for decoder_only), index of the continuation's first target).

        Raises:
            ScoringError: an empty context or continuation, or a continuation over the model's max_len.
        """
        context, continuation = list(context), list(continuation)
        if not context or not continuation:
            raise ScoringError(
                f"empty {'context' if not context else 'continuation'}: nothing to condition on or score"
            )
        if len(continuation) > self.max_len:
            raise ScoringError(
                f"a continuation of {len(continuation)} tokens is longer than the model's context "
                f"(model.max_len={self.max_len})"
            )
        if self.seq2seq:
            target = continuation[-self.max_len :]
            return [self.bos_id, *target[:-1]], target, context[-self.max_len :], 0
        whole = (context + continuation)[-(self.max_len + 1) :]
        return whole[:-1], whole[1:], [], len(whole) - 1 - len(continuation)

    def loglikelihoods(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per request.

        Args:
            requests: (context ids, continuation ids) pairs.

        Returns:
            One (log-likelihood, is_greedy) per request, in request order.

        Raises:
            ScoringError: a request `rows` refuses.
        """
        rows = [self.rows(c, x) for c, x in requests]
        out = []
        for (inp, tgt, _, first), (logp, top, *_) in zip(rows, self._forward(rows), strict=True):
            scored = slice(first, len(inp))
            greedy = bool((top[scored, 0] == np.asarray(tgt)[scored]).all())
            out.append((float(np.sum(logp[scored], dtype=np.float64)), greedy))
        return out

    def prompt_logprobs(
        self, sequences: Sequence[Sequence[int]], top_n: int = 1
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Each token's log-probability given the tokens before it (decoder_only): what an OpenAI
        completion with `echo` and `logprobs` returns for its prompt, and vLLM's `prompt_logprobs`.

        Args:
            sequences: token ids, each of 2 to max_len + 1 tokens.
            top_n: the most likely ids listed at each position (at least 1).

        Returns:
            Per sequence, for its tokens 1..n-1: (log-probability [n-1], the `top_n` most likely ids there
            [n-1, top_n], likeliest first, their log-probabilities [n-1, top_n], and each token's rank [n-1]:
            the ids at least as likely there, itself included), float32 and int32.

        Raises:
            ScoringError: an encoder_decoder model, or a sequence too short or too long.
        """
        if self.seq2seq:
            raise ScoringError("an encoder_decoder model scores a target given a source, not a prompt's own tokens")
        rows = []
        for s in sequences:
            if not 2 <= len(s) <= self.max_len + 1:
                raise ScoringError(f"a sequence of {len(s)} tokens: 2 to model.max_len + 1 = {self.max_len + 1}")
            rows.append((list(s[:-1]), list(s[1:]), [], 0))
        out = self._forward(rows, top_n)
        return [tuple(a[: len(r[0])] for a in got) for r, got in zip(rows, out, strict=True)]

    def _forward(self, rows: list, top_n: int = 1) -> list[tuple[np.ndarray, ...]]:
        """Rows as `rows` cuts them -> per row, (target log-probabilities, the `top_n` likeliest ids, their
        log-probabilities, the targets' ranks) over its padded width, in row order."""
        order = sorted(range(len(rows)), key=lambda i: -(len(rows[i][0]) + len(rows[i][2])))
        out: list = [None] * len(rows)
        B = self.batch_size
        for start in range(0, len(order), B):
            chunk = order[start : start + B]
            T = bucket(max(len(rows[i][0]) for i in chunk), self.max_len)
            inputs = np.full((B, T), self.pad_id, np.int32)
            targets = np.full((B, T), self.pad_id, np.int32)
            lengths = np.ones(B, np.int32)
            src = src_lengths = None
            if self.seq2seq:
                S = bucket(max(len(rows[i][2]) for i in chunk), self.max_len)
                src, src_lengths = np.full((B, S), self.pad_id, np.int32), np.ones(B, np.int32)
            for b, i in enumerate(chunk):
                inp, tgt, source, _ = rows[i]
                inputs[b, : len(inp)], targets[b, : len(tgt)], lengths[b] = inp, tgt, len(inp)
                if src is not None:
                    src[b, : len(source)], src_lengths[b] = source, len(source)
            arrays = (inputs, targets, lengths, src, src_lengths)
            if self._rows is not None:
                arrays = jax.device_put(arrays, self._rows)
            got = jax.device_get(_token_logprobs(self._graphdef, self._params, *arrays, top_n))
            for b, i in enumerate(chunk):
                out[i] = tuple(a[b] for a in got)
        return out


def load(workdir: str | pathlib.Path | None = None, hf: str | pathlib.Path | None = None) -> tuple:
    """The model and tokenizer of a training workdir (its latest checkpoint), an exported directory or a
    Hugging Face model directory.

    Args:
        workdir: a training workdir (or one `jaxformer import-hf` made) or a directory `jaxformer export` wrote.
        hf: a Hugging Face model directory (weights, config.json, tokenizer.json); instead of `workdir`.

    Returns:
        (model, tokenizer).

    Raises:
        FileNotFoundError: no such directory, config or checkpoint.
        ValueError: both or neither of workdir and hf.
    """
    if (workdir is None) == (hf is None):
        raise ValueError("give one of workdir=DIR (a jaxformer workdir) or hf=DIR (a Hugging Face model directory)")
    if hf is not None:
        from jaxformer.data import HFTokenizer
        from jaxformer.interop.hf import load_hf

        if not pathlib.Path(hf).is_dir():
            raise FileNotFoundError(f"hf={hf}: no such directory")
        return load_hf(hf), HFTokenizer(hf)
    from jaxformer.checkpoint import load_workdir
    from jaxformer.data import load_tokenizer

    model, run = load_workdir(workdir)
    return model, load_tokenizer(run, workdir)
