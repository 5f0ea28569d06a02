"""The ASGI app: OpenAI's routes over an EngineThread, the page at `/`, errors as OpenAI writes them.

Each HTTP request gets an asyncio queue; the engine thread puts its Events there through
`loop.call_soon_threadsafe`. A streamed answer is server-sent events in OpenAI's chunk format, ended by
`data: [DONE]`; a client that goes away mid-answer has its requests aborted (their pages freed).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.resources
import json
import logging
import time

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxformer.config import ServeConfig
from jaxformer.serve import encoders, forms, protocol, responses, stored, tokens
from jaxformer.serve.choices import Choice, chat_choice, counts_of, ranked, top_texts, usage_of
from jaxformer.serve.metrics import Metrics
from jaxformer.serve.protocol import APIError, Job
from jaxformer.serve.runner import EngineThread

log = logging.getLogger("jaxformer.serve")
MAX_BODY = 8 << 20  # bytes of one request body
DISCONNECT_POLL = 0.5  # seconds between looks at whether a non-streaming client is still there


def create_app(engine, cfg: ServeConfig, model_name: str) -> Starlette:
    """The server's app; its engine thread starts and stops with the app (ASGI lifespan).

    Args:
        engine (Engine): the engine, owned by the app's engine thread from then on.
        cfg: the server's settings (api_key).
        model_name: the model's id in /v1/models and in requests; the engine's LoRA adapters (`engine.adapters`)
            are models too, each by its name.

    Returns:
        The app (run it with uvicorn).

    Raises:
        ValueError: an engine without a tokenizer (the server speaks text), or an adapter named as the model.
    """
    if getattr(engine, "tokenizer", None) is None:
        raise ValueError("the engine has no tokenizer: the server takes and answers text")
    if model_name in getattr(engine, "adapters", ()):
        raise ValueError(f"the model name {model_name!r} is also an adapter's: give them different names")
    return _Server(engine, cfg, model_name).app


class _Server:
    def __init__(self, engine, cfg: ServeConfig, model_name: str):
        self.engine, self.cfg, self.model_name = engine, cfg, model_name
        self.tok = engine.tokenizer
        self.mcfg = mcfg = engine.model.cfg  # read once: `model` merges the graph
        self.width, self.mode = mcfg.d_model, mcfg.mode  # an encoder's embeddings' size; the model's mode
        self.max_source = mcfg.max_len  # an encoder_decoder model's sources at most
        self.runner = EngineThread(engine)
        self.metrics = Metrics(model_name)
        self.stored = stored.Store(cfg.responses_store)
        self._later: dict[str, asyncio.Task] = {}  # the background Responses running, by id
        self.created = protocol.now()
        routes = [
            Route("/", self.page, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.scrape, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/{rid}", self.response, methods=["GET", "DELETE"]),
            Route("/v1/responses/{rid}/input_items", self.input_items, methods=["GET"]),
            Route("/v1/responses/{rid}/cancel", self.cancel, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/classify", self.classify, methods=["POST"]),  # SGLang's path
            Route("/classify", self.classify, methods=["POST"]),  # vLLM's
            Route("/tokenize", self.tokenize, methods=["POST"]),  # vLLM's
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/v1/load_lora_adapter", self.load_lora, methods=["POST"]),  # vLLM's, if cfg.lora_updates
            Route("/v1/unload_lora_adapter", self.unload_lora, methods=["POST"]),
        ]
        self.app = Starlette(
            routes=routes,
            lifespan=self.lifespan,
            exception_handlers={HTTPException: self.http_error, Exception: self.server_error},
        )
        self.app.state.server = self

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.runner.start()
        yield
        self.runner.stop()

    @property
    def names(self) -> tuple[str, ...]:
        """The models served: the base, then each LoRA adapter (as the engine serves them now)."""
        return (self.model_name, *getattr(self.engine, "adapters", ()))

    # ------------------------------------------------------------------ plain routes

    async def page(self, request: Request) -> Response:
        html = importlib.resources.files("jaxformer.serve").joinpath("page.html").read_text(encoding="utf-8")
        return HTMLResponse(html)

    async def health(self, request: Request) -> Response:
        if not self.runner.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        try:
            stats = await asyncio.wait_for(asyncio.wrap_future(self.runner.call(lambda e: e.stats())), 30)
        except TimeoutError:
            return JSONResponse({"status": "engine busy"}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.model_name, "engine": stats})

    async def scrape(self, request: Request) -> Response:
        """Prometheus's scrape (open, as `/health` is): the requests counted so far and the engine's figures
        now, or as last read where the engine has stopped or stays busy."""
        stats = None
        if self.runner.alive:
            with contextlib.suppress(TimeoutError):
                stats = await asyncio.wait_for(asyncio.wrap_future(self.runner.call(lambda e: e.stats())), 30)
        return Response(self.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    def _model_card(self, name: str) -> dict:
        """OpenAI's model object, and what the page asks of the model: its context, its mode (an encoder_only
        model embeds and, with `labels`, classifies; the others generate) and a classifier's class names."""
        card = {"id": name, "object": "model", "created": self.created, "owned_by": "jaxformer",
                "max_context": self.engine.max_context, "mode": self.mode}  # fmt: skip
        card |= {"labels": list(self.engine.labels)} if self.engine.encoder_only and self.engine.labels else {}
        return card if name == self.model_name else card | {"parent": self.model_name}  # a LoRA adapter of it

    async def models(self, request: Request) -> Response:
        cards = lambda: JSONResponse({"object": "list", "data": [self._model_card(n) for n in self.names]})
        return await self._guarded(request, cards)

    async def model(self, request: Request) -> Response:
        async def answer():
            name = request.path_params["model"]
            if name not in self.names:
                raise APIError(404, f"The model `{name}` does not exist", "model", "model_not_found")
            return JSONResponse(self._model_card(name))

        return await self._guarded(request, answer)

    # ------------------------------------------------------------------ errors and the key

    async def http_error(self, request: Request, exc: HTTPException) -> Response:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(APIError(exc.status_code, message, None, None, kind).body(), status_code=exc.status_code)

    async def server_error(self, request: Request, exc: Exception) -> Response:
        log.error("request %s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(APIError(500, f"the server failed on this request: {type(exc).__name__}: {exc}", None, None,
                               "server_error"))  # fmt: skip

    def _check_key(self, request: Request) -> None:
        if self.cfg.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.cfg.api_key.encode()):
            what = "no API key given (header Authorization: Bearer KEY)" if not given else "incorrect API key provided"
            raise APIError(401, what, None, "invalid_api_key", "authentication_error")

    async def _guarded(self, request: Request, answer) -> Response:
        """The key checked, then the answer; an APIError becomes its response, anything else a 500."""
        try:
            self._check_key(request)
            result = answer()
            return await result if asyncio.iscoroutine(result) else result
        except APIError as e:
            return _error(e)
        except Exception as e:
            return await self.server_error(request, e)

    async def _body(self, request: Request, known: set[str], named: bool = True) -> dict:
        """The request's JSON body, its fields checked, and the model it names (`named`: one must be named;
        else a model, if named, must be served)."""
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise APIError(413, f"the request body is {len(raw)} bytes: at most {MAX_BODY}", None, "body_too_large")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"could not parse the JSON body of the request: {e}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}", None, "invalid_json")
        protocol.check_text(body)  # before any error message repeats a field's name or value
        protocol.check_fields(body, known)
        if named or body.get("model") is not None:
            protocol.check_model(body, self.names)
        return body

    def _named(self, job: Job, body: dict) -> Job:
        """The job with the model its body names (a LoRA adapter's name runs that adapter)."""
        job.model = body["model"]
        job.adapter = None if job.model == self.model_name else job.model
        return job

    # ------------------------------------------------------------------ generation

    def _generates(self, chat: bool = False) -> None:
        """Refuse a generating route of an encoder_only model, saying where its scores are, and chat of an
        encoder_decoder model, saying where its sources go."""
        if chat and self.engine.encoder_decoder:
            raise APIError(400, "this model is encoder_decoder: it answers a source (a translation), not a "
                           "conversation: send the source as /v1/completions' prompt", "model",
                           "model_not_supported")  # fmt: skip
        if self.engine.encoder_only:
            where = "/v1/embeddings" + (" and its classes at /v1/classify" if self.engine.labels else "")
            raise APIError(400, f"this model is encoder_only: it generates nothing; its embeddings are served at "
                           f"{where}", "model", "model_not_supported")  # fmt: skip

    async def completions(self, request: Request) -> Response:
        async def answer():
            body = await self._body(request, protocol.COMPLETION_FIELDS)
            self._generates()
            job = self._named(protocol.completion_job(body, self.tok, self.engine.max_context), body)
            if self.engine.encoder_decoder:  # each prompt a source; the answer starts from BOS
                if job.echo or job.prompt_logprobs is not None:
                    field, what = ("echo", "echo") if job.echo else ("prompt_logprobs", "score")
                    raise protocol.bad(field, "an encoder_decoder model's answer does not continue its source: "
                                       f"nothing to {what}", "unsupported")  # fmt: skip
                for i, ids in enumerate(job.prompts):
                    if len(ids) > self.max_source:
                        raise protocol.bad(f"prompt[{i}]" if len(job.prompts) > 1 else "prompt", f"a source of "
                                           f"{len(ids)} tokens: the model's sources hold {self.max_source}",
                                           "context_length_exceeded")  # fmt: skip
                job.sources = True
            scores = await self._score(job)
            if not job.generate:  # echo with max_tokens 0: the prompt alone, the engine not asked
                choices = [Choice(self.tok, job, index, scores) for index in range(len(job.prompts) * job.n)]
                for c in choices:
                    c.done, c.finish_reason = True, "length"
                return JSONResponse(self._whole(job, choices))
            return await self._run(request, job, scores)

        return await self._guarded(request, answer)

    async def chat(self, request: Request) -> Response:
        async def answer():
            body = await self._body(request, protocol.CHAT_FIELDS)
            self._generates(chat=True)
            template = getattr(self.engine, "chat_template", None)
            job = self._named(protocol.chat_job(body, self.tok, self.engine.max_context, template), body)
            return await self._run(request, job, await self._score(job))

        return await self._guarded(request, answer)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API: the chat its request is (`responses.as_chat`), answered as a Response."""

        async def answer():
            body = await self._body(request, responses.FIELDS)
            self._generates(chat=True)
            template = getattr(self.engine, "chat_template", None)
            before = [] if body.get("previous_response_id") is None else self.stored.conversation(
                body["previous_response_id"])  # fmt: skip
            chat, origin = responses.as_chat(body, before)
            try:
                job = protocol.chat_job(chat, self.tok, self.engine.max_context, template)
            except APIError as e:
                raise responses.renamed(e, origin) from None
            job.respond, job.conversation = body, before + stored.input_items(body["input"])
            if job.guided_by == "response_format":  # an engine's error names the Responses field
                job.guided_by = "text.format"
            if body.get("background"):
                return await self._background(self._named(job, body))
            return await self._run(request, self._named(job, body))

        return await self._guarded(request, answer)

    async def _background(self, job: Job) -> Response:
        """A Responses request answered in the background (`background: true`): its Response comes back at once,
        "queued", and is stored; a task marks it "in_progress", waits for its answer and stores it when it ends
        ("completed", "incomplete", "failed" where the engine failed, or "cancelled": `cancel`). Streamed
        (`stream: true` too), its events come back instead, are kept with it and can be read again from any
        point (`GET /v1/responses/{id}?stream=true`); a client that goes away stops reading them, not the answer."""
        body = job.respond
        if body.get("store") is False or not self.stored.capacity:
            raise protocol.bad("background", "a background response needs the response stored (store: true, on a "
                               "server whose --responses-store is above 0)", "unsupported")  # fmt: skip
        events, ids, choices = await self._started(job)
        out = responses.Events(job.model or self.model_name, body) if body.get("stream") else None
        job.response_id = rid = protocol.new_id("resp") if out is None else out.rid
        created = protocol.now() if out is None else out.created
        queued = responses.response(rid, created, job.model, body, [], None, None) | {"status": "queued"}
        self.stored.put(queued, job.conversation, out)

        async def answer() -> None:
            self.stored.put(queued | {"status": "in_progress"}, job.conversation)  # its requests run in the engine
            try:
                if out is None:
                    await self._collected(None, events, ids, choices)
                else:
                    async for _ in self._stream_response(job, events, ids, choices, out):
                        pass  # each event kept by `out`, for its readers
                    if out.failure is not None:
                        raise out.failure
                whole = self._whole(job, choices, created) if out is None else out.whole
            except Exception as e:  # the engine failed (an APIError), or this server did
                if not isinstance(e, APIError):
                    log.exception("background response %s failed", rid)
                    e = APIError(500, f"{type(e).__name__}: {e}", None, "server_error", "server_error")
                whole = queued | {"status": "failed", "error": {"code": e.code or "server_error", "message": e.message}}
            except asyncio.CancelledError:  # `cancel`: what it said so far
                text = choices[0].text
                whole = queued | {"status": "cancelled", "output": [responses.message_item(rid, text, "incomplete")]
                                  if text else []}  # fmt: skip
            self._later.pop(rid, None)
            self._keep(job, whole)
            if out is not None:
                out.finish()  # its readers' streams end, with the Response stored as it ended

        self._later[rid] = asyncio.create_task(answer())
        return JSONResponse(queued) if out is None else _event_stream(out.follow())

    async def cancel(self, request: Request) -> Response:
        """A background Response stopped (`POST /v1/responses/{id}/cancel`): its requests aborted, it is kept as
        "cancelled" with the text said so far; one cancelled already is answered as it is."""

        async def answer():
            rid = request.path_params["rid"]
            kept = self.stored.get(rid).response
            if rid in self._later:
                await self._stop(rid)
                return JSONResponse(self.stored.get(rid).response)
            if kept.get("background") and kept["status"] == "cancelled":
                return JSONResponse(kept)
            what = "has ended" if kept.get("background") else "was not made in the background"
            raise APIError(400, f"response {rid!r} {what}: only a background response that runs can be cancelled",
                           None, "invalid_request")  # fmt: skip

        return await self._guarded(request, answer)

    async def _stop(self, rid: str) -> None:
        """Cancel a background Response's task and wait until it has stored what it had."""
        task = self._later[rid]
        await asyncio.sleep(0)  # a task cancelled before its first step would not run its own `except`
        task.cancel()
        await asyncio.wait([task])

    async def response(self, request: Request) -> Response:
        """A stored Response (`GET /v1/responses/{id}`), or forgotten (`DELETE`; one running in the background is
        cancelled first)."""

        async def answer():
            rid = request.path_params["rid"]
            if request.method == "GET":
                kept = self.stored.get(rid)
                after = stored.stream_query(kept, dict(request.query_params))
                return JSONResponse(kept.response) if after is None else _event_stream(kept.events.follow(after))
            if rid in self._later:
                await self._stop(rid)
            return JSONResponse(self.stored.delete(rid))

        return await self._guarded(request, answer)

    async def input_items(self, request: Request) -> Response:
        """The input items a stored Response answered, a page of them (`stored.Store.listing`)."""
        listing = lambda: self.stored.listing(request.path_params["rid"], dict(request.query_params))
        return await self._guarded(request, lambda: JSONResponse(listing()))

    def _keep(self, job: Job, whole: dict) -> dict:
        """A Responses request's answer, stored unless it asked not to be (`store: false`)."""
        if whole["store"]:
            self.stored.put(whole, job.conversation)
        return whole

    async def embeddings(self, request: Request) -> Response:
        """OpenAI's embeddings of an encoder_only model: each input's final hidden states averaged over its
        positions (`Engine.score(..., "embed")`), in the engine's thread, `max_slots` inputs a call."""

        async def answer():
            body = await self._body(request, encoders.EMBEDDING_FIELDS)
            if not self.engine.encoder_only:
                raise APIError(400, "embeddings come from an encoder_only model; this one generates: use "
                               "/v1/completions", "model", "model_not_supported")  # fmt: skip
            inputs, as_base64 = encoders.embedding_inputs(body, self.tok, self.engine.max_context, self.width)
            vectors = await self._scores(inputs, "embed", body["model"])
            return JSONResponse(encoders.embeddings_body(vectors, as_base64, body["model"], sum(map(len, inputs))))

        return await self._guarded(request, answer)

    async def classify(self, request: Request) -> Response:
        """vLLM's classification of an encoder_only model with a classification head: each input's class
        probabilities (`Engine.score(..., "classify")`) and the likeliest class's name (`Engine.labels`)."""

        async def answer():
            body = await self._body(request, encoders.CLASSIFY_FIELDS)
            if not self.engine.encoder_only:
                raise APIError(400, "classes come from an encoder_only model with a classification head; this one "
                               "generates: use /v1/completions", "model", "model_not_supported")  # fmt: skip
            if not self.engine.labels:
                raise APIError(400, "this model has no classification head (model.num_classes=0): its embeddings "
                               "are served at /v1/embeddings", "model", "model_not_supported")  # fmt: skip
            inputs = encoders.scored_inputs(body, self.tok, self.engine.max_context)
            logprobs = await self._scores(inputs, "classify", body["model"])
            tokens = sum(map(len, inputs))
            return JSONResponse(encoders.classify_body(logprobs, self.engine.labels, body["model"], tokens))

        return await self._guarded(request, answer)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt, or a chat's messages, as the ids the generation routes feed the model."""

        async def answer():
            body = await self._body(request, tokens.TOKENIZE_FIELDS, named=False)
            template = getattr(self.engine, "chat_template", None)
            return JSONResponse(tokens.tokenize_body(body, self.tok, self.engine.max_context, template))

        return await self._guarded(request, answer)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: token ids as text."""

        async def answer():
            body = await self._body(request, tokens.DETOKENIZE_FIELDS, named=False)
            return JSONResponse(tokens.detokenize_body(body, self.tok, self.engine.vocab_size))

        return await self._guarded(request, answer)

    async def load_lora(self, request: Request) -> Response:
        """vLLM's /v1/load_lora_adapter: {"lora_name", "lora_path"}, the workdir of a LoRA run of this model,
        served from the engine's next step as model `lora_name` (read off the engine's thread, then stacked
        on it)."""

        async def answer():
            name, path = await self._lora_body(request, {"lora_name", "lora_path"})
            if name in self.names:
                raise APIError(400, f"lora_name: {name!r} is already served (unload it first)", "lora_name")
            if not isinstance(path, str) or not path:
                raise APIError(400, "lora_path: the workdir of a LoRA run (a string) is expected", "lora_path")
            from jaxformer.engine import EngineError
            from jaxformer.engine.adapters import arrays_of

            try:  # the checkpoint read here, the engine's steps going on meanwhile
                arrays = await asyncio.to_thread(arrays_of, name, path, self.mcfg)
                await asyncio.wrap_future(self.runner.call(lambda e: e.load_adapter(name, arrays)))
            except EngineError as e:
                raise APIError(400, f"lora_path: {e}", "lora_path") from None
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

        return await self._guarded(request, answer)

    async def unload_lora(self, request: Request) -> Response:
        """vLLM's /v1/unload_lora_adapter: {"lora_name"}, refused while requests of it run."""

        async def answer():
            name, _ = await self._lora_body(request, {"lora_name", "lora_int_id"})
            if name not in self.names[1:]:
                raise APIError(404, f"lora_name: no LoRA adapter {name!r} is served", "lora_name", "model_not_found")
            from jaxformer.engine import EngineError

            try:
                await asyncio.wrap_future(self.runner.call(lambda e: e.unload_adapter(name)))
            except EngineError as e:
                raise APIError(400, f"lora_name: {e}", "lora_name") from None
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

        return await self._guarded(request, answer)

    async def _lora_body(self, request: Request, fields: set[str]) -> tuple:
        """A LoRA route's (lora_name, lora_path), where `cfg.lora_updates` opens the route (else a 404)."""
        if not self.cfg.lora_updates:
            raise APIError(404, "loading LoRA adapters while serving is off: start the server with --lora-updates",
                           None, "not_found")  # fmt: skip
        body = await self._body(request, fields, named=False)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name or name.strip() != name:
            raise APIError(400, "lora_name: a non-empty name without surrounding spaces is expected", "lora_name")
        return name, body.get("lora_path")

    async def _scores(self, inputs: list[list[int]], kind: str, model: str) -> list[list]:
        """An encoder's `Engine.score` of whole inputs, in the engine's thread, by the model (or adapter) named."""
        from jaxformer.engine import EngineError

        adapter = None if model == self.model_name else model
        try:
            return await asyncio.wrap_future(self.runner.call(lambda e: e.score(inputs, kind, adapter=adapter)))
        except EngineError as e:  # an id outside the vocabulary
            raise protocol.bad("input", str(e)) from None

    async def _score(self, job: Job) -> list[dict] | None:
        """Where a request asks (echo with logprobs, or vLLM's `prompt_logprobs`), each prompt's scores by one
        batched forward pass (jaxformer.evaluation.scoring) in the engine's thread, over the weights it serves:
        "echo": OpenAI's "tokens", "token_logprobs" and "top_logprobs" (the first None; `job.top_logprobs`
        likeliest at each), and "ranked": vLLM's prompt_logprobs (`choices.ranked`), each where asked; None where
        neither is."""
        from jaxformer.evaluation.scoring import Scorer, ScoringError

        if not job.score_prompt and job.prompt_logprobs is None:
            return None
        top_n = max(job.top_logprobs, job.prompt_logprobs or 0, 1)

        for i, ids in enumerate(job.prompts):
            V = self.engine.vocab_size
            outside = [t for t in ids if not 0 <= t < V]
            if outside:
                where = f"prompt[{i}]" if len(job.prompts) > 1 else "prompt"
                raise protocol.bad(where, f"token id {outside[0]} is outside the vocabulary [0, {V})")
        scored = [i for i, ids in enumerate(job.prompts) if len(ids) > 1]

        def score(engine):
            model = engine.model if job.adapter is None else engine.model_of(job.adapter)
            scorer = Scorer(model, batch_size=engine.cfg.max_slots)  # weights as served now
            return scorer.prompt_logprobs([job.prompts[i] for i in scored], top_n)

        try:
            found = dict(zip(scored, await asyncio.wrap_future(self.runner.call(score)), strict=True))
        except ScoringError as e:
            field = "echo" if job.score_prompt else "prompt_logprobs"
            raise protocol.bad(field, f"this model cannot score a prompt: {e}", "unsupported") from None
        out = []
        for i, ids in enumerate(job.prompts):
            logp, top, top_logp, rank = found.get(i, ((), (), (), ()))
            k = job.top_logprobs
            tops = [top_texts(self.tok, zip(t[:k], lp[:k], strict=True)) if k else {}
                    for t, lp in zip(top, top_logp, strict=True)]  # fmt: skip
            echo = {"tokens": [self.tok.decode([t]) for t in ids],
                    "token_logprobs": [None, *map(float, logp)], "top_logprobs": [None, *tops]}  # fmt: skip
            n, at = job.prompt_logprobs, zip(ids[1:], logp, rank, top, top_logp, strict=True)
            listed = None if n is None else [None, *(ranked(self.tok, *r, n) for r in at)]
            out.append({"echo": echo if job.score_prompt else None, "ranked": listed})
        return out

    async def _submit(self, job: Job) -> tuple[asyncio.Queue, list[str]]:
        """Every (prompt, choice) of the job added to the engine; their Events come on one queue as
        (choice index, Event or Exception). All or none: one refused aborts the others."""
        from jaxformer.engine import EngineError

        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        futures = []
        for p, ids in enumerate(job.prompts):
            for j, params in enumerate(job.params):
                index = p * job.n + j
                deliver = lambda item, i=index: loop.call_soon_threadsafe(events.put_nowait, (i, item))
                if job.sources:
                    futures.append(self.runner.add([], params, deliver, job.adapter, source_ids=ids))
                else:
                    futures.append(self.runner.add(ids, params, deliver, job.adapter))
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
        except asyncio.CancelledError:  # the client left while the requests were being added
            for f in futures:
                if f.done() and not f.cancelled() and f.exception() is None:
                    self.runner.abort(f.result())
            raise
        refused = [r for r in results if isinstance(r, BaseException)]
        if refused:
            for r in results:
                if isinstance(r, str):
                    self.runner.abort(r)
            e = refused[0]
            if isinstance(e, EngineError) and e.field == "adapter":  # unloaded since the request named it
                raise APIError(404, f"model: {e}", "model", "model_not_found")
            if isinstance(e, EngineError):
                code = "context_length_exceeded" if "context" in str(e) else "invalid_value"
                param = job.guided_by if e.field in forms.STRUCTURED.values() else e.field  # the request's name
                param = param or ("max_tokens" if code == "context_length_exceeded" else "prompt")
                message = str(e)  # the tools' calls are held by a schema the request did not write: say whose
                message = message.replace("json_schema", "the tools' parameters", 1) if param == "tools" else message
                raise APIError(400, message, param, code)
            raise e
        return events, list(results)

    async def _started(self, job: Job, scores: list[dict] | None = None) -> tuple:
        """The job's requests added to the engine: (their Events' queue, their ids, a Choice each, counted in the
        metrics when it ends)."""
        arrived = time.monotonic()
        events, ids = await self._submit(job)
        ended = lambda c, reason: self.metrics.finished(job.adapter, reason, len(c.prompt), len(c.tokens),
                                                        (arrived, c.first_at, c.last_at))  # fmt: skip
        return events, ids, [Choice(self.tok, job, index, scores, ended) for index in range(len(ids))]

    async def _run(self, request: Request, job: Job, scores: list[dict] | None = None) -> Response:
        events, ids, choices = await self._started(job, scores)
        if job.stream:
            stream = self._stream if job.respond is None else self._stream_response
            return _event_stream(stream(job, events, ids, choices))
        if not await self._collected(request, events, ids, choices):
            return Response(status_code=499)  # nobody to answer; its pages are freed
        return JSONResponse(self._whole(job, choices))

    async def _collected(self, request: Request | None, events: asyncio.Queue, ids: list[str], choices: list[Choice]):
        """Take the Events until every choice has ended (True), or the client of `request` went away (False;
        None: a background Response's, whom nobody waits on); what still runs is aborted either way."""
        try:
            looked = time.monotonic()
            while not all(c.done for c in choices):
                if request is not None and time.monotonic() - looked > DISCONNECT_POLL:  # however busy the queue
                    looked = time.monotonic()
                    if await request.is_disconnected():
                        return False
                try:
                    index, item = await asyncio.wait_for(events.get(), DISCONNECT_POLL)
                except TimeoutError:
                    continue
                if isinstance(item, Exception):
                    raise _engine_failed(item)
                choices[index].take(item, lambda i=index: self.runner.abort(ids[i]))
        finally:
            self._abort_unfinished(ids, choices)
        return True

    def _abort_unfinished(self, ids: list[str], choices: list[Choice]) -> None:
        for request_id, c in zip(ids, choices, strict=True):
            if not c.done:
                c.end("abort")  # the client went away: counted before the engine can hear of it
            if not c.engine_done:
                self.runner.abort(request_id)

    def _whole(self, job: Job, choices: list[Choice], created: int | None = None) -> dict:
        usage = usage_of(job, choices)
        if job.respond is not None:  # one choice: a Responses request has no n
            c, rid = choices[0], job.response_id or protocol.new_id("resp")
            content, calls, reason = c.text, [], c.finish_reason
            if job.tools is not None:
                content, calls, reason = job.tools.answer(c.text, c.finish_reason)
            logprobs = c.chat_logprobs(c.logprobs)["content"] if job.logprobs else None
            output = responses.outputs(rid, content, calls, reason, logprobs)
            model = job.model or self.model_name
            whole = responses.response(rid, created or protocol.now(), model, job.respond, output, reason, usage)
            return self._keep(job, whole)
        # vLLM's prompt_logprobs: a completion's in each choice, a chat's (one prompt) in the answer.
        prompt_logprobs = lambda c: {} if job.prompt_logprobs is None else {"prompt_logprobs": c.scores["ranked"]}
        if job.chat:
            return {
                "id": protocol.new_id("chatcmpl"), "object": "chat.completion", "created": protocol.now(),
                "model": job.model or self.model_name,
                "choices": [chat_choice(c, job) for c in choices],
                "usage": usage,
            } | prompt_logprobs(choices[0])  # fmt: skip
        return {
            "id": protocol.new_id("cmpl"), "object": "text_completion", "created": protocol.now(),
            "model": job.model or self.model_name,
            "choices": [{"index": c.index, "text": c.text, "logprobs": c.text_logprobs(c.logprobs, whole=True)
                         if job.logprobs else None, "finish_reason": c.finish_reason} | prompt_logprobs(c)
                        for c in choices],
            "usage": usage,
        }  # fmt: skip

    async def _stream(self, job: Job, events: asyncio.Queue, ids: list[str], choices: list[Choice]):
        kind = "chat.completion.chunk" if job.chat else "text_completion"
        head = {"id": protocol.new_id("chatcmpl" if job.chat else "cmpl"), "object": kind,
                "created": protocol.now(), "model": job.model or self.model_name}  # fmt: skip

        def chunk(index: int, text: str, finish: str | None, logprobs: list | None = None, first: bool = False) -> str:
            c = choices[index]
            if job.chat:
                delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                if c.calls is not None and not first:  # under tools: a call's arguments, or content before one
                    if finish is None:
                        delta = c.calls.add(text)
                    else:
                        delta, finish = c.calls.end(finish)
                lp = c.chat_logprobs(logprobs) if job.logprobs and logprobs else None
                choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                lp = c.text_logprobs(logprobs) if job.logprobs and logprobs else None
                choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
            usage = {"usage": counts_of(c) if job.continuous_usage else None} if job.include_usage else {}
            return _sse(head | {"choices": [choice]} | usage)

        try:
            for c in choices:  # the role first (chat), or the echoed prompt
                if job.chat:
                    yield chunk(c.index, "", None, first=True)
                elif job.echo:
                    yield chunk(c.index, c.echo, None)
            async for index, piece, logprobs in self._pieces(job, events, ids, choices):
                if piece or logprobs:
                    yield chunk(index, piece, None, logprobs)
                if choices[index].done:
                    yield chunk(index, "", choices[index].finish_reason)
            if job.include_usage:
                yield _sse(head | {"choices": [], "usage": usage_of(job, choices)})
            yield "data: [DONE]\n\n"
        except APIError as e:  # the engine failed
            yield _sse(e.body())
        finally:  # the client went away (the generator is closed), or all is said: free what still runs
            self._abort_unfinished(ids, choices)

    async def _stream_response(self, job: Job, events: asyncio.Queue, ids: list[str], choices: list[Choice],
                               out: responses.Events | None = None):  # fmt: skip
        """A Responses request's stream: its typed events (`out`, or new `responses.Events`)."""
        out = out or responses.Events(job.model or self.model_name, job.respond)
        try:
            yield out.start()
            c = choices[0]
            async for _, piece, triples in self._pieces(job, events, ids, choices):
                if c.calls is not None:  # under tools: the content before the calls, then each call
                    yield out.chat_delta(c.calls.add(piece))
                elif piece or triples:
                    yield out.delta(piece, c.chat_logprobs(triples)["content"] if triples else None)
            reason = c.finish_reason
            if c.calls is not None:
                delta, reason = c.calls.end(reason)
                yield out.chat_delta(delta)
            yield out.end(reason, usage_of(job, choices))
            self._keep(job, out.whole)
        except APIError as e:  # the engine failed
            yield out.error(e)
        finally:
            self._abort_unfinished(ids, choices)

    async def _pieces(self, job: Job, events: asyncio.Queue, ids: list[str], choices: list[Choice]):
        """(choice index, its new text, its new (id, log-probability, likeliest) triples if asked) as the
        engine's events come, until every choice is done; a choice's last is its end (`Choice.done`).

        Raises:
            APIError: the engine failed.
        """
        while not all(c.done for c in choices):
            index, item = await events.get()
            if isinstance(item, Exception):
                raise _engine_failed(item)
            c = choices[index]
            before = len(c.logprobs)
            piece = c.take(item, lambda i=index: self.runner.abort(ids[i]))
            yield index, piece, c.logprobs[before:] if job.logprobs else []


def _engine_failed(e: Exception) -> APIError:
    return APIError(500, f"the engine failed on this request: {type(e).__name__}: {e}", None, None, "server_error")


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _event_stream(events) -> StreamingResponse:
    """Server-sent events as `events` (an async iterator of their texts) gives them, kept by no proxy's buffer."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
