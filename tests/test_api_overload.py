"""Overload degrades gracefully, through real processes: redis-server, `redserve engine`, `redserve api`.

The engine is frozen (SIGSTOP) so that admitted streams stay in flight as long as the test needs:
one API worker admits 4 slots (prompt x n: a request with n=2 does not fit in the last slot); the
excess gets 429 + Retry-After at once, /health and /metrics still answer while every slot's stream
holds a gunicorn thread (gunicorn keeps threads beyond the limit), a second API whose engine stream
cap is already reached answers 503 engine_overloaded, nothing is dropped from the stream, and once
the engine runs again every admitted stream completes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import redis
import requests
from conftest import ApiStack
from stack_procs import wait_for

from broker.keys import RedisKeys
from redserve.redis_server import EmbeddedRedis

LIMIT = 4
BACKLOG = 2
MAX_TOKENS = 8
QUICK = 1.0  # generous bound (s) for an answer that needs no engine: 429, 503, /health, /metrics


@pytest.fixture(scope="module")
def overload_stack(tiny_llama_dir, tmp_path_factory) -> Iterator[tuple[ApiStack, str]]:
    """Redis + engine (heartbeat TTL 60 s, so a frozen engine stays live) + two one-worker APIs:
    `stack.base_url` admits LIMIT slots; the second URL has an engine stream cap of BACKLOG."""
    stack = ApiStack(tiny_llama_dir, tmp_path_factory.mktemp("overload-logs"), EmbeddedRedis().start())
    try:
        stack.engine = stack.spawn("engine", ["engine", "--model", tiny_llama_dir, "--redis-url", stack.redis_url,
                                              "--dtype", "float32", "--heartbeat-ttl", "60"])
        stack.api, stack.base_url = stack.spawn_api("api", "--max-concurrent-streams", str(LIMIT), workers=1)
        backlog_api, backlog_url = stack.spawn_api("api-backlog", "--max-engine-backlog", str(BACKLOG), workers=1)
        stack.wait_healthy(stack.base_url)
        stack.wait_healthy(backlog_url, watch=(backlog_api,))
        yield stack, backlog_url
    finally:
        stack.close()


def stream_len(stack: ApiStack) -> int:
    r = redis.Redis.from_url(stack.redis_url)
    try:
        return r.xlen(RedisKeys().request_stream("0"))
    finally:
        r.close()


def stream_completion(url: str, n: int, results: list) -> None:
    """One streamed completion read to the end: (status, choices' token counts, last event)."""
    body = {"prompt": "The quick brown fox", "max_tokens": MAX_TOKENS, "n": n, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=120) as r:
        events = [line[6:].decode() for line in r.iter_lines() if line.startswith(b"data: ")]
    usage = json.loads(events[-2])["usage"] if r.status_code == 200 and len(events) > 1 else None
    results.append((r.status_code, usage, events[-1] if events else None))


def timed(method: str, url: str, **kwargs) -> tuple[requests.Response, float]:
    started = time.monotonic()
    response = requests.request(method, url, timeout=10, **kwargs)
    return response, time.monotonic() - started


@contextlib.contextmanager
def frozen(proc) -> Iterator[None]:
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(proc.pid, signal.SIGCONT)


def test_overload_is_answered_fast_and_admitted_streams_complete(overload_stack) -> None:
    stack, backlog_url = overload_stack
    results: list = []
    admitted = [threading.Thread(target=stream_completion, args=(stack.base_url, 1, results)) for _ in range(LIMIT)]
    with frozen(stack.engine):
        for t in admitted[:-1]:
            t.start()
        wait_for(lambda: stream_len(stack) == LIMIT - 1, 30, "the first admitted requests in the engine's stream")
        r, elapsed = timed("POST", f"{stack.base_url}/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 2})
        assert r.status_code == 429 and elapsed < QUICK, r.text  # 1 prompt x n=2 needs 2 slots; 1 is left
        admitted[-1].start()
        wait_for(lambda: stream_len(stack) == LIMIT, 30, "every admitted request in the engine's stream")

        # every slot is taken and each admitted stream holds a gunicorn thread: the spare threads answer
        excess = [("/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True}),
                  ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})]
        for route, body in excess:
            r, elapsed = timed("POST", f"{stack.base_url}{route}", json=body)
            assert r.status_code == 429 and r.headers.get("Retry-After") == "1", r.text
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert elapsed < QUICK, f"the 429 took {elapsed:.2f}s"
        for path in ("/health", "/metrics"):
            r, elapsed = timed("GET", f"{stack.base_url}{path}")
            assert r.status_code == 200 and elapsed < QUICK, (path, r.status_code, elapsed)

        r, elapsed = timed("POST", f"{backlog_url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_overloaded", r.text
        assert r.headers.get("Retry-After") and elapsed < QUICK
        assert stream_len(stack) == LIMIT  # refused, and nothing unread was trimmed
        assert all(t.is_alive() for t in admitted)
    for t in admitted:
        t.join(timeout=120)
    assert [r[1]["completion_tokens"] for r in results] == [MAX_TOKENS] * LIMIT, results
    assert all(status == 200 and last == "[DONE]" for status, _, last in results), results
    after = requests.post(f"{stack.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": LIMIT},
                          timeout=60)
    assert after.status_code == 200, after.text  # every slot was given back
