"""vLLM-grade metrics: the engine's counters and histograms, their way to /metrics, and the dashboard.

- `StepMetrics` (engine.step_metrics) on a fake clock: each phase observed once per sequence.
- A real EngineCore: prefix-cache hits after two prompts sharing a prefix; preemptions with a tiny KV cache.
- `EngineStatsCollector` skips a malformed ``histograms`` field and exposes a good one.
- Real engine + API (the session's `api_stack`): after some traffic every series that
  monitoring/grafana/redserve-dashboard.json queries is in /metrics, and the engine counters move.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import requests
from engine_helpers import BLOCK, PROMPTS, greedy, make_llm, random_prompt
from stack_procs import wait_for

from api.metrics import MIGRATION_REASONS, EngineStatsCollector, engine_histograms
from engine.step_metrics import ITERATION_TOKENS, StepMetrics
from protocol.messages import ErrorCode, FinishReason

DASHBOARD = Path(__file__).resolve().parent.parent / "monitoring" / "grafana" / "redserve-dashboard.json"
_NAME = re.compile(r"\bredserve[:_][A-Za-z0-9_:]*")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def hist(metrics: StepMetrics, name: str) -> tuple[int, float]:
    wire = metrics.wire()[name]
    return wire["counts"][-1], wire["sum"]


def test_step_metrics_observe_each_phase_once_per_sequence() -> None:
    clock = FakeClock()
    metrics = StepMetrics(clock)
    metrics.on_queued(["a", "b"])
    clock.now += 2.0
    metrics.on_scheduled({"a": 7})
    clock.now += 0.5
    metrics.on_token("a", finished=False)
    metrics.on_scheduled({"a": 1, "b": 3})
    clock.now += 1.0
    metrics.on_token("a", finished=True)
    metrics.forget(["b"])
    metrics.on_token("b", finished=True)  # forgotten (aborted): nothing more
    assert len(metrics) == 0
    assert hist(metrics, "request_queue_time_seconds") == (2, 2.0 + 2.5)
    assert hist(metrics, "request_prefill_time_seconds") == (1, 0.5)
    assert hist(metrics, "request_decode_time_seconds") == (1, 1.0)
    assert hist(metrics, "request_inference_time_seconds") == (1, 1.5)
    iteration = metrics.wire()[ITERATION_TOKENS]
    assert iteration["sum"] == 11 and iteration["counts"][iteration["le"].index(8)] == 2  # 7 and 4 tokens


def test_prefix_cache_counters_count_a_shared_prefix(llama_dir: str) -> None:
    llm = make_llm(llama_dir)
    shared = random_prompt(3 * BLOCK, seed=201)
    llm.generate([shared + [1, 2]], greedy(2))
    first = llm.engine.stats()
    assert first.prefix_cache_queries == 3 * BLOCK + 2 and first.prefix_cache_hits == 0
    llm.generate([shared + [3, 4]], greedy(2))
    second = llm.engine.stats()
    assert second.prefix_cache_hits - first.prefix_cache_hits == 3 * BLOCK
    assert len(llm.engine.metrics) == 0
    counts = {name: h["counts"][-1] for name, h in second.histograms.items()}
    assert counts["request_queue_time_seconds"] == counts["request_inference_time_seconds"] == 2
    assert counts[ITERATION_TOKENS] == second.load.step


def test_preemptions_are_counted_with_a_tiny_kv_cache(llama_dir: str) -> None:
    llm = make_llm(llama_dir, num_kv_blocks=8)
    prompts = [PROMPTS[3], PROMPTS[4], random_prompt(30, seed=104), random_prompt(25, seed=105)]
    llm.generate(prompts, greedy(24))
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    # a preempted sequence is still observed once per phase
    assert stats.histograms["request_decode_time_seconds"]["counts"][-1] == len(prompts)


def test_collector_skips_malformed_histograms() -> None:
    good = {"le": [1.0, 2.0], "counts": [1, 3, 4], "sum": 6.5}
    bad = [{"le": [2.0, 1.0], "counts": [0, 0, 0], "sum": 0}, {"le": [1.0], "counts": [2, 1], "sum": 1},
           {"le": [1.0], "counts": [1], "sum": 1}, {"le": [1.0], "counts": [0, 0], "sum": "x"}, [1]]
    raw = json.dumps({"request_queue_time_seconds": good, "not_ours": good,
                      **{f"request_{p}_time_seconds": b for p, b in zip(("prefill", "decode", "inference"), bad,
                                                                         strict=False)}})
    assert [name for name, _, _ in engine_histograms(raw, "0")] == ["request_queue_time_seconds"]
    assert engine_histograms("{not json", "0") == [] and engine_histograms("[]", "0") == []
    engines = [{"engine_id": "0", "state": "ready", "running": 1, "num_preemptions": 3, "histograms": raw}]
    families = {m.name: m for m in EngineStatsCollector("m", lambda: engines).collect()}
    queue = families["redserve:request_queue_time_seconds"].samples
    assert [(s.name, s.labels.get("le"), s.value) for s in queue if s.name.endswith("_bucket")] == [
        ("redserve:request_queue_time_seconds_bucket", "1.0", 1), ("redserve:request_queue_time_seconds_bucket",
                                                                   "2.0", 3),
        ("redserve:request_queue_time_seconds_bucket", "+Inf", 4)]
    assert families["redserve:num_preemptions"].samples[0].value == 3


def test_engine_hash_fields_are_checked_on_read(redis_client) -> None:
    from broker.control_state import decode_fields

    redis_client.hset("h", mapping={"prefix_cache_hits": "-3", "prefix_cache_queries": "12", "histograms": "{}"})
    fields = decode_fields(redis_client.hgetall("h"), "h")
    assert fields == {"prefix_cache_queries": 12, "histograms": "{}"}


# --------------------------------------------------------------------------------- real engine + API

def dashboard_metric_names() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"]]
    return {name for expr in exprs for name in _NAME.findall(expr)}


def series_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def metric_sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_every_dashboard_series_is_in_metrics_after_traffic(api_stack) -> None:
    auth = {"Authorization": f"Bearer {api_stack.API_KEY}"}
    url = f"{api_stack.base_url}/metrics"
    model = requests.get(f"{api_stack.base_url}/v1/models", headers=auth, timeout=10).json()["data"][0]["id"]
    before = requests.get(url, headers=auth, timeout=10).text
    shared = "The same long preamble that both requests share, " * 8
    for i in range(2):
        r = requests.post(f"{api_stack.base_url}/v1/completions", headers=auth, timeout=60,
                          json={"model": model, "prompt": shared + str(i), "max_tokens": 4, "n": 2,
                                "ignore_eos": True})
        assert r.status_code == 200, r.text
    body = {"model": model, "prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    abandoned = requests.post(f"{api_stack.base_url}/v1/completions", json=body, headers=auth, stream=True,
                              timeout=60)
    lines = abandoned.iter_lines()
    assert any(next(lines).startswith(b"data: {") for _ in range(4))
    abandoned.close()
    failures_before = metric_sum(before, "redserve:request_failure_total")

    def scrape_after_traffic() -> str | None:
        text = requests.get(url, headers=auth, timeout=10).text
        done = metric_sum(text, "redserve:request_failure_total") > failures_before
        hits = metric_sum(text, "redserve:prefix_cache_hits_total") - metric_sum(before, "redserve:prefix_cache_hits_total")
        queued = metric_sum(text, "redserve:request_queue_time_seconds_count") > 0
        return text if done and queued and hits >= BLOCK else None

    text = wait_for(scrape_after_traffic, 30, "the abandoned stream, the prefix hit and the engine histograms in /metrics")
    missing = sorted(dashboard_metric_names() - series_names(text))
    assert not missing, f"the dashboard queries series that /metrics lacks: {missing}"
    hits = metric_sum(text, "redserve:prefix_cache_hits_total") - metric_sum(before, "redserve:prefix_cache_hits_total")
    assert hits >= BLOCK, "the second request did not hit the prefix cache"
    assert metric_sum(text, "redserve:request_params_n_sum") - metric_sum(before, "redserve:request_params_n_sum") >= 4


def test_a_fresh_api_shows_every_request_series_at_zero(api_stack) -> None:
    """Before any request, each labelled counter is 0 for every value its label can take, and the dashboard's
    API panels have their series (no "No data"); summed over the gunicorn workers, as a scrape sees them."""
    proc, base = api_stack.spawn_api("api-fresh-metrics", "--public-metrics")
    try:
        api_stack.wait_healthy(base, watch=(proc,))
        text = requests.get(f"{base}/metrics", timeout=10).text
    finally:
        api_stack.stop_process(proc)
    labelled = {"request_success_total": ("finished_reason", FinishReason),
                "request_failure_total": ("reason", ErrorCode),
                "request_migrations_total": ("reason", MIGRATION_REASONS)}
    for name, (label, values) in labelled.items():
        found = dict(re.findall(rf'^redserve:{name}{{[^}}]*{label}="([a-z_]+)"[^}}]*}} (\S+)$', text, re.M))
        assert found == {str(v): "0.0" for v in values}, name
    for name in ("prompt_tokens_total", "generation_tokens_total", "e2e_request_latency_seconds_count",
                 "time_to_first_token_seconds_count", "api_requests_in_flight"):
        assert re.search(rf"^redserve:{name}{{[^}}]*}} 0\.0$", text, re.M), name
