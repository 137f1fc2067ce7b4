"""BrokerClient end to end against a real Redis, with fake engines built on engine_link."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import defaultdict

import pytest

from broker.client import BrokerClient
from broker.connection import connect
from broker.engine_link import EngineHeartbeat, EngineRegistry, OutputPublisher, RequestReader
from broker.errors import BrokerUnavailable, NoEngineAvailable, UtilityError
from broker.load_balance import EngineLoad, write_lb_snapshot
from broker.messages import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    RequestOutput,
    UtilityCall,
    UtilityResult,
    encode,
    error_code,
)
from broker.redis_server import EmbeddedRedis


def eventually(predicate, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class FakeEngine:
    """Stands in for an engine process: every step gives each running sequence one token.

    Token k (1-based) of a request is prompt_token_ids[0] * 1000 + k. Params: max_tokens (default
    4), n, and stall_after (stop producing after that many tokens, to keep a request in flight).
    Utility methods: echo(*args) -> args, fail() -> error, stats() -> {"running": ...}.
    """

    def __init__(self, url, keys, engine_id, ttl=1.0, step_delay=0.002):
        self.engine_id = engine_id
        self.redis = connect(url, backoff_cap=0.1)
        self.registry = EngineRegistry(self.redis, keys)
        self.reader = RequestReader(self.redis, keys, engine_id, backoff_cap=0.1)
        self.publisher = OutputPublisher(self.redis, keys, engine_id, backoff_cap=0.1)
        self.heartbeat = EngineHeartbeat(self.registry, engine_id, ttl=ttl, interval=ttl / 10)
        self.step_delay = step_delay
        self.go = threading.Event()
        self.go.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.running: dict[str, dict] = {}
        self.utility: dict[str, list[UtilityResult]] = defaultdict(list)
        self.adds: list[str] = []
        self.aborts: list[str] = []

    def start(self, ready=True):
        self.reader.reset()
        self.registry.register(self.engine_id, {"dp_rank": 0, "tp": 1, "model": "fake"})
        self.heartbeat.start()
        if ready:
            self.registry.mark_ready(self.engine_id, num_kv_blocks=100, block_size=16, max_model_len=1024)
        self._thread.start()
        return self

    def crash(self):
        """Stop everything without deregistering: the heartbeat key will expire."""
        self._stop.set()
        self.heartbeat.stop()
        if self._thread.is_alive():
            self._thread.join()

    def stop(self):
        self.crash()
        with contextlib.suppress(Exception):
            self.registry.deregister(self.engine_id)
        self.redis.close()

    def _loop(self):
        while not self._stop.is_set():
            busy = bool(self.running) and self.go.is_set()
            for msg_id, msg in self.reader.read(block_ms=0 if busy else 20):
                self._handle(msg_id, msg)
            if (busy and self.running) or self.utility:
                self._step()

    def _handle(self, msg_id, msg):
        if isinstance(msg, AddRequest):
            if msg.request_id in self.running:
                return
            self.adds.append(msg.request_id)
            n = msg.params.get("n", 1)
            self.running[msg.request_id] = {"msg_id": msg_id, "add": msg, "made": [0] * n, "done": set()}
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self.aborts.append(rid)
                state = self.running.pop(rid, None)
                if state is not None:
                    self.reader.ack([state["msg_id"]])
        elif isinstance(msg, UtilityCall):
            if msg.method == "echo":
                result = UtilityResult(msg.call_id, msg.args, None)
            elif msg.method == "stats":
                result = UtilityResult(msg.call_id, {"running": len(self.running)}, None)
            else:
                result = UtilityResult(msg.call_id, None, f"no such method {msg.method!r}")
            self.utility[msg.client_id].append(result)

    def _step(self):
        outputs: dict[str, list[RequestOutput]] = defaultdict(list)
        acks = []
        for rid, st in list(self.running.items()) if self.go.is_set() else []:
            add = st["add"]
            max_tokens = add.params.get("max_tokens", 4)
            stall = add.params.get("stall_after")
            for i, made in enumerate(st["made"]):
                if i in st["done"] or (stall is not None and made >= stall):
                    continue
                made = st["made"][i] = made + 1
                finish = "length" if made >= max_tokens else None
                if finish:
                    st["done"].add(i)
                token = add.prompt_token_ids[0] * 1000 + made
                outputs[add.client_id].append(RequestOutput(rid, i, [token], finish, None, len(add.prompt_token_ids), 0))
            if len(st["done"]) == len(st["made"]):
                acks.append(st["msg_id"])
                del self.running[rid]
        clients = set(outputs) | set(self.utility)
        step = {c: EngineOutputs(self.engine_id, outputs[c], time.time(), self.utility.pop(c, [])) for c in clients}
        if step or acks:
            self.publisher.publish(step, acks, {"running": len(self.running)})
        time.sleep(self.step_delay)


@pytest.fixture
def cluster(redis_url, redis_keys):
    """Start fake engines and clients; everything is stopped after the test."""
    made = {"engines": [], "clients": []}

    class Cluster:
        url, keys = redis_url, redis_keys

        def engine(self, engine_id, **kw):
            ready = kw.pop("ready", True)
            eng = FakeEngine(redis_url, redis_keys, engine_id, **kw).start(ready=ready)
            made["engines"].append(eng)
            return eng

        def client(self, **kw):
            opts = dict(heartbeat_ttl=2.0, engine_refresh=0.05, liveness_interval=0.1, subscribe_timeout=3.0) | kw
            client = BrokerClient(redis_url, redis_keys, **opts)
            made["clients"].append(client)
            assert client.wait_subscribed(5)
            return client

    yield Cluster()
    for client in made["clients"]:
        client.stop()
    for eng in made["engines"]:
        eng.stop()


def add(first_token=1, deadline_in=None, **params):
    deadline = None if deadline_in is None else time.time() + deadline_in
    return AddRequest(uuid.uuid4().hex, "", [first_token, 7, 7], params, time.time(), deadline)


def collect(handle, timeout=5.0):
    outs = []
    end = time.monotonic() + timeout
    while not handle.finished:
        out = handle.get(timeout=max(0.0, end - time.monotonic()))
        if out is None:
            raise AssertionError(f"request {handle.request_id} timed out; got {outs}")
        outs.append(out)
    return outs


# --------------------------------------------------------------------------- happy paths


def test_end_to_end_two_engines_many_threads(cluster):
    engines = [cluster.engine("e0"), cluster.engine("e1")]
    client = cluster.client()
    results: dict[int, list[int]] = {}
    used: dict[int, str] = {}

    def run(i):
        with client.submit(add(first_token=i, max_tokens=5)) as handle:
            used[i] = handle.engine_id
            results[i] = [t for out in collect(handle) for t in out.new_token_ids]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, 25)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {i: [i * 1000 + k for k in range(1, 6)] for i in range(1, 25)}
    assert set(used.values()) == {"e0", "e1"}
    assert client.in_flight() == 0
    for eng in engines:  # every finished request was acked: pending lists are empty
        assert eventually(lambda eng=eng: eng.reader.pending()["count"] == 0)


def test_n_greater_than_one_ends_after_every_index(cluster):
    cluster.engine("e0")
    client = cluster.client()
    outs = collect(client.submit(add(first_token=3, n=2, max_tokens=3)))
    assert sorted((o.index, o.new_token_ids[0]) for o in outs) == [(i, 3000 + k) for i in (0, 1) for k in (1, 2, 3)]
    assert {o.index for o in outs if o.finish_reason == "length"} == {0, 1}
    assert outs[-1].finished


def test_iterating_a_handle(cluster):
    cluster.engine("e0")
    client = cluster.client()
    handle = client.submit(add(first_token=2, max_tokens=3, deadline_in=5))
    assert [o.new_token_ids[0] for o in handle] == [2001, 2002, 2003]
    assert handle.get(timeout=0) is None


def test_utility_calls(cluster):
    cluster.engine("e0")
    client = cluster.client()
    assert client.call_utility("e0", "echo", [1, "two"], timeout=5) == [1, "two"]
    with pytest.raises(UtilityError, match="no such method"):
        client.call_utility("e0", "explode", timeout=5)
    with pytest.raises(NoEngineAvailable):
        client.call_utility("nope", "echo")


def test_utility_call_times_out(cluster):
    eng = cluster.engine("e0")
    eng.crash()
    eng.heartbeat = EngineHeartbeat(eng.registry, "e0", ttl=1.0, interval=0.1).start()  # alive but deaf
    client = cluster.client()
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        client.call_utility("e0", "echo", timeout=0.3)
    assert time.monotonic() - start < 2
    eng.heartbeat.stop()


# --------------------------------------------------------------------------- abort, placement


def test_abort_is_routed_to_the_owning_engine(cluster):
    e0, e1 = cluster.engine("e0"), cluster.engine("e1")
    client = cluster.client()
    handle = client.submit(add(max_tokens=100, stall_after=1), engine_id="e1")
    assert handle.engine_id == "e1"
    first = handle.get(timeout=5)
    assert first.new_token_ids == [1001]
    handle.abort()
    handle.abort()  # idempotent
    assert handle.get(timeout=1).finish_reason == "abort"
    assert handle.finished and handle.get(timeout=0) is None
    assert eventually(lambda: handle.request_id in e1.aborts)
    assert handle.request_id not in e0.aborts and handle.request_id not in e0.adds
    assert eventually(lambda: e1.reader.pending()["count"] == 0)


def test_close_aborts_a_running_request(cluster):
    eng = cluster.engine("e0")
    client = cluster.client()
    with client.submit(add(max_tokens=100, stall_after=1)) as handle:
        assert handle.get(timeout=5) is not None
    assert eventually(lambda: handle.request_id in eng.aborts)
    assert client.in_flight() == 0


def test_load_balancing_picks_least_loaded(cluster):
    cluster.engine("e0")
    cluster.engine("e1")
    client = cluster.client()
    now = time.time()
    snapshot = {"e0": EngineLoad(waiting=2, running=3, ts=now), "e1": EngineLoad(waiting=0, running=1, ts=now)}
    write_lb_snapshot(connect(cluster.url), cluster.keys, snapshot)
    client.selector.refresh()
    # e0 scores 11; e1 scores 1, then 5, 9 as this client's own requests count as waiting, then 13.
    placed = [client.submit(add(max_tokens=100, stall_after=0)).engine_id for _ in range(4)]
    assert placed == ["e1", "e1", "e1", "e0"]


def test_no_engine_available(cluster):
    client = cluster.client()
    with pytest.raises(NoEngineAvailable):
        client.submit(add())
    cluster.engine("starting", ready=False)
    with pytest.raises(NoEngineAvailable):
        client.submit(add())
    with pytest.raises(NoEngineAvailable):
        client.submit(add(), engine_id="starting")
    assert client.in_flight() == 0
    cluster.engine("e0")
    assert collect(client.submit(add()))[-1].finish_reason == "length"


def test_duplicate_and_foreign_ids_are_rejected(cluster):
    cluster.engine("e0")
    client = cluster.client()
    req = add(max_tokens=100, stall_after=0)
    client.submit(req)
    with pytest.raises(ValueError, match="already in flight"):
        client.submit(req)
    other = add()
    other.client_id = "someone-else"
    with pytest.raises(ValueError, match="client_id"):
        client.submit(other)


# --------------------------------------------------------------------------- failures


def test_deadline_ends_a_stuck_request(cluster):
    eng = cluster.engine("e0")
    client = cluster.client()
    start = time.monotonic()
    handle = client.submit(add(max_tokens=100, stall_after=0, deadline_in=0.3))
    outs = list(handle)
    assert 0.25 < time.monotonic() - start < 2
    assert error_code(outs[-1].error) == "deadline_exceeded" and outs[-1].finish_reason == "error"
    assert eventually(lambda: handle.request_id in eng.aborts)


def test_deadline_is_enforced_without_a_reader(cluster):
    cluster.engine("e0")
    client = cluster.client()
    handle = client.submit(add(max_tokens=100, stall_after=0, deadline_in=0.2))
    assert eventually(lambda: client.in_flight() == 0, timeout=3)  # the maintenance thread expired it
    assert error_code(handle.get(timeout=0).error) == "deadline_exceeded"


def test_unstarted_request_moves_to_a_live_engine_when_its_engine_dies(cluster):
    e0 = cluster.engine("e0", ttl=0.4)
    cluster.engine("e1")
    client = cluster.client()
    e0.go.clear()  # e0 accepts requests but produces nothing
    handle = client.submit(add(first_token=5, max_tokens=3), engine_id="e0")
    assert eventually(lambda: handle.request_id in e0.adds)
    e0.crash()
    outs = collect(handle, timeout=5)
    assert handle.engine_id == "e1"
    assert [o.new_token_ids[0] for o in outs] == [5001, 5002, 5003]


def test_started_request_fails_when_its_engine_dies(cluster):
    e0 = cluster.engine("e0", ttl=0.4)
    cluster.engine("e1")
    client = cluster.client(max_migrations=0)  # resuming: tests/test_broker_client_migration.py
    handle = client.submit(add(max_tokens=100, stall_after=1), engine_id="e0")
    assert handle.get(timeout=5).new_token_ids == [1001]
    e0.crash()
    last = handle.get(timeout=5)
    assert error_code(last.error) == "engine_gone" and handle.finished


def _fake_ready_engine(cluster, engine_id="e0"):
    registry = EngineRegistry(connect(cluster.url), cluster.keys)
    registry.register(engine_id, {})
    registry.mark_ready(engine_id, 10, 16, 128)
    return EngineHeartbeat(registry, engine_id, ttl=2.0, interval=0.2).start()


def test_duplicates_are_dropped_and_gaps_fail_requests(cluster):
    beat = _fake_ready_engine(cluster)
    client = cluster.client()
    handle = client.submit(add(max_tokens=10), engine_id="e0")
    r = connect(cluster.url)
    channel = cluster.keys.output_channel(client.client_id)

    def send(seq, token):
        outs = EngineOutputs("e0", [RequestOutput(handle.request_id, 0, [token])], time.time(), seq=seq)
        assert r.publish(channel, encode(outs)) == 1

    send(1, 11)
    send(1, 11)  # a retried PUBLISH
    r.publish(channel, b"garbage")  # dropped; the listener survives
    send(2, 12)
    send(4, 14)  # seq 3 was lost
    outs = collect(handle, timeout=3)
    assert [o.new_token_ids for o in outs[:2]] == [[11], [12]]
    assert error_code(outs[2].error) == "output_lost" and len(outs) == 3
    beat.stop()


def test_client_heartbeat_and_stop(cluster):
    beat = _fake_ready_engine(cluster)
    client = cluster.client()
    r = connect(cluster.url)
    alive = cluster.keys.client_alive(client.client_id)
    assert eventually(lambda: r.exists(alive))
    assert 0 < r.pttl(alive) <= 2000
    assert r.sismember(cluster.keys.clients(), client.client_id)
    handle = client.submit(add(), engine_id="e0")
    client.stop()
    client.stop()
    assert error_code(handle.get(timeout=1).error) == "broker_disconnected"
    assert not r.exists(alive) and not r.sismember(cluster.keys.clients(), client.client_id)
    with pytest.raises(RuntimeError, match="stopped"):
        client.submit(add())
    beat.stop()


def test_client_refuses_use_after_fork(cluster, monkeypatch):
    client = cluster.client()
    real_pid = client._pid
    monkeypatch.setattr("broker.client.os.getpid", lambda: real_pid + 1)
    with pytest.raises(RuntimeError, match="another process"):
        client.submit(add())


def test_redis_restart_mid_stream(redis_keys):
    with EmbeddedRedis() as server:
        engine = FakeEngine(server.url, redis_keys, "e0", ttl=1.0).start()
        client = BrokerClient(server.url, redis_keys, engine_refresh=0.05, liveness_interval=0.1, subscribe_timeout=5)
        try:
            assert client.wait_subscribed(5)
            assert [o.new_token_ids[0] for o in collect(client.submit(add(max_tokens=2)))] == [1001, 1002]

            stuck = client.submit(add(first_token=2, max_tokens=100, stall_after=1, deadline_in=20))
            assert stuck.get(timeout=5).new_token_ids == [2001]
            start = time.monotonic()
            server.restart()
            last = stuck.get(timeout=10)
            assert error_code(last.error) == "broker_disconnected" and stuck.finished
            assert time.monotonic() - start < 5  # ended on the disconnect, not on its 20 s deadline

            # Reconnected: the engine restored its registration and group, the client resubscribed.
            assert client.wait_subscribed(5)
            assert eventually(lambda: len(client.ready_engines()) == 1, timeout=10)
            outs = collect(client.submit(add(first_token=3, max_tokens=3)), timeout=10)
            assert [o.new_token_ids[0] for o in outs] == [3001, 3002, 3003]
            assert eventually(lambda: stuck.request_id in engine.aborts)  # the deferred ABORT was sent
        finally:
            client.stop()
            engine.stop()


def test_redis_down_fails_fast_and_nothing_hangs(redis_keys):
    with EmbeddedRedis() as server:
        engine = FakeEngine(server.url, redis_keys, "e0", ttl=1.0).start()
        client = BrokerClient(server.url, redis_keys, engine_refresh=0.05, liveness_interval=0.1, subscribe_timeout=0.5,
                              replace_wait=1.0)
        try:
            assert client.wait_subscribed(5)
            # no output yet: it waits for Redis to come back (to be sent again), but no longer than replace_wait
            stuck = client.submit(add(max_tokens=100, stall_after=0, deadline_in=30))
            server.stop()
            assert error_code(stuck.get(timeout=5).error) == "broker_disconnected"
            start = time.monotonic()
            with pytest.raises(BrokerUnavailable):
                client.submit(add())
            assert time.monotonic() - start < 5
        finally:
            client.stop()
            engine.stop()
