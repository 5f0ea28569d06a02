"""A server of the app for tests: uvicorn in a thread of the test process, on a free port of 127.0.0.1,
with the real `openai` client and plain HTTP posts against it."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import processes
import uvicorn

from jaxformer.serve import create_app

_ITS_KEY = object()  # client() and post() send the server's own API key unless told another (None: none)


class Server:
    """uvicorn serving `create_app(engine, cfg, model_name)` in a thread, on a free port of 127.0.0.1.

    Args:
        engine (Engine): the engine.
        cfg (ServeConfig): the server's settings (its port is replaced by the free one found).
        model_name: the name the model is served by.
    """

    def __init__(self, engine, cfg, model_name: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = cfg.replace(port=port)
        self.key = cfg.api_key
        self.app = create_app(engine, cfg, model_name)
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + processes.HANG_GUARD_S  # a hang guard: starting takes a busy machine long
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.025)
        assert self.server.started, "uvicorn did not start" + ("" if self.thread.is_alive() else ": its thread ended")

    @property
    def runner(self):
        return self.app.state.server.runner

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)

    def client(self, key=_ITS_KEY, **kw) -> openai.OpenAI:
        key = self.key if key is _ITS_KEY else key
        kw = {"timeout": processes.HANG_GUARD_S} | kw
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or "none", max_retries=0, **kw)

    def post(self, path: str, body: bytes | dict, key=_ITS_KEY) -> tuple[int, dict | str]:
        key = self.key if key is _ITS_KEY else key
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=processes.HANG_GUARD_S) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:  # a route that answers plain text (vLLM's LoRA routes)
            return status, raw.decode()

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=processes.HANG_GUARD_S) as r:
            return json.loads(r.read())

    def metrics(self) -> dict[str, float]:
        """/metrics, read by Prometheus's own parser: {sample name{labels}: value}, labels sorted."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=processes.HANG_GUARD_S) as r:
            assert r.headers["Content-Type"].startswith("text/plain"), r.headers["Content-Type"]
            text = r.read().decode()
        return {
            s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}": s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def idle(self) -> dict:
        """/health once the engine has nothing unfinished (the aborts and finishes have gone through)."""
        deadline = time.monotonic() + processes.HANG_GUARD_S  # a hang guard: a busy machine's steps are slow
        while time.monotonic() < deadline:
            if not self.runner.call(lambda e: e.has_unfinished()).result(timeout=processes.HANG_GUARD_S):
                h = self.health()
                assert not h["engine"].get("running") and not h["engine"].get("waiting"), h
                return h
            time.sleep(0.05)
        raise AssertionError(f"the engine still has work: {self.health()}")
