"""BrokerClient failures against a real Redis, with fake engines (tests/broker_fakes.py): deadlines, dead
engines, lost and duplicate output messages, stopping, use after fork."""
# ruff: noqa: F811 - test parameters named after the fixtures imported from broker_fakes

from __future__ import annotations

import os
import time

import pytest
from broker_fakes import add, cluster, collect, fake_ready_engine  # noqa: F401 - fixtures (see the top)
from stack_procs import poll

from broker.connection import connect
from protocol.messages import EngineOutputs, ErrorCode, FinishReason, RequestOutput, encode

# --------------------------------------------------------------------------- failures


def test_deadline_ends_a_stuck_request(cluster):
    eng = cluster.engine("e0")
    client = cluster.client()
    start = time.monotonic()
    handle = client.submit(add(max_tokens=100, stall_after=0, deadline_in=0.3))
    outs = list(handle)
    assert 0.25 < time.monotonic() - start < 2
    assert outs[-1].error_code is ErrorCode.DEADLINE_EXCEEDED and outs[-1].finish_reason is FinishReason.ERROR
    poll(lambda: handle.request_id in eng.aborts, 5, "the ABORT of the expired request")


def test_deadline_is_enforced_without_a_reader(cluster):
    cluster.engine("e0")
    client = cluster.client()
    handle = client.submit(add(max_tokens=100, stall_after=0, deadline_in=0.2))
    poll(lambda: client.in_flight() == 0, 3, "the maintenance thread expiring the request")
    assert handle.get(timeout=0).error_code is ErrorCode.DEADLINE_EXCEEDED


def test_unstarted_request_moves_to_a_live_engine_when_its_engine_dies(cluster):
    e0 = cluster.engine("e0", ttl=0.4)
    cluster.engine("e1")
    client = cluster.client()
    e0.go.clear()  # e0 accepts requests but produces nothing
    handle = client.submit(add(first_token=5, max_tokens=3), engine_id="e0")
    poll(lambda: handle.request_id in e0.adds, 5, "e0 reading the ADD")
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
    assert last.error_code is ErrorCode.ENGINE_GONE and handle.finished


def test_duplicates_are_dropped_and_gaps_fail_requests(cluster):
    beat = fake_ready_engine(cluster)
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
    assert outs[2].error_code is ErrorCode.OUTPUT_LOST and len(outs) == 3
    beat.stop()


def test_client_heartbeat_and_stop(cluster):
    beat = fake_ready_engine(cluster)
    client = cluster.client()
    r = connect(cluster.url)
    alive = cluster.keys.client_alive(client.client_id)
    poll(lambda: r.exists(alive), 5, "the client heartbeat key")
    assert 0 < r.pttl(alive) <= 2000
    assert r.sismember(cluster.keys.clients(), client.client_id)
    handle = client.submit(add(), engine_id="e0")
    client.stop()
    client.stop()
    assert handle.get(timeout=1).error_code is ErrorCode.BROKER_DISCONNECTED
    assert not r.exists(alive) and not r.sismember(cluster.keys.clients(), client.client_id)
    with pytest.raises(RuntimeError, match="stopped"):
        client.submit(add())
    beat.stop()


def test_client_refuses_use_after_fork(cluster, monkeypatch):
    client = cluster.client()
    real_pid = os.getpid()  # the client was started here
    monkeypatch.setattr("broker.client.client.os.getpid", lambda: real_pid + 1)
    with pytest.raises(RuntimeError, match="another process"):
        client.submit(add())
