"""Pipeline stages on a worker host (`redserve worker`), on this machine's loopback: the link's handshake and
liveness, the Redis rendezvous store, and the whole path: an engine whose last stage a worker host runs gives
the tokens of PP=1, a dead worker on the host ends the engine's requests and leaves nothing behind, and the
host rejoins the engine's next start by itself, whatever its layout (PP=2, then PP=2 x TP=2). (`tests/test_multihost_pp.py` runs the same across network
namespaces, with a cut link.)"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from engine_helpers import requires_devices
from parallel_helpers import shm_segments, submit, wait_engine_ready, wait_gone
from stack_procs import process_tree, title, wait_for

from broker.client import BrokerClient
from engine import LLM
from protocol.sampling_params import SamplingParams
from redserve.status import collect_status, format_status
from worker.redis_store import RedisStore, clear
from worker.remote_link import (
    CONTROL,
    HEARTBEAT,
    REPLY,
    STEP,
    Link,
    LinkClosed,
    interface_of,
    local_address_towards,
    new_key,
    split_reply,
)

PROMPTS = [[5, 17, 99, 4, 250, 31], list(range(40, 140)), [7]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


# --- the link ---------------------------------------------------------------------------------------------------


def _pair(engine_key: str, host_key: str, timeout: float = 5.0) -> tuple[Link | Exception, Link | Exception]:
    """Handshake an engine end and a host end over loopback; each side's Link or the exception it raised."""
    server = socket.create_server(("127.0.0.1", 0))
    result: dict = {}

    def accept() -> None:
        sock, _ = server.accept()
        try:
            result["engine"] = Link.accept(sock, engine_key, timeout)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            result["engine"] = exc

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        host = Link.connect(server.getsockname()[:2], host_key, timeout)
    except Exception as exc:  # noqa: BLE001
        host = exc
    thread.join(10)
    server.close()
    return result["engine"], host


def test_link_carries_frames_both_ways_after_the_handshake() -> None:
    key = new_key()
    engine, host = _pair(key, key)
    try:
        big = os.urandom(3 << 20)
        engine.send(STEP, big)
        host.send_reply(3, b"reply")
        host.send_control({"type": "ready"})
        assert host.recv() == (STEP, bytearray(big))
        kind, payload = engine.recv()
        assert kind == REPLY and split_reply(payload) == (3, bytearray(b"reply"))
        assert engine.recv()[0] == CONTROL
    finally:
        engine.close()
        host.close()


def test_a_host_without_the_key_is_turned_away_and_cannot_fake_the_engine() -> None:
    engine, host = _pair(new_key(), new_key())
    assert isinstance(engine, LinkClosed) and "wrong key" in str(engine)
    assert isinstance(host, (LinkClosed, OSError))


def test_silence_past_the_timeout_is_a_dead_link_and_heartbeats_keep_it_alive() -> None:
    key = new_key()
    engine, host = _pair(key, key, timeout=1.0)
    try:
        done = threading.Event()
        host.start_heartbeat(done.is_set)
        started = time.monotonic()
        while time.monotonic() - started < 2.5:  # heartbeats every 0.25 s: no timeout
            assert engine.recv()[0] == HEARTBEAT
        done.set()
        with pytest.raises(LinkClosed, match="nothing from"):
            while True:
                engine.recv()
        assert time.monotonic() - started < 2.5 + 1.0 + 1.0
    finally:
        engine.close()
        host.close()


# --- the rendezvous store ---------------------------------------------------------------------------------------


def _send_over_gloo(rank: int, redis_url: str, prefix: str, out: mp.Queue) -> None:
    store = RedisStore(redis_url, prefix, timeout=30)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    group = dist.ProcessGroupGloo(store, rank, 2, options)
    tensor = torch.arange(6, dtype=torch.float32) * (rank + 1)
    if rank == 0:
        group.send([tensor], 1, 0).wait()
    else:
        group.recv([tensor], 0, 0).wait()
        out.put(tensor.tolist())


