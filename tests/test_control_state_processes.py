"""Garbage in Redis control state, met by real processes and threads: the coordinator's loop and process,
`redserve status`, garbage on the request stream and the output channel, and an engine + API + coordinator
stack that keeps serving through it (the reader table is in test_control_state.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import msgpack
import pytest
import redis
import requests
from stack_procs import poll, quiet_cli
from test_control_state import (  # noqa: F401 - fresh_log_limits is an autouse fixture
    GARBAGE,
    add_all_garbage,
    coordinator,
    fake_ready,
    fresh_log_limits,
    ids,
    lb_written_at,
    register_engine,
)

from broker.client import BrokerClient
from broker.engine_link import STREAM_FIELD, RequestReader
from broker.keys import RedisKeys
from broker.load_balance import read_lb_snapshot
from protocol.messages import AddRequest, EngineOutputs, MessageError, RequestOutput, decode, encode
from protocol.sampling_params import SamplingParams
from redserve.redis_server import EmbeddedRedis

# ----------------------------------------------------------------------------------------- coordinator


def test_coordinator_loop_survives_garbage_and_its_own_errors(redis_client, redis_keys, monkeypatch):
    r, keys = redis_client, redis_keys
    register_engine(r, keys, "0")
    add_all_garbage(r, keys)
    c = coordinator(r, keys)
    real_all_engines, failures = c.registry.all_engines, [3]

    def flaky_all_engines():
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("something nobody foresaw")
        return real_all_engines()

    monkeypatch.setattr(c.registry, "all_engines", flaky_all_engines)
    stop = threading.Event()
    loop = threading.Thread(target=c.run, args=(stop,), daemon=True)
    loop.start()
    try:
        poll(lambda: sorted(read_lb_snapshot(r, keys)) == ["0"], 10, "the coordinator to write {rs}:lb")
        assert failures[0] == 0 and loop.is_alive()
        for _ in range(2):  # garbage again, in its own keys too: each time it rewrites them
            written = lb_written_at(r, keys)
            add_all_garbage(r, keys)
            r.set(keys.wave(), "zzz")
            poll(lambda w=written: lb_written_at(r, keys) > w and r.get(keys.wave()) == b"0"
                 and sorted(read_lb_snapshot(r, keys)) == ["0"], 10, "{rs}:lb, {rs}:wave, {rs}:coordinator rewritten")
        assert loop.is_alive()
    finally:
        stop.set()
        loop.join(10)
    assert not loop.is_alive()


def test_coordinator_process_keeps_running_with_garbage(redis_url, redis_client, redis_keys):
    r, keys = redis_client, redis_keys
    register_engine(r, keys, "0")
    add_all_garbage(r, keys)
    proc = subprocess.Popen(quiet_cli("coordinator", "--redis-url", redis_url, "--key-prefix", keys.prefix,
                                      "--lock-ttl", "1.5"))
    try:
        poll(lambda: sorted(read_lb_snapshot(r, keys)) == ["0"], 20, "the coordinator to write {rs}:lb")
        written = lb_written_at(r, keys)
        add_all_garbage(r, keys)
        poll(lambda: lb_written_at(r, keys) > written and sorted(read_lb_snapshot(r, keys)) == ["0"], 10,
             "{rs}:lb rewritten")
        assert proc.poll() is None
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
    assert code == 0


# ----------------------------------------------------------------------------------------- redserve status


def test_status_command_shows_the_good_engines_with_garbage_everywhere(redis_url, redis_client, redis_keys):
    r, keys = redis_client, redis_keys
    register_engine(r, keys, "0")
    register_engine(r, keys, "1")
    add_all_garbage(r, keys)
    r.hset(keys.coordinator_lock(), "a", "b")
    base = ["status", "--redis-url", redis_url, "--key-prefix", keys.prefix]
    out = subprocess.run(quiet_cli(*base, "--json"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert [e["engine_id"] for e in status["engines"] if e["alive"]] == ["0", "1"]
    assert status["coordinator"]["holder"] is None
    assert "ignoring" in out.stderr  # the garbage is named on stderr, stdout stays JSON
    text = subprocess.run(quiet_cli(*base), capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    rows = [line.split()[:4] for line in text.stdout.splitlines() if line.startswith("  ")]
    assert ["0", "both", "ready", "yes"] in rows and ["1", "both", "ready", "yes"] in rows
    assert "Traceback" not in text.stderr


# ----------------------------------------------------------------------------------------- messages


def test_garbage_on_the_request_stream_is_acked_and_dropped(redis_client, redis_keys):
    r, keys = redis_client, redis_keys
    reader = RequestReader(r, keys, "0")
    reader.reset()
    stream = keys.request_stream("0")
    add = AddRequest("r1", "c1", [1, 2], SamplingParams(max_tokens=2), time.time())
    for fields in ({"x": "y"}, {STREAM_FIELD: b"garbage"}, {STREAM_FIELD: b"\xff\xfe"},
                   {STREAM_FIELD: msgpack.packb({"t": "add", "v": 1, "request_id": 5})},
                   {STREAM_FIELD: msgpack.packb([1, 2, 3])}, {STREAM_FIELD: encode(add)}):
        r.xadd(stream, fields)
    messages = reader.read(block_ms=0)
    assert [m for _, m in messages] == [add]
    assert r.xlen(stream) == 1 and r.xpending(stream, keys.consumer_group)["pending"] == 1  # the ADD only


def test_garbage_on_the_output_channel_is_dropped_and_the_request_goes_on(redis_url, redis_client, redis_keys):
    r, keys = redis_client, redis_keys
    register_engine(r, keys, "0")
    client = BrokerClient(redis_url, keys)
    try:
        assert client.wait_subscribed(10)
        handle = client.submit(AddRequest("r1", "", [1, 2], SamplingParams(max_tokens=1), time.time()))
        channel = keys.output_channel(client.client_id)
        v = EngineOutputs.VERSION  # the current version: the content, not the version, is what is wrong
        bad_content = [msgpack.packb({"t": "outputs", "v": v, "engine_id": 3}),
                       msgpack.packb({"t": "outputs", "v": v, "engine_id": "0", "outputs": [[1]], "timestamp": 0,
                                      "seq": 1})]
        for junk in bad_content:
            with pytest.raises(MessageError) as rejected:
                decode(junk)
            assert "version" not in str(rejected.value)
        for junk in (b"garbage", b"\xff", *bad_content):
            assert r.publish(channel, junk) == 1
        out = RequestOutput("r1", 0, [7], "length", num_prompt_tokens=2)
        r.publish(channel, encode(EngineOutputs("0", [out], time.time(), seq=1)))
        got = handle.get(timeout=10)
        assert got is not None and got.new_token_ids == [7] and got.error_code is None
    finally:
        client.stop()


# ----------------------------------------------------------------------------------------- end to end


def add_stack_garbage(r: redis.Redis, keys: RedisKeys) -> None:
    """What the issue reported, and more: a malformed engine id, a bogus engine, {rs}:lb and {rs}:wave garbage."""
    r.sadd(keys.engines(), "a:b", b"\xff")
    fake_ready(r, keys, "bogus", max_model_len="lots", waiting="many")
    r.set(keys.lb(), "notahash")
    r.set(keys.wave(), "abc")
    r.sadd(keys.clients(), "c:d")


@pytest.fixture(scope="module")
def garbage_stack(tiny_llama_dir, tmp_path_factory):
    """Its own Redis + engine + API (1 worker) + coordinator, started with garbage already in Redis (so
    every read from the first one meets it); the garbage must not reach other tests' stacks."""
    from conftest import ApiStack

    stack = ApiStack(tiny_llama_dir, tmp_path_factory.mktemp("garbage-stack-logs"), EmbeddedRedis().start())
    try:
        r = redis.Redis.from_url(stack.redis_url)
        add_stack_garbage(r, RedisKeys())
        r.close()
        stack.start_engine()
        stack.api, stack.base_url = stack.spawn_api("api", workers=1)
        coordinator_proc = stack.spawn("coordinator", ["coordinator", "--redis-url", stack.redis_url])
        stack.wait_healthy(stack.base_url, watch=(coordinator_proc,))
        yield stack, coordinator_proc
    finally:
        stack.close()


