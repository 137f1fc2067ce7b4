"""Garbage in Redis control state is skipped where it is read (issue 9: the stack survives its parts).

Every reader (registry, load snapshot, coordinator, engine waves, `redserve status`, the client's engine
cache, /health) meets each kind of garbage from a table (malformed set members, hashes with bad or
missing fields, keys of the wrong type, bad JSON, bytes that are not UTF-8) next to one good engine: it
keeps the good engine, skips the rest with one rate-limited warning, and never raises. The same through
real processes (coordinator, `redserve status`, messages, a whole stack) is in test_control_state_processes.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time

import pytest
import redis
from stack_procs import poll

from broker import log_limits
from broker.client import BrokerClient
from broker.control_state import INT_FIELDS, NUMBER_FIELDS, decode_fields, member_ids
from broker.keys import RedisKeys, check_id
from broker.load_balance import read_lb_snapshot
from broker.registry import EngineRegistry
from coordinator.process import Coordinator, CoordinatorConfig
from engine.dp_wave import DpWaves
from protocol.engine_load import EngineLoad
from protocol.messages import StartWave
from redserve.status import collect_status, format_status


@pytest.fixture(autouse=True)
def fresh_log_limits():
    log_limits.reset()
    yield
    log_limits.reset()


def register_engine(r: redis.Redis, keys: RedisKeys, engine_id: str = "0") -> EngineRegistry:
    """A READY engine with a live heartbeat and stats, as a real one leaves it (no model, no stream reader)."""
    registry = EngineRegistry(r, keys)
    registry.register(engine_id, {"dp_rank": 0, "tp": 1, "model": "fake", "heartbeat_ttl": 60.0})
    registry.heartbeat(engine_id, 60.0)
    registry.mark_ready(engine_id, 100, 16, 2048)
    registry.update_stats(engine_id, {"waiting": 0, "running": 0, "kv_usage": 0.25, "num_steps": 1,
                                      "stats_at": time.time(), "wave": 0, "wave_running": 0})
    return registry


def fake_ready(r: redis.Redis, keys: RedisKeys, engine_id: str, **fields) -> None:
    """A hand-written engine entry (set member + hash + heartbeat) with `fields` over a valid READY hash."""
    r.sadd(keys.engines(), engine_id)
    r.hset(keys.engine(engine_id), mapping={"state": "ready", "incarnation": "x", "max_model_len": 64,
                                            "num_kv_blocks": 4, "block_size": 16, **fields})
    r.set(keys.engine_alive(engine_id), "x")


GARBAGE = {
    "engine id with ':'": lambda r, k: r.sadd(k.engines(), "a:b"),
    "engine id with whitespace": lambda r, k: r.sadd(k.engines(), "a b"),
    "engine id not UTF-8": lambda r, k: r.sadd(k.engines(), b"\xff\xfe"),
    "engine hash without state": lambda r, k: (r.sadd(k.engines(), "bogus"), r.hset(k.engine("bogus"), "foo", "bar")),
    "engine state unknown": lambda r, k: fake_ready(r, k, "odd", state="sleepy"),
    "engine without incarnation": lambda r, k: (fake_ready(r, k, "noinc"), r.hdel(k.engine("noinc"), "incarnation")),
    "ready engine without max_model_len": lambda r, k: (fake_ready(r, k, "nolen"),
                                                        r.hdel(k.engine("nolen"), "max_model_len")),
    "ready engine with non-numeric max_model_len": lambda r, k: fake_ready(r, k, "lots", max_model_len="lots"),
    "engine hash of the wrong type": lambda r, k: (r.sadd(k.engines(), "str"), r.set(k.engine("str"), "x")),
    "heartbeat key of the wrong type": lambda r, k: (fake_ready(r, k, "hb"), r.delete(k.engine_alive("hb")),
                                                     r.hset(k.engine_alive("hb"), "a", "b")),
    "non-numeric counters on the good engine": lambda r, k: r.hset(k.engine("0"), mapping={
        "waiting": "lots", "running": -3, "kv_usage": "nan", "num_steps": "1e999", "wave": 10**30,
        "stats_at": "inf", "pid": "12.5"}),
    "fields not UTF-8 on the good engine": lambda r, k: r.hset(k.engine("0"), mapping={
        b"\xff": "x", "model": b"\xff\xfe", "host": b"\xc3"}),
    "{rs}:lb of the wrong type": lambda r, k: r.set(k.lb(), "notahash"),
    "bad entries in {rs}:lb": lambda r, k: r.hset(k.lb(), mapping={
        "0": "{not json", "a:b": "{}", b"\xff": "{}", "1": "[1, 2]", "2": '{"waiting": 1e999}',
        "3": '{"running": -1}', "4": '{"ts": NaN}', "5": "[" * 100_000, "6": b"\xff\xfe", "7": '{"waiting": "3"}',
        "8": '{"step": true}', "9": '{"kv_usage": Infinity}'}),
    "{rs}:wave not a number": lambda r, k: r.set(k.wave(), "abc"),
    "{rs}:wave negative": lambda r, k: r.set(k.wave(), -4),
    "{rs}:wave too large": lambda r, k: r.set(k.wave(), 10**30),
    "{rs}:wave not UTF-8": lambda r, k: r.set(k.wave(), b"\xff"),
    "{rs}:wave of the wrong type": lambda r, k: r.hset(k.wave(), "a", "b"),
    "{rs}:coordinator of the wrong type": lambda r, k: r.set(k.coordinator(), "x"),
    "bad fields in {rs}:coordinator": lambda r, k: r.hset(k.coordinator(), mapping={
        "lockstep": "x", "lb_written_at": "nan", "holder": 5, "pid": b"\xff"}),
    "malformed client ids": lambda r, k: r.sadd(k.clients(), "a:b", b"\xff", "c d"),
    "{rs}:clients of the wrong type": lambda r, k: r.set(k.clients(), "x"),
}


def add_all_garbage(r: redis.Redis, keys: RedisKeys) -> None:
    for make in GARBAGE.values():
        with contextlib.suppress(redis.ResponseError):  # some kinds overwrite the key another one wrote
            make(r, keys)


def ids(engines) -> list[str]:
    return sorted(e["engine_id"] for e in engines)


def coordinator(r: redis.Redis, keys: RedisKeys) -> Coordinator:
    config = CoordinatorConfig(interval=0.05, idle_interval=0.1, refresh_interval=0.3, lock_ttl=0.9)
    return Coordinator(r, keys, config)


def lb_written_at(r: redis.Redis, keys: RedisKeys) -> float:
    """When the coordinator last wrote {rs}:lb (0 while {rs}:coordinator holds garbage)."""
    if r.type(keys.coordinator()) != b"hash":
        return 0.0
    return float(r.hget(keys.coordinator(), "lb_written_at") or 0)


def assert_well_typed(engine: dict) -> None:
    check_id("engine", engine["engine_id"])
    for name, value in engine.items():
        if name in INT_FIELDS:
            assert type(value) is int and 0 <= value < 2**63, (name, value)
        if name in NUMBER_FIELDS:
            assert type(value) in (int, float) and value >= 0 and value == value and value != float("inf")
        assert "\ufffd" not in name and "\ufffd" not in str(value), (name, value)


# ----------------------------------------------------------------------------------------- every reader


@pytest.mark.parametrize("garbage", list(GARBAGE))
def test_every_reader_skips_the_garbage_and_keeps_the_good_engine(garbage, redis_url, redis_client, redis_keys):
    r, keys = redis_client, redis_keys
    register_engine(r, keys, "0")
    GARBAGE[garbage](r, keys)

    registry = EngineRegistry(r, keys)
    assert ids(registry.ready_engines()) == ["0"]
    assert ids(registry.live_engines()) == ["0"]
    for engine in registry.all_engines():
        assert_well_typed(engine)
    assert all(check_id("engine", e) for e in read_lb_snapshot(r, keys))

    status = collect_status(r, keys)
    assert [e["engine_id"] for e in status["engines"] if e["alive"]] == ["0"]
    assert status["wave"] is None or type(status["wave"]) is int
    json.dumps(status)
    assert "0" in format_status(status)

    client = BrokerClient(redis_url, keys, engine_refresh=0.0)
    try:
        assert ids(client.ready_engines()) == ["0"]
        assert client.selector.select()["engine_id"] == "0"
    finally:
        client.stop()

    waves = DpWaves(r, keys, "0", poll_interval=0.0)
    waves.load()
    assert waves.update(busy=True) is not None
    waves.notify_others(StartWave(waves.wave, "0"))
    assert 0 <= waves.wave < 2**63

    c = coordinator(r, keys)
    for _ in range(3):
        c.step()
    assert c.active
    assert sorted(read_lb_snapshot(r, keys)) == ["0"]  # the coordinator rewrote {rs}:lb whole
    assert r.get(keys.wave()).isdigit()  # and {rs}:wave, if it held garbage
    c.resign()


def test_a_control_set_of_the_wrong_type_reads_as_empty(redis_url, redis_client, redis_keys):
    r, keys = redis_client, redis_keys
    r.set(keys.engines(), "x")
    assert EngineRegistry(r, keys).all_engines() == []
    assert collect_status(r, keys)["engines"] == []
    c = coordinator(r, keys)
    c.step()
    assert c.active and read_lb_snapshot(r, keys) == {}
    waves = DpWaves(r, keys, "0")
    assert waves.notify_others(StartWave(0, "0")) == 0
    client = BrokerClient(redis_url, keys)
    try:
        assert client.ready_engines() == []
    finally:
        client.stop()


def test_field_types_and_set_members_are_checked():
    fields = decode_fields({b"max_model_len": b"2048", b"waiting": b"x", b"kv_usage": b"0.5", b"stats_at": b"nan",
                            b"model": b"007", b"other": b"inf", b"n": b"12", b"\xff": b"1", b"host": b"\xff"}, "h")
    assert fields == {"max_model_len": 2048, "kv_usage": 0.5, "model": "007", "other": "inf", "n": 12}
    assert member_ids([b"b", b"a", b"a:b", b"a b", b"", b"\xff"], "engine", "s") == ["a", "b"]
    assert EngineLoad.from_json('{"waiting": 2, "ts": 5}') == EngineLoad(waiting=2, ts=5.0)
    for bad in ['{"waiting": 2.5}', '{"waiting": true}', '{"ts": -1}', '{"kv_usage": NaN}', "[", "[" * 10_000]:
        with pytest.raises(ValueError):
            EngineLoad.from_json(bad)


def test_a_bad_entry_is_logged_once_per_interval_not_per_read(redis_client, redis_keys, caplog):
    register_engine(redis_client, redis_keys, "0")
    redis_client.sadd(redis_keys.engines(), "a:b")
    registry = EngineRegistry(redis_client, redis_keys)
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            assert ids(registry.all_engines()) == ["0"]
    assert len([r for r in caplog.records if "a:b" in r.getMessage()]) == 1
    log_limits.reset()  # as if the interval had passed
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        registry.all_engines()
    assert len([r for r in caplog.records if "a:b" in r.getMessage()]) == 1


def test_warn_every_counts_what_it_held_back(caplog, monkeypatch):
    log = logging.getLogger("test.log_limits")
    clock = [100.0]
    monkeypatch.setattr(log_limits, "_clock", lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="test.log_limits"):
        assert log_limits.warn_every(log, "k", 10.0, "bad %s", "x")
        assert not log_limits.warn_every(log, "k", 10.0, "bad %s", "x")
        assert log_limits.warn_every(log, "other", 10.0, "bad %s", "y")
        clock[0] += 11
        assert log_limits.warn_every(log, "k", 10.0, "bad %s", "x")
    assert [r.getMessage() for r in caplog.records] == ["bad x", "bad y", "bad x (1 more like this since the last "
                                                        "such line)"]
    monkeypatch.setattr(log_limits, "MAX_KEYS", 3)
    for i in range(10):  # a flood of distinct bad entries: each is logged, the table stays bounded
        assert log_limits.warn_every(log, f"flood-{i}", 10.0, "bad %d", i)
        assert len(log_limits._seen) <= 3


# ----------------------------------------------------------------------------------------- /health


@pytest.fixture
def health(redis_url, redis_keys, tiny_llama_dir):
    """GET /health of an in-process API app on the test's Redis and prefix (real ApiState and BrokerClient)."""
    from api.app import create_app
    from api.config import ApiConfig
    from api.state import ApiState

    config = ApiConfig(model=tiny_llama_dir, redis_url=redis_url, key_prefix=redis_keys.prefix)
    state = ApiState(config, tokenizer=object())  # /health needs no tokenizer
    http = create_app(config, state).test_client()
    yield lambda: http.get("/health"), state
    state.stop()


