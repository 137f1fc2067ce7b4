import time

import msgpack
import pytest
import redis

from broker.connection import connect
from broker.engine_link import STREAM_FIELD, EngineHeartbeat, EngineRegistry, OutputPublisher, RequestReader
from broker.keys import EngineState
from protocol.messages import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    ErrorCode,
    FinishReason,
    RequestOutput,
    StartWave,
    UtilityCall,
    UtilityResult,
    decode,
    encode,
)
from protocol.sampling_params import SamplingParams


def _eventually(predicate, timeout=5.0, interval=0.01):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture
def registry(redis_client, redis_keys):
    return EngineRegistry(redis_client, redis_keys)


def _xadd(redis_client, keys, engine_id, msg):
    return redis_client.xadd(keys.request_stream(engine_id), {STREAM_FIELD: encode(msg)}).decode()


# --------------------------------------------------------------------------- registry


def test_registry_lifecycle(registry, redis_client, redis_keys):
    inc = registry.register("e0", {"dp_rank": 0, "tp": 2, "model": "tiny-llama"})
    info = registry.get("e0")
    assert info["state"] == EngineState.STARTING and info["incarnation"] == inc
    assert info["dp_rank"] == 0 and info["tp"] == 2 and info["model"] == "tiny-llama"
    assert isinstance(info["pid"], int) and isinstance(info["started_at"], float)
    assert redis_client.sismember(redis_keys.engines(), "e0")
    assert registry.ready_engines() == []  # starting, and no heartbeat yet

    registry.heartbeat("e0", ttl=5)
    assert registry.ready_engines() == []  # live but still starting
    registry.mark_ready("e0", num_kv_blocks=1000, block_size=16, max_model_len=4096)
    [ready] = registry.ready_engines()
    assert ready["engine_id"] == "e0" and ready["num_kv_blocks"] == 1000 and ready["alive"] is True

    registry.update_stats("e0", {"waiting": 3, "running": 5, "kv_usage": 0.25})
    info = registry.get("e0")
    assert (info["waiting"], info["running"], info["kv_usage"]) == (3, 5, 0.25)
    assert redis_client.hget(redis_keys.engine("e0"), "state") == b"ready"  # readable in redis-cli

    registry.set_state("e0", EngineState.DRAINING)
    assert registry.ready_engines() == []
    assert [e["engine_id"] for e in registry.live_engines()] == ["e0"]

    registry.deregister("e0")
    assert registry.get("e0") is None
    assert not redis_client.exists(redis_keys.engine_alive("e0"), redis_keys.request_stream("e0"))
    assert not redis_client.sismember(redis_keys.engines(), "e0")


def test_heartbeat_expiry_makes_engine_not_ready(registry):
    registry.register("e0", {"model": "m"})
    registry.mark_ready("e0", 10, 16, 128)
    registry.heartbeat("e0", ttl=0.15)
    assert len(registry.ready_engines()) == 1
    assert _eventually(lambda: registry.ready_engines() == [], timeout=3)
    assert registry.get("e0")["alive"] is False


def test_new_incarnation_invalidates_old_heartbeat(registry, redis_client, redis_keys):
    registry.register("e0", {})
    registry.mark_ready("e0", 10, 16, 128)
    registry.heartbeat("e0", ttl=5)
    other = EngineRegistry(redis_client, redis_keys)
    other.register("e0", {})  # a restarted engine with the same id, not yet heartbeating
    assert registry.get("e0")["alive"] is False


def test_heartbeat_restores_registration_after_flush(registry, redis_client, redis_admin, redis_keys):
    registry.register("e0", {"model": "m"})
    registry.mark_ready("e0", 10, 16, 128)
    assert registry.heartbeat("e0", ttl=5) is False
    redis_admin.flushdb()
    assert registry.heartbeat("e0", ttl=5) is True
    [ready] = registry.ready_engines()
    assert ready["model"] == "m" and ready["num_kv_blocks"] == 10


def test_heartbeat_thread_reports_a_restored_registration(registry, redis_admin):
    """Redis restarted empty: the beat that restores the registration tells the engine (which then
    publishes its prefix index again), once, and not on ordinary beats."""
    registry.register("e0", {})
    registry.mark_ready("e0", 10, 16, 128)
    restored = []
    beat = EngineHeartbeat(registry, "e0", ttl=5, interval=0.05, on_restored=lambda: restored.append(1)).start()
    try:
        time.sleep(0.3)
        assert restored == []
        redis_admin.flushdb()
        assert _eventually(lambda: restored == [1], timeout=3)
        time.sleep(0.3)
        assert restored == [1]
    finally:
        beat.stop()


