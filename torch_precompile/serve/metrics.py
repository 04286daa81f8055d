"""Prometheus metrics for ``/metrics``, through prometheus-client, in a registry of the app's own.

What vLLM's ``/metrics`` has, named ``torch_precompile_*``: requests running and
waiting, slots and their use, prompt and generated tokens, requests finished by
reason (``stop``, ``length``, ``abort`` for a client gone, ``error``), and
histograms of time to first token, inter-token latency and end-to-end latency,
each timed on the event loop from the request's arrival, as its client sees it.

prometheus-client is in the ``serve`` extra. A server installed without it
still serves; its ``/metrics`` is a 501 saying what to install.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from ..engine.requests import Event, Failed

# Seconds: a small model on a CPU answers in milliseconds, a long prompt on a big one in
# seconds; each histogram spans both.
_TTFT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
PREFIX = "torch_precompile_"


class _Untracked:
    """A request's tracker where there are no metrics."""

    def see(self, event: Event) -> None:
        pass

    def close(self) -> None:
        pass


class _Tracker:
    """One request's timings, fed its events on the event loop."""

    def __init__(self, metrics: Metrics, prompt: int, began: float) -> None:
        self.metrics, self.prompt, self.began = metrics, prompt, began
        self.last: float | None = None
        self.tokens: dict[int, int] = {}  # each choice's tokens so far
        self.finished = False

    def see(self, event: Event) -> None:
        m, now = self.metrics, time.perf_counter()
        if isinstance(event, Failed):
            self._finish("error", now)
            return
        new = event.tokens - self.tokens.get(event.index, 0)
        if new > 0:
            if self.last is None:
                m.ttft.observe(now - self.began)
                m.prompt_tokens.inc(self.prompt)
            else:
                m.itl.observe((now - self.last) / new)
            m.generation_tokens.inc(new)
            self.tokens[event.index], self.last = event.tokens, now
        if event.finish is not None:
            self._finish(event.finish.reason, now)

    def _finish(self, reason: str, now: float) -> None:
        if not self.finished:
            self.finished = True
            self.metrics.finished.labels(finish_reason=reason).inc()
            self.metrics.e2e.observe(now - self.began)

    def close(self) -> None:
        """The response is over: a run that did not finish was abandoned."""
        self._finish("abort", time.perf_counter())


class Metrics:
    """The server's metrics; ``enabled`` is False without prometheus-client."""

    def __init__(self, load: Callable[[], dict[str, int]]) -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            self.enabled = False
            return
        self.enabled = True
        self._prom = prom
        self.registry = prom.CollectorRegistry(auto_describe=True)
        r, p = self.registry, PREFIX
        self.prompt_tokens = prom.Counter(
            p + "prompt_tokens", "Prompt tokens prefilled", registry=r
        )
        self.generation_tokens = prom.Counter(
            p + "generation_tokens", "Tokens generated", registry=r
        )
        self.finished = prom.Counter(
            p + "requests_finished",
            "Requests ended, by finish reason (abort: the client left)",
            ["finish_reason"],
            registry=r,
        )
        self.ttft = prom.Histogram(
            p + "time_to_first_token_seconds",
            "From a request's arrival to its first token",
            buckets=_TTFT,
            registry=r,
        )
        self.itl = prom.Histogram(
            p + "inter_token_latency_seconds",
            "Between a request's consecutive tokens",
            buckets=_ITL,
            registry=r,
        )
        self.e2e = prom.Histogram(
            p + "e2e_request_latency_seconds",
            "From a request's arrival to its end",
            buckets=_E2E,
            registry=r,
        )
        self.registry.register(_Load(load, prom))

    def track(self, prompt: int, began: float) -> _Tracker | _Untracked:
        """A tracker for a request of ``prompt`` tokens that arrived at ``began``."""
        return _Tracker(self, prompt, began) if self.enabled else _Untracked()

    def exposition(self) -> tuple[bytes, str]:
        """The text format and its content type."""
        return self._prom.generate_latest(self.registry), self._prom.CONTENT_TYPE_LATEST


class _Load:
    """The engine's gauges, read at each scrape."""

    def __init__(self, load: Callable[[], dict[str, int]], prom: Any) -> None:
        self.load, self.gauge = load, prom.metrics_core.GaugeMetricFamily

    def collect(self) -> Iterator[Any]:
        now = self.load()
        yield self.gauge(PREFIX + "requests_running", "Requests in a slot", value=now["busy"])
        yield self.gauge(
            PREFIX + "requests_waiting", "Requests queued for a slot", value=now["queued"]
        )
        yield self.gauge(PREFIX + "slots", "Slots in the cache", value=now["slots"])
        yield self.gauge(
            PREFIX + "slot_use", "Busy slots over all slots (0-1)", value=now["busy"] / now["slots"]
        )
