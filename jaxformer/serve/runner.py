"""The engine's own thread: the Engine is not thread-safe, so one thread owns it. It takes add, abort
and call commands from a thread-safe queue, calls `step()` while there is work, and hands each Event to
the callback its request was added with (the app's: onto that HTTP request's asyncio queue).

An exception in `step()` fails the requests then in flight (their callbacks get it), aborts them in the
engine, and the loop goes on: the server never dies of a request.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger("jaxformer.serve")


class EngineThread:
    """Runs an Engine in a thread of its own.

    Args:
        engine (Engine): the engine (jaxformer.engine.Engine, or anything with its methods).
        idle_wait: seconds the idle loop waits for a command before looking again.
    """

    def __init__(self, engine, idle_wait: float = 0.05):
        self.engine, self.idle_wait = engine, idle_wait
        self._commands: queue.Queue = queue.Queue()
        self._routes: dict[str, Callable] = {}  # request id -> its callback (touched by the engine thread only)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxformer-engine", daemon=True)
        self.steps = self.failures = 0

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current step and wait for the thread.

        Args:
            timeout: seconds to wait.
        """
        self._stopping.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the loop runs."""
        return self._thread.is_alive()

    def add(
        self, prompt_ids: list[int], params, deliver: Callable, adapter: str | None = None, source_ids=None
    ) -> concurrent.futures.Future:
        """Ask for a request to be added; `deliver(event)` is called (in the engine thread) with each of its
        Events, or with an Exception if the engine failed it.

        Args:
            prompt_ids: the prompt's token ids.
            params (SamplingParams): its settings.
            deliver: the callback; it must not block.
            adapter: the engine's LoRA adapter the request runs (None: the base).
            source_ids (list[int] | None): an encoder_decoder model's source.

        Returns:
            A future of the request id (or of the EngineError that refused it).
        """
        future = concurrent.futures.Future()
        self._commands.put(("add", (prompt_ids, params, deliver, adapter, source_ids), future))
        return future

    def abort(self, request_id: str) -> None:
        """Ask for a request to be aborted (its pages freed); one already finished is left alone.

        Args:
            request_id: the id `add` gave.
        """
        self._commands.put(("abort", request_id, None))

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """Run `fn(engine)` in the engine thread (between steps), e.g. `lambda e: e.stats()`.

        Args:
            fn: the function.

        Returns:
            A future of its result.
        """
        future = concurrent.futures.Future()
        self._commands.put(("call", fn, future))
        return future

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                busy = self.engine.has_unfinished()
                self._take_commands(wait=not busy)
                if self.engine.has_unfinished():
                    self._step()
            except Exception:  # a command or the engine's bookkeeping: logged, the loop goes on
                log.exception("engine loop")
                time.sleep(self.idle_wait)
        for deliver in self._routes.values():
            _safely(deliver, RuntimeError("the server is shutting down"))

    def _take_commands(self, wait: bool) -> None:
        try:
            command = self._commands.get(timeout=self.idle_wait) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._do(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _do(self, what: str, arg, future: concurrent.futures.Future | None) -> None:
        if what == "abort":
            if arg in self._routes:
                try:
                    self.engine.abort(arg)
                except Exception:  # finished meanwhile: nothing to free
                    self._routes.pop(arg, None)
            return
        if not future.set_running_or_notify_cancel():
            return
        try:
            if what == "call":
                future.set_result(arg(self.engine))
                return
            prompt_ids, params, deliver, adapter, source_ids = arg
            named = {} if adapter is None else {"adapter": adapter}  # an engine without adapters need not take it
            named |= {} if source_ids is None else {"source_ids": source_ids}
            request_id = self.engine.add_request(prompt_ids, params, **named)
            self._routes[request_id] = deliver
            future.set_result(request_id)
        except Exception as e:  # EngineError (a request the engine refuses) or worse: the caller's to answer
            future.set_exception(e)

    def _step(self) -> None:
        try:
            events = self.engine.step()
            self.steps += 1
        except Exception as e:
            self.failures += 1
            log.exception("engine step failed: failing the %d requests in flight", len(self._routes))
            failed, self._routes = self._routes, {}
            for request_id, deliver in failed.items():
                _safely(deliver, e)
                with contextlib.suppress(Exception):
                    self.engine.abort(request_id)
            time.sleep(self.idle_wait)  # an engine that keeps failing must not spin
            return
        for event in events:
            deliver = self._routes.get(event.request_id)
            if event.finished:
                self._routes.pop(event.request_id, None)
            if deliver is not None:
                _safely(deliver, event)


def _safely(deliver: Callable, item) -> None:
    try:
        deliver(item)
    except Exception:  # e.g. the HTTP request's event loop has closed
        log.debug("dropped an event", exc_info=True)
