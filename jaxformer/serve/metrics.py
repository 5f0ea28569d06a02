"""The server's Prometheus metrics at `GET /metrics`, named as vLLM names its own (prefix `jaxformer:`), so
that the dashboards and alerts written for a vLLM server read ours: requests and tokens counted as they end,
their latencies in histograms, and the engine's queue and pool as they are when scraped.

Each app keeps its metrics in a registry of its own (prometheus_client's), not the process's global one: a
process may run several servers (the tests do), each counting its own requests.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds. vLLM's buckets, from a few milliseconds (a small model's step on a GPU) to minutes (a long answer).
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_PER_TOKEN = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class Metrics:
    """One server's metrics. Each generated choice (one engine request) is counted when it ends
    (`finished`); the engine's figures are read when scraped (`render`).

    Args:
        model_name: the served model's name (each metric's `model_name` label: the base's or an adapter's).
    """

    def __init__(self, model_name: str):
        self.model_name, self.registry, self._stats = model_name, CollectorRegistry(), {}
        by_model, r = ["model_name"], self.registry
        self.prompt_tokens = Counter("jaxformer:prompt_tokens", "Prompt tokens of the requests ended (each "
                                     "choice's: a prompt of n choices counts n times)", by_model,
                                     registry=r)  # fmt: skip
        self.generation_tokens = Counter("jaxformer:generation_tokens", "Tokens generated for the requests ended",
                                         by_model, registry=r)  # fmt: skip
        self.success = Counter("jaxformer:request_success", "Requests ended, by why: stop, length or abort (the "
                               "client went away)", [*by_model, "finished_reason"], registry=r)  # fmt: skip
        self.ttft = Histogram("jaxformer:time_to_first_token_seconds", "From the request's arrival to its first "
                              "token", by_model, buckets=_TTFT, registry=r)  # fmt: skip
        self.per_token = Histogram("jaxformer:time_per_output_token_seconds", "A request's time between its first "
                                   "and last token, per token after the first", by_model, buckets=_PER_TOKEN,
                                   registry=r)  # fmt: skip
        self.e2e = Histogram("jaxformer:e2e_request_latency_seconds", "From the request's arrival to its end",
                             by_model, buckets=_E2E, registry=r)  # fmt: skip
        r.register(_EngineFigures(self))

    def finished(self, model: str | None, reason: str, prompt: int, tokens: int, times: tuple) -> None:
        """Count one choice that ended.

        Args:
            model: the model its request named (None: the base).
            reason: "stop", "length" or "abort".
            prompt: its prompt's tokens.
            tokens: the tokens generated for it.
            times: (arrival, first token or None, last token or None), `time.monotonic()` seconds.
        """
        model = model or self.model_name
        arrived, first, last = times
        self.prompt_tokens.labels(model).inc(prompt)
        self.generation_tokens.labels(model).inc(tokens)
        self.success.labels(model, reason).inc()
        self.e2e.labels(model).observe(time.monotonic() - arrived)
        if first is not None:
            self.ttft.labels(model).observe(first - arrived)
            if tokens > 1:
                self.per_token.labels(model).observe((last - first) / (tokens - 1))

    def render(self, stats: dict | None) -> bytes:
        """The text exposition of every metric, with the engine's figures `stats` (`Engine.stats()`, read in
        the engine's thread just before).

        Args:
            stats: the engine's figures now; None: as last read (none before the first: no engine figures).

        Returns:
            Prometheus's text format.
        """
        self._stats = self._stats if stats is None else stats
        return generate_latest(self.registry)


class _EngineFigures:
    """The engine's queue and pool as last read (`Metrics.render`), as vLLM's gauges and counters."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        stats, name = self.metrics._stats, self.metrics.model_name
        if not stats:
            return
        gauges = [
            ("jaxformer:num_requests_running", "Requests in the engine's slots", stats["running"]),
            ("jaxformer:num_requests_waiting", "Requests waiting for a slot or for pages", stats["waiting"]),
            ("jaxformer:kv_cache_usage_perc", "The share of the KV cache's pages in use (1: full)",
             1 - stats["pages_free"] / max(stats["pages_total"], 1)),
        ]  # fmt: skip
        for metric, doc, value in gauges:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            yield family
        for metric, doc, value in [
            ("jaxformer:num_preemptions", "Requests preempted when the pool ran out of pages", stats["preempted"]),
            ("jaxformer:prefix_cache_hits", "Prompt pages found in the prefix cache", stats["prefix_hits"]),
            ("jaxformer:spec_decode_num_draft_tokens", "Tokens drafted by prompt lookup", stats["drafted"]),
            ("jaxformer:spec_decode_num_accepted_tokens", "Drafted tokens taken", stats["draft_accepted"]),
        ]:
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            yield family
