"""`Engine`: continuous batching over a paged KV cache, for serving and batch jobs.

A scheduler in plain Python (outside jit) runs each `step`: it admits waiting requests into free slots
(sharing the pages of a prompt prefix already in the pool), runs one chunk of prefill for every slot
still reading its prompt (`prefill_chunk` tokens each, so a long prompt never stalls the others), then
one decode step for every slot that is generating, and retires requests at EOS, a stop string or
`max_tokens`. Shapes are static per bucket: a decode step runs [R, 1] and prefill [R, prefill_chunk]
with R a power of two up to `max_slots`, over page tables cut to P pages, P the power of two (up to
max_context's) covering the longest row of the call, so attention reads the live sequences' pages and
not the whole context's; a few compilations serve every mix of requests (each row's sampling settings
are arrays). When the pool runs out of pages, the latest admitted request is preempted (its pages
freed, it waits to be recomputed, prompt and tokens so far); its tokens do not change, since a row draws
with a key from its request's seed and the token's position. A model whose every layer is local
(`model.sliding_window`, Mistral's) releases a request's pages once they lie wholly behind its window
(`pages.pages_behind`), so a request holds a few pages at once however long it grows.

A model with latent attention (`model.mla`) has pages of latents rather than of keys and values, read
in the absorbed form; the scheduler is the same. An encoder_decoder model's request brings its source:
encoded once when it takes a slot, each decoder layer's cross-attention keys and values of it stay in
the slot until it leaves. An encoder_only model generates nothing: `Engine.score` classifies, fills
masks or embeds whole inputs.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxformer import precast
from jaxformer.config import EngineConfig
from jaxformer.decode import SAMPLED
from jaxformer.engine import adapters as _adapters
from jaxformer.engine import paged, speculate
from jaxformer.engine import steps as _steps
from jaxformer.engine.guided import ChoiceGuide, GrammarGuide, Guides, bad_word_ids
from jaxformer.engine.pages import PageAllocator, bucket, page_hashes, pages_at_once, pages_behind, releasable_window
from jaxformer.engine.requests import MAX_TOP_LOGPROBS, EngineError, Event, Output, SamplingParams, each, penalty_inputs
from jaxformer.engine.steps import _copy_page, _encode_into, _forward, drawn, score_batches


@dataclasses.dataclass(eq=False)
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    order: int  # admission order: the latest admitted is preempted first
    out: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # positions whose keys and values are in its pages
    registered: int = 0  # full prompt pages entered in the prefix cache
    hashes: list[int] = dataclasses.field(default_factory=list)
    behind: int = 0  # leading pages released behind the window (their entries 0)
    source: list[int] | None = None  # encoder_decoder: the source, encoded when the request takes a slot
    adapter: int = 0  # its LoRA adapter's index in the stacks (engine.adapters): 0 is the base
    guide: ChoiceGuide | GrammarGuide | None = None  # what holds its output (choices, a pattern), if anything
    banned: tuple = ()  # its bad words' ids (guided.bad_word_ids)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out


_MIN_READ = 32  # positions a step's page tables cover at least: fewer buckets, each compiled once
_LOWERED = collections.Counter()  # the step's shapes compiled, by (rows, width, pages[, steps]): tests count them


def _aval(a) -> tuple:
    """What an executable compiled for array `a` requires of another in its place."""
    return a.shape, a.dtype, getattr(a, "sharding", None)


def _key(x: dict[str, np.ndarray], steps: int, top_n: int, verify: bool = False) -> tuple:
    """A step's executable's key: (rows, width, pages, steps[, top_n][, "penalized"][, "verify"]) of its inputs."""
    variant = ((top_n,) if top_n else ()) + ("penalized",) * ("penalties" in x) + ("verify",) * verify
    return (*x["ids"].shape, x["table"].shape[1], steps, *variant)


class Engine(_adapters.Served):
    """Continuous batching over a paged KV cache (see the module's docstring).

    Not thread-safe: one thread owns it (a server calls `step` in a loop, fed by a queue).

    Args:
        model (Transformer): a model of any mode (LoRA adapters are merged, scanned stacks unrolled);
            encoder_only serves `score` only.
        cfg (EngineConfig): the pool and the scheduler.
        tokenizer (Tokenizer | None): detokenizes outputs and matches stop strings; None: ids only.
        eos_id: the end-of-sequence id (finish_reason "stop"; never in an output's token_ids).
        bos_id: the beginning-of-sequence id, or None.
        adapters (dict | None): LoRA adapters served beside the base, each request choosing one by name
            (`add_request(..., adapter=NAME)`): name -> a model of the same architecture with adapters, or
            the workdir of a LoRA run (`jaxformer.engine.adapters`). An encoder_decoder request's source is
            encoded with its adapter too; an encoder_only model's `score` takes one per input.

    Raises:
        EngineError: a model the engine does not serve, a context the model cannot hold, or an adapter that
            does not fit the model.
    """

    def __init__(
        self,
        model,
        cfg: EngineConfig | None = None,
        *,
        tokenizer=None,
        eos_id: int,
        bos_id: int | None = None,
        adapters: dict | None = None,
    ):
        from jaxformer.decode import decodable
        from jaxformer.layers import without_id_checks

        cfg = EngineConfig() if cfg is None else cfg
        if not isinstance(cfg, EngineConfig):
            raise TypeError(f"cfg: a jaxformer.config.EngineConfig, got {type(cfg).__name__}")
        mcfg = model.cfg
        if cfg.max_context is not None and cfg.max_context > mcfg.max_len:
            raise EngineError(f"engine.max_context={cfg.max_context} exceeds the model's max_len={mcfg.max_len}")
        for name, value in (("eos_id", eos_id), ("bos_id", bos_id)):
            if value is not None and not (isinstance(value, int) and 0 <= value < mcfg.vocab_size):
                raise EngineError(f"{name}={value!r} is not an id of the vocabulary [0, {mcfg.vocab_size})")
        self.cfg, self.tokenizer, self.eos_id, self.bos_id = cfg, tokenizer, eos_id, bos_id
        self.guides = Guides(tokenizer, eos_id, mcfg.vocab_size)  # structured outputs (jaxformer.engine.guided)
        self.chat_template: str | None = None
        # A classifier's class names, by index (`from_workdir`: the workdir's own; else Hugging Face's defaults).
        self.labels = tuple(f"LABEL_{c}" for c in range(mcfg.num_classes))
        self.vocab_size = mcfg.vocab_size
        self.max_context = cfg.max_context or mcfg.max_len
        self.pages_per_seq = -(-self.max_context // cfg.page_size)
        own = nnx.merge(*nnx.split(model))  # new modules over the same arrays: the caller's keep their id checks
        served = decodable(without_id_checks(own))
        self._lora = _adapters.attach(served, adapters or {})  # their A and B by name (`adapters.Served`)
        self.adapters = tuple(self._lora)  # names; adapter i + 1 of the stacks is names[i]
        self._graphdef, self._params = nnx.split(served)
        G, K = mcfg.kv_heads, mcfg.dim_per_head
        self.encoder_only = mcfg.mode == "encoder_only"  # scores only (`score`): no cache, no decoding
        self._pools = paged.empty_pools(mcfg, cfg.num_pages, cfg.page_size)  # K/V pages, or MLA's latents
        self._compiled = {}  # the step's executables, by (rows, width, pages, steps[, top_n][, "penalized"])
        self.encoder_decoder = mcfg.mode == "encoder_decoder"
        self._memory, self._src_lengths = None, np.zeros(cfg.max_slots, np.int32)
        if self.encoder_decoder:  # each slot's source, as cross-attention keys and values [slots, G, S, K]
            mem = jax.jit(lambda: jnp.zeros((cfg.max_slots, G, mcfg.max_len, K), mcfg.dtype))
            self._memory = [{"k": mem(), "v": mem()} for _ in range(mcfg.num_decoder_layers)]
        self.pad_id, self._num_classes = mcfg.pad_id, mcfg.num_classes
        self._alloc = PageAllocator(cfg.num_pages)
        self._window = releasable_window(mcfg)  # > 0: pages behind it are released as a request moves on
        self._table = np.zeros((cfg.max_slots, self.pages_per_seq), np.int32)
        self._slots: list[_Request | None] = [None] * cfg.max_slots
        self._waiting: collections.deque[_Request] = collections.deque()  # admitted in order, preempted first
        self._live: dict[str, _Request] = {}
        self._pending: list[Event] = []  # aborts, reported at the next step
        self._keep: dict[str, Output | None] = {}  # outputs `generate` collects
        self._ids, self._order = itertools.count(), itertools.count()
        # Counters: requests preempted, prompt pages found in the pool rather than computed, pages released
        # behind the sliding window, tokens drafted and accepted (speculative decoding).
        self.num_preempted = self.prefix_hits = self.window_released = self.drafted = self.draft_accepted = 0
        self._casts = {}  # parameters stored in the dtype every program reads them in (precast), by leaf
        self._precast()

    def _precast(self) -> None:
        """Store the parameters in the dtype every program reads them in (`precast`)."""
        if not self.encoder_only:
            src = (self._memory, np.zeros((1, 1), np.int32), np.ones(1, np.int32), 0)  # _encode_into's arguments
            step = self._inputs(self._blank(1, 1, 1))[1:]  # _forward's
            self._casts = _steps.cast_plan(self._graphdef, self._params, step, None if self._memory is None else src)
            self._params = precast.apply_plan(self._params, self._casts)

    @classmethod
    def from_workdir(cls, workdir, cfg: EngineConfig | None = None, *, adapters: dict | None = None) -> Engine:
        """An engine over a training workdir's latest checkpoint (or an exported directory): its model,
        tokenizer (EOS, BOS), the chat template of its data (`data.template`), if any, and a classifier's
        class names (`checkpoint.class_labels`).

        Args:
            workdir (str | pathlib.Path): a training workdir or a directory `jaxformer export` wrote.
            cfg: the engine's settings (None: the defaults).
            adapters (dict | None): name -> the workdir of a LoRA run of this model (or a model), served beside it.

        Returns:
            The engine.

        Raises:
            FileNotFoundError: no config.json or no checkpoint there.
            EngineError: an adapter that does not fit the model.
        """
        from jaxformer.checkpoint import class_labels, load_workdir
        from jaxformer.data import load_tokenizer

        model, run = load_workdir(workdir)
        tok = load_tokenizer(run, workdir)
        bos = getattr(tok, "bos_id", None)
        engine = cls(model, cfg, tokenizer=tok, eos_id=tok.eos_id, bos_id=bos, adapters=adapters)
        engine.chat_template = None if run.data.template == "none" else run.data.template
        engine.labels = class_labels(workdir, run.model.num_classes)
        return engine

    @property
    def model(self):
        """The model as the engine runs it, over its current weights (the same arrays, nothing copied): what
        the server scores prompts with (`echo` with `logprobs`).

        Returns:
            model (Transformer): its own adapters folded, layers unrolled; the served adapters' rows all 0 (the base).
        """
        return nnx.merge(self._graphdef, self._params)

    def load_weights(self, model) -> None:
        """Serve `model`'s current weights from the next step on (a training loop hands over its new
        parameters: the arrays themselves, folded and unrolled as at construction, nothing synchronised).
        Pages cached for prefix sharing held keys of the old weights: they are forgotten.

        Args:
            model (Transformer): a model of the engine's structure (the one it was built on, updated).

        Raises:
            EngineError: requests are still running or waiting, or the model's structure differs.
        """
        from jaxformer.decode import decodable
        from jaxformer.layers import without_id_checks

        if self.has_unfinished():
            raise EngineError("load_weights: requests are still running; finish or abort them first")
        if self.adapters:
            raise EngineError("load_weights: this engine serves adapters over its base; build a new engine")
        graphdef, params = nnx.split(decodable(without_id_checks(nnx.merge(*nnx.split(model)))))
        if graphdef != self._graphdef:
            raise EngineError("load_weights: the model's structure differs from the engine's")
        params = precast.apply_plan(params, self._casts)
        if jax.tree.map(_aval, params) != jax.tree.map(_aval, self._params):
            self._compiled.clear()  # the executables were compiled for the old arrays' shapes and placement
        self._params = params
        self._alloc.forget()

    # ------------------------------------------------------------------------- requests

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        source_ids: list[int] | None = None,
        adapter: str | None = None,
    ) -> str:
        """Queue a request; it is admitted at a coming `step`.

        Args:
            prompt_ids: the prompt's token ids.
            params: how to decode it.
            request_id: its id (None: one is made).
            source_ids: an encoder_decoder model's source (its prompt then may be empty: BOS).
            adapter: the served LoRA adapter it runs (a name of `adapters`), or None: the base.

        Returns:
            The request id.

        Raises:
            EngineError: an adapter the engine does not serve.
            EngineError: an empty prompt, ids outside the vocabulary, a prompt and max_tokens over the
                context or the pool, a live id, stop strings without a tokenizer, or a source missing
                (encoder_decoder) or given (decoder_only).
        """
        if self.encoder_only:
            raise EngineError("an encoder_only model generates nothing: use Engine.score")
        if not isinstance(params, SamplingParams):
            raise EngineError(f"params: a SamplingParams, got {type(params).__name__}")
        index = _adapters.index_of(self.adapters, adapter)
        source = None
        if self.encoder_decoder:
            if source_ids is None:
                raise EngineError("source_ids: an encoder_decoder model needs a source")
            source = self._check_ids(source_ids, "source_ids")
            if len(source) > (S := self._memory[0]["k"].shape[2]):
                raise EngineError(f"source_ids has {len(source)} tokens; the model's max_len is {S}")
            if len(prompt_ids) == 0 and self.bos_id is None:
                raise EngineError("prompt_ids is empty and the engine has no bos_id to start the output with")
            prompt_ids = prompt_ids if len(prompt_ids) else [self.bos_id]
        elif source_ids is not None:
            raise EngineError("source_ids: a decoder_only model has no encoder; give the prompt only")
        prompt = self._check_ids(prompt_ids)
        need = len(prompt) + params.max_tokens
        if need > self.max_context:
            raise EngineError(
                f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} = {need} exceeds the context of "
                f"{self.max_context} positions"
            )
        span = max(self.cfg.prefill_chunk, self.cfg.decode_steps)
        if (pages := pages_at_once(need, self._window, self.cfg.page_size, span)) > self.cfg.num_pages - 1:
            raise EngineError(
                f"prompt + max_tokens = {need} positions need {pages} pages at once; the pool has "
                f"{self.cfg.num_pages - 1} (engine.num_pages={self.cfg.num_pages}, one scratch)"
            )
        if (params.stop or params.bad_words) and self.tokenizer is None:
            what = "stop strings" if params.stop else "bad words"
            raise EngineError(f"{what} need a tokenizer (the engine has none)")
        params.check_ids(self.vocab_size)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if not isinstance(request_id, str) or request_id in self._live:
            raise EngineError(f"request_id {request_id!r} is not a string or is already live")
        seed = params.seed
        if seed is None:
            seed = zlib.crc32(f"{self.cfg.seed}/{request_id}".encode())
        guide = self.guides.guide(params)
        req = _Request(request_id, prompt, params, seed, order=0, source=source, adapter=index, guide=guide)
        req.banned = bad_word_ids(params.bad_words, self.tokenizer) if params.bad_words else ()
        root = None if source is None else hash(("source", tuple(source)))  # its keys depend on the source
        root = hash(("adapter", adapter, root)) if index else root  # and on the adapter: shared within one only
        req.hashes = page_hashes(prompt, self.cfg.page_size, root) if self.cfg.prefix_sharing else []
        self._live[request_id] = req
        self._waiting.append(req)
        return request_id

    def _check_ids(self, ids, what: str = "prompt_ids") -> list[int]:
        if isinstance(ids, (np.ndarray, jax.Array)):  # ids as JAX and numpy hold them: read once, as ints
            array = np.asarray(ids)
            if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
                raise EngineError(f"{what}: a 1-D array of integer token ids, got {array.dtype} {array.shape}")
            ids = array.tolist()
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
            raise EngineError(f"{what}: a list of token ids, got {type(ids).__name__}")
        if len(ids) == 0:
            raise EngineError(f"{what} is empty: at least one token is needed")
        out = []
        for i, t in enumerate(ids):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise EngineError(f"{what}[{i}] = {t!r} is not an integer token id")
            if not 0 <= t < self.vocab_size:
                raise EngineError(f"{what}[{i}] = {int(t)} is outside the vocabulary [0, {self.vocab_size})")
            out.append(int(t))
        return out

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages; its next Event has finish_reason "abort" (unknown or finished
        ids: nothing happens, as a client may leave after its request ended).

        Args:
            request_id: the request.
        """
        req = self._live.get(request_id)
        if req is None:
            return
        if req in self._waiting:
            self._waiting.remove(req)
        self._finish(req, "abort", [], self._pending)

    def has_unfinished(self) -> bool:
        """Whether a request waits or runs (or an abort is yet to be reported).

        Returns:
            True while `step` has work.
        """
        return bool(self._live) or bool(self._pending)

    def stats(self) -> dict:
        """The pool and the queue, now.

        Returns:
            {"pages_total", "pages_free", "pages_cached", "running", "waiting", "preempted", "prefix_hits",
            "window_released", "drafted", "draft_accepted", "cache_bytes_per_token"}: pages_total excludes the
            scratch page; pages_cached are free pages still holding a prefix; window_released counts the pages
            released behind a sliding window so far (a model whose every layer is local); drafted and
            draft_accepted count speculative decoding's drafted tokens and those taken; cache_bytes_per_token
            is what one position takes in the pools over all layers (2 G K x the dtype's bytes a layer,
            latent attention's (C + R) x the dtype's bytes).
        """
        cached = sum(1 for p in self._alloc.free if p in self._alloc.hash_of)
        positions = self.cfg.num_pages * self.cfg.page_size
        return {
            "pages_total": self.cfg.num_pages - 1, "pages_free": self._alloc.num_free(), "pages_cached": cached,
            "running": sum(r is not None for r in self._slots), "waiting": len(self._waiting),
            "preempted": self.num_preempted, "prefix_hits": self.prefix_hits, "window_released": self.window_released,
            "drafted": self.drafted, "draft_accepted": self.draft_accepted,
            "cache_bytes_per_token": sum(p.nbytes for pool in self._pools for p in pool.values()) // positions,
        }  # fmt: skip

    # ------------------------------------------------------------------------- scheduling

    def step(self) -> list[Event]:
        """One scheduler iteration: admit, one prefill chunk per prefilling slot, one decode step.

        Returns:
            The events of this step (aborts since the last step included).
        """
        events, self._pending = self._pending, []
        self._admit(events)
        prefilling = [r for r in self._slots if r is not None and len(r.tokens) - r.computed > 1]
        if prefilling:
            self._run(prefilling, self.cfg.prefill_chunk, events, decode=False)
        decoding = [r for r in self._slots if r is not None and r not in prefilling and len(r.tokens) - r.computed == 1]
        if decoding:
            self._run(decoding, 1, events, decode=True)
        return events

    def _admit(self, events: list[Event]) -> None:
        promised = 0  # fresh pages the first chunks of the requests admitted so far will take
        while self._waiting and None in self._slots:
            req = self._waiting[0]
            shared = self._shared_prefix(req)
            fresh = -(
                -min(len(req.tokens), len(shared) * self.cfg.page_size + self.cfg.prefill_chunk) // self.cfg.page_size
            )
            # Shared pages the prefix cache kept on the free list leave it when shared: not free for the rest.
            revived = sum(self._alloc.refs[page] == 0 for page in shared)
            if fresh - len(shared) + revived > self._alloc.num_free() - promised:
                return  # it waits for pages; running requests are not preempted to admit one
            promised += fresh - len(shared)
            self._waiting.popleft()
            for page in shared:
                self._alloc.share(page)
            self.prefix_hits += len(shared)
            req.pages, req.registered = shared, len(shared)
            # A prompt found whole still computes its last token (its logits give the first new one).
            req.computed = min(len(shared) * self.cfg.page_size, len(req.tokens) - 1)
            req.slot, req.order = self._slots.index(None), next(self._order)
            self._slots[req.slot] = req
            self._slide(req)  # shared pages its first query no longer sees go back at once
            self._sync_table(req)
            if req.source is not None:
                self._encode(req)
            if req.guide is not None and not req.out:  # the tokens its form forces first join its prompt's prefill
                self._jump(req, events)

    def _encode(self, req: _Request) -> None:
        S = self._memory[0]["k"].shape[2]
        src = np.full((1, S), self.pad_id, np.int32)
        src[0, : len(req.source)] = req.source
        lengths = np.asarray([len(req.source)], np.int32)
        rows = np.int32(req.adapter) if self.adapters else None  # its adapter in the encoder and cross-attention
        self._memory = _encode_into(self._graphdef, self._params, self._memory, src, lengths, req.slot, rows)
        self._src_lengths[req.slot] = len(req.source)

    def _shared_prefix(self, req: _Request) -> list[int]:
        pages = []
        for h in req.hashes:
            if (page := self._alloc.lookup(h)) is None:
                break
            pages.append(page)
        return pages

    def _sync_table(self, req: _Request) -> None:
        row = self._table[req.slot]
        row[:] = 0
        row[: len(req.pages)] = req.pages

    def _reserve(self, req: _Request, upto: int) -> bool:
        """Pages for positions [computed, upto) of `req`, a shared one copied before it is written;
        False when the pool cannot give them even after preempting later requests."""
        size = self.cfg.page_size
        first, last = req.computed // size, (upto - 1) // size
        needed = sum(1 for i in range(first, last + 1) if i >= len(req.pages) or self._alloc.refs[req.pages[i]] > 1)
        while self._alloc.num_free() < needed:  # the latest admitted goes, `req` itself if it is the latest
            victim = max((r for r in self._slots if r is not None), key=lambda r: r.order)
            self._preempt(victim)
            if victim is req:
                return False
        for i in range(first, last + 1):
            if i >= len(req.pages):
                req.pages.append(self._alloc.allocate())
            elif self._alloc.refs[req.pages[i]] > 1:  # copy-on-write
                page = self._alloc.allocate()
                self._pools = _copy_page(self._pools, req.pages[i], page)
                self._alloc.release(req.pages[i])
                req.pages[i] = page
        self._sync_table(req)
        return True

    def _slide(self, req: _Request) -> None:
        """Release `req`'s pages wholly behind the window of its next position (every layer local)."""
        upto = pages_behind(req.computed, self._window, self.cfg.page_size)
        if upto > req.behind:
            self.window_released += self._alloc.release_front(req.pages, req.behind, upto)
            req.behind = upto
            self._sync_table(req)

    def _preempt(self, req: _Request) -> None:
        self._release(req)
        req.computed = req.registered = 0
        self.num_preempted += 1
        self._waiting.appendleft(req)  # recomputed first, prompt and tokens so far

    def _release(self, req: _Request) -> None:
        for page in req.pages[req.behind :]:
            self._alloc.release(page)
        req.pages, req.behind = [], 0
        if req.slot is not None:
            self._slots[req.slot] = None
            self._table[req.slot] = 0
            req.slot = None

    def _run(self, reqs: list[_Request], width: int, events: list[Event], decode: bool) -> None:
        """One compiled step over `reqs`: a prefill chunk, the next `width` (at most) uncomputed tokens of each
        (a chunk of one included), or (`decode`) up to `decode_steps` steps from each one's last token."""
        spans = {}
        # A guided request learns its next allowed tokens from each one drawn, as one with a bad word of several
        # tokens its banned ones: their calls run one step.
        steps = 1 if any(r.guide or any(len(w) > 1 for w in r.banned) for r in reqs) else self.cfg.decode_steps
        drafts = speculate.drafts(reqs, self.cfg, self.max_context) if decode else {}
        # Where a row has drafts, one step checks each row's last token and its drafts at once (`speculate`).
        width, steps = (1 + self.cfg.speculative_tokens, 1) if drafts else (width, steps)
        for req in sorted(reqs, key=lambda r: r.order):
            if req.slot is None:  # preempted by an earlier one's reservation
                continue
            n = min(width, len(req.tokens) - req.computed)
            if decode:  # up to `steps` tokens, no more than the request may still take
                n = 1 + len(drafts[req]) if drafts else min(steps, req.params.max_tokens - len(req.out))
            if self._reserve(req, req.computed + n):
                spans[req] = n
        reqs = [r for r in spans if r.slot is not None]
        if not reqs:
            return
        # A power of two of rows, and of pages: the pages the longest row reads in this call (positions up
        # to the last it writes), so a step's attention reads the live sequences' pages, not max_context's.
        # A few shapes serve every mix, one compilation each.
        R = bucket(len(reqs), self.cfg.max_slots)
        row_of = {r: i for i, r in enumerate(reqs)}
        size = self.cfg.page_size
        P = bucket(max(-(-_MIN_READ // size), *(-(-(r.computed + spans[r]) // size) for r in reqs)), self.pages_per_seq)
        x = self._blank(R, width, P)
        for req, i in row_of.items():
            start = req.computed
            n = spans[req] if not decode or drafts else 1  # positions fed in (decoding feeds the tokens it draws)
            x["ids"][i, :n] = req.tokens[start : start + 1] + drafts[req] if drafts else req.tokens[start : start + n]
            x["positions"][i] = start + np.arange(width)
            x["valid"][i, :n] = True
            x["last"][i], x["steps"][i] = n - 1, spans[req] if decode else 0  # steps: the decoding loop's
            x["table"][i] = self._table[req.slot, :P]
            p = req.params
            x["seeds"][i], x["adapters"][i], x["slots"][i] = req.seed, req.adapter, req.slot
            for field in SAMPLED:
                x[field][i] = getattr(p, field)
            x["eos_from"][i] = len(req.prompt) + p.min_tokens  # the first position EOS may take
        # The likeliest tokens' log-probabilities, where a row asks: a variant of the step that returns them.
        top_n = MAX_TOP_LOGPROBS if any(r.params.top_logprobs for r in reqs) else 0
        if any(r.params.penalized for r in reqs):  # penalties or biases: a variant of the step that applies them
            rows = [(i, r.params, r.prompt, r.out, r.guide, r.banned) for r, i in row_of.items()]
            x["penalties"] = penalty_inputs(rows, R, self.vocab_size, self.eos_id)
        out = self._call(x, steps if decode else 1, top_n, bool(drafts))
        for req, i in row_of.items():
            n = req.params.top_logprobs
            if not decode:  # a prefill chunk
                req.computed += spans[req]
                self._register(req)
                if req.computed == len(req.tokens):  # its last known token ran: a new one
                    self._accept(req, *drawn(out, i, 0, n), events)
                continue
            taken = speculate.accepted(out[0][i], drafts[req]) if drafts else spans[req]  # the drafts matched, +1
            if drafts:
                self.drafted, self.draft_accepted = self.drafted + len(drafts[req]), self.draft_accepted + taken - 1
            for j in range(taken):  # decode: each token fed in gave the next, until the request ends
                req.computed += 1
                if self._accept(req, *drawn(out, i, j, n), events):
                    break
        for req in row_of:
            if req.slot is not None:  # still running
                self._slide(req)

    def _blank(self, R: int, width: int, P: int, penalized: bool = False) -> dict[str, np.ndarray]:
        """The inputs of one compiled step, every row empty: R rows of `width` positions over P pages
        (page 0, scratch), greedy (`penalized`: with the penalty inputs, none set); an empty row writes
        nothing that any request reads."""
        zeros = lambda dtype, shape=(R,): np.zeros(shape, dtype)
        penalties = {"penalties": penalty_inputs([], R, self.vocab_size, self.eos_id)} if penalized else {}
        return penalties | {
            "ids": zeros(np.int32, (R, width)), "positions": zeros(np.int32, (R, width)),
            "valid": zeros(bool, (R, width)), "last": zeros(np.int32), "table": zeros(np.int32, (R, P)),
            "steps": zeros(np.int32), "adapters": zeros(np.int32), "slots": zeros(np.int32),
            "seeds": zeros(np.uint32), "temperature": zeros(np.float32), "top_k": zeros(np.int32),
            "top_p": np.ones(R, np.float32), "min_p": zeros(np.float32), "eos_from": zeros(np.int32),
        }  # fmt: skip

    def _call(self, x: dict[str, np.ndarray], steps: int, top_n: int = 0, verify: bool = False) -> tuple:
        """Run the compiled step of `steps` steps (a prefill chunk: 1) on inputs `x` (`_blank`'s, filled): tokens
        and log-probabilities [R, steps], and None or the `top_n` likeliest ids and their log-probabilities
        [R, steps, top_n]. Its executable for this shape is compiled the first time (unless `warmup` did; the
        variants with `top_n` or penalties, `warmup(every_variant=True)`) and kept: a call then flattens the
        arrays and runs, with no jit cache to look up by the model's graph. `verify`: each position draws."""
        shape = _key(x, steps, top_n, verify)
        if shape not in self._compiled:
            self._compiled[shape] = self._lower(x, steps, top_n, verify).compile()
        tokens, logp, top, self._pools = self._compiled[shape](*self._inputs(x))
        return np.asarray(tokens), np.asarray(logp), None if top is None else tuple(map(np.asarray, top))

    def _lower(self, x: dict[str, np.ndarray], steps: int, top_n: int = 0, verify: bool = False):
        _LOWERED[(*x["ids"].shape, x["table"].shape[1]) + ((steps,) if steps > 1 else ())] += 1
        raw = self.cfg.logprobs_mode == "raw"
        return _forward.lower(self._graphdef, *self._inputs(x), steps=steps, top_n=top_n, raw=raw, verify=verify)

    def _inputs(self, x: dict[str, np.ndarray]) -> tuple:
        """`_forward`'s arguments but its static ones (the graph, the steps), from `_blank`'s inputs."""
        source = None if self._memory is None else (self._memory, self._src_lengths, x["slots"])
        eos = np.int32(-1 if self.eos_id is None else self.eos_id)
        sampling = (x["seeds"], *(x[f] for f in SAMPLED), eos, x["eos_from"])
        return (
            self._params, self._pools, x["table"], x["ids"], x["positions"], x["valid"], x["last"], sampling, source,
            x["steps"], x["adapters"] if self.adapters else None, x.get("penalties"),
        )  # fmt: skip

    def warmup(self, threads: int | None = None, every_variant: bool = False) -> int:
        """Compile every shape of the step the scheduler can call, before any request: prefill chunks and
        decode steps, at each power of two of rows up to `max_slots` and of pages up to the context's,
        so that no request waits for a compilation (as a server warms up before it takes traffic). Each
        shape is traced here, then compiled on `threads` threads at once (XLA's compiler runs outside
        Python's lock), then run once on empty rows, which write only the scratch page: a GPU loads an
        executable's kernels and records its CUDA graphs at its first run, which would otherwise fall on
        the first requests (an H100 at the 1.3B shape: the first round after a compile-only warm-up took
        3.5 s, the later ones 1.9 s). The steps that follow call these executables.

        Args:
            threads: compilations at once (default: the host's cores).
            every_variant: also the variants of the step that a request's fields choose: the one that lists
                the likeliest tokens (`top_logprobs`), the one that applies penalties, biases or a structured
                output (whose decoding calls run one step each), and the two at once; about 4.5x the shapes.
                Without it, a request that needs a variant waits for its compilation the first time.

        Returns:
            The count of shapes the step can take, each now compiled (0 for an encoder_only engine, which
            only scores).

        Raises:
            EngineError: requests are queued or running (warm up an idle engine).
        """
        if self.has_unfinished():
            raise EngineError("warmup: requests are queued or running; warm up before adding any")
        if self.encoder_only:
            return 0
        top, pps, c = self.cfg.max_slots, self.pages_per_seq, self.cfg
        rows = sorted({bucket(n, top) for n in range(1, top + 1)})
        pages = sorted({bucket(n, pps) for n in range(min(-(-_MIN_READ // c.page_size), pps), pps + 1)})
        variants = [(0, False)] + [(MAX_TOP_LOGPROBS, False), (0, True), (MAX_TOP_LOGPROBS, True)] * every_variant
        calls = {}  # each shape's blank inputs, steps, top_n and verify, by its key in `_compiled`
        checks = [(1 + c.speculative_tokens, 1, True)] if c.speculative_tokens else []  # speculative decoding's
        for top_n, penalized in variants:
            shapes = [(c.prefill_chunk, 1, False), (1, c.decode_steps, False)] + [(1, 1, False)] * penalized + checks
            for width, steps, verify in dict.fromkeys(shapes):
                for x in (self._blank(R, width, P, penalized) for R in rows for P in pages):
                    calls[_key(x, steps, top_n, verify)] = (x, steps, top_n, verify)
        new = {key: call for key, call in calls.items() if key not in self._compiled}
        lowered = [self._lower(*call) for call in new.values()]
        with concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
            self._compiled.update(zip(new, pool.map(lambda lowering: lowering.compile(), lowered), strict=True))
        for call in new.values():
            self._call(*call)
        return len(calls)

    def _register(self, req: _Request) -> None:
        """Enter the prompt pages now computed into the prefix cache."""
        done = min(req.computed // self.cfg.page_size, len(req.hashes))
        for i in range(req.registered, done):
            self._alloc.register(req.pages[i], req.hashes[i])
        req.registered = max(req.registered, done)

    def _accept(self, req: _Request, token: int, logp: float, top, events: list[Event], forced=False) -> bool:
        """Take a new token of `req` and, if asked, its log-probability and the likeliest tokens' (`top`: (id,
        log-probability) pairs); its EOS, a stop string or its length may end it. Then (unless `forced`) the
        tokens its form forces (`_jump`). True if it ended."""
        p = req.params
        new = ([logp] if p.logprobs else None, None if top is None else [top])
        if (token == self.eos_id and not p.ignore_eos) or token in p.stop_token_ids:
            return self._finish(req, "stop", [], events) or True
        req.out.append(token)
        if p.logprobs:
            req.logprobs.append(logp)
        if top is not None:
            req.top_logprobs.append(top)
        if p.stop and self._stop_at(req) is not None:
            return self._finish(req, "stop", [token], events, new) or True
        if req.guide is not None and not len(req.guide.allowed(req.out)[0]):  # whole, and nothing extends it
            return self._finish(req, "stop", [token], events, new) or True
        if len(req.out) >= p.max_tokens or len(req.tokens) >= self.max_context:
            return self._finish(req, "length", [token], events, new) or True
        events.append(Event(req.id, [token], new[0], False, None, new[1]))
        return req.guide is not None and not forced and self._jump(req, events)

    def _jump(self, req: _Request, events: list[Event]) -> bool:
        """Take the tokens `req`'s form forces now (`GrammarGuide.forced`), each as if drawn (log-probability 0),
        for its next call to compute as a prefill chunk. True if it ended. Under "raw" logprobs, steps draw them."""
        raw = self.cfg.logprobs_mode == "raw" and req.params.logprobs  # each drawn: the model's log-probability
        top = (lambda t: [(t, 0.0)]) if req.params.top_logprobs else (lambda t: None)
        return not raw and any(self._accept(req, t, 0.0, top(t), events, True) for t in req.guide.forced(req.out))

    def _stop_at(self, req: _Request) -> int | None:
        """Where `req`'s text ends at its first stop string found: before it, or (include_stop_str_in_output)
        after it; None while none is found."""
        text = self.tokenizer.decode(req.out)
        found = [(i, i + len(s)) for s in req.params.stop if (i := text.find(s)) >= 0]
        return min(found)[req.params.include_stop_str_in_output] if found else None

    def _finish(self, req, reason: str, new: list[int], events: list[Event], got=(None, None)) -> None:
        """End `req`: its pages freed, its last Event (`new` tokens, `got`: their log-probabilities and likeliest
        tokens, or None each), its Output kept where `generate` waits for it."""
        self._release(req)
        del self._live[req.id]
        tokens, logprobs, text = req.out, req.logprobs if req.params.logprobs else None, None
        tops = req.top_logprobs if req.params.top_logprobs else None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(tokens)
            if reason == "stop" and req.params.stop and (cut := self._stop_at(req)) is not None:
                text = text[:cut]
                n = len(tokens)
                while n and not text.startswith(self.tokenizer.decode(tokens[:n])):
                    n -= 1  # the tokens whose text stays within the text kept
                tokens = tokens[:n]
                logprobs, tops = (None if x is None else x[:n] for x in (logprobs, tops))
        events.append(Event(req.id, new, got[0], True, reason, got[1]))
        if req.id in self._keep:
            self._keep[req.id] = Output(req.id, req.prompt, list(tokens), text, logprobs, reason, tops)

    # ------------------------------------------------------------------------- batch jobs

    def score(self, inputs: list[list[int]], kind: str, *, mask_id: int | None = None, adapter=None) -> list[list]:
        """encoder_only: scores of whole inputs, `max_slots` rows at a time (widths rounded up to a
        power of two, so a few compiled shapes serve every input).

        Args:
            inputs: token-id inputs (each at most the model's max_len).
            kind: "classify" (log-probabilities of the classes; needs model.num_classes > 0), "fill" (the
                input with each `mask_id` replaced by the masked-LM head's likeliest id) or "embed" (the
                mean of the final hidden states over the input's positions).
            mask_id: the mask token ("fill"; None: the tokenizer's).
            adapter (str | None | list[str | None]): the served adapter of every input, or one per input (a
                list or tuple; None: the base); rows of one call may run different adapters.

        Returns:
            One list per input: C log-probabilities, the filled ids, or D floats.

        Raises:
            EngineError: not an encoder_only model, an unknown kind, no classes, no mask id, a bad input,
                or an adapter the engine does not serve.
        """
        if not self.encoder_only:
            raise EngineError("score() needs an encoder_only model; this one generates (use generate)")
        if kind not in ("classify", "fill", "embed"):
            raise EngineError(f"kind must be 'classify', 'fill' or 'embed', got {kind!r}")
        if kind == "classify" and self._num_classes == 0:
            raise EngineError("kind='classify' needs a classification head (model.num_classes > 0)")
        if (
            kind == "fill"
            and (mask_id := mask_id if mask_id is not None else getattr(self.tokenizer, "mask_id", None)) is None
        ):
            raise EngineError("kind='fill' needs a mask_id (the engine's tokenizer has none)")
        rows = [self._check_ids(x, f"inputs[{i}]") for i, x in enumerate(inputs)]
        for i, r in enumerate(rows):
            if len(r) > self.max_context:
                raise EngineError(f"inputs[{i}] has {len(r)} tokens; the model's max_len is {self.max_context}")
        names = each(adapter, len(rows), "adapters", "inputs")
        indices = [_adapters.index_of(self.adapters, name) for name in names] if self.adapters else None
        return score_batches(self._graphdef, self._params, rows, kind, self.cfg.max_slots, self.pad_id,
                             self.max_context, indices, mask_id)  # fmt: skip

    def generate(self, prompts, params, *, sources=None, adapter=None) -> list[Output]:
        """Run prompts to the end (with any requests already queued) and return their outputs.

        Args:
            prompts (list[list[int]]): token-id prompts.
            params (SamplingParams | list[SamplingParams]): one for all, or one per prompt.
            sources (list[list[int]] | None): encoder_decoder: the sources (prompts may then be empty: BOS).
            adapter (str | None | list[str | None]): the served adapter of every prompt, or one per prompt.

        Returns:
            One Output per prompt, in prompt order.

        Raises:
            EngineError: a bad request (nothing is queued then), or a params, sources or adapter list of another
                length.
        """
        if sources is not None and len(sources) != len(prompts):
            raise EngineError(f"{len(sources)} sources for {len(prompts)} prompts")
        sources = [None] * len(prompts) if sources is None else sources
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise EngineError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        names = each(adapter, len(prompts), "adapters", "prompts")
        ids = []
        try:
            for prompt, p, src, name in zip(prompts, params, sources, names, strict=True):
                ids.append(self.add_request(prompt, p, source_ids=src, adapter=name))
                self._keep[ids[-1]] = None
        except EngineError:
            for rid in ids:
                self.abort(rid)
                self._keep.pop(rid)
            self._pending = [e for e in self._pending if e.request_id not in ids]
            raise
        while any(self._keep[rid] is None for rid in ids):
            self.step()
        return [self._keep.pop(rid) for rid in ids]
