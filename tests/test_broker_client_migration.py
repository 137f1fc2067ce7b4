"""BrokerClient resumes started requests on another engine (`broker.client_migration`): real Redis, fake
engines that continue a sequence from its prompt, so a continuation is checked token by token."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
from test_broker_client import FakeEngine, add, cluster, collect, eventually  # noqa: F401 - cluster is a fixture

from broker.engine_presence import EnginePresence
from broker.errors import NoEngineAvailable
from broker.messages import (
    AddRequest,
    EngineOutputs,
    ErrorCode,
    FinishReason,
    RequestOutput,
    error_code,
    make_error,
)
from broker.sampling_params import SamplingParams

PROMPT_LEN = 3  # `add()` prompts: [first_token, 7, 7]


class ContinuingEngine(FakeEngine):
    """Sequence i of a request whose prompt starts with t goes t*1000 + 100*i + 1, + 2, ...; a prompt longer
    than `PROMPT_LEN` is a continuation: it goes on from its last token. `hold()` stops every output."""

    def __init__(self, *args, presence: bool = False, **kw) -> None:
        super().__init__(*args, **kw)
        self.presence = EnginePresence(args[0], args[1], args[2], lambda: self.incarnation) if presence else None
        self.incarnation = ""
        self.received: dict[str, AddRequest] = {}

    def start(self, ready=True):
        self.reader.reset()
        self.incarnation = self.registry.register(self.engine_id, {"dp_rank": 0, "tp": 1, "model": "fake",
                                                                    **({"presence": 1} if self.presence else {})})
        if self.presence:
            self.presence.start()
            assert self.presence.wait_subscribed(5)
        self.heartbeat.start()
        self.registry.mark_ready(self.engine_id, num_kv_blocks=100, block_size=16, max_model_len=1024)
        self._thread.start()
        return self

    def hold(self) -> None:
        self.go.clear()

    def crash(self):
        super().crash()
        if self.presence:
            self.presence.stop()  # as the kernel closing a killed process's socket

    def _handle(self, msg_id, msg):
        if isinstance(msg, AddRequest):
            self.received[msg.request_id] = msg
        super()._handle(msg_id, msg)

    def _step(self):
        outputs: dict[str, list[RequestOutput]] = defaultdict(list)
        acks = []
        for rid, st in list(self.running.items()) if self.go.is_set() else []:
            add_, prompt = st["add"], st["add"].prompt_token_ids
            params = SamplingParams.from_dict(add_.params)
            for i, made in enumerate(st["made"]):
                if i in st["done"]:
                    continue
                made = st["made"][i] = made + 1
                start = prompt[-1] if len(prompt) > PROMPT_LEN else prompt[0] * 1000 + 100 * i
                finish = "length" if made >= params.max_tokens else None
                if finish:
                    st["done"].add(i)
                outputs[add_.client_id].append(RequestOutput(rid, i, [start + made], finish, None, len(prompt), 0))
            if len(st["done"]) == len(st["made"]):
                acks.append(st["msg_id"])
                del self.running[rid]
        step = {c: EngineOutputs(self.engine_id, outs, time.time()) for c, outs in outputs.items()}
        if step or acks:
            self.publisher.publish(step, acks, {"running": len(self.running)})
        time.sleep(self.step_delay)


@pytest.fixture
def engines(cluster):  # noqa: F811
    made = []

    def start(engine_id, **kw):
        eng = ContinuingEngine(cluster.url, cluster.keys, engine_id, **kw).start()
        made.append(eng)
        return eng
    yield start
    for eng in made:
        eng.stop()
        if eng.presence:
            eng.presence.stop()


def _tokens(outs, index=0):
    return [t for o in outs if o.index == index for t in o.new_token_ids]


def _started(handle, count):
    """Read `count` outputs (the request is under way)."""
    return [handle.get(timeout=5) for _ in range(count)]


def test_a_started_request_continues_on_another_engine_when_its_heartbeat_expires(cluster, engines):  # noqa: F811
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
    assert (cont.params["max_tokens"], cont.params["min_tokens"], cont.params["n"]) == (4, 2, 1)
    assert client.in_flight() == 0


def test_a_killed_engine_is_seen_by_its_presence_long_before_its_heartbeat_expires(cluster, engines):  # noqa: F811
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


def test_every_running_sequence_of_n_continues_on_its_own(cluster, engines):  # noqa: F811
    e0, e1 = engines("e0", ttl=0.4, step_delay=0.05), engines("e1")
    client = cluster.client()
    handle = client.submit(add(first_token=4, n=2, max_tokens=4, temperature=0), engine_id="e0")
    outs = _started(handle, 2)
    e0.hold()
    e0.crash()
    outs += collect(handle, timeout=10)
    assert _tokens(outs, 0) == [4001, 4002, 4003, 4004] and _tokens(outs, 1) == [4101, 4102, 4103, 4104]
    assert {o.index for o in outs if o.finish_reason == "length"} == {0, 1}
    assert sorted(e1.received) == [f"{handle.request_id}~m1.0", f"{handle.request_id}~m1.1"]
    assert {o.request_id for o in outs} == {handle.request_id}


def test_a_sequence_the_caller_stopped_is_not_continued(cluster, engines):  # noqa: F811
    e0, e1 = engines("e0", ttl=0.4, step_delay=0.05), engines("e1")
    client = cluster.client()
    handle = client.submit(add(first_token=5, n=2, max_tokens=4, temperature=0), engine_id="e0")
    outs = _started(handle, 2)
    e0.hold()
    handle.abort_sequence(1)  # a stop string ended choice 1
    e0.crash()
    outs += collect(handle, timeout=10)
    assert _tokens(outs, 0)[-1] == 5004
    assert [o.finish_reason for o in outs if o.index == 1 and o.finish_reason] == [FinishReason.ABORT.value]
    assert list(e1.received) == [f"{handle.request_id}~m1.0"]


def test_a_request_moves_at_most_max_migrations_times(cluster, engines):  # noqa: F811
    e0, e1 = engines("e0", ttl=0.4, step_delay=0.05), engines("e1", ttl=0.4, step_delay=0.05)
    client = cluster.client(max_migrations=1)
    handle = client.submit(add(first_token=6, max_tokens=50, temperature=0), engine_id="e0")
    _started(handle, 1)
    e0.hold()
    e0.crash()
    assert eventually(lambda: handle.engine_id == "e1" and e1.running)
    assert handle.get(timeout=5).new_token_ids  # e1 produces
    e1.hold()
    e1.crash()
    outs = collect(handle, timeout=10)
    assert error_code(outs[-1].error) == ErrorCode.ENGINE_GONE
    assert "moved 1 time(s) already (--max-migrations 1)" in outs[-1].error


def test_a_request_the_caller_closed_is_not_resumed(cluster, engines):  # noqa: F811
    e0, e1 = engines("e0", ttl=0.4, step_delay=0.05), engines("e1")
    client = cluster.client()
    handle = client.submit(add(first_token=7, max_tokens=50, temperature=0), engine_id="e0")
    _started(handle, 1)
    e0.hold()
    handle.close()  # the HTTP client went away
    e0.crash()
    time.sleep(1.0)  # several liveness checks: nothing may be sent on
    assert not e1.received and client.in_flight() == 0


def test_a_dead_tp_worker_engine_failed_output_resumes_the_request(cluster, engines):  # noqa: F811
    e0, _ = engines("e0", step_delay=0.05), engines("e1")
    moves = []
    client = cluster.client(on_migration=lambda *move: moves.append(move))
    handle = client.submit(add(first_token=8, max_tokens=5, temperature=0), engine_id="e0")
    outs = _started(handle, 2)
    e0.hold()
    failed = RequestOutput(handle.request_id, 0, [], "error", error=make_error(ErrorCode.ENGINE_FAILED, "worker died"))
    e0.publisher.publish({client.client_id: EngineOutputs("e0", [failed], time.time())}, [], None)
    outs += collect(handle, timeout=10)
    assert _tokens(outs) == [8001, 8002, 8003, 8004, 8005] and outs[-1].error is None
    assert moves == [("engine_failed", "e0", "e1")]


def test_an_engine_failed_request_that_cannot_move_ends_with_the_engines_error(cluster, engines):  # noqa: F811
    e0 = engines("e0", step_delay=0.05)
    client = cluster.client(max_migrations=0)
    handle = client.submit(add(first_token=9, max_tokens=50, temperature=0), engine_id="e0")
    _started(handle, 1)
    e0.hold()
    failed = RequestOutput(handle.request_id, 0, [], "error", error=make_error(ErrorCode.ENGINE_FAILED, "worker died"))
    e0.publisher.publish({client.client_id: EngineOutputs("e0", [failed], time.time())}, [], None)
    last = collect(handle, timeout=10)[-1]
    assert error_code(last.error) == ErrorCode.ENGINE_FAILED and "worker died" in last.error


def test_an_engine_whose_presence_comes_back_is_used_again(cluster, engines):  # noqa: F811
    e0 = engines("e0", ttl=30.0, step_delay=0.05, presence=True)
    client = cluster.client(liveness_interval=5.0)
    handle = client.submit(add(first_token=1, max_tokens=40, temperature=0), engine_id="e0")
    outs = _started(handle, 1)
    e0.presence.stop()  # its connection dropped (a Redis restart), the process lives on
    assert eventually(lambda: "e0" in client._gone_engines())
    with pytest.raises(NoEngineAvailable):
        client.submit(add(max_tokens=1))
    e0.presence = EnginePresence(cluster.url, cluster.keys, "e0", lambda: e0.incarnation).start()
    assert eventually(lambda: not client._gone_engines())
    assert collect(client.submit(add(first_token=2, max_tokens=2)))[-1].finish_reason == "length"
    outs += collect(handle, timeout=10)
    assert _tokens(outs) == [1000 + k for k in range(1, 41)] and handle.migrations == 0


def test_an_engine_that_fails_and_deregisters_at_once_counts_as_failed(cluster, engines):  # noqa: F811
    """The engine_failed outputs and the deregistration reach the client before its next liveness check:
    the move is still reported as engine_failed (the registry catching up must not erase why)."""
    e0, _ = engines("e0", step_delay=0.05), engines("e1")
    moves = []
    client = cluster.client(on_migration=lambda *move: moves.append(move), liveness_interval=30.0)
    handle = client.submit(add(first_token=8, max_tokens=5, temperature=0), engine_id="e0")
    outs = _started(handle, 2)
    e0.hold()
    with client._lock:  # the liveness check runs only after both events have landed
        failed = RequestOutput(handle.request_id, 0, [], "error",
                               error=make_error(ErrorCode.ENGINE_FAILED, "worker died"))
        e0.publisher.publish({client.client_id: EngineOutputs("e0", [failed], time.time())}, [], None)
        e0.stop()  # deregisters
    outs += collect(handle, timeout=10)
    assert _tokens(outs) == [8001, 8002, 8003, 8004, 8005] and outs[-1].error is None
    assert moves == [("engine_failed", "e0", "e1")]
