"""Redis with replicas and sentinels (`redserve serve --redis-replicas N`), through real processes: an engine and
an API server on a ``redis+sentinel://`` URL. Killing the primary mid-stream makes the sentinels promote a
replica; every stream still completes with exactly its tokens (resumed from what it delivered). Killing a
replica and a sentinel shows nothing to clients. A dead node comes back as a replica of the new primary."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import requests
from conftest import ApiStack
from greedy_stream import GreedyStream
from stack_procs import poll

from broker.connection import connect, parse_sentinel_url, sentinel_url
from broker.keys import RedisKeys
from redserve.redis_replicas import ReplicatedRedis
from redserve.stack import RedisWatch
from redserve.supervisor import RestartPolicy, Supervisor

MAX_TOKENS = 200
PROMPT = [11, 12, 13]


@pytest.fixture(scope="module")
def replicated_stack(tiny_llama_dir, tmp_path_factory) -> Iterator[tuple[ReplicatedRedis, ApiStack]]:
    """A primary, two replicas and three sentinels, one engine and one API server."""
    rr = ReplicatedRedis(2).start()
    stack = ApiStack(tiny_llama_dir, tmp_path_factory.mktemp("sentinel-stack"), rr)
    try:
        stack.start_engine()
        stack.api, stack.base_url = stack.spawn_api("api", workers=1)
        stack.wait_healthy(stack.base_url)
        yield rr, stack
    finally:
        stack.close()


def _reference(base_url: str) -> str:
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    resp = requests.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def _run_through(stack: ApiStack, fault, streams: int = 4) -> list[GreedyStream]:
    running = [GreedyStream(stack.base_url, PROMPT, MAX_TOKENS) for _ in range(streams)]
    assert all(s.started.wait(60) for s in running), "streams did not start"
    fault()
    return [s.join() for s in running]


def test_sentinel_url_round_trip() -> None:
    url = sentinel_url([("127.0.0.1", 1), ("h2", 2)], "mymaster", "u", "p@ss", db=3)
    parsed = parse_sentinel_url(url)
    assert parsed.sentinels == (("127.0.0.1", 1), ("h2", 2)) and parsed.master == "mymaster" and parsed.db == 3
    assert (parsed.username, parsed.password) == ("u", "p@ss")
    assert (parsed.sentinel_username, parsed.sentinel_password) == ("u", "p@ss")  # same users on the sentinels
    unauthenticated = parse_sentinel_url(url + "?sentinel_password=")
    assert (unauthenticated.sentinel_username, unauthenticated.sentinel_password) == (None, None)
    with pytest.raises(ValueError, match="MASTER"):
        parse_sentinel_url("redis+sentinel://u:p@h:1")
    with pytest.raises(ValueError, match="unsupported option"):
        parse_sentinel_url("redis+sentinel://h:1/m?ssl_ca_certs=x")


def test_replica_and_sentinel_kills_are_invisible(replicated_stack) -> None:
    rr, stack = replicated_stack
    expected = _reference(stack.base_url)
    primary = rr.primary_address()
    replica = next(name for name, node in rr.data.items() if node.address != primary)
    killed = [replica, "sentinel-0"]

    def fault() -> None:
        for name in killed:
            os.kill(rr.nodes[name].pid, signal.SIGKILL)

    done = _run_through(stack, fault)
    assert [(s.error, s.text, (s.usage or {}).get("completion_tokens")) for s in done] == [(None, expected, MAX_TOKENS)] * 4
    assert max(s.longest_gap for s in done) < 2.0, [s.longest_gap for s in done]
    assert rr.primary_address() == primary  # no failover
    for name in killed:  # back for the next test, as the supervisor would bring them back
        poll(lambda name=name: rr.prepare_restart(name), 10, f"{name} ready to restart")
        rr.nodes[name].restart()
    poll(lambda: rr._settled(len(rr.data) - 1), 30, "the sentinels to see every node again")


def test_primary_killed_mid_stream_fails_over_and_every_stream_completes(replicated_stack) -> None:
    """Started streams resume; requests the (paused) engine had not read yet are sent again and answered."""
    rr, stack = replicated_stack
    expected = _reference(stack.base_url)
    old_primary = rr.primary_address()
    primary_node = next(node for node in rr.data.values() if node.address == old_primary)
    queued: list = []

    def fault() -> None:
        r = connect(rr.url)
        os.kill(stack.engine.pid, signal.SIGSTOP)
        try:
            before = r.xlen(RedisKeys().request_stream("0"))
            body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            queued.extend(ThreadPoolExecutor(2).submit(requests.post, f"{stack.base_url}/v1/completions",
                                                       json=body, timeout=60) for _ in range(2))
            poll(lambda: r.xlen(RedisKeys().request_stream("0")) >= before + 2, 10, "two requests queued")
            os.kill(primary_node.pid, signal.SIGKILL)
        finally:
            os.kill(stack.engine.pid, signal.SIGCONT)
            r.close()

    done = _run_through(stack, fault)
    assert [(s.error, s.text, (s.usage or {}).get("completion_tokens")) for s in done] == [(None, expected, MAX_TOKENS)] * 4
    answers = [f.result() for f in queued]
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert [a.json()["usage"]["completion_tokens"] for a in answers] == [8, 8]
    longest = max(s.longest_gap for s in done)
    print(f"longest stream pause across the failover: {longest:.2f} s")
    assert longest < 10.0, [s.longest_gap for s in done]
    assert rr.primary_address() not in (None, old_primary)
    assert _reference(stack.base_url) == expected  # serves on the new primary
    assert stack.engine.poll() is None and stack.api.poll() is None


def test_a_dead_primary_comes_back_as_a_replica_of_the_new_one() -> None:
    policy = RestartPolicy(initial_backoff=0.01, max_backoff=0.01)
    with_data = ReplicatedRedis(1).start()
    try:
        supervisor, restarted = Supervisor(policy), []
        watches = [RedisWatch(node, supervisor, restarted.append, name, lambda name=name: with_data.prepare_restart(name))
                   for name, node in with_data.nodes.items()]
        client = connect(with_data.url)
        client.set("k", b"v")
        old = with_data.data["redis-0"]
        os.kill(old.pid, signal.SIGKILL)
        poll(lambda: [w.check() for w in watches] and restarted, 30, "redis-0 restarted")
        assert restarted == ["redis-0"]
        assert with_data.primary_address() == with_data.data["redis-1"].address  # it waited for the failover
        assert client.get("k") == b"v"
        admin = redis.Redis(*old.address, username="admin", password=with_data.passwords["admin"], decode_responses=True)
        poll(lambda: admin.info("replication").get("master_link_status") == "up", 10, "redis-0 replicating")
        assert admin.info("replication")["master_port"] == with_data.data["redis-1"].port
        admin.close()
        client.close()
    finally:
        with_data.stop()


def test_celery_gets_its_sentinel_transport() -> None:
    from api.batch.celery_redis import celery_redis_settings, celery_transport_options

    url = sentinel_url([("10.0.0.5", 26379), ("10.0.0.6", 26380)], "mymaster", "redserve", "pw", db=2)
    settings = celery_redis_settings(url)
    assert settings["broker_url"] == "sentinel://redserve:pw@10.0.0.5:26379/2;sentinel://redserve:pw@10.0.0.6:26380/2"
    assert settings["result_backend"] == settings["broker_url"]
    assert celery_transport_options(url) == {"master_name": "mymaster",
                                             "sentinel_kwargs": {"username": "redserve", "password": "pw"}}
    assert celery_transport_options(url + "?sentinel_password=")["sentinel_kwargs"] == {}
    assert celery_transport_options("redis://u:p@h:1/0") == {}


def test_serve_takes_replicas_only_for_its_own_redis(tmp_path) -> None:
    from redserve.cli import build_parser
    from redserve.stack import Stack

    parse = build_parser().parse_args
    with pytest.raises(ValueError, match="own Sentinel deployment"):
        Stack(parse(["serve", "--model", str(tmp_path), "--redis-url", "redis://h:1/0", "--redis-replicas", "2"]))
    with pytest.raises(ValueError, match=">= 0"):
        Stack(parse(["serve", "--model", str(tmp_path), "--redis-replicas", "-1"]))
    assert parse(["serve", "--model", str(tmp_path)]).redis_replicas == 0  # `make serve`: one server, as before
