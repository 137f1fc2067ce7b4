"""Redis killed and restarted under live streams: no request hangs past a deadline, and the stack
serves again once Redis is back (engines restore their registration, API processes resubscribe)."""

from __future__ import annotations

import json
import threading
import time

import requests

from broker.redis_server import EmbeddedRedis
from tests.conftest import ApiStack

DEADLINE_S = 45


def _stream(base_url: str, results: list, first_token: threading.Event) -> None:
    started = time.monotonic()
    outcome = "no-end"
    try:
        with requests.post(f"{base_url}/v1/completions", stream=True, timeout=DEADLINE_S, json={
                "model": "tiny-llama", "prompt": [11, 12, 13], "max_tokens": 2000, "ignore_eos": True,
                "temperature": 0, "stream": True}) as resp:
            for line in resp.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    outcome = "done" if outcome == "no-end" else outcome
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome = "error"
                first_token.set()
    except requests.RequestException as exc:
        outcome = f"exception: {type(exc).__name__}"
    results.append((outcome, time.monotonic() - started))


def test_redis_restart_ends_every_stream_and_the_stack_recovers(tiny_llama_dir, tmp_path) -> None:
    redis_server = EmbeddedRedis().start()
    stack = ApiStack(tiny_llama_dir, tmp_path, redis_server)
    try:
        stack.start_engine()
        stack.api, stack.base_url = stack.spawn_api("api")
        stack.wait_healthy(stack.base_url)
        results: list = []
        first = [threading.Event() for _ in range(4)]
        threads = [threading.Thread(target=_stream, args=(stack.base_url, results, ev)) for ev in first]
        for t in threads:
            t.start()
        assert all(ev.wait(30) for ev in first), "streams did not start"
        redis_server.restart()
        restarted = time.monotonic()
        for t in threads:
            t.join(timeout=DEADLINE_S)
        assert not any(t.is_alive() for t in threads), "a stream hung after the Redis restart"
        assert time.monotonic() - restarted < DEADLINE_S
        assert len(results) == 4
        assert all(outcome in ("done", "error") for outcome, _ in results), results
        assert any(outcome == "error" for outcome, _ in results), "the restart should have cut a stream"

        stack.wait_healthy(stack.base_url, timeout=60)
        deadline = time.monotonic() + 60
        while True:
            r = requests.post(f"{stack.base_url}/v1/completions", timeout=30, json={
                "model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        assert stack.engine.poll() is None and stack.api.poll() is None
    finally:
        stack.close()