def test_health_is_200_or_503_with_a_reason_never_500(health, redis_client, redis_keys, monkeypatch):
    get, state = health
    r, keys = redis_client, redis_keys
    add_all_garbage(r, keys)
    fake_ready(r, keys, "lots", max_model_len="lots")
    resp = get()
    assert resp.status_code == 503 and resp.headers["Retry-After"]
    assert resp.get_json()["ready_engines"] == 0 and "no engine is ready" in resp.get_json()["status"]

    register_engine(r, keys, "0")
    add_all_garbage(r, keys)
    assert get().status_code == 200 and get().get_json() == {"status": "ok", "ready_engines": 1}

    r.delete(keys.engines())
    r.set(keys.engines(), "x")
    codes = []
    poll(lambda: codes.append(get().status_code) or codes[-1] == 503, 5, "503 once the engine cache expires")
    assert set(codes) <= {200, 503}

    def broken() -> list:
        raise RuntimeError("a bug nobody foresaw")

    monkeypatch.setattr(state, "ready_engines", broken)
    resp = get()
    assert resp.status_code == 503
    assert resp.get_json() == {"status": "control state unreadable: RuntimeError: a bug nobody foresaw",
                               "ready_engines": 0}


def test_metrics_skip_garbage_in_the_restart_counts(health, redis_client, redis_keys):
    _, state = health
    r, keys = redis_client, redis_keys
    r.hset(keys.stack_restarts(), mapping={"engine-0": "2", "api": "lots", b"\xff": "1", "batch": "-3"})
    assert state.child_restarts() == {"engine-0": 2}
    r.delete(keys.stack_restarts())
    r.sadd(keys.stack_restarts(), "x")
    assert state.child_restarts() == {}


