"""`jaxformer serve`: an OpenAI-compatible HTTP server of one model, and a page to try it at `/`.

Routes: `POST /v1/completions` (an encoder_decoder model's prompts are sources, its answers their
translations), `POST /v1/chat/completions` (the messages written in the workdir's chat template,
`data.template`), both streamed by server-sent events with `"stream": true`; `POST /v1/embeddings`
and, with a classification head, `POST /v1/classify` (also at `/classify`, vLLM's path; each input's class
probabilities and its likeliest class's name) of an encoder_only model; `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus's, `metrics`) and `GET /` (the page: one HTML file, no external assets).
Bound to 127.0.0.1 unless told otherwise; with `api_key` set, every route but `/`, `/health` and
`/metrics` asks for `Authorization: Bearer KEY`.

The app is Starlette on uvicorn. Starlette: a small, well-kept ASGI toolkit whose StreamingResponse
carries server-sent events and closes the stream's generator when the client goes away (so its requests
are aborted); FastAPI's pydantic validation would answer malformed requests with its own 422 body, not
OpenAI's error body, so the checks are written out here (`protocol`) and name OpenAI's fields.
uvicorn: the reference ASGI server, pure Python with h11 (no compiled extras needed).

Modules:
- `protocol`: request bodies checked into jobs, OpenAI's error body, text handed out as tokens come
- `runner`: the engine's own thread (the Engine is not thread-safe) and its command queue
- `app`: the ASGI app (create_app)
"""

from __future__ import annotations

from jaxformer.serve.app import create_app
from jaxformer.serve.protocol import APIError
from jaxformer.serve.runner import EngineThread

__all__ = ["APIError", "EngineThread", "create_app", "run"]


def run(engine, cfg, model_name: str, log_level: str = "info") -> None:
    """Serve `engine` until interrupted (Ctrl-C), on uvicorn at cfg.host:cfg.port.

    Args:
        engine (Engine): the engine.
        cfg (ServeConfig): host, port, api_key.
        model_name: the model's id in /v1/models and in requests.
        log_level: uvicorn's log level.
    """
    import uvicorn

    uvicorn.run(create_app(engine, cfg, model_name), host=cfg.host, port=cfg.port, log_level=log_level)
