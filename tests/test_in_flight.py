"""The client's in-flight table (`broker.client.in_flight.InFlightTable`) on its own: no Redis, no threads.

Each test drives the table the way the listener and maintenance threads do and checks what reaches the
callers' mailboxes, what is left to ABORT and how the engines' load counts move."""

from __future__ import annotations

import queue
from collections import Counter

import pytest

from broker.client.in_flight import InFlightTable
from broker.client.mailbox import Mailbox
from broker.client.request_resume import resume_blocker
from protocol.messages import (
    AddRequest,
    EngineOutputs,
    ErrorCode,
    FinishReason,
    RequestOutput,
    UtilityResult,
)
from protocol.sampling_params import SamplingParams

LIVE = {"e0": {"incarnation": "i0"}, "e1": {"incarnation": "i1"}}


class Table:
    """An InFlightTable, subscribed, with the load counts it reports in `load`."""

    def __init__(self) -> None:
        self.load: Counter[str] = Counter()
        self.table = InFlightTable("c", placed=lambda e: self.load.update([e]), released=lambda e: self.load.subtract([e]))
        self.table.set_subscribed(True)

    def submit(self, rid: str, engine_id: str = "e0", n: int = 1) -> Mailbox:
        add = AddRequest(rid, "c", [1, 2, 3], SamplingParams(n=n, max_tokens=10, temperature=0), 0.0)
        mb = Mailbox(add=add, engine_id=engine_id, incarnation=LIVE[engine_id]["incarnation"], n=n)
        self.table.note_incarnation(engine_id, mb.incarnation)  # as the client does when it chooses the engine
        assert self.table.register(mb)
        return mb

    def step(self, engine_id: str, seq: int, *outputs: RequestOutput, results: tuple = ()) -> None:
        self.table.deliver(EngineOutputs(engine_id, list(outputs), 0.0, list(results), seq=seq))

    def orphans(self, live=LIVE, resubmit_limit: int = 1):
        return self.table.collect_orphans(live, resubmit_limit, lambda mb: resume_blocker(mb.add.params))

    @property
    def in_use(self) -> dict[str, int]:
        return {e: n for e, n in self.load.items() if n}


@pytest.fixture
def t() -> Table:
    return Table()


def _read(mb: Mailbox) -> list[tuple[RequestOutput, bool]]:
    items = []
    while True:
        try:
            items.append(mb.outputs.get_nowait())
        except queue.Empty:
            return items


def _token(rid: str, token: int, index: int = 0, finish: str | None = None) -> RequestOutput:
    return RequestOutput(rid, index, [token], finish)


def test_a_gap_fails_exactly_the_requests_and_calls_of_that_engine(t) -> None:
    a, b, other = t.submit("a"), t.submit("b"), t.submit("x", "e1")
    call_e0, call_e1 = t.table.add_call("k0", "e0"), t.table.add_call("k1", "e1")
    t.step("e0", 1, _token("a", 11))
    t.step("e1", 1, _token("x", 21))
    t.step("e0", 3, _token("a", 12))  # seq 2 was lost
    (first, _), (error, last) = _read(a)
    assert first.new_token_ids == [11] and last and error.error_code is ErrorCode.OUTPUT_LOST
    assert _read(b)[0][0].error_code is ErrorCode.OUTPUT_LOST
    assert a.done and b.done and not other.done
    assert call_e0.get_nowait().error.startswith("engine_gone: ") and call_e1.empty()
    assert t.in_use == {"e1": 1}
    assert t.table.take_deferred_aborts() == {"e0": {"a", "b"}}  # e0 still runs them: ABORT
    t.step("e0", 4, _token("a", 13))  # the request is over: nothing more reaches it
    assert _read(a) == []


def test_a_duplicate_seq_is_dropped_and_a_new_incarnation_restarts_the_numbering(t) -> None:
    a = t.submit("a")
    t.step("e0", 5, _token("a", 11))
    t.step("e0", 5, _token("a", 11))  # a retried PUBLISH
    t.table.note_incarnation("e0", "i0")  # the same incarnation: numbering goes on
    t.step("e0", 4, _token("a", 99))
    t.table.note_incarnation("e0", "i0-new")  # a restart: its seq starts over, no gap, no duplicate
    t.step("e0", 1, _token("a", 12, finish="length"))
    assert [(o.new_token_ids, last) for o, last in _read(a)] == [([11], False), ([12], True)]