def test_gloo_meets_through_the_redis_store_and_the_keys_can_be_cleared(redis_url, redis_client, redis_keys) -> None:
    prefix = redis_keys.engine_rendezvous("0", "n1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_send_over_gloo, args=(rank, redis_url, prefix, out)) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert out.get(timeout=5) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert list(redis_client.scan_iter(match=prefix + "*")), "the rendezvous left no keys to clear"
    assert all(0 < redis_client.pttl(k) <= 600_000 for k in redis_client.scan_iter(match=prefix + "*"))
    assert clear(redis_client, prefix) > 0
    assert not list(redis_client.scan_iter(match=prefix + "*"))


def test_store_operations_match_torch_semantics(redis_url, redis_keys) -> None:
    store = RedisStore(redis_url, redis_keys.engine_rendezvous("0", "n2"), timeout=0.5)
    assert store.add("counter", 2) == 2 and store.add("counter", 3) == 5
    store.set("k", b"v")
    assert store.get("k") == b"v" and store.check(["k"]) and not store.check(["k", "missing"])
    assert store.compare_set("k", b"other", b"new") == b"v"
    assert store.compare_set("k", b"v", b"new") == b"new" and store.get("k") == b"new"
    with pytest.raises(TimeoutError, match="not set within"):
        store.get("missing")
    assert store.delete_key("k") and not store.check(["k"])


# --- the whole path: an engine and a worker host ----------------------------------------------------------------


@pytest.fixture(scope="module")
def pp1_tokens(tiny_llama_dir: str) -> list[list[int]]:
    llm = LLM(tiny_llama_dir, dtype="float32")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _cli(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "redserve.cli", *argv], stdin=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _workers(pid: int) -> dict[str, int]:
    return {title(p): p for p in process_tree(pid)[1:] if title(p).startswith("redserve-worker-0")}


def _generate(client: BrokerClient, tag: str) -> list[list[int]]:
    results = []
    for i, prompt in enumerate(PROMPTS):
        tokens = []
        with submit(client, f"{tag}{i}", prompt, GREEDY) as handle:
            for out in handle:
                assert out.error_code is None, out.error_message
                tokens += out.new_token_ids
        results.append(tokens)
    return results


@requires_devices(4)  # on CUDA: the engine and the "other host" share this machine's GPUs (TP=2 x PP=2 at the end)
def test_a_worker_host_runs_the_last_stage_fails_with_its_worker_and_rejoins(tiny_llama_dir, redis_url, redis_keys,
                                                                          redis_client, pp1_tokens) -> None:
    common = ("--redis-url", redis_url, "--key-prefix", redis_keys.prefix)
    engine_argv = ("engine", "--model", tiny_llama_dir, *common, "--dtype", "float32", "-pp", "2",
                   "--remote-stages", "1", "--worker-link-timeout", "3")
    host = _cli("worker", *common, "--engine-id", "0")
    engine = _cli(*engine_argv)
    client = BrokerClient(redis_url, keys=redis_keys, max_migrations=0, replace_wait=3).start()
    try:
        wait_engine_ready(client, engine)
        assert sorted(_workers(engine.pid)) == ["redserve-worker-0-0-0"]
        host_workers = _workers(host.pid)
        assert sorted(host_workers) == ["redserve-worker-0-1-0"]
        published = {k.decode(): v.decode() for k, v in redis_client.hgetall(redis_keys.engine_workers("0")).items()}
        assert published["stages"] == "1" and published["address"] == "127.0.0.1" and len(published["key"]) == 64
        status = collect_status(redis_client, redis_keys)
        hosts = status["engines"][0]["worker_hosts"]["hosts"]
        assert [(h["stages"], h["state"]) for h in hosts] == [([1], "ready")]
        assert "remote pipeline stages" in format_status(status)
        assert published["key"] not in json.dumps(status, default=str), "status must not show the link key"
        assert _generate(client, "a") == pp1_tokens

        # A worker on the host dies mid-stream: the engine ends its requests and exits; nothing is left over.
        long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
        handle = submit(client, "long", PROMPTS[0], long)
        assert handle.get(timeout=60) is not None
        engine_workers = list(_workers(engine.pid).values())
        os.kill(host_workers["redserve-worker-0-1-0"], signal.SIGKILL)
        started = time.monotonic()
        last = None
        for out in handle:
            last = out
        assert last is not None and last.finish_reason == "error"
        assert time.monotonic() - started < 20
        assert engine.wait(timeout=30) != 0
        assert wait_gone(engine_workers + list(host_workers.values()), 15) == []
        wait_for(lambda: not shm_segments(engine.pid), 10, "the engine's segments to go")
        wait_for(lambda: not redis_client.exists(redis_keys.engine_workers("0")), 10, "the workers key to go")
        assert host.poll() is None, "the worker host must outlive its engine"

        # The engine starts again (as its supervisor would), now with TP = 2 inside each stage: the host joins the
        # new start by itself and runs what the engine's config says (ranks 2 and 3, a TP group of its own).
        engine = _cli(*engine_argv, "--tensor-parallel-size", "2")
        wait_engine_ready(client, engine)
        assert sorted(_workers(host.pid)) == ["redserve-worker-0-1-0", "redserve-worker-0-1-1"]
        assert _generate(client, "b") == pp1_tokens
    finally:
        client.stop()
        _stop(engine)
        _stop(host)


def test_the_address_towards_a_peer_and_its_interface_are_found() -> None:
    assert local_address_towards("127.0.0.1", 6379) == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"  # NCCL_SOCKET_IFNAME for a pipeline across hosts on CUDA
    assert interface_of("198.18.255.254") is None
