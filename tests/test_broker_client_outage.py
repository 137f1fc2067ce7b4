"""BrokerClient when Redis restarts or goes away (a Redis of the test's own, `EmbeddedRedis`), with a fake
engine (tests/broker_fakes.py): requests end instead of hanging, and the client recovers."""

from __future__ import annotations

import time

import pytest
from broker_fakes import FakeEngine, add, collect
from stack_procs import poll

from broker.client import BrokerClient
from broker.errors import BrokerUnavailable
from protocol.messages import ErrorCode
from protocol.sampling_params import SamplingParams
from redserve.redis_server import EmbeddedRedis


def test_redis_restart_mid_stream(redis_keys):
    """A started request that may not be resumed (max_migrations=0 here; the fake engine's params would not
    resume anyway) ends with broker_disconnected on the restart; resumable ones are covered by
    test_api_redis_restart.py and test_redis_sentinel.py with a real engine."""
    with EmbeddedRedis() as server:
        engine = FakeEngine(server.url, redis_keys, "e0", ttl=1.0).start()
        client = BrokerClient(server.url, redis_keys, engine_refresh=0.05, liveness_interval=0.1, subscribe_timeout=5,
                              max_migrations=0)
        try:
            assert client.wait_subscribed(5)
            assert [o.new_token_ids[0] for o in collect(client.submit(add(max_tokens=2)))] == [1001, 1002]

            stuck = client.submit(add(first_token=2, max_tokens=100, stall_after=1, deadline_in=20))
            assert stuck.get(timeout=5).new_token_ids == [2001]
            start = time.monotonic()
            server.restart()
            last = stuck.get(timeout=10)
            assert last.error_code is ErrorCode.BROKER_DISCONNECTED and stuck.finished
            assert time.monotonic() - start < 5  # ended on the disconnect, not on its 20 s deadline

            # Reconnected: the engine restored its registration and group, the client resubscribed.
            assert client.wait_subscribed(5)
            poll(lambda: len(client.ready_engines()) == 1, 10, "the engine READY again")
            outs = collect(client.submit(add(first_token=3, max_tokens=3)), timeout=10)
            assert [o.new_token_ids[0] for o in outs] == [3001, 3002, 3003]
            poll(lambda: stuck.request_id in engine.aborts, 5, "the deferred ABORT")
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
            assert stuck.get(timeout=5).error_code is ErrorCode.BROKER_DISCONNECTED
            start = time.monotonic()
            with pytest.raises(BrokerUnavailable):
                client.submit(add())
            assert time.monotonic() - start < 5
        finally:
            client.stop()
            engine.stop()


def test_no_presence_verdict_while_engines_resubscribe_after_an_outage():
    """Right after the client's subscription comes back, the engines' presence channels may still be empty
    (their subscriptions were cut too): that must not declare them gone (their re-sent requests would fail)."""
    from broker.client.client import ClientSettings
    from broker.client.in_flight import InFlightTable
    from broker.client.liveness import PRESENCE_GRACE, Maintenance
    from broker.client.mailbox import Mailbox
    from broker.client.sender import Sender
    from broker.keys import RedisKeys
    from protocol.messages import AddRequest

    class NoSubscribers:
        def pubsub_numsub(self, *channels):
            return [(channel, 0) for channel in channels]

    class Engines:
        def live_engines(self, max_age=None):
            return {"e0": {"engine_id": "e0", "incarnation": "i0", "presence": 1}}

    table = InFlightTable("c", placed=lambda e: None, released=lambda e: None)
    table.set_subscribed(True)
    assert table.register(Mailbox(add=AddRequest("r", "c", [1], SamplingParams(max_tokens=4), 0.0), engine_id="e0",
                                  incarnation="i0", n=1))
    redis_client = NoSubscribers()
    maintenance = Maintenance(table, Engines(), Sender("c", RedisKeys(), table, lambda: redis_client),
                              lambda: redis_client, ClientSettings())
    table.lose_subscription(resubmit_limit=1)
    table.set_subscribed(True)
    maintenance.check_presence()
    maintenance.check_presence()
    assert table.gone_engines() == []
    table._resubscribed_at -= PRESENCE_GRACE  # the grace is over: two empty reads mean the engine died
    maintenance.check_presence()
    maintenance.check_presence()
    assert table.gone_engines() == ["e0"]
