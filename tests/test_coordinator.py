"""The DP coordinator: its pure rules, the leader lock, engine-side waves, the coordinator against real
Redis with registered fake engines (no model), failover between coordinator processes, `redserve status`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest
from stack_procs import poll, quiet_cli

from broker.engine_link import RequestReader
from broker.keys import EngineState
from broker.load_balance import read_lb_snapshot
from broker.registry import EngineRegistry
from coordinator.leader_lock import LeaderLock
from coordinator.process import Coordinator, CoordinatorConfig
from coordinator.rules import DeathWatch, EngineReport, WaveTracker, build_snapshot, same_loads
from engine.dp_wave import DpWaves
from protocol.engine_load import EngineLoad
from protocol.messages import AddRequest, StartWave, decode
from protocol.sampling_params import SamplingParams


def report(engine_id: str = "0", state: str = "ready", alive: bool = True, waiting: int = 0, running: int = 0,
           wave: int = 0, wave_running: bool = False, incarnation: str = "i0", stats_at: float = 100.0,
           ) -> EngineReport:
    load = EngineLoad(waiting, running, 0.123456, 7, stats_at)
    return EngineReport(engine_id, state, incarnation, alive, load, wave, wave_running)


# ----------------------------------------------------------------------------------------- pure rules


def test_snapshot_holds_live_ready_and_draining_engines_only():
    reports = [report("a"), report("b", state="draining", waiting=2, running=1), report("c", state="starting"),
               report("d", alive=False), report("e", state="dead"),
               EngineReport.from_registry({"engine_id": "f", "state": "ready", "incarnation": "i",
                                           "alive": True}, now=555.0)]  # no stats yet
    snap = build_snapshot(reports)
    assert sorted(snap) == ["a", "b", "f"]
    assert snap["b"] == EngineLoad(2, 1, 0.1235, 7, 100.0)
    assert snap["f"].ts == 555.0


def test_same_loads_ignores_timestamps_only():
    a = {"0": EngineLoad(1, 2, 0.5, 3, 10.0)}
    assert same_loads(a, {"0": EngineLoad(1, 2, 0.5, 3, 99.0)})
    assert not same_loads(a, {"0": EngineLoad(1, 2, 0.5, 4, 10.0)})
    assert not same_loads(a, {"1": EngineLoad(1, 2, 0.5, 3, 10.0)})
    assert not same_loads(a, {})


def test_report_from_registry_parses_the_hash():
    r = EngineReport.from_registry({"engine_id": "3", "state": "ready", "incarnation": "x", "alive": True,
                                    "waiting": 2, "running": 1, "kv_usage": 0.5, "num_steps": 9,
                                    "stats_at": 12.5, "wave": 4, "wave_running": 1, "host": "h", "pid": 42},
                                   now=555.0)
    assert (r.busy, r.live, r.wave, r.wave_running, r.pid) == (True, True, 4, True, 42)
    assert r.load == EngineLoad(waiting=2, running=1, kv_usage=0.5, step=9, ts=12.5)
    bare = EngineReport.from_registry({"engine_id": "4", "state": "starting", "alive": False,
                                       "waiting": "junk"}, now=555.0)
    assert (bare.busy, bare.live, bare.wave) == (False, False, 0)
    assert bare.load == EngineLoad(ts=555.0)  # no stats_at: the time of the read


def test_wave_advances_once_per_idle_busy_idle_cycle():
    t = WaveTracker(0)
    idle = [report("0"), report("1")]
    assert not t.due(idle)  # never busy: nothing to complete
    assert not t.due([report("0", running=1), report("1", wave_running=True)])
    assert t.due(idle)
    assert t.advanced() == 1
    # engines still report the old wave as running until they read the counter: not a new wave
    assert not t.due([report("0", wave_running=True), report("1", wave_running=True)])
    assert not t.due(idle)


def test_a_burst_shorter_than_a_tick_still_completes_its_wave():
    t = WaveTracker(5)
    assert t.due([report("0", wave=5, wave_running=True), report("1")])


def test_busy_engine_on_a_stale_wave_starts_the_next_one():
    t = WaveTracker(0)
    t.due([report("0", running=1)])
    assert t.due([report("0")]) and t.advanced() == 1
    assert not t.due([report("0", waiting=1, wave=0, wave_running=True)])  # new work raced the advance
    assert t.due([report("0", wave=1, wave_running=True)])


def test_dead_or_gone_engines_do_not_hold_a_wave_open():
    t = WaveTracker(0)
    t.due([report("0", running=1)])
    assert t.due([report("0", alive=False, running=1), report("1", state="dead", running=1)])


def test_wave_sync_follows_the_highest_and_never_goes_back():
    t = WaveTracker(3)
    t.sync(None, [report("0", wave=2)])
    assert t.wave == 3
    t.sync(7, [])
    assert t.wave == 7
    t.sync(0, [report("0", wave=9), report("1", wave=20, alive=False)])  # Redis restarted empty
    assert t.wave == 9


def test_death_needs_two_reads_confirm_seconds_apart():
    w = DeathWatch(confirm=1.0)
    gone = report("0", alive=False)
    assert w.check([gone], now=10.0) == []
    assert w.check([gone], now=10.5) == []
    assert w.check([gone], now=11.0) == [gone]
    assert w.check([gone], now=11.1) == [gone]  # until its report shows it dead: a failed mark is retried
    assert w.check([report("0", alive=False, state="dead")], now=12.0) == []


def test_death_timer_restarts_for_a_live_read_or_a_new_incarnation():
    w = DeathWatch(confirm=1.0)
    w.check([report("0", alive=False)], now=0.0)
    w.check([report("0", alive=True)], now=0.5)
    assert w.check([report("0", alive=False)], now=1.2) == []
    assert w.check([report("0", alive=False, incarnation="new")], now=2.5) == []
    assert w.check([report("0", alive=False, incarnation="new")], now=3.5) != []


def test_config_rejects_a_lock_ttl_shorter_than_three_ticks():
    with pytest.raises(ValueError, match="lock_ttl"):
        CoordinatorConfig(lock_ttl=1.0, idle_interval=0.5)
    with pytest.raises(ValueError, match="interval"):
        CoordinatorConfig(interval=0)


# ----------------------------------------------------------------------------------------- leader lock


def test_leader_lock_is_exclusive_and_fenced(redis_client, redis_keys):
    key = redis_keys.coordinator_lock()
    a = LeaderLock(redis_client, key, "a", ttl=5.0)
    b = LeaderLock(redis_client, key, "b", ttl=5.0)
    assert a.acquire() and a.held
    assert not b.acquire() and not b.held
    assert a.transaction(lambda p: p.set("x-" + redis_keys.prefix, "1"))
    redis_client.delete(key)  # a's lock "expired" while a was paused
    assert b.acquire()
    assert not a.renew() and not a.held
    assert not a.transaction(lambda p: p.set("x-" + redis_keys.prefix, "stale"))
    assert redis_client.get("x-" + redis_keys.prefix) == b"1"
    assert not a.release()
    assert redis_client.get(key) == b"b"
    assert b.holder()[0] == "b" and 0 < b.holder()[1] <= 5000
    assert b.release() and redis_client.get(key) is None
    redis_client.delete("x-" + redis_keys.prefix)


# ----------------------------------------------------------------------------------------- engine side


class FakeExecutor:
    def __init__(self) -> None:
        self.calls = 0

    def execute_model(self, sched):
        assert sched.is_empty
        self.calls += 1


def _stream_messages(redis_client, stream: str) -> list:
    return [decode(fields[b"m"]) for _, fields in redis_client.xrange(stream)]


def test_engine_starts_a_wave_and_tells_only_the_other_live_engines(redis_client, redis_keys):
    for engine_id in ("0", "1", "2"):
        redis_client.sadd(redis_keys.engines(), engine_id)
    for engine_id in ("0", "1"):
        RequestReader(redis_client, redis_keys, engine_id).reset()  # engine 2 has no stream: departed
    redis_client.set(redis_keys.wave(), 4)
    waves = DpWaves(redis_client, redis_keys, "0")
    waves.load()
    assert (waves.wave, waves.running) == (4, False)
    msg = waves.update(busy=True)
    assert msg == StartWave(4, "0") and waves.running and waves.take_changed()
    assert waves.notify_others(msg) == 1
    assert _stream_messages(redis_client, redis_keys.request_stream("1")) == [StartWave(4, "0")]
    assert redis_client.xlen(redis_keys.request_stream("0")) == 0
    assert not redis_client.exists(redis_keys.request_stream("2"))  # NOMKSTREAM: not re-created
    assert waves.update(busy=True) is None  # already in the running wave


def test_engine_leaves_the_wave_when_the_counter_passes_it(redis_client, redis_keys):
    waves = DpWaves(redis_client, redis_keys, "1", poll_interval=0.0)
    waves.on_start_wave(StartWave(0, "0"))
    assert waves.running and waves.take_changed()
    assert waves.idle_wait() == waves.poll_interval
    assert waves.update(busy=False) is None and waves.running
    redis_client.set(redis_keys.wave(), 1)
    assert waves.update(busy=False) is None
    assert (waves.wave, waves.running, waves.take_changed()) == (1, False, True)
    waves.on_start_wave(StartWave(0, "0"))  # stale: that wave is over
    assert not waves.running
    waves.on_start_wave(StartWave(1, "1"))  # its own: ignored
    assert not waves.running


def test_with_its_poller_the_busy_loop_never_reads_the_counter_itself(redis_client, redis_keys):
    """`start_polling` (what the server runs): the "engine-wave" thread reads `{rs}:wave`; `update` on the busy
    loop only takes its latest read, except to join a wave, so a step never waits on a Redis round trip."""
    waves = DpWaves(redis_client, redis_keys, "1", poll_interval=0.02)
    waves.on_start_wave(StartWave(0, "0"))
    reads = []
    real_read = waves._read
    waves._read = lambda: reads.append(threading.current_thread().name) or real_read()
    waves.start_polling()
    try:
        assert waves.update(busy=True) is None  # became busy inside a running wave: no read
        redis_client.set(redis_keys.wave(), 1)  # the coordinator closed wave 0 as this work arrived
        deadline = time.monotonic() + 5
        while (msg := waves.update(busy=True)) is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert msg == StartWave(1, "1") and (waves.wave, waves.running) == (1, True)
        redis_client.set(redis_keys.wave(), 2)
        while waves.running and time.monotonic() < deadline:
            assert waves.update(busy=False) is None
            time.sleep(0.005)
        assert (waves.wave, waves.running) == (2, False)
        assert reads and set(reads) == {"engine-wave"}
        reads.clear()
        time.sleep(0.1)
        assert reads == []  # out of a wave: the poller reads nothing
        assert waves.update(busy=True) == StartWave(2, "1") and reads == ["MainThread"]  # joining reads at once
    finally:
        waves.stop_polling()
    assert not any(t.name == "engine-wave" for t in threading.enumerate())


def test_busy_engine_behind_the_counter_starts_the_new_wave(redis_client, redis_keys):
    waves = DpWaves(redis_client, redis_keys, "0", poll_interval=0.0)
    assert waves.update(busy=True) == StartWave(0, "0")
    redis_client.set(redis_keys.wave(), 1)  # the coordinator closed wave 0 as this work arrived
    assert waves.update(busy=True) == StartWave(1, "0")
    assert (waves.wave, waves.running) == (1, True)


def test_lockstep_comes_from_the_coordinator_and_runs_dummy_steps_only_in_a_wave(redis_client, redis_keys):
    redis_client.hset(redis_keys.coordinator(), "lockstep", 1)
    waves = DpWaves(redis_client, redis_keys, "1", poll_interval=0.0)
    waves.load()
    executor = FakeExecutor()
    assert waves.lockstep and not waves.dummy_step_due(busy=False)
    waves.on_start_wave(StartWave(0, "0"))
    assert waves.dummy_step_due(busy=False) and not waves.dummy_step_due(busy=True)
    assert waves.idle_wait() == waves.dummy_step_interval
    waves.dummy_step(executor)
    assert executor.calls == 1 and waves.fields()["dummy_steps"] == 1
    assert waves.fields() == {"wave": 0, "wave_running": 1, "dp_lockstep": 1, "dummy_steps": 1}


# ----------------------------------------------------------------------------------------- coordinator + Redis


class FakeEngine:
    """A registered engine without a model: registration, heartbeat, stats, a request stream."""

    def __init__(self, redis_client, keys, engine_id: str, ttl: float = 60.0) -> None:
        self.registry = EngineRegistry(redis_client, keys)
        self.engine_id, self.ttl = engine_id, ttl
        RequestReader(redis_client, keys, engine_id).reset()
        self.registry.register(engine_id, {"dp_rank": 0, "tp": 1, "model": "fake", "heartbeat_ttl": ttl})
        self.registry.heartbeat(engine_id, ttl)
        self.registry.mark_ready(engine_id, 100, 16, 2048)
        self.stats()

    def stats(self, waiting: int = 0, running: int = 0, wave: int = 0, wave_running: int = 0, steps: int = 0):
        self.registry.update_stats(self.engine_id, {"waiting": waiting, "running": running, "kv_usage": 0.25,
                                                    "num_steps": steps, "stats_at": time.time(), "wave": wave,
                                                    "wave_running": wave_running})


def _coordinator(redis_client, keys, **config) -> Coordinator:
    base = dict(interval=0.05, idle_interval=0.1, refresh_interval=0.5, lock_ttl=0.6, death_confirm=0.2)
    return Coordinator(redis_client, keys, CoordinatorConfig(**{**base, **config}))


def test_coordinator_writes_the_snapshot_and_advances_the_wave(redis_client, redis_keys):
    e0, e1 = FakeEngine(redis_client, redis_keys, "0"), FakeEngine(redis_client, redis_keys, "1")
    c = _coordinator(redis_client, redis_keys)
    c.step()
    assert c.active and redis_client.get(redis_keys.wave()) == b"0"
    snap = read_lb_snapshot(redis_client, redis_keys)
    assert sorted(snap) == ["0", "1"] and snap["0"].kv_usage == 0.25
    info = redis_client.hgetall(redis_keys.coordinator())
    assert info[b"coordinator_id"] == c.id.encode() and info[b"lockstep"] == b"0"

    e0.stats(waiting=3, running=1, wave_running=1, steps=1)
    e1.stats(wave_running=1)
    c.step()
    assert read_lb_snapshot(redis_client, redis_keys)["0"].waiting == 3
    assert redis_client.get(redis_keys.wave()) == b"0"
    e0.stats(wave_running=1, steps=5)
    c.step()
    assert redis_client.get(redis_keys.wave()) == b"1"
    c.step()  # the engines still report wave 0 running: no second advance
    assert redis_client.get(redis_keys.wave()) == b"1"
    c.resign()
    assert redis_client.get(redis_keys.coordinator_lock()) is None
    assert not redis_client.exists(redis_keys.coordinator())


def test_coordinator_declares_a_silent_engine_dead_without_resending_its_requests(redis_client, redis_keys):
    FakeEngine(redis_client, redis_keys, "0")
    FakeEngine(redis_client, redis_keys, "1")
    add = AddRequest("r1", "client", [1, 2, 3], SamplingParams(max_tokens=4), time.time())
    from protocol.messages import encode
    redis_client.xadd(redis_keys.request_stream("1"), {b"m": encode(add)})
    c = _coordinator(redis_client, redis_keys)
    c.step()
    redis_client.delete(redis_keys.engine_alive("1"))  # engine 1 stops heartbeating (killed)
    deadline = time.monotonic() + 5
    while redis_client.sismember(redis_keys.engines(), "1") and time.monotonic() < deadline:
        time.sleep(c.step())
    assert not redis_client.sismember(redis_keys.engines(), "1")
    assert not redis_client.exists(redis_keys.request_stream("1"))
    assert redis_client.hget(redis_keys.engine("1"), "state") == EngineState.DEAD.value.encode()
    assert 0 < redis_client.ttl(redis_keys.engine("1")) <= 600
    c.step()
    assert sorted(read_lb_snapshot(redis_client, redis_keys)) == ["0"]
    assert redis_client.xlen(redis_keys.request_stream("0")) == 0  # nothing re-sent by the coordinator


def test_a_starting_engine_is_not_taken_for_dead(redis_client, redis_keys):
    registry = EngineRegistry(redis_client, redis_keys)
    registry.register("0", {"model": "fake"})  # registered; its first heartbeat is about to come
    c = _coordinator(redis_client, redis_keys, death_confirm=5.0)
    for _ in range(3):
        c.step()
    assert redis_client.sismember(redis_keys.engines(), "0")
    assert redis_client.hget(redis_keys.engine("0"), "state") == b"starting"


def test_standby_takes_over_and_the_stale_coordinator_writes_nothing(redis_client, redis_keys):
    FakeEngine(redis_client, redis_keys, "0")
    a, b = _coordinator(redis_client, redis_keys), _coordinator(redis_client, redis_keys)
    a.step()
    b.step()
    assert a.active and not b.active
    time.sleep(0.7)  # a is paused past its lock TTL
    b.step()
    assert b.active
    assert a.step() == a.config.standby_poll and not a.active
    assert redis_client.hget(redis_keys.coordinator(), "coordinator_id") == b.id.encode()


def test_expired_clients_are_swept(redis_client, redis_keys):
    redis_client.sadd(redis_keys.clients(), "gone", "here")
    redis_client.set(redis_keys.client_alive("here"), "host 1", px=60_000)
    _coordinator(redis_client, redis_keys).step()
    assert redis_client.smembers(redis_keys.clients()) == {b"here"}


# ----------------------------------------------------------------------------------------- processes


def test_coordinator_process_failover_keeps_the_snapshot_fresh(redis_url, redis_client, redis_keys):
    engine = FakeEngine(redis_client, redis_keys, "0")
    args = ["coordinator", "--redis-url", redis_url, "--key-prefix", redis_keys.prefix, "--lock-ttl", "1.5"]
    procs = [subprocess.Popen(quiet_cli(*args, "--coordinator-id", f"c{i}")) for i in range(2)]
    try:
        holder = poll(lambda: redis_client.get(redis_keys.coordinator_lock()), 20, "a coordinator").decode()
        active = procs[int(holder[1])]
        standby_id = "c1" if holder == "c0" else "c0"
        os.kill(active.pid, signal.SIGKILL)
        active.wait()
        killed_at = time.monotonic()
        poll(lambda: redis_client.get(redis_keys.coordinator_lock()) == standby_id.encode(), 10, "the takeover")
        assert time.monotonic() - killed_at < 5
        engine.stats(waiting=2, running=1, steps=3)
        poll(lambda: read_lb_snapshot(redis_client, redis_keys).get("0", EngineLoad()).waiting == 2, 5,
             "the new coordinator to refresh {rs}:lb")
        written = float(redis_client.hget(redis_keys.coordinator(), "lb_written_at"))
        time.sleep(1.5)  # idle: it still rewrites the snapshot about every second
        assert float(redis_client.hget(redis_keys.coordinator(), "lb_written_at")) > written
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=10)
    assert redis_client.get(redis_keys.coordinator_lock()) is None  # the survivor handed its lock back


def test_status_command_shows_engines_waves_streams_and_clients(redis_url, redis_client, redis_keys):
    engine = FakeEngine(redis_client, redis_keys, "0")
    engine.stats(waiting=1, running=2, wave=3, wave_running=1)
    redis_client.set(redis_keys.wave(), 3)
    redis_client.sadd(redis_keys.clients(), "api-1")
    redis_client.set(redis_keys.client_alive("api-1"), "host 99", px=60_000)
    c = _coordinator(redis_client, redis_keys)
    c.step()
    base = ["status", "--redis-url", redis_url, "--key-prefix", redis_keys.prefix]
    out = subprocess.run(quiet_cli(*base, "--json"), capture_output=True, text=True, timeout=60, check=True).stdout
    status = json.loads(out)
    assert status["wave"] == 3 and status["coordinator"]["holder"] == c.id
    (e,) = status["engines"]
    assert (e["engine_id"], e["state"], e["alive"], e["waiting"], e["running"]) == ("0", "ready", True, 1, 2)
    assert e["stream_len"] == 0 and e["pending"] == 0 and e["lb"]["running"] == 2
    assert 0 <= e["heartbeat_age_s"] <= 60
    assert status["clients"] == [{"client_id": "api-1", "alive": True, "info": "host 99",
                                  "heartbeat_ttl_left_s": status["clients"][0]["heartbeat_ttl_left_s"]}]
    text = subprocess.run(quiet_cli(*base), capture_output=True, text=True, timeout=60, check=True).stdout
    assert "wave 3" in text and "api-1" in text and "3*" in text
    c.resign()
