"""Prometheus metrics of the API tier, correct across gunicorn workers.

Rules:
- Under gunicorn, `run_api` points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory BEFORE any
  worker imports prometheus_client; every worker writes its samples there and a scrape of any
  worker sums them (`MultiProcessCollector`). Without that variable (tests, one process) the
  default registry is used.
- Request metrics (names as vLLM's, prefix ``redserve:``): histograms time_to_first_token_seconds,
  inter_token_latency_seconds, e2e_request_latency_seconds; counters prompt_tokens_total,
  generation_tokens_total, request_success_total{finished_reason} (one per finished choice),
  request_failure_total{reason} (one per failed or abandoned request); gauge
  api_requests_in_flight (live sum over workers).
- Engine gauges are read from the engines' Redis hashes at scrape time, not kept here:
  num_requests_running / num_requests_waiting / kv_cache_usage_perc {engine}, and engines_ready.
  If Redis cannot be read the scrape still succeeds, with ``redserve:broker_up 0``.
- ``redserve_child_restarts_total{child}`` (a counter): restarts of each child of ``redserve serve``,
  read at scrape time from the stack's Redis hash ``{prefix}:stack:restarts``; absent without a stack.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0)
_MODEL = ["model_name"]

TIME_TO_FIRST_TOKEN = Histogram("redserve:time_to_first_token_seconds", "Time to first token (API view).",
                                _MODEL, buckets=_LATENCY_BUCKETS)
INTER_TOKEN_LATENCY = Histogram("redserve:inter_token_latency_seconds", "Time between output tokens.",
                                _MODEL, buckets=_ITL_BUCKETS)
E2E_LATENCY = Histogram("redserve:e2e_request_latency_seconds", "Request latency from arrival to finish.",
                        _MODEL, buckets=_LATENCY_BUCKETS)
PROMPT_TOKENS = Counter("redserve:prompt_tokens", "Prompt tokens of requests.", _MODEL)
GENERATION_TOKENS = Counter("redserve:generation_tokens", "Generated tokens.", _MODEL)
REQUEST_SUCCESS = Counter("redserve:request_success", "Finished choices, by finish reason.",
                          [*_MODEL, "finished_reason"])
REQUEST_FAILURE = Counter("redserve:request_failure", "Failed or abandoned requests, by reason.",
                          [*_MODEL, "reason"])
IN_FLIGHT = Gauge("redserve:api_requests_in_flight", "Generation requests in flight in the API.", _MODEL,
                  multiprocess_mode="livesum")


class RequestRecorder:
    """Records one request's latencies and counts (the `Recorder` of `api.generation`)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._start = time.monotonic()
        self._first: float | None = None
        self._last: dict[int, float] = {}

    def on_tokens(self, choice: int, count: int) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = now
            TIME_TO_FIRST_TOKEN.labels(self.model_name).observe(now - self._start)
        previous = self._last.get(choice)
        if previous is not None:
            INTER_TOKEN_LATENCY.labels(self.model_name).observe((now - previous) / max(count, 1))
        self._last[choice] = now

    def on_finish(self, prompt_tokens: int, completion_tokens: int, reasons: list[str], error: str | None) -> None:
        PROMPT_TOKENS.labels(self.model_name).inc(prompt_tokens)
        GENERATION_TOKENS.labels(self.model_name).inc(completion_tokens)
        if error is not None:
            REQUEST_FAILURE.labels(self.model_name, error).inc()
            return
        E2E_LATENCY.labels(self.model_name).observe(time.monotonic() - self._start)
        for reason in reasons:
            REQUEST_SUCCESS.labels(self.model_name, reason).inc()


class EngineStatsCollector:
    """Gauges read from the engines' Redis hashes at scrape time; see the module rules."""

    def __init__(self, model_name: str, read_engines: Callable[[], list[dict[str, Any]]],
                 read_restarts: Callable[[], dict[str, int]] | None = None) -> None:
        self._model_name = model_name
        self._read_engines = read_engines
        self._read_restarts = read_restarts

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("redserve:broker_up", "1 if the API could read the engine registry from Redis.")
        try:
            engines = self._read_engines()
        except Exception as e:  # noqa: BLE001 - a scrape must not fail because Redis is down
            logger.warning("metrics: cannot read the engines from Redis: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        labels = ["model_name", "engine"]
        families = {
            "running": GaugeMetricFamily("redserve:num_requests_running", "Requests running on an engine.",
                                         labels=labels),
            "waiting": GaugeMetricFamily("redserve:num_requests_waiting", "Requests waiting on an engine.",
                                         labels=labels),
            "kv_usage": GaugeMetricFamily("redserve:kv_cache_usage_perc", "KV cache usage (0-1) of an engine.",
                                          labels=labels),
        }
        ready = GaugeMetricFamily("redserve:engines_ready", "READY engines with a live heartbeat.",
                                  labels=["model_name"])
        ready.add_metric([self._model_name], sum(1 for e in engines if e.get("state") == "ready"))
        for engine in engines:
            for field, family in families.items():
                value = engine.get(field)
                if isinstance(value, (int, float)):
                    family.add_metric([self._model_name, str(engine["engine_id"])], value)
        yield ready
        yield from families.values()
        yield from self._restarts()

    def _restarts(self) -> Iterator[Metric]:
        try:
            restarts = self._read_restarts() if self._read_restarts is not None else {}
        except Exception as e:  # noqa: BLE001 - a bad restarts hash must not hide the engine gauges
            logger.warning("metrics: cannot read the stack's restart counts from Redis: %s", e)
            return
        if restarts:
            counter = CounterMetricFamily("redserve_child_restarts", "Restarts of a child of `redserve serve`.",
                                          labels=["child"])
            for child, count in sorted(restarts.items()):
                counter.add_metric([child], count)
            yield counter


def render_metrics(engine_collector: EngineStatsCollector) -> tuple[bytes, str]:
    """The exposition text of this worker's view (all workers' samples in multiprocess mode)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = REGISTRY
    engines = CollectorRegistry()
    engines.register(engine_collector)
    return generate_latest(registry) + generate_latest(engines), CONTENT_TYPE_LATEST


def mark_worker_dead(pid: int) -> None:
    """Gunicorn child_exit hook: drop a dead worker's live gauges (multiprocess mode only)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
