"""Shared-memory message queue: real processes (spawn), ordering, overflow, back-pressure, cleanup."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import pickle
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.shm_queue import (
    MessageQueue,
    QueueClosed,
    QueueCorrupted,
    QueueHandle,
)

pytestmark = pytest.mark.timeout(60)
CTX = mp.get_context("spawn")
SHM = Path("/dev/shm")
REPO = Path(__file__).resolve().parents[1]


def _payload(i: int, size: int) -> bytes:
    return bytes([i % 251]) * size


def _sizes(n: int, max_size: int) -> list[int]:
    return [(i * 7919) % max_size for i in range(n)]


def _digest(sizes: list[int]) -> str:
    h = hashlib.sha256()
    for i, size in enumerate(sizes):
        h.update(i.to_bytes(8, "little") + _payload(i, size))
    return h.hexdigest()


def _reader_digest(handle: QueueHandle, rank: int, n: int, delay: float, conn) -> None:
    q = MessageQueue.attach(handle, rank)
    conn.send("attached")
    time.sleep(delay)
    h = hashlib.sha256()
    for i in range(n):
        msg = q.dequeue(timeout=30)
        if msg["i"] != i:
            conn.send(f"out of order: got {msg['i']} expected {i}")
            return
        h.update(i.to_bytes(8, "little") + msg["p"])
    conn.send(h.hexdigest())
    q.close()


def _reader_until_closed(handle: QueueHandle, rank: int, conn) -> None:
    q = MessageQueue.attach(handle, rank)
    conn.send("attached")
    got = []
    try:
        while True:
            got.append(q.dequeue(timeout=None))
    except QueueClosed:
        conn.send(("closed", got, time.monotonic()))


def _reader_idle_cpu(handle: QueueHandle, conn) -> None:
    q = MessageQueue.attach(handle, 0)
    start = time.process_time()
    with pytest.raises(TimeoutError):
        q.dequeue(timeout=1.0)
    conn.send(time.process_time() - start)


def _reader_read_one_then_wait(handle: QueueHandle, conn) -> None:
    q = MessageQueue.attach(handle, 0)
    conn.send(q.dequeue(timeout=30))
    time.sleep(60)


def _owner_then_wait(tag: str, wait_to_be_killed: bool, conn) -> None:
    q = MessageQueue.create(1, tag=tag, max_chunk_bytes=4096, max_chunks=4)
    conn.send(q.name)
    if not wait_to_be_killed:
        conn.recv()
        return  # exits without close(): atexit must unlink
    time.sleep(60)


def _echo_worker(request: QueueHandle, response: QueueHandle) -> None:
    requests = MessageQueue.attach(request, 0)
    replies = MessageQueue.attach_writer(response)
    try:
        while True:
            replies.enqueue(requests.dequeue(timeout=30), timeout=30)
    except QueueClosed:
        pass


@pytest.fixture
def tag() -> Iterator[str]:
    tag = f"test-{secrets.token_hex(4)}"
    yield tag
    leftover = sorted(p.name for p in SHM.glob(f"rs_mq_{tag}_*"))
    for name in leftover:
        (SHM / name).unlink()
    assert not leftover, f"segments left in /dev/shm: {leftover}"


def _start(target, *args) -> tuple[mp.Process, object]:
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    return proc, parent


def _recv(conn, timeout: float = 30.0):
    if not conn.poll(timeout):
        raise AssertionError("child process did not answer in time")
    return conn.recv()


def _stop(*procs: mp.Process) -> None:
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def test_order_and_wraparound_one_reader(tag: str) -> None:
    sizes = _sizes(3000, 600)
    with MessageQueue.create(1, tag=tag, max_chunk_bytes=1024, max_chunks=4) as q:
        proc, conn = _start(_reader_digest, q.handle(), 0, len(sizes), 0.0)
        assert _recv(conn) == "attached"
        for i, size in enumerate(sizes):
            q.enqueue({"i": i, "p": _payload(i, size)}, timeout=10)
        assert _recv(conn) == _digest(sizes)
        _stop(proc)


def test_every_reader_gets_every_message_with_overflow(tag: str) -> None:
    sizes = _sizes(400, 40_000)  # up to 10 slots: bigger than the whole 8-slot ring
    with MessageQueue.create(3, tag=tag, max_chunk_bytes=4096, max_chunks=8) as q:
        started = [_start(_reader_digest, q.handle(), rank, len(sizes), 0.0) for rank in range(3)]
        assert all(_recv(conn) == "attached" for _, conn in started)
        for i, size in enumerate(sizes):
            q.enqueue({"i": i, "p": _payload(i, size)}, timeout=10)
        assert [_recv(conn) for _, conn in started] == [_digest(sizes)] * 3
        _stop(*(proc for proc, _ in started))


def test_raw_overflow_boundaries_keep_order(tag: str) -> None:
    slot = 256
    sizes = [0, 1, slot - 1, slot, slot + 1, 2 * slot, 2 * slot + 1, 10 * slot + 3, 5, 3 * slot]
    with MessageQueue.create(2, tag=tag, max_chunk_bytes=slot, max_chunks=3) as q:
        readers = [MessageQueue.attach(q.handle(), rank) for rank in range(2)]
        got: list[list[bytes]] = [[], []]

        def read(rank: int) -> None:  # one thread per reader: a message may outsize the ring
            got[rank] = [bytes(readers[rank].dequeue_bytes(timeout=10)) for _ in sizes]

        threads = [threading.Thread(target=read, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for i, size in enumerate(sizes):
            q.enqueue_bytes(_payload(i, size), timeout=10)
        for thread in threads:
            thread.join(10)
        expected = [_payload(i, size) for i, size in enumerate(sizes)]
        assert got == [expected, expected]
        for reader in readers:
            reader.close()


def test_back_pressure_blocks_writer_until_slow_reader_reads(tag: str) -> None:
    sizes = [100] * 12
    with MessageQueue.create(1, tag=tag, max_chunk_bytes=1024, max_chunks=4) as q:
        proc, conn = _start(_reader_digest, q.handle(), 0, len(sizes), 0.5)
        assert _recv(conn) == "attached"
        start = time.monotonic()
        for i, size in enumerate(sizes):
            q.enqueue({"i": i, "p": _payload(i, size)}, timeout=10)
        assert time.monotonic() - start > 0.3
        assert _recv(conn) == _digest(sizes)
        _stop(proc)


def test_writer_timeout_names_the_lagging_reader(tag: str) -> None:
    with MessageQueue.create(2, tag=tag, max_chunk_bytes=128, max_chunks=2) as q:
        readers = [MessageQueue.attach(q.handle(), rank) for rank in range(2)]
        q.enqueue(1)
        q.enqueue(2)
        assert readers[0].dequeue() == 1
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"reader\(s\) \[1\]"):
            q.enqueue(3, timeout=0.1)
        assert 0.09 < time.monotonic() - start < 1.0
        assert readers[1].dequeue() == 1
        q.enqueue(3, timeout=1)
        assert [r.dequeue() for r in readers] == [2, 2]
        assert [r.dequeue() for r in readers] == [3, 3]
        with pytest.raises(TimeoutError, match="no message"):
            readers[0].dequeue(timeout=0.05)
        for reader in readers:
            reader.close()


def test_writer_timeout_mid_message_closes_queue(tag: str) -> None:
    with MessageQueue.create(1, tag=tag, max_chunk_bytes=64, max_chunks=2) as q:
        reader = MessageQueue.attach(q.handle(), 0)
        with pytest.raises(TimeoutError, match="half written"):
            q.enqueue_bytes(bytes(300), timeout=0.1)
        with pytest.raises(QueueClosed):
            reader.dequeue_bytes(timeout=1)
        reader.close()


def test_reader_timeout_mid_message_resumes(tag: str) -> None:
    with MessageQueue.create(2, tag=tag, max_chunk_bytes=64, max_chunks=2) as q:
        fast, slow = (MessageQueue.attach(q.handle(), rank) for rank in range(2))
        message = bytes(range(200))  # 4 chunks in a 2-slot ring
        writer = threading.Thread(target=q.enqueue_bytes, args=(message, 10))
        writer.start()
        with pytest.raises(TimeoutError):
            fast.dequeue_bytes(timeout=0.2)  # got 2 chunks; the rest waits for the slow reader
        assert slow.dequeue_bytes(timeout=5) == message
        assert fast.dequeue_bytes(timeout=5) == message
        writer.join(5)
        fast.close()
        slow.close()


def test_close_unblocks_reader_processes(tag: str) -> None:
    with MessageQueue.create(2, tag=tag, max_chunk_bytes=1024, max_chunks=4) as q:
        started = [_start(_reader_until_closed, q.handle(), rank) for rank in range(2)]
        assert all(_recv(conn) == "attached" for _, conn in started)
        q.enqueue("last words")
        time.sleep(0.3)  # readers are parked in their sleep backoff now
        closed_at = time.monotonic()
        q.close()
        for _, conn in started:
            status, got, when = _recv(conn)
            assert (status, got) == ("closed", ["last words"])
            assert when - closed_at < 0.5
        _stop(*(proc for proc, _ in started))


def test_owner_reader_close_unblocks_writer(tag: str) -> None:
    owner = MessageQueue.create(1, tag=tag, max_chunk_bytes=128, max_chunks=1, reader_rank=0)
    writer = MessageQueue.attach_writer(owner.handle())
    writer.enqueue("fills the ring")
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            writer.enqueue("blocked", timeout=10)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(0.1)
    owner.close()
    thread.join(5)
    assert len(errors) == 1 and isinstance(errors[0], QueueClosed)
    writer.close()


def test_idle_reader_uses_little_cpu(tag: str) -> None:
    """An idle reader naps (doubling up to 1 ms): a few % of a core, where a spinning one takes all of it (~1 s
    a second). ~1,000 wake-ups a second cost 2-4% on a quiet machine and 6.5-7.5% on a slow hour of the 2-core
    VM (5-6 Dec 2026, every commit alike), so the bound is 15%, and the best of up to three seconds counts."""
    measured = []
    with MessageQueue.create(1, tag=tag) as q:
        for _ in range(3):
            proc, conn = _start(_reader_idle_cpu, q.handle())
            measured.append(_recv(conn))
            _stop(proc)
            if measured[-1] < 0.15:
                break
    assert min(measured) < 0.15, f"idle reader used {measured} s of CPU in 1 s tries"


def test_name_has_tag_and_pid_and_close_unlinks(tag: str) -> None:
    q = MessageQueue.create(2, tag=tag)
    assert q.name.startswith(f"rs_mq_{tag}_{os.getpid()}_")
    assert (SHM / q.name).exists()
    reader = MessageQueue.attach(q.handle(), 1)
    reader.close()
    assert (SHM / q.name).exists(), "a reader's close must not unlink"
    q.close()
    q.close()
    assert not (SHM / q.name).exists()
    with pytest.raises(FileNotFoundError, match="closed it or died"):
        MessageQueue.attach(q.handle(), 0)


def test_reader_in_its_own_process_tree_does_not_unlink(tag: str) -> None:
    # A reader with its own resource tracker must not register the segment: that tracker
    # would unlink it when the reader exits (CPython's shared_memory tracking issue).
    with MessageQueue.create(1, tag=tag) as q:
        q.enqueue("hello")
        code = (
            "import sys; from worker.shm_queue import MessageQueue, QueueHandle;"
            "q = MessageQueue.attach(QueueHandle(*sys.argv[1:2], 1, *map(int, sys.argv[2:])), 0);"
            "import multiprocessing.resource_tracker as rt; rt.ensure_running();"
            "assert q.dequeue(timeout=10) == 'hello'"
        )
        h = q.handle()
        args = [sys.executable, "-c", code, h.name, str(h.max_chunks), str(h.max_chunk_bytes)]
        result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        assert "leaked" not in result.stderr and "Traceback" not in result.stderr
        time.sleep(0.3)  # the reader's tracker exits after it and would unlink now
        assert (SHM / q.name).exists()


def test_killed_reader_leaves_nothing(tag: str) -> None:
    q = MessageQueue.create(1, tag=tag)
    proc, conn = _start(_reader_read_one_then_wait, q.handle())
    q.enqueue({"x": 1})
    assert _recv(conn) == {"x": 1}
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    q.close()
    assert not (SHM / q.name).exists()


def test_owner_exit_without_close_unlinks(tag: str) -> None:
    proc, conn = _start(_owner_then_wait, tag, False)
    name = _recv(conn)
    assert (SHM / name).exists()
    conn.send("exit")
    proc.join(10)
    assert proc.exitcode == 0
    assert not (SHM / name).exists()


def test_engine_owned_response_queue_and_tensors_round_trip(tag: str) -> None:
    import torch

    requests = MessageQueue.create(1, tag=tag, max_chunk_bytes=64 * 1024, max_chunks=4)
    replies = MessageQueue.create(1, tag=tag, max_chunk_bytes=64 * 1024, max_chunks=4, reader_rank=0)
    proc = CTX.Process(target=_echo_worker, args=(requests.handle(), replies.handle()), daemon=True)
    proc.start()
    tensors = [
        torch.randn(3, 5).to(torch.bfloat16),
        torch.randn(7, dtype=torch.float32),
        torch.arange(-5, 5, dtype=torch.int64).reshape(2, 5),
        torch.empty(0, 4),
        torch.tensor(3.5, dtype=torch.float16),
        torch.tensor([True, False, True]),
        torch.randn(4, 6).t(),
        torch.randn(300, 100),  # 120 KB: overflow path with a tensor inside
    ]
    message = {"step": 7, "tensors": tensors, 3: ("a", b"b", None, 1.5)}
    requests.enqueue(message, timeout=30)
    echoed = replies.dequeue(timeout=60)
    assert echoed["step"] == 7 and echoed[3] == ["a", b"b", None, 1.5]
    for sent, back in zip(tensors, echoed["tensors"], strict=True):
        assert back.dtype == sent.dtype and back.shape == sent.shape
        assert torch.equal(back, sent)
    requests.close()
    proc.join(10)
    assert proc.exitcode == 0
    replies.close()
    assert not (SHM / replies.name).exists() and not (SHM / requests.name).exists()


def test_second_writer_is_detected_by_sequence_numbers(tag: str) -> None:
    owner = MessageQueue.create(1, tag=tag, max_chunk_bytes=128, max_chunks=1, reader_rank=0)
    first, second = MessageQueue.attach_writer(owner.handle()), MessageQueue.attach_writer(owner.handle())
    first.enqueue("a")
    assert owner.dequeue() == "a"
    second.enqueue("b")
    with pytest.raises(QueueCorrupted, match="expected chunk seq 1"):
        owner.dequeue(timeout=1)
    first.close()
    second.close()
    owner.close()


def test_handle_travels_by_pickle_and_msgpack(tag: str) -> None:
    from worker.serialization import decode, encode

    with MessageQueue.create(2, tag=tag, max_chunk_bytes=512, max_chunks=3) as q:
        handle = q.handle()
        assert pickle.loads(pickle.dumps(handle)) == handle
        assert QueueHandle.from_dict(decode(encode(handle.to_dict()))) == handle
        with pytest.raises(TypeError, match="handle"):
            pickle.dumps(q)
        with pytest.raises(ValueError, match="not the queue"):
            MessageQueue.attach(QueueHandle(handle.name, 2, 4, 512), 0)


def test_invalid_arguments_raise_value_error(tag: str) -> None:
    with pytest.raises(ValueError, match="tag"):
        MessageQueue.create(1, tag="bad/tag")
    with pytest.raises(ValueError, match="n_readers"):
        MessageQueue.create(0, tag=tag)
    with pytest.raises(ValueError, match="reader_rank"):
        MessageQueue.create(2, tag=tag, reader_rank=2)
    with MessageQueue.create(2, tag=tag) as q:
        with pytest.raises(ValueError, match="reader_rank"):
            MessageQueue.attach(q.handle(), 2)
        with pytest.raises(RuntimeError, match="only readers"):
            q.dequeue(timeout=0)


def test_serialization_round_trip_and_rules() -> None:
    import torch

    from worker.serialization import decode, encode

    obj = {
        "ints": [0, -1, 2**63 - 1],
        "tuple": (1, (2, 3)),
        "bytes": b"\x00\xff",
        "none": None,
        "flag": True,
        "f": 0.25,
        "s": "héllo",
        5: "int key",
        "t": [torch.ones(2, 3, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.int64)],
    }
    back = decode(encode(obj))
    assert back["tuple"] == [1, [2, 3]] and back[5] == "int key" and back["s"] == "héllo"
    assert back["t"][0].dtype == torch.bfloat16 and torch.equal(back["t"][0], obj["t"][0])
    assert back["t"][1].shape == (0,) and back["t"][1].dtype == torch.int64
    back["t"][0].add_(1)  # tensors from a bytes message are writable copies
    with pytest.raises(TypeError, match="convert dataclasses"):
        encode({"x": object()})
    with pytest.raises(TypeError):
        encode({1, 2})
