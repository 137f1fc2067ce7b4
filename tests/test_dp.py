"""Data parallelism with real processes and a real Redis: a coordinator (lockstep on) and tiny-model engines
driven through `BrokerClient`. The tests share one stack and run in order: spread, waves, lockstep, a late
joiner, a drain, then a `kill -9` under load (which leaves one engine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter

import pytest
import redis
from stack_procs import poll, quiet_cli

from broker.client import BrokerClient
from broker.connection import connect
from broker.keys import RedisKeys
from broker.registry import EngineRegistry
from protocol.messages import AddRequest, ErrorCode, FinishReason
from protocol.sampling_params import SamplingParams

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", str(32 << 20), "--max-num-seqs", "4",
                "--heartbeat-ttl", "2"]


class Stack:
    def __init__(self, url: str, keys: RedisKeys, model: str) -> None:
        self.url, self.keys, self.model = url, keys, model
        self.redis = redis.Redis.from_url(url)
        self.registry = EngineRegistry(self.redis, keys)
        self.engines: dict[str, subprocess.Popen] = {}
        self.coordinator = subprocess.Popen(quiet_cli("coordinator", "--redis-url", url, "--key-prefix", keys.prefix,
                                                      "--dp-lockstep", "--lock-ttl", "1.5"))
        self.client = BrokerClient(url, keys=keys, resubmit_limit=2)
        self._ids = (f"r{i}" for i in range(1_000_000))

    def start_engine(self, rank: int) -> None:
        self.engines[str(rank)] = subprocess.Popen(quiet_cli(
            "engine", "--model", self.model, "--redis-url", self.url, "--key-prefix", self.keys.prefix,
            "--dp-rank", str(rank), *ENGINE_FLAGS), stdin=subprocess.DEVNULL)

    def wait_ready(self, *engine_ids: str, client_view: bool = True) -> None:
        """Until the engines are READY in Redis and, with `client_view`, in the client's cached list too."""
        def ready():
            for e in engine_ids:
                assert self.engines[e].poll() is None, f"engine {e} exited with {self.engines[e].returncode}"
            engines = self.client.ready_engines() if client_view else self.registry.ready_engines()
            return {info["engine_id"] for info in engines}.issuperset(engine_ids)
        poll(ready, 180, f"engines {engine_ids} to be ready")

    def submit(self, max_tokens: int = 8, engine_id: str | None = None, prompt: list[int] | None = None):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        add = AddRequest(next(self._ids), "", prompt or [5, 17, 99, 4, 250], params, time.time(), time.time() + 120)
        return self.client.submit(add, engine_id=engine_id)

    def stat(self, engine_id: str, name: str) -> int:
        return int(self.redis.hget(self.keys.engine(engine_id), name) or 0)

    def wave(self) -> int:
        return int(self.redis.get(self.keys.wave()) or 0)

    def settle(self) -> int:
        """Wait until the current wave is closed and every engine has seen it; return the wave."""
        def settled():
            wave, engines = self.wave(), self.registry.live_engines()
            return all(e.get("wave") == wave and e.get("wave_running") == 0 for e in engines) and (wave,)
        return poll(settled, 15, "the wave to settle")[0]

    def stop(self) -> None:
        self.client.stop()
        procs = [*self.engines.values(), self.coordinator]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.redis.close()


def _finish(handle) -> tuple[list[int], FinishReason | None, ErrorCode | None]:
    tokens, last = [], None
    for out in handle:
        tokens += out.new_token_ids
        last = out
    return tokens, last.finish_reason if last else None, last.error_code if last else None


@pytest.fixture(scope="module")
def stack(redis_server, tiny_llama_dir):
    url = redis_server.url
    s = Stack(url, RedisKeys(f"dp{uuid.uuid4().hex[:8]}"), tiny_llama_dir)
    try:
        s.start_engine(0)
        s.start_engine(1)
        s.client.start()
        s.wait_ready("0", "1")
        yield s
    finally:
        s.stop()


def test_a_burst_is_spread_over_both_engines(stack):
    before = {e: stack.stat(e, "generated_tokens") for e in ("0", "1")}
    handles = [stack.submit(max_tokens=8) for _ in range(16)]
    placed = Counter(h.engine_id for h in handles)
    for h in handles:
        tokens, finish, error = _finish(h)
        assert (len(tokens), finish, error) == (8, "length", None)
    assert placed["0"] >= 4 and placed["1"] >= 4, placed

    def generated():
        got = {e: stack.stat(e, "generated_tokens") - before[e] for e in before}
        return sum(got.values()) == 16 * 8 and got
    got = poll(generated, 10, "the engines' stats")
    assert got == {e: 8 * placed[e] for e in ("0", "1")}


def test_the_wave_advances_once_per_idle_busy_idle_cycle(stack):
    wave = stack.settle()
    for _ in range(2):
        handles = [stack.submit(max_tokens=6) for _ in range(6)]
        for h in handles:
            assert _finish(h)[1] == "length"
        poll(lambda w=wave: stack.wave() == w + 1, 10, "the wave to advance")
        wave = stack.settle()
        time.sleep(1.0)
        assert stack.wave() == wave, "the wave advanced with every engine idle"


