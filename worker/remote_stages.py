"""The engine's side of pipeline stages on other hosts: publish where to join, admit worker hosts, fan steps out
to them and route their replies back.

An engine started with ``remote_stages = k`` runs the first ``P - k`` stages' workers itself and waits for
``redserve worker`` processes on other hosts (``worker.worker_host``) to take the last ``k``. Sequence:

1. Listen on ``address:port`` (the address of the interface that routes to Redis unless given; port 0 picks
   a free one) and publish ``rs:engine:{id}:workers``: address, port, a fresh link key, a fresh nonce (the
   pipeline store's prefix, ``worker.redis_store``), the stages to take, tp, pp and the link timeout; field
   ``hosts`` (JSON) lists the hosts that joined, their stages, ranks and state, as they join and get ready.
2. Admit hosts until every remote stage is taken: a host proves the key (``worker.remote_link``), says
   which stages it takes (none named: all that are left), and gets the engine config, its global ranks and
   the rendezvous prefix; a host asking for a taken or unknown stage is told why and dropped.
3. Each host then loads its stages and joins the pipeline group through the Redis store, like the local
   workers, and sends READY (or FAILED with the error). After startup the listener closes: the set of hosts
   is fixed for this engine's life.
4. Steps: every broadcast message is sent to each host as it is written to the local shm queue; a reader
   thread per host files each REPLY under its rank. A host that fails, goes silent past the link timeout or
   disconnects is a dead worker: ``on_failure`` fails the executor, as a local worker's exit does.
5. Shutdown: close the links (the hosts stop their workers and wait for the engine's next start), delete the
   key if it is still ours, and the store's keys.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import redis

from broker.connection import connect, redis_address
from broker.keys import RedisKeys
from worker import redis_store
from worker.config import EngineConfig
from worker.remote_link import (
    CONTROL,
    HEARTBEAT,
    REPLY,
    STEP,
    Link,
    LinkClosed,
    decode_control,
    local_address_towards,
    new_key,
    split_reply,
)
from worker.serialization import decode
from worker.shm_queue import QueueClosed

logger = logging.getLogger(__name__)


@dataclass
class WorkerRendezvous:
    """Where an engine with remote stages publishes itself (``redserve engine --remote-stages``)."""

    redis_url: str
    keys: RedisKeys
    engine_id: str
    address: str | None = None  # the listener's address; None: the interface that routes to Redis
    port: int = 0
    link_timeout: float = 10.0


@dataclass
class _Host:
    link: Link
    stages: list[int]
    ranks: list[int]
    name: str
    state: str = "starting"  # starting -> ready | failed
    error: str = ""
    replies: dict[int, queue.SimpleQueue] = field(default_factory=dict)


class RemoteReplies:
    """One remote rank's replies; reads like a ``MessageQueue`` reader (``dequeue``, ``close``)."""

    def __init__(self, rank: int, box: queue.SimpleQueue, failed: Callable[[], bool]):
        self.rank, self._box, self._failed = rank, box, failed

    def dequeue(self, timeout: float | None = None):
        try:
            return decode(self._box.get(timeout=timeout))
        except queue.Empty:
            if self._failed():
                raise QueueClosed(f"the host of rank {self.rank} is gone") from None
            raise TimeoutError(f"no reply from rank {self.rank} within {timeout}s") from None

    def close(self) -> None:
        pass


