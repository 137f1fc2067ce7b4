"""BrokerClient resumes started requests on another engine (`broker.client.migration`): real Redis, fake
engines that continue a sequence from its prompt, so a continuation is checked token by token."""
# ruff: noqa: F811 - test parameters named after the fixtures imported from broker_fakes

from __future__ import annotations

import threading
import time

import pytest
from broker_fakes import add, cluster, collect, engines  # noqa: F401 - fixtures (see the top)
from stack_procs import poll

from broker.engine_presence import EnginePresence
from broker.errors import NoEngineAvailable
from protocol.messages import (
    EngineOutputs,
    ErrorCode,
    FinishReason,
    RequestOutput,
)


def _tokens(outs, index=0):
    return [t for o in outs if o.index == index for t in o.new_token_ids]


def _started(handle, count):
    """Read `count` outputs (the request is under way)."""
    return [handle.get(timeout=5) for _ in range(count)]


def test_a_started_request_continues_on_another_engine_when_its_heartbeat_expires(cluster, engines):
    e0, e1 = engines("e0", ttl=0.4, step_delay=0.05), engines("e1")
    moves = []
    client = cluster.client(on_migration=lambda *move: moves.append(move))
    handle = client.submit(add(first_token=2, max_tokens=6, temperature=0, min_tokens=4), engine_id="e0")
    outs = _started(handle, 2)
    e0.hold()
    e0.crash()
    outs += collect(handle, timeout=10)
    assert _tokens(outs) == [2001, 2002, 2003, 2004, 2005, 2006]
    assert [o.finish_reason for o in outs] == [None] * 5 + ["length"]
    assert {o.request_id for o in outs} == {handle.request_id} and handle.migrations == 1
    assert (handle.engine_id, moves) == ("e1", [("heartbeat_expired", "e0", "e1")])
    cont = e1.received[f"{handle.request_id}~m1"]
    assert cont.prompt_token_ids == [2, 7, 7, 2001, 2002]
    assert (cont.params.max_tokens, cont.params.min_tokens, cont.params.n) == (4, 2, 1)
    assert client.in_flight() == 0


def test_a_killed_engine_is_seen_by_its_presence_long_before_its_heartbeat_expires(cluster, engines):
    e0, _ = engines("e0", ttl=30.0, step_delay=0.05, presence=True), engines("e1", presence=True)
    moves = []
    client = cluster.client(liveness_interval=5.0, on_migration=lambda *move: moves.append(move))
    handle = client.submit(add(first_token=3, max_tokens=5, temperature=0), engine_id="e0")
    outs = _started(handle, 1)
    e0.hold()
    crashed = time.monotonic()
    e0.crash()
    outs += collect(handle, timeout=10)
    assert time.monotonic() - crashed < 3.0  # the heartbeat would have taken 30 s, the liveness check 5 s
    assert _tokens(outs) == [3001, 3002, 3003, 3004, 3005]
    assert moves == [("engine_exited", "e0", "e1")]
    # new requests avoid the engine as soon as it is declared gone, before its registration lapses
    assert all(client.submit(add(max_tokens=1)).engine_id == "e1" for _ in range(4))


def test_every_running_sequence_of_n_continues_on_its_own(cluster, engines):
    e0, e1 = engines("e0", ttl=0.4, step_delay=0.05), engines("e1")
    client = cluster.client()
    handle = client.submit(add(first_token=4, n=2, max_tokens=4, temperature=0), engine_id="e0")
    outs = _started(handle, 2)
    e0.hold()
    e0.crash()
    outs += collect(handle, timeout=10)
    assert _tokens(outs, 0) == [4001, 4002, 4003, 4004] and _tokens(outs, 1) == [4101, 4102, 4103, 4104]
    assert {o.index for o in outs if o.finish_reason is FinishReason.LENGTH} == {0, 1}
    assert sorted(e1.received) == [f"{handle.request_id}~m1.0", f"{handle.request_id}~m1.1"]
    assert {o.request_id for o in outs} == {handle.request_id}


