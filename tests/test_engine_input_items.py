"""Every kind of engine input item reaches its handler: stream messages (add, abort, abort of one
sequence, utility, wave, and a type that does not belong there), client gone, rejoin and drain.

An `EngineServer` with a real EngineCore (tiny llama) and a real Redis; its busy loop is driven one
`_drain_input` at a time. Stream messages come through the real input thread (XADD -> XREADGROUP ->
`Received`), client-gone through the real output thread (outputs published to a channel nobody
listens on -> `ClientGone`), drain through the signal handler `request_drain`.
"""

import queue
import threading
import time

import pytest
from stack_procs import poll

from broker.engine_link import STREAM_FIELD
from broker.keys import EngineState
from engine.core import EngineCore
from engine.input_items import ClientGone, Drain, Received, Rejoin
from engine.server import EngineServer, StepBatch
from protocol.messages import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    ErrorCode,
    FinishReason,
    RequestOutput,
    StartWave,
    UtilityCall,
    encode,
)
from protocol.sampling_params import SamplingParams
from worker.config import EngineConfig

CLIENT = "c1"
PARAMS = {"temperature": 0.0, "max_tokens": 50, "ignore_eos": True}  # keyword arguments of SamplingParams


@pytest.fixture
def server(redis_url, llama_dir):
    config = EngineConfig(model=llama_dir, dtype="float32", num_kv_blocks=64, block_size=16)
    srv = EngineServer(config, redis_url, engine_id="items", heartbeat_ttl=5.0)
    srv.reader.reset()
    srv._register()
    srv.presence.start()
    srv.core = EngineCore(config)
    srv.core.block_manager.track_events()
    srv._mark_ready()
    threads = [threading.Thread(target=srv._input_loop, daemon=True),
               threading.Thread(target=srv._output_loop, daemon=True)]
    for t in threads:
        t.start()
    yield srv
    srv.stop_event.set()
    srv.output_queue.put(None)
    for t in threads:
        t.join(timeout=5)
    srv.presence.stop()
    srv.registry.deregister(srv.engine_id)
    srv.core.shutdown()


def _send(srv, msg) -> str:
    return srv.redis.xadd(srv.keys.request_stream(srv.engine_id), {STREAM_FIELD: encode(msg)}).decode()


def _handle_until(srv, done, timeout=20.0) -> StepBatch:
    """Run the busy loop's input step until `done(batch)`; one batch collects everything handled."""
    batch = StepBatch()

    def step() -> bool:
        srv._drain_input(batch, block=True, timeout=0.05)
        return done(batch)

    poll(step, timeout, "the input item to be handled")
    return batch


def _outputs(batch):
    return [o for outs in batch.by_client.values() for o in outs.outputs]


def _add(srv, rid, **params) -> str:
    message_id = _send(srv, AddRequest(rid, CLIENT, [5, 6, 7], SamplingParams(**{**PARAMS, **params}), time.time()))
    _handle_until(srv, lambda b: rid in srv.in_flight)
    return message_id


def test_received_add_and_abort(server):
    message_id = _add(server, "r1")
    assert server.in_flight["r1"].message_id == message_id and server.core.has_unfinished_requests()
    _send(server, AbortRequests(["r1", "unknown"], CLIENT))
    batch = _handle_until(server, lambda b: "r1" not in server.in_flight)
    assert [(o.request_id, o.finish_reason) for o in _outputs(batch)] == [("r1", FinishReason.ABORT)]
    assert batch.ack_ids == [message_id] and not server.core.has_unfinished_requests()


def test_received_add_that_the_engine_rejects(server):
    params = SamplingParams()
    params.temperature = -1.0  # out of range, as a peer that skips the checks sends it: decoding checks types only
    message_id = _send(server, AddRequest("bad", CLIENT, [5], params, time.time()))
    batch = _handle_until(server, lambda b: bool(_outputs(b)))
    [out] = _outputs(batch)
    assert out.finish_reason is FinishReason.ERROR and out.error_code is ErrorCode.INVALID_REQUEST
    assert "temperature" in out.error_message and batch.ack_ids == [message_id] and not server.in_flight


def test_received_abort_of_one_sequence(server):
    _add(server, "r2", n=2)
    _send(server, AbortRequests(["r2"], CLIENT, index=1))
    batch = _handle_until(server, lambda b: bool(_outputs(b)))
    assert [(o.index, o.finish_reason) for o in _outputs(batch)] == [(1, FinishReason.ABORT)]
    assert server.in_flight["r2"].remaining == 1 and not batch.ack_ids