def test_stack_serves_through_garbage_and_health_says_why_it_cannot(garbage_stack):
    stack, coordinator_proc = garbage_stack
    keys, base = RedisKeys(), stack.base_url
    r = redis.Redis.from_url(stack.redis_url)
    try:
        add_stack_garbage(r, keys)
        r.xadd(keys.request_stream("0"), {"x": "y"})
        r.xadd(keys.request_stream("0"), {STREAM_FIELD: b"garbage"})
        model = requests.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]

        served, until = 0, time.monotonic() + 1.5  # across refreshes of the API's engine cache (0.5 s)
        while served < 2 or time.monotonic() < until:
            resp = requests.post(f"{base}/v1/completions", timeout=60,
                                 json={"model": model, "prompt": f"hello {served}", "max_tokens": 3,
                                       "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 3
            assert requests.get(f"{base}/health", timeout=10).status_code == 200
            served += 1
        poll(lambda: r.xlen(keys.request_stream("0")) == 0, 10, "the engine to drop the bad stream entries")
        poll(lambda: sorted(read_lb_snapshot(r, keys)) == ["0"], 10, "the coordinator to rewrite {rs}:lb")
        assert coordinator_proc.poll() is None and stack.engine.poll() is None

        stack.stop_engine()
        seen = set()

        def health_503() -> dict | None:
            resp = requests.get(f"{base}/health", timeout=10)
            seen.add(resp.status_code)
            return resp.json() if resp.status_code == 503 else None

        body = poll(health_503, 30, "/health to answer 503")
        assert seen <= {200, 503}
        assert body["ready_engines"] == 0 and "no engine is ready" in body["status"]
        assert coordinator_proc.poll() is None and stack.api.poll() is None
    finally:
        r.close()