def test_a_sequence_the_caller_stopped_is_not_continued(cluster, engines):
    e0, e1 = engines("e0", ttl=0.4, step_delay=0.05), engines("e1")
    client = cluster.client()
    handle = client.submit(add(first_token=5, n=2, max_tokens=4, temperature=0), engine_id="e0")
    outs = _started(handle, 2)
    e0.hold()
    handle.abort_sequence(1)  # a stop string ended choice 1
    e0.crash()
    outs += collect(handle, timeout=10)
    assert _tokens(outs, 0)[-1] == 5004
    assert [o.finish_reason for o in outs if o.index == 1 and o.finish_reason] == [FinishReason.ABORT]
    assert list(e1.received) == [f"{handle.request_id}~m1.0"]


def test_a_request_moves_at_most_max_migrations_times(cluster, engines):
    e0, e1 = engines("e0", ttl=0.4, step_delay=0.05), engines("e1", ttl=0.4, step_delay=0.05)
    client = cluster.client(max_migrations=1)
    handle = client.submit(add(first_token=6, max_tokens=50, temperature=0), engine_id="e0")
    _started(handle, 1)
    e0.hold()
    e0.crash()
    poll(lambda: handle.engine_id == "e1" and e1.running, 5, "the request running on e1")
    assert handle.get(timeout=5).new_token_ids  # e1 produces
    e1.hold()
    e1.crash()
    outs = collect(handle, timeout=10)
    assert outs[-1].error_code is ErrorCode.ENGINE_GONE
    assert "moved 1 time(s) already (--max-migrations 1)" in outs[-1].error_message


def test_a_request_the_caller_closed_is_not_resumed(cluster, engines, monkeypatch):
    e0, e1 = engines("e0", ttl=0.4, step_delay=0.05), engines("e1")
    moves = []
    client = cluster.client(on_migration=lambda *move: moves.append(move))
    handle = client.submit(add(first_token=7, max_tokens=50, temperature=0), engine_id="e0")
    _started(handle, 1)
    e0.hold()
    handle.close()  # the HTTP client went away
    checks = _liveness_checks_without(client, "e0", monkeypatch)
    e0.crash()
    poll(lambda: checks["done"] >= 2, 5, "two whole liveness checks after e0's heartbeat expired")
    assert not moves and not e1.received and client.in_flight() == 0


def _liveness_checks_without(client, engine_id, monkeypatch) -> dict[str, int]:
    """Counts the client's liveness checks that found `engine_id` gone (checks["done"]): once it is 2, the
    first of them has finished whatever it did about that engine's requests (the checks run one by one)."""
    checks = {"done": 0}
    collect_orphans = client.table.collect_orphans

    def counting(live, *args):
        orphans = collect_orphans(live, *args)
        checks["done"] += engine_id not in live
        return orphans
    monkeypatch.setattr(client.table, "collect_orphans", counting)
    return checks


def test_a_dead_tp_worker_engine_failed_output_resumes_the_request(cluster, engines):
    e0, _ = engines("e0", step_delay=0.05), engines("e1")
    moves = []
    client = cluster.client(on_migration=lambda *move: moves.append(move))
    handle = client.submit(add(first_token=8, max_tokens=5, temperature=0), engine_id="e0")
    outs = _started(handle, 2)
    e0.hold()
    failed = RequestOutput.failure(handle.request_id, ErrorCode.ENGINE_FAILED, "worker died")
    e0.publisher.publish({client.client_id: EngineOutputs("e0", [failed], time.time())}, [], None)
    outs += collect(handle, timeout=10)
    assert _tokens(outs) == [8001, 8002, 8003, 8004, 8005] and outs[-1].error_code is None
    assert moves == [("engine_failed", "e0", "e1")]