@pytest.mark.parametrize("stray", ["set", "string-without-ttl"])
def test_a_stray_coordinator_lock_is_cleared_not_obeyed_for_ever(stray, redis_client, redis_keys):
    from coordinator.leader_lock import LeaderLock

    r, keys = redis_client, redis_keys
    if stray == "set":
        r.sadd(keys.coordinator_lock(), "x")
    else:
        r.set(keys.coordinator_lock(), "someone")
    lock = LeaderLock(r, keys.coordinator_lock(), "me", ttl=2.0)
    assert lock.acquire() and r.get(keys.coordinator_lock()) == b"me"
    other = LeaderLock(r, keys.coordinator_lock(), "other", ttl=2.0)
    assert not other.acquire(), "a live holder's lock (a string with a TTL) is never cleared"


def test_an_unreachable_redis_is_read_with_backoff_not_every_poll():
    """A wave read blocks the busy loop for the client's timeout: while Redis fails, reads back off (1, 2, 4,
    8, 10, 10 s ...) instead of running every poll_interval, and resume at the poll rate once it answers."""
    class Unreachable:
        def __init__(self) -> None:
            self.reads = 0
            self.down = True

        def pipeline(self, transaction: bool = False):
            owner = self

            class Pipe:
                def get(self, key): pass
                def hget(self, key, field): pass

                def execute(self, raise_on_error: bool = True):
                    owner.reads += 1
                    if owner.down:
                        raise redis.ConnectionError("Timeout connecting to server")
                    return [b"3", None]
            return Pipe()

    now = [0.0]
    server = Unreachable()
    waves = DpWaves(server, RedisKeys("t"), "0", poll_interval=0.1, clock=lambda: now[0])
    waves.update(busy=True)  # joins a wave: reads once
    while now[0] < 40.0:  # 400 busy-loop iterations of 0.1 s
        now[0] += 0.1
        waves.update(busy=True)
    assert server.reads <= 8, server.reads  # 1 + retries at ~1, 3, 7, 15, 25, 35 s; without backoff ~400
    server.down = False
    now[0] += 10.1
    waves.update(busy=True)
    assert waves.wave == 3
    reads = server.reads
    for _ in range(10):
        now[0] += 0.1
        waves.update(busy=True)
    assert server.reads - reads >= 9  # back to one read per poll
