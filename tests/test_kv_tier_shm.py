"""broker.kv_tier_shm: the KV tier's shared-memory pool, alone, shared by processes, under SIGKILL, and through
two real engines (the second loads the prefix the first stored)."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

import broker.kv_tier_shm as shm
from broker.kv_tier_shm import ShmKVTierStore, parse_shm_url, parse_size
from broker.kv_tier_store import KVTierStore, open_store

REPO = Path(__file__).resolve().parents[1]
NS = "0123456789ab"
KB64 = 64 * 1024


def made(block_hash: int, size: int = KB64) -> bytes:
    """A deterministic value that proves its own wholeness (see ``check``)."""
    payload = block_hash.to_bytes(8, "little") + random.Random(block_hash).randbytes(size - 40)
    return hashlib.blake2b(payload, digest_size=32).digest() + payload


def check(value: bytes, block_hash: int) -> None:
    payload = value[32:]
    assert hashlib.blake2b(payload, digest_size=32).digest() == value[:32], f"torn value of block {block_hash}"
    assert int.from_bytes(payload[:8], "little") == block_hash


# The child processes: each opens the pool at argv[1] and does what argv[2] says.
CHILD = r"""
import fcntl, hashlib, itertools, os, random, sys, time
from broker.kv_tier_shm import ShmKVTierStore

def made(h, size):
    payload = h.to_bytes(8, "little") + random.Random(h).randbytes(size - 40)
    return hashlib.blake2b(payload, digest_size=32).digest() + payload

url, mode = sys.argv[1], sys.argv[2]
store = ShmKVTierStore(url, "0123456789ab")
if mode == "share":
    print(" ".join(hashlib.sha256(v).hexdigest() for v in store.get_run([100, 101, 102])), flush=True)
    store.put([(h, made(h, 65536)) for h in range(5)])
    print("done", flush=True)