def test_an_engine_failed_request_that_cannot_move_ends_with_the_engines_error(cluster, engines):
    e0 = engines("e0", step_delay=0.05)
    client = cluster.client(max_migrations=0)
    handle = client.submit(add(first_token=9, max_tokens=50, temperature=0), engine_id="e0")
    _started(handle, 1)
    e0.hold()
    failed = RequestOutput.failure(handle.request_id, ErrorCode.ENGINE_FAILED, "worker died")
    e0.publisher.publish({client.client_id: EngineOutputs("e0", [failed], time.time())}, [], None)
    last = collect(handle, timeout=10)[-1]
    assert last.error_code is ErrorCode.ENGINE_FAILED and last.error_message == "worker died"


def test_an_engine_whose_presence_comes_back_is_used_again(cluster, engines):
    e0 = engines("e0", ttl=30.0, step_delay=0.05, presence=True)
    client = cluster.client(liveness_interval=5.0)
    handle = client.submit(add(first_token=1, max_tokens=40, temperature=0), engine_id="e0")
    outs = _started(handle, 1)
    e0.presence.stop()  # its connection dropped (a Redis restart), the process lives on
    poll(lambda: "e0" in client.table.gone_engines(), 5, "e0 declared gone")
    with pytest.raises(NoEngineAvailable):
        client.submit(add(max_tokens=1))
    e0.presence = EnginePresence(cluster.url, cluster.keys, "e0", lambda: e0.incarnation).start()
    poll(lambda: not client.table.gone_engines(), 5, "the verdict on e0 withdrawn")
    assert collect(client.submit(add(first_token=2, max_tokens=2)))[-1].finish_reason is FinishReason.LENGTH
    outs += collect(handle, timeout=10)
    assert _tokens(outs) == [1000 + k for k in range(1, 41)] and handle.migrations == 0


def test_an_engine_that_fails_and_deregisters_at_once_counts_as_failed(cluster, engines, monkeypatch):
    """The engine_failed outputs and the deregistration reach the client before its next liveness check:
    the move is still reported as engine_failed (the registry catching up must not erase why)."""
    e0, _ = engines("e0", step_delay=0.05), engines("e1")
    moves = []
    client = cluster.client(on_migration=lambda *move: moves.append(move), liveness_interval=30.0)
    handle = client.submit(add(first_token=8, max_tokens=5, temperature=0), engine_id="e0")
    outs = _started(handle, 2)
    e0.hold()
    landed = threading.Event()  # the outputs reach the client only after the deregistration
    deliver = client.table.deliver
    monkeypatch.setattr(client.table, "deliver", lambda outs: (landed.wait(10), deliver(outs)))
    failed = RequestOutput.failure(handle.request_id, ErrorCode.ENGINE_FAILED, "worker died")
    e0.publisher.publish({client.client_id: EngineOutputs("e0", [failed], time.time())}, [], None)
    e0.stop()  # deregisters
    landed.set()
    outs += collect(handle, timeout=10)
    assert _tokens(outs) == [8001, 8002, 8003, 8004, 8005] and outs[-1].error_code is None
    assert moves == [("engine_failed", "e0", "e1")]


def test_a_request_resumed_as_n_continuations_moves_once_when_its_new_engine_dies(cluster, engines):
    """After a first move an n=2 request sits under two continuation ids; when their engine dies too, the
    request moves once more, as one request (not once per continuation), within `max_migrations`."""
    fleet = {e: engines(e, ttl=0.4, step_delay=0.05) for e in ("e0", "e1", "e2", "e3")}
    moves = []
    client = cluster.client(on_migration=lambda *move: moves.append(move))
    handle = client.submit(add(first_token=4, n=2, max_tokens=12, temperature=0), engine_id="e0")
    outs = _started(handle, 2)
    fleet["e0"].hold()
    fleet["e0"].crash()
    poll(lambda: handle.migrations == 1 and fleet[handle.engine_id].running, 5, "the first move")
    second = fleet[handle.engine_id]
    second.hold()
    second.crash()
    outs += collect(handle, timeout=10)
    assert handle.migrations == 2 and [m[1] for m in moves] == ["e0", second.engine_id]
    assert _tokens(outs, 0) == [4000 + k for k in range(1, 13)] and _tokens(outs, 1) == [4100 + k for k in range(1, 13)]
