"""``redserve worker``: a host that runs an engine's remote pipeline stages (``worker.remote_stages`` is the
engine's side).

The host needs only the Redis URL and the engine id. It reads ``rs:engine:{id}:workers``, connects to the
address published there, proves the link key (``worker.remote_link``), says which stages it takes, and gets
the engine config, its global ranks and the pipeline store's prefix. Then it runs one session:

- It spawns one worker process per rank (``worker.worker_proc.worker_main``, titles as on the engine's host:
  ``redserve-worker-<dp>-<stage>-<tp rank>``), on a shm broadcast queue and response queues of its own, a
  file store for its TP groups, and the Redis store for the pipeline group, bound to this host's address.
- A relay thread writes each STEP frame, byte for byte, into the shm queue; one thread per rank sends that
  rank's replies back as REPLY frames. READY goes to the engine once every local worker is up, FAILED with
  the error if one is not, or if one dies later.
- The session ends when the engine's link closes or goes silent (engine stopped, died, or the network cut),
  or when a worker dies: the relay closes the link and the queues, and its workers exit (death pipes).

After a session the host waits for the engine's next start (a new nonce under the key) and joins again, so
an engine restarted by its supervisor, or a link restored after a cut, gets its stages back with no one
touching this host. ``--once`` exits after the first session instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from multiprocessing import get_context
from multiprocessing.connection import wait

import redis

from broker.connection import connect
from broker.keys import RedisKeys
from worker.multiproc_executor import worker_title
from worker.remote_link import (
    CONTROL,
    HEARTBEAT,
    STEP,
    Link,
    LinkClosed,
    decode_control,
    local_address_towards,
)
from worker.shm_queue import MessageQueue, QueueClosed
from worker.worker_proc import stop_workers, worker_main

logger = logging.getLogger(__name__)

POLL_SECONDS = 1.0


class Rejected(RuntimeError):
    """The engine turned this host away (its stages are taken or unknown)."""


class WorkerHost:
    def __init__(self, redis_url: str, engine_id: str, key_prefix: str = "rs", stages: list[int] | None = None,
                 address: str | None = None, once: bool = False):
        self.redis_url, self.engine_id = redis_url, engine_id
        self.keys = RedisKeys(key_prefix)
        self.stages, self.address, self.once = stages, address, once
        self.stop = threading.Event()
        self.redis = connect(redis_url, socket_timeout=5, connect_timeout=5)

    def install_signal_handlers(self) -> None:
        def handle(*_: object) -> None:
            self.stop.set()
        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def run(self) -> int:
        """Join each start of the engine until stopped (see the module docstring); 0 on a clean stop."""
        joined: set[str] = set()
        unreachable: set[str] = set()
        quiet_until = 0.0
        logger.info("worker host: waiting for engine %s to publish its remote stages", self.engine_id)
        while not self.stop.is_set():
            try:
                info = {k.decode(): v.decode() for k, v in
                        self.redis.hgetall(self.keys.engine_workers(self.engine_id)).items()}
            except redis.RedisError as exc:
                if time.monotonic() > quiet_until:
                    logger.warning("worker host: cannot read Redis (%s); retrying", exc)
                    quiet_until = time.monotonic() + 30
                self.stop.wait(POLL_SECONDS)
                continue
            if not info or info.get("nonce") in joined:
                self.stop.wait(POLL_SECONDS)
                continue
            try:
                code = self._join(info)
            except Rejected as exc:
                logger.warning("worker host: engine %s turned this host away: %s", self.engine_id, exc)
                joined.add(info["nonce"])
                code = 1
            except (LinkClosed, OSError) as exc:
                if info["nonce"] not in unreachable:  # once per engine start: a dead engine's key may linger
                    unreachable.add(info["nonce"])
                    logger.warning("worker host: could not join engine %s at %s:%s: %s; retrying", self.engine_id,
                                   info.get("address"), info.get("port"), exc)
                self.stop.wait(POLL_SECONDS)
                continue
            joined.add(info["nonce"])
            if self.once:
                return code
        return 0

    def _join(self, info: dict[str, str]) -> int:
        engine_address = (info["address"], int(info["port"]))
        link = Link.connect(engine_address, info["key"], float(info["link_timeout"]))
        session_over = threading.Event()
        link.start_heartbeat(session_over.is_set)
        try:
            address = self.address or local_address_towards(*engine_address)
            link.send_control({"type": "hello", "stages": self.stages, "host": socket.gethostname(),
                               "pid": os.getpid(), "address": address})
            while True:
                kind, payload = link.recv()
                if kind == CONTROL:
                    break
                if kind != HEARTBEAT:
                    raise LinkClosed(f"unexpected {kind!r} frame before setup")
            setup = decode_control(payload)
            if setup["type"] == "rejected":
                raise Rejected(setup.get("reason", "?"))
            return Session(setup, link, self.redis_url, address, self.stop).run()
        finally:
            session_over.set()
            link.close()


class Session:
    """One engine start's stages on this host (see the module docstring)."""

    def __init__(self, setup: dict, link: Link, redis_url: str, address: str, stop: threading.Event):
        self.link, self.stop = link, stop
        self.ranks: list[int] = setup["ranks"]
        config = setup["config"]
        tp, pp, dp_rank = config["tensor_parallel_size"], config["pipeline_parallel_size"], setup["dp_rank"]
        self.store_timeout = float(setup["store_timeout"])
        self.gone = threading.Event()
        self.reason = ""
        tag = f"h{dp_rank}"
        self.broadcast = MessageQueue.create(len(self.ranks), tag=tag)
        self.responses = [MessageQueue.create(1, tag=f"{tag}r{rank}", reader_rank=0) for rank in self.ranks]
        self.rendezvous_dir = tempfile.mkdtemp(prefix=f"redserve-worker-host-{os.getpid()}-")  # mode 0700
        pp_link = {"redis_url": redis_url, "prefix": setup["store_prefix"], "address": address,
                   "timeout": self.store_timeout}
        ctx = get_context("spawn")
        self.procs, self._death_writers, self._ready = [], [], {}
        for local_rank, rank in enumerate(self.ranks):
            ready_reader, ready_writer = ctx.Pipe(duplex=False)
            death_reader, death_writer = ctx.Pipe(duplex=False)
            title = worker_title(dp_rank, rank, tp, pp)
            proc = ctx.Process(target=worker_main, name=title, daemon=True,
                               args=(config, rank, title, os.path.join(self.rendezvous_dir, "store"),
                                     self.broadcast.handle(), self.responses[local_rank].handle(), ready_writer,
                                     death_reader, pp_link, local_rank))
            proc.start()
            ready_writer.close()
            death_reader.close()
            self.procs.append(proc)
            self._death_writers.append(death_writer)
            self._ready[rank] = ready_reader
        logger.info("worker host: started ranks %s for engine stages (pp %d, tp %d)", self.ranks, pp, tp)

    def run(self) -> int:
        threads = [threading.Thread(target=self._relay_steps, name="relay-steps", daemon=True)]
        threads += [threading.Thread(target=self._relay_replies, args=(local_rank, rank), name=f"relay-replies-{rank}",
                                     daemon=True) for local_rank, rank in enumerate(self.ranks)]
        for thread in threads:
            thread.start()
        try:
            error = self._wait_ready()
            if error:
                logger.error("worker host: %s", error)
                with contextlib.suppress(LinkClosed):
                    self.link.send_control({"type": "failed", "error": error})
                return 1
            self.link.send_control({"type": "ready"})
            logger.info("worker host: ranks %s READY", self.ranks)
            return self._watch()
        except LinkClosed as exc:
            logger.warning("worker host: the engine's link is gone: %s", exc)
            return 1
        finally:
            self.close()

    def _wait_ready(self) -> str | None:
        deadline = time.monotonic() + self.store_timeout
        pending = dict(self._ready)
        while pending:
            if self.gone.is_set() or self.stop.is_set():
                return f"stopped while starting: {self.reason or 'signal'}"
            if time.monotonic() > deadline:
                return f"ranks {sorted(pending)} not ready after {self.store_timeout:.0f}s"
            for conn in wait(list(pending.values()) + [p.sentinel for p in self.procs], timeout=0.5):
                rank = next((r for r, c in pending.items() if c is conn), None)
                if rank is None:
                    dead = next((p for p in self.procs if not p.is_alive()), None)
                    if dead is not None:
                        return f"{dead.name} exited with code {dead.exitcode} during startup"
                    continue
                try:
                    msg = conn.recv()
                except EOFError:
                    return f"rank {rank} closed its ready pipe during startup"
                if msg["status"] != "ready":
                    return f"rank {rank} failed to start: {msg['error']}"
                del pending[rank]
        return None

    def _watch(self) -> int:
        """Until the engine goes or a worker dies; 0 when the engine ended the session."""
        sentinels = {p.sentinel: p for p in self.procs}
        while not self.stop.is_set():
            if self.gone.is_set():
                logger.info("worker host: the engine ended the session (%s)", self.reason)
                return 0
            done = wait(list(sentinels), timeout=0.5)
            if done:
                proc = sentinels[done[0]]
                if self.gone.wait(1.0):  # SHUTDOWN: workers exit, then the engine closes the link
                    continue
                error = f"{proc.name} (pid {proc.pid}) died with exit code {proc.exitcode}"
                logger.error("worker host: %s", error)
                with contextlib.suppress(LinkClosed):
                    self.link.send_control({"type": "failed", "error": error})
                return 1
        return 0

    def _relay_steps(self) -> None:
        try:
            while True:
                kind, payload = self.link.recv()
                if kind == STEP:
                    self.broadcast.enqueue_bytes(payload)
                elif kind != HEARTBEAT:
                    raise LinkClosed(f"unexpected {kind!r} frame")
        except (LinkClosed, QueueClosed) as exc:
            self.reason = str(exc)
            self.gone.set()

    def _relay_replies(self, local_rank: int, rank: int) -> None:
        queue = self.responses[local_rank]
        while not self.gone.is_set():
            try:
                data = queue.dequeue_bytes(timeout=0.5)
            except TimeoutError:
                continue
            except QueueClosed:
                return
            try:
                self.link.send_reply(rank, data)
            except LinkClosed as exc:
                self.reason = str(exc)
                self.gone.set()
                return

    def close(self) -> None:
        self.gone.set()
        self.link.close()
        stop_workers(self.procs, self._death_writers)
        self.broadcast.close()
        for queue in self.responses:
            queue.close()
        shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
        logger.info("worker host: ranks %s stopped", self.ranks)
