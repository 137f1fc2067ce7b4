"""BrokerClient end to end against a real Redis, with fake engines (tests/broker_fakes.py): requests,
utility calls, aborts and placement. Failures: tests/test_broker_client_failures.py; Redis outages:
tests/test_broker_client_outage.py; resuming: tests/test_broker_client_migration.py."""
# ruff: noqa: F811 - test parameters named after the fixtures imported from broker_fakes

from __future__ import annotations

import threading
import time

import pytest
from broker_fakes import FakeEngine, add, cluster, collect  # noqa: F401 - fixtures (see the top)
from stack_procs import poll

from broker.connection import connect
from broker.engine_link import EngineHeartbeat
from broker.errors import NoEngineAvailable, UtilityError
from broker.load_balance import write_lb_snapshot
from protocol.engine_load import EngineLoad
from protocol.messages import FinishReason

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
        poll(lambda eng=eng: eng.reader.pending()["count"] == 0, 5, f"{eng.engine_id} acked everything")


def test_n_greater_than_one_ends_after_every_index(cluster):
    cluster.engine("e0")
    client = cluster.client()
    outs = collect(client.submit(add(first_token=3, n=2, max_tokens=3)))
    assert sorted((o.index, o.new_token_ids[0]) for o in outs) == [(i, 3000 + k) for i in (0, 1) for k in (1, 2, 3)]
    assert {o.index for o in outs if o.finish_reason is FinishReason.LENGTH} == {0, 1}
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
    assert handle.get(timeout=1).finish_reason is FinishReason.ABORT
    assert handle.finished and handle.get(timeout=0) is None
    poll(lambda: handle.request_id in e1.aborts, 5, "the ABORT on e1")
    assert handle.request_id not in e0.aborts and handle.request_id not in e0.adds
    poll(lambda: e1.reader.pending()["count"] == 0, 5, "e1 acked the aborted request")


def test_close_aborts_a_running_request(cluster):
    eng = cluster.engine("e0")
    client = cluster.client()
    with client.submit(add(max_tokens=100, stall_after=1)) as handle:
        assert handle.get(timeout=5) is not None
    poll(lambda: handle.request_id in eng.aborts, 5, "the ABORT sent by close()")
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
    assert collect(client.submit(add()))[-1].finish_reason is FinishReason.LENGTH


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
