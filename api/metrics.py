"""Prometheus metrics of the API tier, correct across gunicorn workers.

Naming: vLLM's metric names with our prefix, ``redserve:`` instead of ``vllm:`` (same suffix, type,
labels ``model_name`` [+ ``engine``] and meaning). Why not ``vllm:`` itself: a fleet that runs both would
merge two implementations' series under one name and nobody could tell them apart, and our numbers are
ours (e.g. queue time is measured by our engine); a vLLM Grafana dashboard works after one
``sed 's/vllm:/redserve:/g'``. Our own dashboard is ``monitoring/grafana/redserve-dashboard.json``.

| redserve (this /metrics)                        | vLLM                                        | kind / where   |
|-------------------------------------------------|---------------------------------------------|----------------|
| redserve:time_to_first_token_seconds            | vllm:time_to_first_token_seconds            | histogram, API |
| redserve:inter_token_latency_seconds            | vllm:inter_token_latency_seconds            | histogram, API |
| redserve:request_time_per_output_token_seconds  | vllm:request_time_per_output_token_seconds  | histogram, API |
| redserve:e2e_request_latency_seconds            | vllm:e2e_request_latency_seconds            | histogram, API |
| redserve:request_prompt_tokens                  | vllm:request_prompt_tokens                  | histogram, API |
| redserve:request_generation_tokens              | vllm:request_generation_tokens              | histogram, API |
| redserve:request_max_num_generation_tokens      | vllm:request_max_num_generation_tokens      | histogram, API |
| redserve:request_params_n                       | vllm:request_params_n                       | histogram, API |
| redserve:request_params_max_tokens              | vllm:request_params_max_tokens              | histogram, API |
| redserve:prompt_tokens_total                    | vllm:prompt_tokens_total                    | counter, API   |
| redserve:generation_tokens_total                | vllm:generation_tokens_total                | counter, API   |
| redserve:request_success_total{finished_reason} | vllm:request_success_total                  | counter, API   |
| redserve:request_failure_total{reason}          | (none)                                      | counter, API   |
| redserve:api_requests_in_flight                 | (none)                                      | gauge, API     |
| redserve:request_migrations_total{reason}       | (none)                                      | counter, API   |
| redserve:num_requests_running{engine}           | vllm:num_requests_running                   | gauge, engine  |
| redserve:num_requests_waiting{engine}           | vllm:num_requests_waiting                   | gauge, engine  |
| redserve:kv_cache_usage_perc{engine}            | vllm:kv_cache_usage_perc                    | gauge, engine  |
| redserve:prefix_cache_queries_total{engine}     | vllm:prefix_cache_queries_total (tokens)    | counter, engine|
| redserve:prefix_cache_hits_total{engine}        | vllm:prefix_cache_hits_total (tokens)       | counter, engine|
| redserve:num_preemptions_total{engine}          | vllm:num_preemptions_total                  | counter, engine|
| redserve:prefix_cache_hit_rate{engine}          | (none; hits / queries since engine start)   | gauge, engine  |
| redserve:routing_decisions_total{engine,reason} | (none; reason cache / load, `{rs}:routing`)   | counter, Redis |
| redserve:request_queue_time_seconds{engine}     | vllm:request_queue_time_seconds             | histogram, eng.|
| redserve:request_prefill_time_seconds{engine}   | vllm:request_prefill_time_seconds           | histogram, eng.|
| redserve:request_decode_time_seconds{engine}    | vllm:request_decode_time_seconds            | histogram, eng.|
| redserve:request_inference_time_seconds{engine} | vllm:request_inference_time_seconds         | histogram, eng.|
| redserve:iteration_tokens_total{engine}         | vllm:iteration_tokens_total                 | histogram, eng.|
| redserve:engines_ready, redserve:broker_up      | (none)                                      | gauge, Redis   |
| redserve:kv_tier_{lookups,hit_blocks,hit_tokens,miss_blocks,miss_tokens,corrupt_blocks,stored_blocks,bytes_in,bytes_out,load_seconds,errors,dropped_blocks,store_evicted_keys}_total{engine} | (LMCache's own) | counter, engine |
| redserve:kv_tier_{store_used_bytes,store_max_bytes,pending_bytes}{engine} | (none)         | gauge, engine  |
| redserve_child_restarts_total{child}            | (none)                                      | counter, stack |

Not carried: vLLM's LoRA, speculative decoding and cache_config_info families (no such features here), nor
its KV-connector families (each connector reports its own; the KV tier's are the ``redserve:kv_tier_*`` above,
from an engine's ``kv_tier_*`` fields).

Rules:
- Under gunicorn, `run_api` points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory BEFORE any
  worker imports prometheus_client; every worker writes its samples there and a scrape of any
  worker sums them (`MultiProcessCollector`). Without that variable (tests, one process) the
  default registry is used.
- Request metrics ("API" above) exist from the API's start (`start_at_zero`): every labelled counter at 0
  for each value its label can take (finish reasons, `ErrorCode`s, migration reasons). They are observed
  once per API request when it finishes (one per
  finished choice for request_success_total; request_failure_total once per failed or abandoned
  request, which observes no histogram). Token histograms count the tokens the engine generated.
- Engine metrics ("engine" above) are read from the engines' Redis hashes at scrape time, not kept
  here: the gauges and counters from numeric fields, the histograms from the ``histograms`` JSON field
  (cumulative buckets kept by `engine.step_metrics`; one observation per sequence). A counter restarts
  from 0 with its engine (Prometheus' rate() handles resets). A malformed histogram is skipped with a
  rate-limited warning. If Redis cannot be read the scrape still succeeds, with ``redserve:broker_up 0``.
- ``redserve:routing_decisions_total{engine,reason}``: requests the API processes routed to an engine
  for its cached prefix (``cache``) or for its load (``load``), read at scrape time from ``{prefix}:routing``
  (`broker.prefix_index.RoutingCounter`); only choices among two or more READY engines are counted.
- ``redserve_child_restarts_total{child}`` (a counter): restarts of each child of ``redserve serve``,
  read at scrape time from the stack's Redis hash ``{prefix}:stack:restarts``; absent without a stack.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from itertools import pairwise
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from broker.control_state import warn_bad
from protocol.messages import ErrorCode, FinishReason

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000,
                  500000, 1000000)
_N_BUCKETS = (1, 2, 5, 10, 20)
_MODEL = ["model_name"]

TIME_TO_FIRST_TOKEN = Histogram("redserve:time_to_first_token_seconds", "Time to first token (API view).",
                                _MODEL, buckets=_LATENCY_BUCKETS)
INTER_TOKEN_LATENCY = Histogram("redserve:inter_token_latency_seconds", "Time between output tokens.",
                                _MODEL, buckets=_ITL_BUCKETS)
E2E_LATENCY = Histogram("redserve:e2e_request_latency_seconds", "Request latency from arrival to finish.",
                        _MODEL, buckets=_LATENCY_BUCKETS)
TIME_PER_OUTPUT_TOKEN = Histogram("redserve:request_time_per_output_token_seconds",
                                  "Mean time per output token after the first, per request.", _MODEL,
                                  buckets=_ITL_BUCKETS)
REQUEST_PROMPT_TOKENS = Histogram("redserve:request_prompt_tokens", "Prompt tokens per request.", _MODEL,
                                  buckets=_TOKEN_BUCKETS)
REQUEST_GENERATION_TOKENS = Histogram("redserve:request_generation_tokens", "Generated tokens per request.",
                                      _MODEL, buckets=_TOKEN_BUCKETS)
REQUEST_MAX_GENERATION_TOKENS = Histogram("redserve:request_max_num_generation_tokens",
                                          "Most tokens generated by one choice of a request.", _MODEL,
                                          buckets=_TOKEN_BUCKETS)
REQUEST_PARAMS_N = Histogram("redserve:request_params_n", "The n parameter of requests.", _MODEL,
                             buckets=_N_BUCKETS)
REQUEST_PARAMS_MAX_TOKENS = Histogram("redserve:request_params_max_tokens", "The max_tokens parameter of requests.",
                                      _MODEL, buckets=_TOKEN_BUCKETS)
PROMPT_TOKENS = Counter("redserve:prompt_tokens", "Prompt tokens of requests.", _MODEL)
GENERATION_TOKENS = Counter("redserve:generation_tokens", "Generated tokens.", _MODEL)
REQUEST_SUCCESS = Counter("redserve:request_success", "Finished choices, by finish reason.",
                          [*_MODEL, "finished_reason"])
REQUEST_FAILURE = Counter("redserve:request_failure", "Failed or abandoned requests, by reason.",
                          [*_MODEL, "reason"])
MIGRATION_REASONS = ("engine_exited", "engine_failed", "engine_restarted", "heartbeat_expired",
                     "handoff")  # broker.client.in_flight
REQUEST_MIGRATIONS = Counter("redserve:request_migrations",
                             "Started requests resumed on another engine (`broker.client.migration`), by why "
                             f"their engine was declared gone ({', '.join(MIGRATION_REASONS[:-1])}) or handed over "
                             "by a prefill engine (handoff).", [*_MODEL, "reason"])
IN_FLIGHT = Gauge("redserve:api_requests_in_flight", "Generation requests in flight in the API.", _MODEL,
                  multiprocess_mode="livesum")


def start_at_zero(model_name: str) -> None:
    """Create this model's request series, each labelled counter for every value its label can take, so
    that a scrape shows 0 (not "No data") before the first request, failure or migration (as vLLM does)."""
    for metric in (TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, E2E_LATENCY, TIME_PER_OUTPUT_TOKEN, REQUEST_PROMPT_TOKENS,
                   REQUEST_GENERATION_TOKENS, REQUEST_MAX_GENERATION_TOKENS, REQUEST_PARAMS_N,
                   REQUEST_PARAMS_MAX_TOKENS, PROMPT_TOKENS, GENERATION_TOKENS, IN_FLIGHT):
        metric.labels(model_name)
    for counter, values in ((REQUEST_SUCCESS, FinishReason), (REQUEST_FAILURE, ErrorCode),
                            (REQUEST_MIGRATIONS, MIGRATION_REASONS)):
        for value in values:
            counter.labels(model_name, str(value))


class RequestRecorder:
    """Records one request's latencies and counts (the `Recorder` of `api.generation`)."""

    def __init__(self, model_name: str, params: list[Any] | None = None) -> None:
        self.model_name = model_name
        self._params = params or []
        self._start = time.monotonic()
        self._first: float | None = None
        self._last: dict[int, float] = {}
        self._tokens: dict[int, int] = {}

    def on_tokens(self, choice: int, count: int) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = now
            TIME_TO_FIRST_TOKEN.labels(self.model_name).observe(now - self._start)
        previous = self._last.get(choice)
        if previous is not None:
            INTER_TOKEN_LATENCY.labels(self.model_name).observe((now - previous) / max(count, 1))
        self._last[choice] = now
        self._tokens[choice] = self._tokens.get(choice, 0) + count

    def on_finish(self, prompt_tokens: int, completion_tokens: int, reasons: list[str], error: str | None) -> None:
        PROMPT_TOKENS.labels(self.model_name).inc(prompt_tokens)
        GENERATION_TOKENS.labels(self.model_name).inc(completion_tokens)
        if error is not None:
            REQUEST_FAILURE.labels(self.model_name, error).inc()
            return
        now = time.monotonic()
        E2E_LATENCY.labels(self.model_name).observe(now - self._start)
        for reason in reasons:
            REQUEST_SUCCESS.labels(self.model_name, reason).inc()
        self._observe_sizes(prompt_tokens, completion_tokens, now)

    def _observe_sizes(self, prompt_tokens: int, completion_tokens: int, now: float) -> None:
        most = max(self._tokens.values(), default=0)
        REQUEST_PROMPT_TOKENS.labels(self.model_name).observe(prompt_tokens)
        REQUEST_GENERATION_TOKENS.labels(self.model_name).observe(completion_tokens)
        REQUEST_MAX_GENERATION_TOKENS.labels(self.model_name).observe(most)
        if self._first is not None and most > 1:
            TIME_PER_OUTPUT_TOKEN.labels(self.model_name).observe((now - self._first) / (most - 1))
        for params in self._params:
            REQUEST_PARAMS_N.labels(self.model_name).observe(params.n)
            if params.max_tokens is not None:
                REQUEST_PARAMS_MAX_TOKENS.labels(self.model_name).observe(params.max_tokens)