class RemoteStages:
    """See the module docstring; ``first_rank`` is the global rank of the first remote worker."""

    def __init__(self, config: EngineConfig, rendezvous: WorkerRendezvous, on_failure: Callable[[str], None],
                 startup_timeout: float, dp_rank: int = 0):
        self.config, self.rdzv, self.on_failure = config, rendezvous, on_failure
        self.dp_rank = dp_rank
        self.startup_timeout = startup_timeout
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.stages = list(range(pp - config.remote_stages, pp))
        self.first_rank = self.stages[0] * tp
        self.hosts: list[_Host] = []
        self.failed = False
        self._closed = False
        self.key = new_key()
        self.nonce = secrets.token_hex(8)
        self.store_prefix = rendezvous.keys.engine_rendezvous(rendezvous.engine_id, self.nonce)
        self.redis = connect(rendezvous.redis_url, socket_timeout=10, connect_timeout=10)
        self.address = rendezvous.address or local_address_towards(*redis_address(rendezvous.redis_url))
        self.listener = socket.create_server((self.address, rendezvous.port))
        self.port = self.listener.getsockname()[1]
        self.redis.hset(rendezvous.keys.engine_workers(rendezvous.engine_id), mapping={
            "address": self.address, "port": self.port, "key": self.key, "nonce": self.nonce,
            "stages": ",".join(map(str, self.stages)), "tp": tp, "pp": pp, "dp_rank": dp_rank,
            "link_timeout": rendezvous.link_timeout, "published_at": time.time()})
        logger.info("engine %s: waiting for worker hosts to take pipeline stages %s at %s:%d (redserve worker)",
                    rendezvous.engine_id, self.stages, self.address, self.port)

    @property
    def pp_link(self) -> dict:
        """What the engine's own workers need to join the pipeline group that spans hosts."""
        return {"redis_url": self.rdzv.redis_url, "prefix": self.store_prefix, "address": self.address,
                "timeout": self.startup_timeout}

    def replies(self) -> dict[int, RemoteReplies]:
        return {rank: RemoteReplies(rank, host.replies[rank], lambda: self.failed)
                for host in self.hosts for rank in host.ranks}

    # --- startup ---------------------------------------------------------------------------------------------

    def admit(self, deadline: float) -> None:
        """Admit hosts until every remote stage is taken (steps 2 of the module docstring)."""
        left = set(self.stages)
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no worker host took pipeline stages {sorted(left)} within "
                                   f"{self.startup_timeout:.0f}s (start `redserve worker --engine-id "
                                   f"{self.rdzv.engine_id}` on the worker hosts)")
            self.listener.settimeout(min(remaining, 1.0))
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            host = self._admit_one(sock, left)
            if host is not None:
                left -= set(host.stages)
                self.hosts.append(host)
                self._record_hosts()
                threading.Thread(target=self._read, args=(host,), name=f"worker-host-{host.name}",
                                 daemon=True).start()
        self.listener.close()

    def _admit_one(self, sock: socket.socket, left: set[int]) -> _Host | None:
        try:
            link = Link.accept(sock, self.key, self.rdzv.link_timeout)
            hello = self._next_control(link)
            wanted = hello.get("stages") or sorted(left)
            if hello.get("type") != "hello" or not isinstance(wanted, list) or not set(wanted) <= left:
                link.send_control({"type": "rejected", "reason": f"stages {wanted} are not free; free: {sorted(left)}"})
                link.close()
                logger.warning("engine %s: turned away worker host %s asking for stages %s (free: %s)",
                               self.rdzv.engine_id, link.peer, wanted, sorted(left))
                return None
            tp = self.config.tensor_parallel_size
            ranks = [stage * tp + r for stage in sorted(wanted) for r in range(tp)]
            link.send_control({"type": "setup", "config": asdict(self.config), "dp_rank": self.dp_rank,
                               "ranks": ranks, "store_prefix": self.store_prefix,
                               "store_timeout": self.startup_timeout})
        except (LinkClosed, OSError) as exc:
            logger.warning("engine %s: a worker host failed to join: %s", self.rdzv.engine_id, exc)
            return None
        name = f"{hello.get('host', '?')}[{hello.get('pid', '?')}]@{link.peer}"
        host = _Host(link, sorted(wanted), ranks, name, replies={rank: queue.SimpleQueue() for rank in ranks})
        link.start_heartbeat(lambda: self._closed)
        logger.info("engine %s: worker host %s takes stages %s (ranks %s)", self.rdzv.engine_id, name,
                    host.stages, ranks)
        return host

    @staticmethod
    def _next_control(link: Link) -> dict:
        while True:
            kind, payload = link.recv()
            if kind == CONTROL:
                return decode_control(payload)
            if kind != HEARTBEAT:
                raise LinkClosed(f"unexpected {kind!r} frame from {link.peer} while joining")

    def not_ready(self) -> list[str]:
        """Hosts that have not sent READY yet; raises RuntimeError if one failed to start."""
        for host in self.hosts:
            if host.state == "failed":
                raise RuntimeError(f"worker host {host.name} failed to start stages {host.stages}: {host.error}")
        return [host.name for host in self.hosts if host.state != "ready"]

    # --- running ---------------------------------------------------------------------------------------------

    def send(self, payload: bytes) -> None:
        """One broadcast message to every host; raises QueueClosed if a host is gone."""
        for host in self.hosts:
            try:
                host.link.send(STEP, payload)
            except LinkClosed as exc:
                self._fail(host, str(exc))
                raise QueueClosed(str(exc)) from None

    def _read(self, host: _Host) -> None:
        try:
            while True:
                kind, payload = host.link.recv()
                if kind == REPLY:
                    rank, reply = split_reply(payload)
                    box = host.replies.get(rank)
                    if box is None:
                        raise LinkClosed(f"reply for rank {rank}, which {host.name} does not hold")
                    box.put(reply)
                elif kind == CONTROL:
                    message = decode_control(payload)
                    if message["type"] == "ready":
                        host.state = "ready"
                        self._record_hosts()
                    elif message["type"] == "failed":
                        host.state, host.error = "failed", str(message.get("error", "?"))
                        raise LinkClosed(host.error)
                elif kind != HEARTBEAT:
                    raise LinkClosed(f"unexpected {kind!r} frame")
        except LinkClosed as exc:
            if not self._closed:
                self._fail(host, str(exc))

    def _record_hosts(self) -> None:
        """The joined hosts, for `redserve status` and redis-cli: field ``hosts`` of the workers key (JSON)."""
        hosts = [{"host": h.name, "stages": h.stages, "ranks": h.ranks, "state": h.state} for h in self.hosts]
        with contextlib.suppress(redis.RedisError):
            self.redis.hset(self.rdzv.keys.engine_workers(self.rdzv.engine_id), "hosts", json.dumps(hosts))

    def _fail(self, host: _Host, reason: str) -> None:
        if self.failed or self._closed:
            return
        self.failed = True
        if host.state != "failed":
            host.state, host.error = "failed", reason
        self.on_failure(f"worker host {host.name} (pipeline stages {host.stages}) is gone: {reason}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self.listener.close()
        for host in self.hosts:
            host.link.close()
        key = self.rdzv.keys.engine_workers(self.rdzv.engine_id)
        with contextlib.suppress(redis.RedisError):
            if self.redis.hget(key, "nonce") == self.nonce.encode():
                self.redis.delete(key)
            redis_store.clear(self.redis, self.store_prefix)
        self.redis.close()
