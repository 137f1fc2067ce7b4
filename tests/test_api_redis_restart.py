"""Redis killed and restarted under live streams: no request hangs past a deadline, started streams resume
from the tokens they delivered, and the stack serves again once Redis is back (engines restore their
registration, API processes resubscribe)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import redis
import requests
from conftest import ApiStack

from redserve.redis_server import EmbeddedRedis

DEADLINE_S = 45
STREAM_TOKENS = 300


def _stream(base_url: str, results: list, first_token: threading.Event) -> None:
    started = time.monotonic()
    outcome = "no-end"
    try:
        with requests.post(f"{base_url}/v1/completions", stream=True, timeout=DEADLINE_S, json={
                "model": "tiny-llama", "prompt": [11, 12, 13], "max_tokens": STREAM_TOKENS, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as resp:
            for line in resp.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    outcome = "done" if outcome == "no-end" else outcome
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome = "error"
                if (chunk.get("usage") or {}).get("completion_tokens", STREAM_TOKENS) != STREAM_TOKENS:
                    outcome = f"usage {chunk['usage']}"
                first_token.set()
    except requests.RequestException as exc:
        outcome = f"exception: {type(exc).__name__}"
    results.append((outcome, time.monotonic() - started))


@contextlib.contextmanager
def running_stack(model_dir: str, tmp_path) -> Iterator[tuple[EmbeddedRedis, ApiStack]]:
    """A Redis of its own (these tests restart it), an engine and one API server, all stopped at the end."""
    redis_server = EmbeddedRedis().start()
    stack = ApiStack(model_dir, tmp_path, redis_server)
    try:
        stack.start_engine()
        stack.api, stack.base_url = stack.spawn_api("api")
        stack.wait_healthy(stack.base_url)
        yield redis_server, stack
    finally:
        stack.close()


def test_redis_restart_resumes_every_stream_and_the_stack_recovers(tiny_llama_dir, tmp_path) -> None:
    with running_stack(tiny_llama_dir, tmp_path) as (redis_server, stack):
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
        assert [outcome for outcome, _ in results] == ["done"] * 4, results  # resumed, with all their tokens

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


def test_requests_not_started_survive_a_redis_restart(tiny_llama_dir, tmp_path) -> None:
    """Requests queued on a paused engine when Redis restarts (empty: their ADDs are gone) are sent again
    by their API process once Redis is back, and complete with the same text as before the fault."""
    body = {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}
    with running_stack(tiny_llama_dir, tmp_path) as (redis_server, stack):
        url = f"{stack.base_url}/v1/completions"
        expected = requests.post(url, json=body, timeout=30).json()["choices"][0]["text"]
        os.kill(stack.engine.pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(3) as pool:
                futures = [pool.submit(requests.post, url, json=body, timeout=DEADLINE_S) for _ in range(3)]
                deadline = time.monotonic() + 10
                while redis_server_pending(redis_server) < 3 and time.monotonic() < deadline:
                    time.sleep(0.05)
                redis_server.restart()
                os.kill(stack.engine.pid, signal.SIGCONT)
                answers = [f.result() for f in futures]
        finally:
            os.kill(stack.engine.pid, signal.SIGCONT)
        assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
        assert [a.json()["choices"][0]["text"] for a in answers] == [expected] * 3


def redis_server_pending(server: EmbeddedRedis) -> int:
    """ADDs waiting in every request stream (the paused engine has read none of them)."""
    r = redis.Redis.from_url(server.url)
    try:
        return sum(r.xlen(k) for k in r.scan_iter(match="*:req:*", _type="STREAM"))
    finally:
        r.close()