def test_declaring_an_engine_gone_twice_keeps_the_first_reason(t) -> None:
    a = t.submit("a")
    t.step("e0", 1, _token("a", 11))
    t.table.declare_gone("e0", "i0", "engine_failed")
    t.table.declare_gone("e0", "i0", "engine_exited")
    assert t.table.take_liveness_due() and not t.table.take_liveness_due()
    assert t.table.gone_engines() == ["e0"]
    # The registry has caught up (e0 deregistered): the verdict goes, its reason still counts.
    orphans = t.orphans(live={"e1": LIVE["e1"]})
    assert orphans.resume == [(a, "engine_failed")] and t.table.gone_engines() == []


def test_a_verdict_on_a_live_engine_makes_its_requests_orphans_until_withdrawn(t) -> None:
    a = t.submit("a")
    t.step("e0", 1, _token("a", 11))
    t.table.declare_gone("e0", "i0", "engine_exited")
    assert t.table.presence_targets() == ({("e0", "i0")}, {("e0", "i0")})
    t.table.withdraw_exited([("e0", "other-incarnation")])  # not that verdict: kept
    assert t.table.gone_engines() == ["e0"]
    t.table.withdraw_exited([("e0", "i0")])
    assert t.table.gone_engines() == [] and t.orphans().resume == [] and not a.done


def test_orphans_are_sorted_by_what_they_produced_and_what_they_ask_for(t) -> None:
    unstarted = t.submit("u")
    started = t.submit("s")
    penalised = t.submit("p")
    penalised.add.params.presence_penalty = 0.5
    elsewhere = t.submit("x", "e1")
    for seq, rid in enumerate(("s", "p"), start=1):
        t.step("e0", seq, _token(rid, 11))
    orphans = t.orphans(live={"e1": LIVE["e1"]})
    assert orphans.replace == [unstarted] and orphans.resend == []
    assert orphans.resume == [(started, "heartbeat_expired")]
    (out, last), = _read(penalised)[1:]
    assert last and out.error_code is ErrorCode.ENGINE_GONE and "not resumed: presence" in out.error_message
    assert t.table.take_deferred_aborts() == {}  # its engine is gone: nothing to ABORT
    assert not elsewhere.done and t.in_use == {"e0": 2, "e1": 1}


def test_an_engine_failed_output_declares_the_engine_gone_instead_of_ending_the_request(t) -> None:
    a = t.submit("a")
    t.step("e0", 1, _token("a", 11))
    t.step("e0", 2, RequestOutput.failure("a", ErrorCode.ENGINE_FAILED, "worker died"))
    assert len(_read(a)) == 1 and not a.done and t.table.gone_engines() == ["e0"]
    orphans = t.table.collect_orphans(LIVE, 1, lambda mb: "resuming is off")  # it may not move
    assert orphans.resume == [] and a.done
    (out, last), = _read(a)
    assert last and out.error_code is ErrorCode.ENGINE_FAILED and out.error_message == "worker died"


def test_a_request_resumed_as_n_continuations_is_one_orphan_and_takes_their_outputs(t) -> None:
    a = t.submit("a", n=2)
    t.step("e0", 1, _token("a", 11, index=0), _token("a", 21, index=1))
    moved = t.table.move_to_continuations(a, "e1", "i1")
    assert sorted(moved.adds) == ["a~m1.0", "a~m1.1"] and (moved.old_engine, moved.old_ids) == ("e0", ["a"])
    assert t.in_use == {"e1": 1} and a.migrations == 1
    t.step("e0", 2, _token("a", 12))  # late output of the old engine: dropped
    t.step("e1", 1, _token("a~m1.1", 22, finish="length"))
    (out, last), = _read(a)[2:]
    assert (out.request_id, out.index, out.new_token_ids, last) == ("a", 1, [22], False)
    orphans = t.orphans(live={"e0": LIVE["e0"]})  # now e1 is gone
    assert orphans.resume == [(a, "heartbeat_expired")]  # once, not once per continuation id


def test_a_request_ends_once_and_its_load_count_with_it(t) -> None:
    a = t.submit("a")
    with pytest.raises(ValueError, match="already in flight"):
        t.table.register(Mailbox(add=a.add, engine_id="e1", incarnation="i1", n=1))
    assert t.table.abort(a) == ("e0", ["a"])
    t.table.expire(a)
    t.table.fail(a, ErrorCode.ENGINE_GONE, "gone")
    assert t.table.abort(a) is None
    t.table.drop(a)  # e.g. its XADD failed while the client was stopping
    assert [(o.finish_reason, last) for o, last in _read(a)] == [(FinishReason.ABORT, True)]
    assert t.in_use == {} and t.table.in_flight() == 0 and t.table.take_deferred_aborts() == {}


