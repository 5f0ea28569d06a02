"""A stand-in for `jaxformer.engine` with its agreed interface (SamplingParams, Event, Output, EngineError,
Engine), for the server's tests on an install whose engine does not load: tests/test_serve.py puts it in
`sys.modules["jaxformer.engine"]` only when `import jaxformer.engine` fails. It is a test double, not an
engine: no pages, no batching. Each admitted request is decoded whole by `jaxformer.decode.generate` (one
row, greedy or sampled), then handed out one token a step, `max_slots` requests at a time.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np
from flax import nnx

from jaxformer import decode
from jaxformer.config import DecodeConfig


class EngineError(ValueError):
    """A request the engine cannot take."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False

    def __post_init__(self):
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (self.top_k >= 0, "top_k", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
        ]
        for ok, name, what in checks:
            if not ok:
                raise ValueError(f"{name} {what}, got {getattr(self, name)}")


@dataclasses.dataclass
class Event:
    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool
    finish_reason: str | None


@dataclasses.dataclass
class Output:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    logprobs: list[float] | None
    finish_reason: str


@dataclasses.dataclass
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    reason: str = "length"
    sent: int = 0


class Engine:
    def __init__(self, model, cfg=None, *, tokenizer=None, eos_id: int, bos_id: int | None = None, max_slots=8):
        self.model, self.tokenizer, self.eos_id, self.bos_id = model, tokenizer, eos_id, bos_id
        self.max_context = model.cfg.max_len
        self.chat_template = None
        self.max_slots = max_slots
        self._ids = itertools.count()
        self._waiting: list[_Request] = []
        self._running: dict[str, _Request] = {}
        self._aborted: list[str] = []
        self._forward = nnx.jit(lambda m, ids: jax.nn.log_softmax(m(ids).astype("float32"), axis=-1))

    @classmethod
    def from_workdir(cls, workdir, cfg=None) -> Engine:
        from jaxformer.checkpoint import restore_workdir
        from jaxformer.config import read_config
        from jaxformer.data import load_tokenizer

        run = read_config(f"{workdir}/config.json")
        graphdef, state, _ = restore_workdir(run, workdir)
        tok = load_tokenizer(run, workdir)
        engine = cls(nnx.merge(graphdef, state.weights), cfg, tokenizer=tok, eos_id=tok.eos_id, bos_id=tok.bos_id)
        engine.chat_template = None if run.data.template == "none" else run.data.template
        return engine

    def add_request(self, prompt_ids, params, request_id=None, *, source_ids=None) -> str:
        V = self.model.cfg.vocab_size
        if not prompt_ids or any(not isinstance(i, int) or not 0 <= i < V for i in prompt_ids):
            raise EngineError(f"a prompt is a non-empty list of ids in [0, {V})")
        if len(prompt_ids) + params.max_tokens > self.max_context:
            raise EngineError(
                f"a prompt of {len(prompt_ids)} tokens and max_tokens={params.max_tokens} exceed the model's "
                f"context of {self.max_context}"
            )
        rid = request_id or f"req-{next(self._ids)}"
        self._waiting.append(_Request(rid, list(prompt_ids), params))
        return rid

    def abort(self, request_id: str) -> None:
        before = len(self._waiting) + len(self._running)
        self._waiting = [r for r in self._waiting if r.id != request_id]
        self._running.pop(request_id, None)
        if len(self._waiting) + len(self._running) == before:
            raise EngineError(f"no request {request_id!r} is unfinished")
        self._aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._aborted)

    def stats(self) -> dict:
        return {"pages_total": 0, "pages_free": 0, "running": len(self._running), "waiting": len(self._waiting),
                "preempted": 0}  # fmt: skip

    def step(self) -> list[Event]:
        events = [Event(r, [], None, True, "abort") for r in self._aborted]
        self._aborted = []
        while self._waiting and len(self._running) < self.max_slots:
            r = self._waiting.pop(0)
            self._decode(r)
            self._running[r.id] = r
        for r in list(self._running.values()):
            new = r.tokens[r.sent : r.sent + 1]
            lp = r.logprobs[r.sent : r.sent + 1] if r.params.logprobs else None
            r.sent += len(new)
            done = r.sent == len(r.tokens)
            events.append(Event(r.id, new, lp, done, r.reason if done else None))
            if done:
                del self._running[r.id]
        return events

    def _decode(self, r: _Request) -> None:
        p, L = r.params, self.max_context
        width = min(max(8, 1 << (len(r.prompt) - 1).bit_length()), L - 1)
        settings = DecodeConfig(
            # a few lengths (powers of two) so that a few compilations serve every request
            strategy="greedy" if p.temperature == 0 else "sample",
            max_new_tokens=max(1, min(L - width, 1 << max(4, (p.max_tokens - 1).bit_length()))),
            temperature=p.temperature or 1.0, top_k=p.top_k, top_p=p.top_p, seed=p.seed or 0,
        )  # fmt: skip
        out = decode.generate(self.model, [r.prompt], settings, eos_id=self.eos_id)
        ids = [int(i) for i in out.tokens[0, 0]][: L - len(r.prompt)]
        if self.eos_id in ids:
            ids, r.reason = ids[: ids.index(self.eos_id)], "stop"
        if len(ids) >= p.max_tokens:
            ids, r.reason = ids[: p.max_tokens], "length"
        if p.stop and self.tokenizer is not None:
            for n in range(1, len(ids) + 1):
                if any(s in self.tokenizer.decode(ids[:n]) for s in p.stop):
                    ids, r.reason = ids[:n], "stop"
                    break
        r.tokens = ids
        if p.logprobs and ids:
            full = np.zeros((1, L), np.int32)
            full[0, : len(r.prompt) + len(ids)] = r.prompt + ids
            logp = np.asarray(self._forward(self.model, full))[0]
            r.logprobs = [float(logp[len(r.prompt) - 1 + i, t]) for i, t in enumerate(ids)]

    def generate(self, prompts, params, *, sources=None) -> list[Output]:
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
        done = {}
        while self.has_unfinished():
            for e in self.step():
                done.setdefault(e.request_id, []).append(e)
        outs = []
        for rid, prompt in zip(ids, prompts, strict=True):
            tokens = [t for e in done[rid] for t in e.token_ids]
            text = self.tokenizer.decode(tokens) if self.tokenizer else None
            outs.append(Output(rid, prompt, tokens, text, None, done[rid][-1].finish_reason))
        return outs