elif mode == "mid-write":
    real = os.write
    def half(fd, data):
        real(fd, bytes(data[:len(data) // 2]))
        print("mid", flush=True)
        time.sleep(600)
    os.write = half
    store.put([(7, made(7, 65536))])
elif mode == "locks":
    for fd in store._fds:
        fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(600)
elif mode == "churn":
    for i in itertools.count():
        store.put([(i % 64, made(i % 64, 100_000))])
        if i == 0:
            print("go", flush=True)
"""


def read_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the child said nothing"
    return proc.stdout.readline().strip()


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def assert_locks_free(pool: Path) -> None:
    for name in (".state", ".evict.lock"):
        fd = os.open(pool / name, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError when a dead writer still held it
        finally:
            os.close(fd)


def pool_files(store: ShmKVTierStore) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in store.dir.iterdir()}


def pool_bytes(store: ShmKVTierStore) -> int:
    return sum(-(-p.stat().st_size // mmap.PAGESIZE) * mmap.PAGESIZE
               for space in store.pool.iterdir() if space.is_dir() for p in space.iterdir())


@pytest.fixture
def pool_url():
    name = f"redserve-kv-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield f"shm:///{name}?maxmemory=1mb"
    shutil.rmtree(parse_shm_url(f"shm:///{name}")[0], ignore_errors=True)


@pytest.fixture
def spawn(pool_url):
    """Start a child on the pool (``CHILD``); any still running at teardown is killed before the pool goes."""
    children: list[subprocess.Popen] = []

    def start(mode: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        children.append(subprocess.Popen([sys.executable, "-c", CHILD, pool_url, mode], stdout=subprocess.PIPE,
                                         text=True, env=env))
        return children[-1]

    yield start
    for child in children:
        if child.poll() is None:
            kill(child)
        child.stdout.close()


@pytest.fixture
def store(pool_url):
    store = ShmKVTierStore(pool_url, NS)
    yield store
    store.close()


def test_urls_and_sizes_read_as_valkey_does():
    assert [parse_size(s) for s in ("1048576", "100k", "100kb", "512mb", "4GB", "2g")] == [
        1048576, 100_000, 102_400, 512 << 20, 4 << 30, 2_000_000_000]
    assert parse_shm_url("shm://") == (shm.SHM_ROOT / "redserve-kv", 1 << 30)
    assert parse_shm_url("shm:///pool-1?maxmemory=64mb") == (shm.SHM_ROOT / "pool-1", 64 << 20)
    for bad in ("shm://otherhost/pool", "shm:///../etc", "shm:///a/b", "shm:///p?maxmemory=lots",
                "shm:///p?maxmemory=0", "shm:///p?size=1gb", "redis://localhost"):
        with pytest.raises(ValueError):
            parse_shm_url(bad)
    assert isinstance(open_store("redis://127.0.0.1:1/0", NS), KVTierStore)


def test_get_run_is_the_leading_run_and_a_held_block_is_not_counted_twice(store, pool_url):
    assert isinstance(open_store(pool_url, NS), ShmKVTierStore)
    store.put([(1, made(1)), (2, made(2)), (4, made(4))])
    store.describe({"model": "tiny"})
    assert store.get_run([1, 2, 3, 4]) == [made(1), made(2)]
    assert store.get_run([3, 1]) == []
    store.put([(2, made(2))])
    assert store.memory() == {"used_bytes": 3 * KB64, "max_bytes": 1 << 20, "evicted_keys": 0}
    assert sorted(pool_files(store)) == ["0000000000000001", "0000000000000002", "0000000000000004", "meta.json"]
    assert [oct(p.stat().st_mode & 0o777) for p in (store.pool, store.dir, Path(store.key(1)))] == [
        "0o700", "0o700", "0o600"]


def test_eviction_keeps_the_pool_under_maxmemory_and_drops_the_least_recently_read(store):
    store.put([(h, made(h)) for h in range(10)])
    assert store.get_run([0]) == [made(0)]  # block 0 is now the most recently used of the ten
    for h in range(10, 20):
        store.put([(h, made(h))])
        assert store.memory()["used_bytes"] <= 1 << 20
    assert store.memory()["evicted_keys"] == 6
    assert store.memory()["used_bytes"] == pool_bytes(store)
    assert [h for h in range(20) if not store.get_run([h])] == [1, 2, 3, 4, 5, 6]


def test_two_processes_share_a_pool(store, spawn):
    store.put([(100, made(100)), (101, made(101))])
    child = spawn("share")
    assert read_line(child).split() == [hashlib.sha256(made(h)).hexdigest() for h in (100, 101)]
    assert read_line(child) == "done"
    assert child.wait() == 0
    assert store.get_run(range(5)) == [made(h) for h in range(5)]
    assert store.memory()["used_bytes"] == 7 * KB64


def test_a_writer_killed_mid_value_or_holding_the_locks_leaves_the_pool_whole(store, spawn, monkeypatch):
    child = spawn("mid-write")
    assert read_line(child) == "mid"
    kill(child)
    assert store.get_run([7]) == []
    assert any(name.startswith(shm.TEMP_PREFIX) for name in pool_files(store))
    child = spawn("locks")
    assert read_line(child) == "locked"
    kill(child)
    assert_locks_free(store.pool)
    store.put([(7, made(7))])
    monkeypatch.setattr(shm, "STALE_TEMP_SECONDS", 0.0)
    store.evict()
    assert pool_files(store) == {"0000000000000007": KB64}
    assert store.get_run([7]) == [made(7)]


def test_writers_killed_at_random_moments_never_show_a_torn_value(store, spawn, monkeypatch):
    rng = random.Random(30)
    for _ in range(5):
        child = spawn("churn")
        assert read_line(child) == "go"
        reads, goal = 0, rng.randrange(50, 400)
        while reads < goal:
            for h in range(64):
                for value in store.get_run([h]):
                    check(value, h)
                    reads += 1
        kill(child)
    assert_locks_free(store.pool)
    for name in pool_files(store):
        if not name.startswith(shm.TEMP_PREFIX):
            check(Path(store.dir / name).read_bytes(), int(name, 16))
    monkeypatch.setattr(shm, "STALE_TEMP_SECONDS", 0.0)
    store.evict()
    assert not [name for name in pool_files(store) if name.startswith(shm.TEMP_PREFIX)]
    assert store.memory()["used_bytes"] == pool_bytes(store) <= 1 << 20


def test_a_pool_open_to_others_is_refused_and_a_removed_pool_is_made_again(store, pool_url):
    store.put([(1, made(1))])
    shutil.rmtree(store.pool)
    store.put([(2, made(2))])
    assert store.get_run([2]) == [made(2)]
    os.chmod(store.pool, 0o755)
    with pytest.raises(PermissionError, match="closed to others"):
        ShmKVTierStore(pool_url, NS)


def test_without_dev_shm_the_pool_lives_in_the_temp_dir(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(shm, "SHM_ROOT", tmp_path / "no-shm")
    name = f"redserve-kv-test-{uuid.uuid4().hex[:8]}"
    with caplog.at_level(logging.WARNING, logger="broker.kv_tier_shm"):
        store = ShmKVTierStore(f"shm:///{name}", NS)
    try:
        assert store.pool == Path(tempfile.gettempdir()) / name
        assert "is missing" in caplog.text
    finally:
        store.close()
        shutil.rmtree(store.pool)


def test_a_fresh_engine_loads_the_prefix_another_engine_stored(tiny_llama_dir, pool_url):
    from engine_helpers import BLOCK, greedy, make_llm, random_prompt, token_ids

    url = pool_url.replace("1mb", "64mb")
    prompt = random_prompt(300, seed=30)
    first = make_llm(tiny_llama_dir, kv_tier_url=url)
    try:
        expected = token_ids(first.generate([prompt], greedy(), use_tqdm=False))[0]
    finally:
        first.shutdown()  # waits for its store thread: every block it computed is in the pool
    assert first.engine.kv_tier.stats()["stored_blocks"] >= 300 // BLOCK
    second = make_llm(tiny_llama_dir, kv_tier_url=url)
    try:
        got = token_ids(second.generate([prompt], greedy(), use_tqdm=False))[0]
        stats = second.engine.kv_tier.stats()
    finally:
        second.shutdown()
    assert got == expected
    assert stats["hit_blocks"] == (300 - 1) // BLOCK
    assert stats["corrupt_blocks"] == 0 and stats["errors"] == 0