def test_received_utility_and_wave(server):
    _send(server, UtilityCall("u1", CLIENT, "get_stats", []))
    _send(server, UtilityCall("u2", CLIENT, "no_such_method", []))
    batch = _handle_until(server, lambda b: CLIENT in b.by_client and len(b.by_client[CLIENT].utility_results) == 2)
    stats, unknown = batch.by_client[CLIENT].utility_results
    assert stats.call_id == "u1" and stats.error is None and "running" in stats.result
    names = list(stats.result)  # the order the engine's hash and get_stats have always had
    assert names[:5] == ["waiting", "running", "kv_usage", "num_steps", "generated_tokens"]
    assert names.index("stats_at") == names.index("prefix_cache_hit_rate") + 1
    assert unknown.call_id == "u2" and "no_such_method" in unknown.error
    wave = server.waves.wave
    _send(server, StartWave(wave + 3, exclude_engine="another"))
    _handle_until(server, lambda b: server.waves.wave == wave + 3)
    assert server.waves.running


def test_received_message_of_the_wrong_kind_is_ignored(server, caplog):
    _send(server, EngineOutputs("e9", [], 1.0))
    _handle_until(server, lambda b: "ignoring a EngineOutputs" in caplog.text)
    _add(server, "r3")  # still serving


def test_client_gone_from_the_output_thread_aborts_those_requests(server):
    _add(server, "r4")
    _add(server, "r5")
    lost = StepBatch()
    lost.add(server.engine_id, "nobody-listens", RequestOutput("r4", 0, [9]))  # published to no subscriber
    server.output_queue.put(lost)
    batch = _handle_until(server, lambda b: "r4" not in server.in_flight)
    assert [(o.request_id, o.finish_reason) for o in _outputs(batch)] == [("r4", FinishReason.ABORT)]
    assert "r5" in server.in_flight


def test_client_gone_ignores_requests_no_longer_in_flight(server):
    server.input_queue.put(ClientGone(["never-added", "never-added"]))
    batch = StepBatch()
    server._drain_input(batch, block=False)
    assert not batch and not server.in_flight


def test_rejoin_when_declared_dead_ends_requests_and_registers_again(server):
    _add(server, "r6")
    server.input_queue.put(Rejoin())  # not dead: a late report, nothing to do
    batch = StepBatch()
    server._drain_input(batch, block=False)
    assert not batch and "r6" in server.in_flight
    old_incarnation = server.incarnation
    server.registry.set_state(server.engine_id, EngineState.DEAD)
    server.input_queue.put(Rejoin())
    server._drain_input(batch, block=False)
    [out] = _outputs(batch)
    assert out.request_id == "r6" and out.finish_reason is FinishReason.ERROR
    assert out.error_code is ErrorCode.ENGINE_GONE and "declared dead" in out.error_message
    assert not server.in_flight and not batch.ack_ids  # the stream was reset: nothing left to ack
    assert server.incarnation != old_incarnation
    assert server.registry.get(server.engine_id)["state"] == EngineState.READY


def test_drain_wakes_a_blocked_busy_loop(server):
    woke = threading.Event()

    def busy_loop_input_step() -> None:
        server._drain_input(StepBatch(), block=True, timeout=60)
        woke.set()

    assert server.input_queue.empty()  # so only an item can end the 60 s wait below
    threading.Thread(target=busy_loop_input_step, daemon=True).start()
    server.request_drain()
    assert woke.wait(10) and server.draining_since is not None
    with pytest.raises(queue.Empty):
        server.input_queue.get_nowait()  # the Drain item was consumed
    server.request_drain()  # a second signal queues nothing more
    assert server.input_queue.empty()


def test_one_input_step_handles_every_queued_item(server):
    for item in (Drain(), ClientGone(["gone"]), Rejoin(), Received("1-0", UtilityCall("u3", CLIENT, "get_stats", [])),
                 Received("2-0", UtilityCall("u4", CLIENT, "get_stats", []))):
        server.input_queue.put(item)
    batch = StepBatch()
    server._drain_input(batch, block=False)
    assert [r.call_id for r in batch.by_client[CLIENT].utility_results] == ["u3", "u4"]
    assert server.input_queue.empty()


def test_items_are_typed_records():
    assert Received("1-0", StartWave(1)) == Received("1-0", StartWave(1))
    assert ClientGone(["a"]).request_ids == ["a"] and Rejoin() == Rejoin() and Drain() == Drain()