def test_lockstep_dummy_steps_run_only_while_an_engine_has_work(stack):
    stack.settle()
    idle_before = stack.stat("1", "dummy_steps")
    handle = stack.submit(max_tokens=300, engine_id="0")
    poll(lambda: stack.stat("1", "dummy_steps") > idle_before, 20, "engine 1 to run dummy steps")
    assert _finish(handle)[1] == "length"
    stack.settle()
    counts = {e: stack.stat(e, "dummy_steps") for e in ("0", "1")}
    time.sleep(1.0)
    assert {e: stack.stat(e, "dummy_steps") for e in ("0", "1")} == counts
    assert stack.stat("1", "dp_lockstep") == 1


def test_an_engine_that_joins_late_gets_traffic(stack):
    stack.start_engine(2)
    stack.wait_ready("2", client_view=False)
    ready_at = time.monotonic()
    handles = []
    while not any(h.engine_id == "2" for h in handles):
        assert time.monotonic() - ready_at < 3, "the new engine got no request within 3 s"
        handles += [stack.submit(max_tokens=2) for _ in range(3)]
        time.sleep(0.1)
    print(f"late joiner got its first request {time.monotonic() - ready_at:.2f}s after READY")
    for h in handles:
        assert _finish(h)[1] == "length"


def test_a_drained_engine_leaves_without_losing_a_request(stack):
    handles = [stack.submit(max_tokens=32) for _ in range(12)]
    assert any(h.engine_id == "2" for h in handles)
    stack.engines["2"].send_signal(signal.SIGTERM)
    for h in handles:
        tokens, finish, error = _finish(h)
        assert (len(tokens), finish, error) == (32, "length", None)
    assert stack.engines["2"].wait(timeout=60) == 0
    assert stack.registry.get("2") is None
    assert not stack.redis.sismember(stack.keys.engines(), "2")
    assert all(stack.submit(max_tokens=2).engine_id != "2" for _ in range(4))


def test_kill_9_under_load_completes_or_fails_every_request(stack):
    stack.settle()
    handles = [stack.submit(max_tokens=48, prompt=[7, 8, 9, i]) for i in range(16)]
    first_engine = {h.request_id: h.engine_id for h in handles}
    on_1 = [h for h in handles if h.engine_id == "1"]
    assert len(on_1) >= 5, "engine 1 should hold running and waiting requests (max-num-seqs 4)"
    poll(lambda: stack.stat("1", "running") > 0, 20, "engine 1 to be running requests")
    os.kill(stack.engines["1"].pid, signal.SIGKILL)
    stack.engines["1"].wait()
    results = {h.request_id: (h.engine_id, *_finish(h)) for h in handles}
    for rid, (engine, tokens, finish, error) in results.items():
        if engine == "0":  # placed there, or re-placed there because engine 1 never started it
            assert (len(tokens), finish, error) == (48, "length", None), rid
        elif finish != "length":  # engine 1 had started it
            assert finish is FinishReason.ERROR and error is ErrorCode.ENGINE_GONE, (rid, error)
    replaced = [rid for rid in results if first_engine[rid] == "1" and results[rid][0] == "0"]
    assert replaced, "requests engine 1 had not started should have completed on engine 0"

    poll(lambda: stack.redis.hget(stack.keys.engine("1"), "state") == b"dead", 15, "engine 1 marked dead")
    assert not stack.redis.sismember(stack.keys.engines(), "1")
    assert not stack.redis.exists(stack.keys.request_stream("1"))
    poll(lambda: set(stack.redis.hkeys(stack.keys.lb())) == {b"0"}, 5, "{rs}:lb without engine 1")
    after = stack.submit(max_tokens=4)
    assert after.engine_id == "0" and _finish(after)[1] == "length"


def test_engine_declared_dead_rejoins_as_a_new_incarnation(tiny_llama_dir, redis_url, redis_keys) -> None:
    """An engine whose heartbeat lapsed (say it was paused) and that the coordinator marked dead comes
    back by itself: a new incarnation, state ready, a fresh stream, and it serves again."""
    proc = subprocess.Popen([sys.executable, "-m", "redserve.cli", "engine", "--model", tiny_llama_dir, "--redis-url",
                             redis_url, "--key-prefix", redis_keys.prefix, "--dtype", "float32",
                             "--heartbeat-ttl", "1.5"], stdin=subprocess.DEVNULL)
    client = BrokerClient(redis_url, keys=redis_keys).start()
    redis_client = connect(redis_url)
    registry = EngineRegistry(redis_client, redis_keys)
    try:
        poll(lambda: client.ready_engines(), 120, "the engine to be ready")
        first = registry.get("0")["incarnation"]
        # What the coordinator's mark-dead script does to an engine whose heartbeat it found gone.
        redis_client.hset(redis_keys.engine("0"), mapping={"state": "dead", "dead_at": time.time()})
        redis_client.srem(redis_keys.engines(), "0")
        redis_client.delete(redis_keys.request_stream("0"))
        info = poll(lambda: (e := registry.get("0")) and e.get("state") == "ready" and e["incarnation"] != first and e,
                    30, "the engine to rejoin")
        assert info["alive"]
        poll(lambda: any(e["incarnation"] == info["incarnation"] for e in client.ready_engines()), 10,
             "the client to see the new incarnation")
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        with client.submit(AddRequest("after", "", [5, 6, 7], params, time.time(), time.time() + 60)) as handle:
            tokens = [t for out in handle for t in out.new_token_ids]
        assert len(tokens) == 5
        assert proc.poll() is None
    finally:
        client.stop()
        proc.terminate()
        proc.wait(timeout=30)
