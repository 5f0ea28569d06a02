"""`jaxformer batch`: OpenAI's batch file answered by the server's own routes, in this process and without a
network (vLLM's `run_batch`): for generating or scoring thousands of requests written for OpenAI's Batch API.

Each input line is one request, `{"custom_id", "method": "POST", "url", "body"}`, its url one of `URLS`;
each is answered as the server answers that route (the same checks, the same bodies, requests batched by
the engine as a server's are), and written as OpenAI's batch output line, `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}` (`error`: null, or the error body's `error` where the route
refused the request), as soon as it ends: lines come in the order requests end, each found by its
`custom_id`. A line whose structure is wrong (not JSON, a `custom_id` missing or repeated, another method
or url, a body that streams) stops the batch before anything runs, naming its line. Rerun with the same
output file, a batch answers only the `custom_id`s not yet there: an interrupted batch loses nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import pathlib
import secrets
import sys
import time
from collections.abc import Callable

# The routes a batch line may name (OpenAI's Batch API's, and vLLM's classify).
URLS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/classify")
_LINE = {"custom_id", "method", "url", "body"}


class BatchError(ValueError):
    """An input file that is not a batch: its line and what is wrong."""


def answer_file(engine_of: Callable, name: str, inputs: pathlib.Path, output: pathlib.Path, concurrency: int = 256,
                quiet: bool = False) -> dict:  # fmt: skip
    """Answer the batch file `inputs` into `output` (`jaxformer batch`): every line checked, then the requests
    not yet answered there run through the server's routes on the engine `engine_of()` makes (made only if
    there is one to answer).

    Args:
        engine_of: makes the engine (with a tokenizer; its model served as `name`).
        name: the model's name, which each body's `model` gives.
        inputs: the batch file.
        output: the answers' file, appended to.
        concurrency: requests handed to the engine at once.
        quiet: no progress on stderr.

    Returns:
        {HTTP status: count} of the requests answered now.

    Raises:
        BatchError: the input file is not a batch (nothing has run).
    """
    from jaxformer.config import ServeConfig
    from jaxformer.serve.app import create_app

    try:
        requests = read_requests(inputs)
    except (OSError, UnicodeDecodeError) as e:
        raise BatchError(str(e)) from None
    done = answered(output)
    todo = [r for r in requests if r["custom_id"] not in done]
    say = (lambda *_: None) if quiet else (lambda what: print(f"batch: {what}", file=sys.stderr))
    if not todo:
        say(f"every request of {inputs} is answered in {output} already")
        return {}
    app = create_app(engine_of(), ServeConfig(responses_store=0), name)
    say(f"{len(todo)} requests of {len(requests)} to answer ({len(done)} in {output} already), model {name}")
    t0, runner = time.perf_counter(), app.state.server.runner
    runner.start()
    progress = lambda n, bad: say(f"{n} of {len(todo)} answered, {bad} refused")
    try:
        # In a thread of its own where this one runs an event loop already (a notebook's).
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            counts = thread.submit(asyncio.run, run(app, todo, output, concurrency, progress)).result()
    finally:
        runner.stop()
    refused = {code: n for code, n in sorted(counts.items()) if code >= 400}
    codes = " (HTTP " + ", ".join(f"{c}: {n}" for c, n in refused.items()) + ")" if refused else ""
    say(f"{sum(counts.values())} answered in {time.perf_counter() - t0:.1f} s, {sum(refused.values())} refused{codes} "
        f"-> {output}")  # fmt: skip
    return counts


def read_requests(path: pathlib.Path) -> list[dict]:
    """The batch's requests, every line checked first.

    Args:
        path: the input file (JSON lines; blank lines skipped).

    Returns:
        Its requests, in order.

    Raises:
        BatchError: a line that is not a request, naming the file, its line and what is wrong.
    """
    requests, seen = [], {}
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        try:
            line = json.loads(text)
        except json.JSONDecodeError as e:
            raise BatchError(f"{where}: not JSON ({e})") from None
        if not isinstance(line, dict):
            raise BatchError(f"{where}: a JSON object {{custom_id, method, url, body}} is expected")
        if set(line) - _LINE:
            raise BatchError(f"{where}: unknown field {sorted(set(line) - _LINE)[0]!r} (a line has {sorted(_LINE)})")
        cid = line.get("custom_id")
        if not isinstance(cid, str) or not cid:
            raise BatchError(f"{where}: custom_id: a non-empty string is expected, got {cid!r}")
        if cid in seen:
            raise BatchError(f"{where}: custom_id {cid!r} is line {seen[cid]}'s too: each request needs its own")
        if line.get("method") != "POST":
            raise BatchError(f"{where}: method: only POST is served, got {line.get('method')!r}")
        if line.get("url") not in URLS:
            raise BatchError(f"{where}: url: one of {', '.join(URLS)} is expected, got {line.get('url')!r}")
        if not isinstance(line.get("body"), dict):
            raise BatchError(f"{where}: body: a JSON object (the request's body) is expected")
        if line["body"].get("stream"):
            raise BatchError(f"{where}: body.stream: a batch answers whole; leave stream out")
        seen[cid] = number
        requests.append(line)
    return requests


def answered(path: pathlib.Path) -> set[str]:
    """The custom_ids an earlier run of the batch answered into `path` (none if it does not exist). A last
    line cut short (the run was killed while writing it) is dropped from the file.

    Args:
        path: the output file.

    Returns:
        The custom_ids it holds.
    """
    if not path.exists():
        return set()
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    ids, whole = set(), []
    for line in lines:
        try:
            ids.add(json.loads(line)["custom_id"])
            whole.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            break  # a line cut short: the last one written, and what follows it is nothing
    if len(whole) < len(lines) or (whole and not whole[-1].endswith("\n")):
        path.write_text("".join(line if line.endswith("\n") else line + "\n" for line in whole), encoding="utf-8")
    return ids


def output_line(request: dict, status: int, body: dict) -> dict:
    """OpenAI's batch output line for one request answered.

    Args:
        request: the input line.
        status: the route's HTTP status.
        body: the route's JSON body.

    Returns:
        {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}.
    """
    error = body.get("error") if status >= 400 and isinstance(body, dict) else None
    return {"id": "batch_req_" + secrets.token_hex(12), "custom_id": request["custom_id"],
            "response": {"status_code": status, "request_id": "req_" + secrets.token_hex(12), "body": body},
            "error": error}  # fmt: skip


async def run(
    app, requests: list[dict], output: pathlib.Path, concurrency: int, progress: Callable | None = None
) -> dict:
    """Answer `requests` through `app`'s routes, `concurrency` at once, each line appended to `output` as its
    request ends.

    Args:
        app (Starlette): the server's app (`create_app`), its engine thread started.
        requests: the requests to answer (`read_requests`'s, less those already answered).
        output: the output file, appended to.
        concurrency: requests handed to the app at once (the engine's slots take them in turn).
        progress: called with (answered, failed) now and then, or None.

    Returns:
        {status code: count} of the requests answered.
    """
    import httpx

    counts, last, gate = {}, time.monotonic(), asyncio.Semaphore(concurrency)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
        with output.open("a", encoding="utf-8") as out:

            async def one(request: dict) -> None:
                nonlocal last
                async with gate:
                    answer = await client.post(request["url"], json=request["body"])
                try:
                    body = answer.json()
                except ValueError:
                    body = {"error": {"message": answer.text, "type": "server_error", "param": None, "code": None}}
                out.write(json.dumps(output_line(request, answer.status_code, body), ensure_ascii=False) + "\n")
                out.flush()  # a line at a time: what ended is kept if the run is killed
                counts[answer.status_code] = counts.get(answer.status_code, 0) + 1
                if progress is not None and time.monotonic() - last > 10:
                    last = time.monotonic()
                    progress(sum(counts.values()), sum(n for code, n in counts.items() if code >= 400))

            await asyncio.gather(*(one(r) for r in requests))
    return counts