def test_heartbeat_beats_on_for_the_new_incarnation_after_being_declared_dead(registry, redis_client, redis_keys):
    """Declared dead (paused past its TTL), the engine rejoins as a new incarnation from `on_declared_dead`;
    the heartbeat thread must survive that beat and keep the new incarnation alive."""
    registry.register("e0", {})
    registry.mark_ready("e0", 10, 16, 128)
    rejoined = []

    def rejoin():
        rejoined.append(registry.register("e0", {}))
        registry.mark_ready("e0", 10, 16, 128)

    beat = EngineHeartbeat(registry, "e0", ttl=0.3, interval=0.05, on_declared_dead=rejoin).start()
    try:
        redis_client.hset(redis_keys.engine("e0"), "state", EngineState.DEAD.value)  # as the coordinator does
        assert _eventually(lambda: len(rejoined) == 1)
        time.sleep(0.6)  # twice the TTL: only a live thread keeps the new incarnation's key
        assert redis_client.get(redis_keys.engine_alive("e0")) == rejoined[0].encode()
        assert [e["incarnation"] for e in registry.live_engines()] == rejoined
    finally:
        beat.stop()


def test_heartbeat_thread(registry):
    registry.register("e0", {})
    registry.mark_ready("e0", 10, 16, 128)
    beat = EngineHeartbeat(registry, "e0", ttl=0.3, interval=0.05).start()
    try:
        time.sleep(0.5)  # longer than the TTL: only the thread keeps it alive
        assert len(registry.ready_engines()) == 1
    finally:
        beat.stop()
    assert _eventually(lambda: registry.ready_engines() == [], timeout=3)


# --------------------------------------------------------------------------- reader


def test_reader_consumer_group_and_pending(redis_client, redis_keys):
    reader = RequestReader(redis_client, redis_keys, "e0")
    reader.reset()
    assert reader.read(block_ms=10) == []
    add_id = _xadd(redis_client, redis_keys, "e0", AddRequest("r1", "c", [1], SamplingParams(), 1.0))
    _xadd(redis_client, redis_keys, "e0", AbortRequests(["r0"], "c"))
    _xadd(redis_client, redis_keys, "e0", UtilityCall("u", "c", "get_stats", []))
    _xadd(redis_client, redis_keys, "e0", StartWave(3))
    redis_client.xadd(redis_keys.request_stream("e0"), {STREAM_FIELD: b"\xc1garbage"})
    redis_client.xadd(redis_keys.request_stream("e0"), {"wrong-field": b"x"})

    got = reader.read(block_ms=100, count=64)
    kinds = [type(m).__name__ for _, m in got]
    assert kinds == ["AddRequest", "AbortRequests", "UtilityCall", "StartWave"]
    # Only the ADD stays pending; everything else (including garbage) was acked and deleted.
    summary = reader.pending()
    assert summary["count"] == 1 and summary["min"] == add_id and summary["consumers"] == {"engine": 1}
    assert redis_client.xlen(redis_keys.request_stream("e0")) == 1
    assert reader.read(block_ms=10) == []  # nothing is delivered twice

    reader.ack([add_id])
    assert reader.pending()["count"] == 0
    assert redis_client.xlen(redis_keys.request_stream("e0")) == 0


def test_reader_count_and_block(redis_client, redis_keys):
    reader = RequestReader(redis_client, redis_keys, "e0")
    for i in range(5):
        _xadd(redis_client, redis_keys, "e0", AddRequest(f"r{i}", "c", [i], SamplingParams(), 1.0))
    assert len(reader.read(block_ms=10, count=3)) == 3  # lazily creates the group, reads from the start
    assert len(reader.read(block_ms=0, count=3)) == 2
    start = time.monotonic()
    assert reader.read(block_ms=150) == []
    assert 0.1 < time.monotonic() - start < 2


def test_reset_drops_old_requests(redis_client, redis_keys):
    _xadd(redis_client, redis_keys, "e0", AddRequest("old", "c", [1], SamplingParams(), 1.0))
    reader = RequestReader(redis_client, redis_keys, "e0")
    reader.reset()
    assert reader.read(block_ms=10) == []


def test_reader_recreates_group_after_flush(redis_client, redis_admin, redis_keys):
    reader = RequestReader(redis_client, redis_keys, "e0")
    reader.reset()
    redis_admin.flushdb()  # what a Redis restart looks like to the reader
    _xadd(redis_client, redis_keys, "e0", AddRequest("r1", "c", [1], SamplingParams(), 1.0))
    msgs = []
    for _ in range(3):
        msgs += reader.read(block_ms=50)
    assert [m.request_id for _, m in msgs] == ["r1"]


def test_reader_survives_unreachable_redis(redis_keys):
    dead = connect("redis://127.0.0.1:1/0", retries=0, connect_timeout=0.2)
    reader = RequestReader(dead, redis_keys, "e0", backoff_cap=0.05)
    start = time.monotonic()
    assert reader.read(block_ms=10) == []
    assert reader.read(block_ms=10) == []
    assert time.monotonic() - start < 2