def test_nothing_is_registered_while_unsubscribed_and_losing_the_subscription_keeps_unstarted_requests(t) -> None:
    started, unstarted = t.submit("s"), t.submit("u")
    call = t.table.add_call("k", "e0")
    t.step("e0", 7, _token("s", 11))
    assert t.table.lose_subscription(resubmit_limit=1) == (1, 1)
    assert not t.table.subscribed and not t.table.wait_subscribed(0)
    assert not t.table.register(Mailbox(add=AddRequest("n", "c", [1], SamplingParams(), 0.0), engine_id="e0", incarnation="i0", n=1))
    assert _read(started)[-1][0].error_code is ErrorCode.BROKER_DISCONNECTED
    assert isinstance(call.get_nowait(), UtilityResult)
    assert unstarted.lost_with_redis and not unstarted.done and t.orphans().resend == [unstarted]
    assert t.table.re_place(unstarted, "e1", "i1", after_outage=True)
    assert unstarted.request_id == "u~r1" and t.table.take_deferred_aborts() == {"e0": {"s", "u"}}
    t.table.set_subscribed(True)
    t.step("e1", 1, _token("u", 1))  # the old id is no longer routed
    t.step("e1", 2, _token("u~r1", 12, finish="length"))
    assert [(o.request_id, o.new_token_ids, last) for o, last in _read(unstarted)] == [("u~r1", [12], True)]
    later = t.submit("v")
    t.step("e0", 1, _token("v", 31, finish="length"))  # seq numbers from before the outage are forgotten
    assert [o.new_token_ids for o, _ in _read(later)] == [[31]] and t.in_use == {}


def test_a_started_request_lost_with_the_subscription_resumes_from_its_delivered_tokens(t) -> None:
    started, grammar = t.submit("s"), t.submit("g")
    grammar.add.params.structured_output = {"kind": "json_object"}
    t.step("e0", 1, _token("s", 11), _token("g", 21))
    assert t.table.since_resubscribed() == float("inf")
    assert t.table.lose_subscription(1, lambda mb: resume_blocker(mb.add.params)) == (1, 1)
    assert _read(grammar)[-1][0].error_code is ErrorCode.BROKER_DISCONNECTED  # may not move: ends as before
    t.step("e0", 2, _token("s", 12))  # whatever still comes for it before it moves is dropped
    t.table.set_subscribed(True)
    assert t.table.since_resubscribed() < 1.0 and t.table.take_liveness_due()  # resumed at once, not later
    assert t.orphans().resume == [(started, "redis_lost")]
    moved = t.table.move_to_continuations(started, "e0", "i0")  # its own engine will do: it lives on
    assert moved is not None and not started.lost_with_redis
    (rid, (index, add)), = moved.adds.items()
    assert (rid, index, add.prompt_token_ids, add.params.max_tokens) == ("s~m1", 0, [1, 2, 3, 11], 9)
    t.step("e0", 3, _token("s~m1", 13, finish="length"))
    assert [(o.request_id, o.new_token_ids, last) for o, last in _read(started)] == [("s", [11], False),
                                                                                     ("s", [13], True)]


def test_a_parked_request_fails_with_no_engine_once_it_waited_long_enough(t) -> None:
    a = t.submit("a")
    assert t.table.park(a, replace_wait=60.0) and not t.table.park(a, replace_wait=60.0)
    assert not a.done
    t.table.park(a, replace_wait=0.0)
    (out, last), = _read(a)
    assert last and out.error_code is ErrorCode.NO_ENGINE


def test_a_restarted_engine_orphans_its_requests_and_ends_its_calls_and_numbering(t) -> None:
    a = t.submit("a")
    call = t.table.add_call("k", "e0")
    t.step("e0", 3, _token("a", 11))
    restarted = {**LIVE, "e0": {"incarnation": "i0-new"}}
    assert t.orphans(live=restarted).resume == [(a, "engine_restarted")]
    assert call.get_nowait().error.startswith("engine_gone: ")
    t.table.move_to_continuations(a, "e0", "i0-new")  # back on its own engine, restarted
    t.step("e0", 1, _token("a~m1", 12, finish="length"))  # the new incarnation numbers from 1
    assert [(o.request_id, o.new_token_ids, last) for o, last in _read(a)][1:] == [("a", [12], True)]