class EngineStatsCollector:
    """Gauges read from the engines' Redis hashes at scrape time; see the module rules."""

    def __init__(self, model_name: str, read_engines: Callable[[], list[dict[str, Any]]],
                 read_restarts: Callable[[], dict[str, int]] | None = None,
                 read_routing: Callable[[], dict[str, dict[str, int]]] | None = None) -> None:
        self._model_name = model_name
        self._read_engines = read_engines
        self._read_restarts = read_restarts
        self._read_routing = read_routing

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
            "prefix_cache_hit_rate": GaugeMetricFamily(
                "redserve:prefix_cache_hit_rate", "Prompt tokens found in an engine's prefix cache / looked up "
                "(since the engine started).", labels=labels),
        }
        counters = {
            "prefix_cache_queries": CounterMetricFamily(
                "redserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels=labels),
            "prefix_cache_hits": CounterMetricFamily(
                "redserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels=labels),
            "num_preemptions": CounterMetricFamily(
                "redserve:num_preemptions", "Sequences preempted (recomputed later) by an engine.", labels=labels),
        }
        counters.update(_kv_tier_counters(labels))
        families.update(counters)
        families.update(_kv_tier_gauges(labels))
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
        yield from self._histograms(engines)
        yield from self._routing()
        yield from self._restarts()

    def _routing(self) -> Iterator[Metric]:
        try:
            counts = self._read_routing() if self._read_routing is not None else {}
        except Exception as e:  # noqa: BLE001 - a bad routing hash must not hide the engine gauges
            logger.warning("metrics: cannot read the routing decisions from Redis: %s", e)
            return
        if counts:
            counter = CounterMetricFamily("redserve:routing_decisions", "Requests routed to an engine for its "
                                          "cached prefix (cache) or its load (load).",
                                          labels=["model_name", "engine", "reason"])
            for engine_id, reasons in sorted(counts.items()):
                for reason, n in sorted(reasons.items()):
                    counter.add_metric([self._model_name, engine_id, reason], n)
            yield counter

    def _histograms(self, engines: list[dict[str, Any]]) -> Iterator[Metric]:
        families: dict[str, HistogramMetricFamily] = {}
        for engine in engines:
            engine_id = str(engine["engine_id"])
            for name, buckets, total in engine_histograms(engine.get("histograms"), engine_id):
                if name not in families:
                    families[name] = HistogramMetricFamily(f"redserve:{name}", _ENGINE_HISTOGRAM_HELP.get(name, name),
                                                           labels=["model_name", "engine"])
                families[name].add_metric([self._model_name, engine_id], buckets, total)
        yield from families.values()

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


_KV_TIER_COUNTERS = {
    "lookups": "New requests whose missing prefix blocks were looked up in the KV tier.",
    "hit_blocks": "Prefix blocks loaded from the KV tier instead of computed.",
    "hit_tokens": "Prompt tokens loaded from the KV tier instead of computed.",
    "miss_blocks": "Prefix blocks looked up in the KV tier and not found (computed).",
    "miss_tokens": "Prompt tokens looked up in the KV tier and not found (computed).",
    "corrupt_blocks": "Blocks read from the KV tier that failed their check (recomputed).",
    "stored_blocks": "Blocks an engine wrote to the KV tier.",
    "bytes_in": "Bytes of KV loaded from the KV tier.",
    "bytes_out": "Bytes an engine wrote to the KV tier.",
    "load_seconds": "Seconds requests waited for their prefix from the KV tier.",
    "errors": "KV tier operations that failed (the tier is then skipped for a few seconds).",
    "dropped_blocks": "Computed blocks not written to the KV tier (tier down or writes backed up).",
    "store_evicted_keys": "Keys the KV tier's store evicted (LRU) since it started.",
}
_KV_TIER_GAUGES = {
    "store_used_bytes": "Bytes the KV tier's store uses.",
    "store_max_bytes": "The KV tier store's maxmemory (0: none).",
    "pending_bytes": "Bytes of blocks an engine has yet to write to the KV tier.",
}


def _kv_tier_counters(labels: list[str]) -> dict[str, CounterMetricFamily]:
    """redserve:kv_tier_*_total of the engines' ``kv_tier_*`` fields (``engine.kv_tier``)."""
    return {f"kv_tier_{name}": CounterMetricFamily(f"redserve:kv_tier_{name}", text, labels=labels)
            for name, text in _KV_TIER_COUNTERS.items()}


def _kv_tier_gauges(labels: list[str]) -> dict[str, GaugeMetricFamily]:
    return {f"kv_tier_{name}": GaugeMetricFamily(f"redserve:kv_tier_{name}", text, labels=labels)
            for name, text in _KV_TIER_GAUGES.items()}


_ENGINE_HISTOGRAM_HELP = {
    "request_queue_time_seconds": "Time a sequence waited in an engine before its first step.",
    "request_prefill_time_seconds": "Time from a sequence's first step to its first token.",
    "request_decode_time_seconds": "Time from a sequence's first token to its last.",
    "request_inference_time_seconds": "Time from a sequence's first step to its last token.",
    "iteration_tokens_total": "Tokens scheduled per engine step.",
}


def engine_histograms(raw: Any, engine_id: str) -> list[tuple[str, list[tuple[str, float]], float]]:
    """The well-formed histograms of an engine's ``histograms`` field: (name, [(le, cumulative)], sum).

    Only names in `_ENGINE_HISTOGRAM_HELP`; bounds strictly increasing, counts cumulative ints with +Inf
    last; anything else (data from Redis is data from outside) is skipped with a warning."""
    if raw is None:
        return []
    try:
        decoded = json.loads(raw)
    except (TypeError, ValueError):
        decoded = None
    if not isinstance(decoded, dict):
        warn_bad(f"engine:{engine_id}:histograms", "ignoring the histograms of engine %s: not a JSON object",
                 engine_id)
        return []
    out = []
    for name, value in decoded.items():
        parsed = _histogram(value) if name in _ENGINE_HISTOGRAM_HELP else None
        if parsed is None:
            warn_bad(f"engine:{engine_id}:histogram:{name}", "ignoring histogram %r of engine %s", name, engine_id)
            continue
        out.append((name, *parsed))
    return out


def _histogram(value: Any) -> tuple[list[tuple[str, float]], float] | None:
    if not isinstance(value, dict):
        return None
    bounds, counts, total = value.get("le"), value.get("counts"), value.get("sum")
    if not (isinstance(bounds, list) and isinstance(counts, list) and len(counts) == len(bounds) + 1):
        return None
    if not all(isinstance(b, (int, float)) and math.isfinite(b) for b in bounds):
        return None
    if not all(type(c) is int and c >= 0 for c in counts) or not isinstance(total, (int, float)):
        return None
    if any(a >= b for a, b in pairwise(bounds)) or any(a > b for a, b in pairwise(counts)):
        return None
    if not math.isfinite(total):
        return None
    les = [repr(float(b)) for b in bounds] + ["+Inf"]
    return list(zip(les, counts, strict=True)), float(total)


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