# --------------------------------------------------------------------------- publisher


def test_publisher_one_pipeline_per_step(redis_client, redis_keys, registry):
    registry.register("e0", {})
    reader = RequestReader(redis_client, redis_keys, "e0")
    reader.reset()
    add_id = _xadd(redis_client, redis_keys, "e0", AddRequest("r1", "c1", [1], SamplingParams(), 1.0))
    reader.read(block_ms=10)
    assert reader.pending()["count"] == 1

    sub = redis_client.pubsub()
    sub.subscribe(redis_keys.output_channel("c1"))
    assert sub.get_message(timeout=1)["type"] == "subscribe"

    pub = OutputPublisher(redis_client, redis_keys, "e0")
    step = {
        "c1": EngineOutputs("e0", [RequestOutput("r1", 0, [9], "length", None, 1, 0, None, None)], 1.0),
        "gone": EngineOutputs("e0", [RequestOutput("r9", 0, [9], None, None, 1, 0, None, None)], 1.0),
    }
    receivers = pub.publish(step, ack_ids=[add_id], stats={"waiting": 0, "running": 1})
    assert receivers == {"c1": 1, "gone": 0}
    assert reader.pending()["count"] == 0
    assert registry.get("e0")["running"] == 1

    msg = sub.get_message(timeout=1)
    got = decode(msg["data"], expect=EngineOutputs)
    assert got.seq == 1 and got.outputs[0].new_token_ids == [9]
    pub.publish({"c1": EngineOutputs("e0", [], 2.0, [UtilityResult("u", 1, None)])})
    assert decode(sub.get_message(timeout=1)["data"]).seq == 2
    sub.close()


def test_unheard_clients_are_gone_only_without_a_heartbeat(redis_client, redis_keys, monkeypatch):
    """A client whose outputs reached no subscriber on the primary but whose heartbeat lives (resubscribing, or on
    a cluster subscribed on a replica, which relays SPUBLISH) keeps its requests; one without a heartbeat does not.
    A live one is asked about at most once per ALIVE_RECHECK."""
    from broker import engine_link

    pub = OutputPublisher(redis_client, redis_keys, "e0")
    redis_client.set(redis_keys.client_alive("alive"), b"host 1", px=10_000)
    receivers = {"alive": 0, "dead": 0, "heard": 1, "dropped": -1}
    assert pub.gone_clients(receivers) == ["dead"]
    redis_client.delete(redis_keys.client_alive("alive"))
    assert pub.gone_clients(receivers) == ["dead"]  # "alive" was found alive under a second ago: not asked again
    monkeypatch.setattr(engine_link, "ALIVE_RECHECK", 0.0)
    assert pub.gone_clients(receivers) == ["alive", "dead"]
    assert pub.gone_clients({"heard": 2, "dropped": -1}) == []


def test_publisher_replaces_unencodable_items(redis_client, redis_keys):
    sub = redis_client.pubsub()
    sub.subscribe(redis_keys.output_channel("c1"))
    sub.get_message(timeout=1)
    pub = OutputPublisher(redis_client, redis_keys, "e0")
    bad = EngineOutputs(
        "e0",
        [RequestOutput("r1", 0, [1], None, None, 1, 0, [[object(), 1, [], []]], None),
         RequestOutput("r2", 0, [2], None, None, 1, 0, None, None)],
        1.0,
        [UtilityResult("u", object(), None)],
    )  # fmt: skip
    assert pub.publish({"c1": bad}) == {"c1": 1}
    got = decode(sub.get_message(timeout=1)["data"])
    assert got.outputs[0].finish_reason is FinishReason.ERROR and got.outputs[0].error_code is ErrorCode.ENGINE_ERROR
    assert got.outputs[1].new_token_ids == [2]
    assert got.utility_results[0].error.startswith("engine_error")
    sub.close()


def test_publisher_drops_after_bounded_retries(redis_keys):
    dead = connect("redis://127.0.0.1:1/0", retries=1, connect_timeout=0.2, backoff_cap=0.05)
    pub = OutputPublisher(dead, redis_keys, "e0", attempts=2, backoff_cap=0.05)
    start = time.monotonic()
    out = pub.publish({"c1": EngineOutputs("e0", [], 1.0)}, ack_ids=["1-0"])
    assert out == {"c1": -1}
    assert time.monotonic() - start < 3


def test_stream_entries_are_plain_msgpack(redis_client, redis_keys):
    _xadd(redis_client, redis_keys, "e0", AbortRequests(["r"], "c"))
    [(_, fields)] = redis_client.xrange(redis_keys.request_stream("e0"))
    assert msgpack.unpackb(fields[STREAM_FIELD])["t"] == "abort"
    with pytest.raises(redis.ResponseError):
        redis_client.xpending(redis_keys.request_stream("e0"), "no-such-group")
