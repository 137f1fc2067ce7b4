"""Bounded requests: every limit of issue 9, each checked where it matters.

Over the scripted broker (Flask test client): min_tokens beyond the context, a 10 MB prompt refused
without tokenizing, stop-string and stop_token_ids caps, prompts x n against the in-flight limit,
429 while the engines' queues are full. Against a real Redis: the ADD message carries no stop
strings, a full request stream fails fast (503) and nothing is trimmed. Through real HTTP (the
session's `api_stack`): the same 400s from the gunicorn server.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import msgpack
import pytest
import redis
import requests
from fake_broker import FakeClient, make_app, token_script

from api.app import create_app
from api.config import ApiConfig
from broker.client import BrokerClient
from broker.connection import connect
from broker.engine_link import STREAM_FIELD
from broker.errors import EngineOverloaded
from broker.keys import RedisKeys
from broker.registry import EngineHeartbeat, EngineRegistry
from protocol.messages import AbortRequests, AddRequest, RequestOutput, decode
from protocol.sampling_params import MAX_STOP_BYTES, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams

USER = [{"role": "user", "content": "hi"}]
TEN_MB = "hello world " * 873_814  # 10 MiB of text: ~5 M tokens, ~25 s to tokenize on one core


def error_of(response) -> dict[str, Any]:
    body = response.get_json() if hasattr(response, "get_json") else response.json()
    return body["error"]


@pytest.fixture
def http(tiny_llama_dir, tokenizer):  # noqa: F811 - the fixture imported above
    return make_app(tiny_llama_dir, tokenizer, FakeClient(token_script([10, 11, 12])))


# ----------------------------------------------------------------------------------------- context

@pytest.mark.parametrize(("route", "body"), [
    ("/v1/completions", {"prompt": "hi", "max_tokens": None, "min_tokens": 5000}),
    ("/v1/chat/completions", {"messages": USER, "min_tokens": 5000}),
])
def test_min_tokens_beyond_the_context_is_a_400(http, route, body) -> None:
    r = http.post(route, json=body)
    assert r.status_code == 400, r.get_json()
    error = error_of(r)
    assert error["param"] == "min_tokens" and error["code"] == "context_length_exceeded"
    assert "256 tokens" in error["message"]  # the fake engine's max_model_len


class CountingEncoder:
    """Wraps ModelTokenizer.encode to count the calls."""

    def __init__(self, encode) -> None:
        self.encode, self.calls = encode, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.encode(*args, **kwargs)


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/completions", {"prompt": TEN_MB, "max_tokens": 4}),
    ("/v1/completions", {"prompt": ["short", TEN_MB], "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": TEN_MB}], "max_tokens": 4}),
    ("/tokenize", {"prompt": TEN_MB}),
    ("/tokenize", {"messages": [{"role": "user", "content": TEN_MB}]}),
])
def test_a_10mb_prompt_is_refused_without_tokenizing(http, tokenizer, monkeypatch, route, body) -> None:
    state = http.application.extensions["redserve"]
    assert state.prompt_bound.max_chars_per_token == max(len(t) for t in tokenizer.tokenizer.get_vocab())
    counter = CountingEncoder(tokenizer.encode)
    monkeypatch.setattr(tokenizer, "encode", counter)
    started = time.monotonic()
    r = http.post(route, json=body)
    elapsed = time.monotonic() - started
    assert r.status_code == 400, r.get_json()
    error = error_of(r)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "characters" in error["message"]
    assert counter.calls == (1 if body.get("prompt", [None])[0] == "short" else 0)  # only the short prompt
    assert elapsed < 10, f"refusing a 10 MB prompt took {elapsed:.1f}s"  # tokenizing it takes ~25 s


def test_a_prompt_under_the_character_bound_is_still_tokenized_and_checked(http, tokenizer, monkeypatch) -> None:
    counter = CountingEncoder(tokenizer.encode)
    monkeypatch.setattr(tokenizer, "encode", counter)
    r = http.post("/v1/completions", json={"prompt": "a b " * 600, "max_tokens": 4})  # 2400 chars, > 256 tokens
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
    assert "characters" not in error_of(r)["message"] and counter.calls == 1


# ----------------------------------------------------------------------------------------- stop sizes

@pytest.mark.parametrize(("field", "value", "status"), [
    ("stop", ["s"] * MAX_STOP_STRINGS, 200),
    ("stop", ["s"] * (MAX_STOP_STRINGS + 1), 400),
    ("stop", ["x" * (MAX_STOP_BYTES // 2)] * 2, 200),
    ("stop", ["x" * (MAX_STOP_BYTES // 2), "é" * (MAX_STOP_BYTES // 4 + 1)], 400),  # 2 bytes per é
    ("stop", "y" * (MAX_STOP_BYTES + 1), 400),
    ("stop_token_ids", [5] * MAX_STOP_TOKEN_IDS, 200),
    ("stop_token_ids", [5] * (MAX_STOP_TOKEN_IDS + 1), 400),
])
def test_stop_sizes_are_capped(http, field, value, status) -> None:
    for route, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": USER})):
        r = http.post(route, json={**base, "max_tokens": 2, field: value})
        assert r.status_code == status, r.get_json()
        if status == 400:
            assert error_of(r)["param"] == field


# ----------------------------------------------------------------------------------------- in-flight slots

HOLD = 99  # max_tokens of the request that holds its slots


def hold(add: AddRequest) -> list[RequestOutput | None]:
    """A request with max_tokens HOLD gives one token per sequence, then hangs (holding its slots); others finish."""
    if add.params.max_tokens == HOLD:
        return [RequestOutput(add.request_id, i, [10]) for i in range(add.params.n)] + [None]
    return token_script([10, 11])(add)


def test_prompts_times_n_count_against_the_in_flight_limit(tiny_llama_dir, tokenizer) -> None:
    client = FakeClient(hold)
    http = make_app(tiny_llama_dir, tokenizer, client, max_queued_requests=4)
    too_many_n = http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 3})
    assert too_many_n.status_code == 400 and error_of(too_many_n)["param"] == "n"
    too_many_prompts = http.post("/v1/completions", json={"prompt": ["a"] * 5})
    assert too_many_prompts.status_code == 400 and error_of(too_many_prompts)["param"] == "prompt"
    assert http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2}).status_code == 200
    held = http.post("/v1/completions", json={"prompt": "x", "n": 3, "max_tokens": HOLD, "stream": True},
                     buffered=False)
    assert held.status_code == 200  # 3 of 4 slots taken until it ends
    busy = http.post("/v1/chat/completions", json={"messages": USER, "n": 2})
    assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
    assert error_of(busy)["code"] == "rate_limit_exceeded"
    assert http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).status_code == 200
    held.close()
    assert http.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 2}).status_code == 200
    assert http.application.extensions["redserve"].limiter.count == 0


class BusyEngines(FakeClient):
    """Engines that report `waiting` requests in their registry counters."""

    waiting = 0

    def ready_engines(self) -> list[dict[str, Any]]:
        return [{**e, "waiting": self.waiting} for e in super().ready_engines()]


def test_full_engine_queues_are_a_429(tiny_llama_dir, tokenizer) -> None:
    client = BusyEngines(token_script([10, 11]))
    http = make_app(tiny_llama_dir, tokenizer, client, max_engine_waiting=100)
    client.waiting = 100
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 429 and r.headers["Retry-After"] == "1" and "waiting" in error_of(r)["message"]
    client.waiting = 99
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


# ----------------------------------------------------------------------------------------- real Redis

@pytest.fixture
def idle_engine(redis_url, redis_keys):
    """A READY engine in the registry, with a live heartbeat, that never reads its request stream."""
    r = connect(redis_url)
    registry = EngineRegistry(r, redis_keys)
    registry.register("0", {"dp_rank": 0, "tp": 1, "model": "fake"})
    registry.mark_ready("0", num_kv_blocks=100, block_size=16, max_model_len=256)
    heartbeat = EngineHeartbeat(registry, "0", ttl=30).start()
    try:
        yield registry
    finally:
        heartbeat.stop()
        r.close()


def stream_entries(redis_url: str, keys: RedisKeys, unpack=decode) -> list:
    r = redis.Redis.from_url(redis_url)
    try:
        return [unpack(fields[STREAM_FIELD]) for _, fields in r.xrange(keys.request_stream("0"))]
    finally:
        r.close()


def real_app(tiny_llama_dir, redis_url, keys, **config):
    cfg = ApiConfig(model=tiny_llama_dir, redis_url=redis_url, key_prefix=keys.prefix, **config)
    return create_app(cfg).test_client()


def test_the_add_message_carries_no_stop_strings(tiny_llama_dir, redis_url, redis_keys, idle_engine) -> None:
    http = real_app(tiny_llama_dir, redis_url, redis_keys, request_timeout=1.0)
    body = {"prompt": "hello", "max_tokens": 3, "stop": ["END", "\n\n"], "include_stop_str_in_output": True,
            "skip_special_tokens": False, "temperature": 0.5}
    answers: list = []
    thread = threading.Thread(target=lambda: answers.append(http.post("/v1/completions", json=body)))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not stream_entries(redis_url, redis_keys) and time.monotonic() < deadline:
            time.sleep(0.02)
        add = stream_entries(redis_url, redis_keys)[0]
        raw_params = stream_entries(redis_url, redis_keys, msgpack.unpackb)[0]["params"]
    finally:
        thread.join(timeout=20)
        http.application.extensions["redserve"].stop()
    assert isinstance(add, AddRequest)
    assert not {"stop", "include_stop_str_in_output", "skip_special_tokens"} & set(raw_params), raw_params
    assert add.params.max_tokens == 3 and add.params.temperature == 0.5
    assert answers[0].status_code == 504  # nobody ran it: the request's deadline passed


def test_a_full_request_stream_fails_fast_and_drops_nothing(redis_url, redis_keys, idle_engine) -> None:
    client = BrokerClient(redis_url, redis_keys, max_stream_len=2).start()
    try:
        assert client.wait_subscribed(10)
        handles = [client.submit(AddRequest(f"r{i}", "", [1, 2], SamplingParams(n=1, max_tokens=4), time.time()))
                   for i in range(2)]
        started = time.monotonic()
        with pytest.raises(EngineOverloaded):
            client.submit(AddRequest("r2", "", [1, 2], SamplingParams(n=1, max_tokens=4), time.time()))
        assert time.monotonic() - started < 5
        assert client.in_flight() == 2
        assert [e.request_id for e in stream_entries(redis_url, redis_keys)] == ["r0", "r1"]  # nothing trimmed
        handles[0].abort()  # control messages are never refused
        entries = stream_entries(redis_url, redis_keys)
        assert len(entries) == 3 and isinstance(entries[-1], AbortRequests)
    finally:
        client.stop()


def test_engine_waiting_counts_from_redis_give_429(tiny_llama_dir, redis_url, redis_keys, idle_engine) -> None:
    http = real_app(tiny_llama_dir, redis_url, redis_keys, max_engine_waiting=50, max_engine_backlog=1,
                    request_timeout=2.0)  # a request sent by mistake ends (504) instead of hanging the test
    try:
        idle_engine.update_stats("0", {"waiting": 50, "running": 256})
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.get_json()
        assert stream_entries(redis_url, redis_keys) == []
        # below the waiting limit the request is sent; with the stream cap at 1 a second one is refused
        idle_engine.update_stats("0", {"waiting": 0})
        state = http.application.extensions["redserve"]
        state.client.submit(AddRequest(f"x-{uuid.uuid4().hex}", "", [1], SamplingParams(n=1, max_tokens=1), time.time()))
        deadline = time.monotonic() + 5
        while (r := http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status_code == 429:
            assert time.monotonic() < deadline, "the engine's counters were not re-read"
            time.sleep(0.1)
        assert r.status_code == 503 and error_of(r)["code"] == "engine_overloaded", r.get_json()
        assert r.headers["Retry-After"]
    finally:
        http.application.extensions["redserve"].stop()


# ----------------------------------------------------------------------------------------- real HTTP

def test_limits_through_the_real_server(api_stack) -> None:
    url, auth = api_stack.base_url, {"Authorization": f"Bearer {api_stack.API_KEY}"}

    def post(route: str, body: dict) -> requests.Response:
        return requests.post(f"{url}{route}", json=body, headers=auth, timeout=60)

    big = post("/v1/completions", {"prompt": "hello world " * 80_000, "max_tokens": 4})  # 960 kB, < the 1 MB cap
    assert big.status_code == 400 and big.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" in big.json()["error"]["message"]  # refused by the character bound, not by tokenizing
    chat = post("/v1/chat/completions", {"messages": USER, "min_tokens": 5000})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "min_tokens"
    stops = post("/v1/completions", {"prompt": "hi", "stop": ["s"] * 17})
    assert stops.status_code == 400 and stops.json()["error"]["param"] == "stop"
    ids = post("/v1/completions", {"prompt": "hi", "stop_token_ids": [5] * 1025})
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "stop_token_ids"
    many = post("/v1/completions", {"prompt": ["a", "b"], "n": 64, "max_tokens": 1})  # 128 > 64 slots
    assert many.status_code == 400 and many.json()["error"]["param"] == "n"


# ----------------------------------------------------------------------------------------- gunicorn threads

def test_threads_default_to_the_limit_plus_a_reserve(tiny_llama_dir, capsys) -> None:
    import argparse

    from api.options import THREAD_RESERVE, add_api_arguments
    from api.server import run_api, worker_threads

    parser = argparse.ArgumentParser()
    add_api_arguments(parser)
    base = ["--model", tiny_llama_dir, "--redis-url", "redis://127.0.0.1:1/0"]
    assert worker_threads(parser.parse_args(base)) == 64 + THREAD_RESERVE
    assert worker_threads(parser.parse_args([*base, "--max-concurrent-streams", "4"])) == 4 + THREAD_RESERVE
    assert worker_threads(parser.parse_args([*base, "--max-queued-requests", "8", "--threads", "9"])) == 9
    assert run_api(parser.parse_args([*base, "--max-concurrent-streams", "8", "--threads", "8"])) == 2
    assert "--threads (8) must exceed --max-concurrent-streams (8)" in capsys.readouterr().err
    assert run_api(parser.parse_args([*base, "--nice", "20"])) == 2
    assert "--nice must be 0 to 19, got 20" in capsys.readouterr().err
