"""The client side of the broker, shared by API processes and Celery workers.

Rules:
- One `BrokerClient` per process, created (or at least started) after fork: gunicorn forks its
  workers, so build it lazily in the worker (`start()` is idempotent and `submit` calls it).
  Using a client started in another process raises RuntimeError. All methods are thread-safe.
- `start()` runs two threads: a maintenance thread (`broker.client.liveness`) that refreshes a
  heartbeat key `{rs}:client:{id}:alive` (TTL `heartbeat_ttl`), and one listener thread
  (`broker.client.listener`) subscribed once to `rs:out:{id}`; it demuxes `EngineOutputs` into
  per-request mailboxes. `submit` registers the mailbox BEFORE the XADD, and only while subscribed.
- The state shared by the caller threads, the listener and the maintenance thread (mailboxes, calls,
  seq numbers, incarnations, engine verdicts, deferred aborts, the subscription flag) is owned by one
  `broker.client.in_flight.InFlightTable` (`client.table`), behind its lock; its rules say how it changes.
  The client and its threads do the Redis I/O, outside that lock, with what the table's methods return.
- The client is assembled from parts that each take only what they use, never the client: the table, the
  engine selector (`broker.load_balance`), the sender of ABORTs and unbounded ADDs (`broker.client.sender`),
  the listener, the maintenance thread with its migrator (`broker.client.migration`), and one
  `RequestHandle` per request (the table and the sender). Nothing in `broker/client/` imports this module.
- Nothing hangs and nothing is silently lost; a request ends with an error output (finish_reason
  ERROR, an `ErrorCode` in `error_code`, the detail in `error_message`) when:
  * its deadline (`AddRequest.deadline`, wall clock) passes -> deadline_exceeded (+ ABORT sent);
  * the output subscription drops (Redis restarted or failed over, network): the listener resubscribes
    with backoff. A request with no output yet is not failed: once Redis is back it is sent again under a
    fresh id (`~rN`; the old id is aborted, since a Redis that only blinked may still hold it) to any READY
    engine, waiting up to `replace_wait` s for one. A started request is resumed from the tokens it
    delivered (`broker.client.migration`, reason redis_lost; its own engine is a valid target, the old ids
    are aborted) when it may move; one that may not (a grammar, penalties, `max_migrations` used up) ends
    with broker_disconnected (some output may have been missed);
  * `EngineOutputs.seq` from an engine skips a number -> output_lost, for that engine's requests;
  * its engine is declared gone -> the request is re-placed on another engine if it has produced no
    output yet (at most `resubmit_limit` times); if it has, its running sequences are resumed on
    another engine from the tokens already delivered (`broker.client.migration`, at most
    `max_migrations` times; 0 turns it off), else it ends with engine_gone. With no engine READY
    (DP=1 and its engine restarting) such a request waits up to `replace_wait` seconds for one (the
    restarted engine counts), then ends with no_engine.
- An engine is declared gone when (checked by the maintenance thread):
  * its process died: its presence subscription (`rs:engine:{id}:presence:{incarnation}`, held by
    `broker.engine_presence` on a connection of its own) has no subscriber on two reads
    `presence_interval` s apart: the kernel closed its socket, Redis dropped it at once;
  * it failed as a whole (a TP worker died): its requests end with engine_failed outputs;
  * it restarted (new incarnation) or its heartbeat expired (hung, paused, host or network lost):
    read every `liveness_interval` s; the heartbeat TTL is the engine's `--heartbeat-ttl`.
- `submit` raises `NoEngineAvailable` (no READY live engine), `BrokerUnavailable` (Redis
  unreachable or not subscribed within `subscribe_timeout`), `EngineOverloaded` (the engine's
  request stream holds `max_stream_len` messages), ValueError (duplicate request id, foreign client
  id) or `MessageError` (a field not msgpack-able, or params that are not a `SamplingParams`).
- Prefill/decode disaggregation: engines registered with a `role`; with both a prefill and a decode pool READY,
  a new request goes to a prefill engine marked `handoff` (`_place`), which answers its first token with
  `RequestOutput.handoff` once the KV tier holds its prompt's blocks; the maintenance thread then continues it
  on a decode engine (`broker.client.migration`, reason handoff), which loads those blocks from the tier. The
  caller sees one stream.
- Request streams are never trimmed: a trimmed ADD would be lost unread and its client would wait
  for nothing. Engines XACK+XDEL what they finished, so a stream's length is its unread plus
  in-flight messages; an ADD goes in only while that length is under `max_stream_len`, checked and
  added atomically (one Lua script: XLEN, then XADD). ABORTs, utility calls and re-placed ADDs
  (admitted once already) are never refused.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import socket
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis

from broker.client.in_flight import InFlightTable
from broker.client.listener import OutputListener
from broker.client.liveness import Maintenance
from broker.client.mailbox import Mailbox
from broker.client.migration import migration_blocker
from broker.client.request_handle import RequestHandle
from broker.client.request_resume import handoff_blocker
from broker.client.sender import Sender
from broker.connection import connect
from broker.engine_link import STREAM_FIELD
from broker.errors import BrokerUnavailable, EngineOverloaded, NoEngineAvailable, UtilityError
from broker.keys import EngineState, RedisKeys, check_id
from broker.load_balance import DECODE_ROLES, PREFILL_ROLES, EngineSelector, read_lb_snapshot
from broker.prefix_index import PrefixIndexReader, RoutingCounter
from broker.registry import EngineRegistry
from protocol.messages import AddRequest, UtilityCall, UtilityResult, encode

logger = logging.getLogger(__name__)

# KEYS[1] the request stream; ARGV: the cap, the field, the payload. Nil when the stream is full.
_BOUNDED_XADD = """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return false end
return redis.call('XADD', KEYS[1], '*', ARGV[2], ARGV[3])
"""


def default_client_id() -> str:
    """hostname-pid-random, safe inside key names."""
    host = re.sub(r"[:\s]", "_", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class ClientSettings:
    """A client's timings and limits (see the module rules); read by its threads."""

    heartbeat_ttl: float = 10.0
    engine_refresh: float = 0.5
    liveness_interval: float = 1.0
    snapshot_max_age: float = 5.0
    subscribe_timeout: float = 5.0
    resubmit_limit: int = 1
    replace_wait: float = 30.0
    max_stream_len: int = 10_000
    max_migrations: int = 2
    presence_interval: float = 0.1


class BrokerClient:
    """Submits requests to engines and receives their outputs; see the module rules."""

    def __init__(
        self,
        redis_url: str,
        keys: RedisKeys | None = None,
        client_id: str | None = None,
        *,
        heartbeat_ttl: float = 10.0,
        engine_refresh: float = 0.5,
        liveness_interval: float = 1.0,
        snapshot_max_age: float = 5.0,
        subscribe_timeout: float = 5.0,
        resubmit_limit: int = 1,
        replace_wait: float = 30.0,
        max_stream_len: int = 10_000,
        max_migrations: int = 2,
        presence_interval: float = 0.1,
        on_migration: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.keys = keys or RedisKeys()
        self.client_id = check_id("client", client_id or default_client_id())
        self.settings = ClientSettings(
            heartbeat_ttl=heartbeat_ttl, engine_refresh=engine_refresh, liveness_interval=liveness_interval,
            snapshot_max_age=snapshot_max_age, subscribe_timeout=subscribe_timeout, resubmit_limit=resubmit_limit,
            replace_wait=replace_wait, max_stream_len=max_stream_len, max_migrations=max_migrations,
            presence_interval=presence_interval,
        )  # fmt: skip
        self.on_migration = on_migration
        self.table = InFlightTable(self.client_id, placed=lambda e: self.selector.on_submit(e),
                                   released=lambda e: self.selector.on_finish(e))
        self._bounded_xadd = None
        self._start_lock = threading.Lock()
        self._pid: int | None = None
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._redis: redis.Redis | None = None
        self._registry: EngineRegistry | None = None
        self.selector: EngineSelector | None = None
        self.sender = Sender(self.client_id, self.keys, self.table, lambda: self._redis)
        self._maintenance: Maintenance | None = None

    @property
    def redis(self) -> redis.Redis:
        """The client's Redis connection (after `start()`), for its threads' I/O."""
        return self._redis

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> BrokerClient:
        """Start the heartbeat and listener threads (idempotent; does not wait for Redis)."""
        with self._start_lock:
            if self._pid is not None:
                self._check_pid()
                if self._stopping.is_set():
                    raise RuntimeError("this BrokerClient was stopped; create a new one")
                return self
            self._pid = os.getpid()
            self._stopping.clear()
            self._redis = connect(self.redis_url, client_name=f"redserve-client-{self.client_id}")
            self._registry = EngineRegistry(self._redis, self.keys)
            self._bounded_xadd = self._redis.register_script(_BOUNDED_XADD)
            self.selector = EngineSelector(self._fetch_engines, self.settings.engine_refresh,
                                           self.settings.snapshot_max_age,
                                           prefix_index=PrefixIndexReader(self._redis, self.keys),
                                           count_decision=RoutingCounter(self._redis, self.keys))
            self._maintenance = Maintenance(self.table, self.selector, self.sender, lambda: self._redis,
                                            self.settings, self.on_migration)
            listener = OutputListener(self.redis_url, self.keys.output_channel(self.client_id), self.client_id,
                                      self.table, self.settings.resubmit_limit,
                                      lambda mb: migration_blocker(mb, self.settings.max_migrations))
            self._threads = [
                threading.Thread(target=listener.run, args=(self._stopping,),
                                 name=f"broker-listener-{self.client_id}", daemon=True),
                threading.Thread(target=self._maintenance.run, args=(self._stopping,),
                                 name=f"broker-maintenance-{self.client_id}", daemon=True),
            ]
            for t in self._threads:
                t.start()
            return self

    def stop(self) -> None:
        """Fail what is in flight (ABORTs sent), stop the threads, remove the heartbeat; idempotent.

        If Redis is unreachable at that moment the Redis cleanup is skipped (the heartbeat key
        expires by itself, engines abort requests of a client whose channel has no subscriber).
        """
        with self._start_lock:
            if self._pid is None or self._pid != os.getpid() or self._stopping.is_set():
                return
            redis_up = self.table.subscribed
            self._stopping.set()
            for t in self._threads:
                t.join()
            self.table.fail_all("the broker client was stopped")
            if redis_up:
                self._maintenance.flush_aborts()
                try:
                    p = self._redis.pipeline(transaction=False)
                    p.delete(self.keys.client_alive(self.client_id))
                    p.srem(self.keys.clients(), self.client_id)
                    p.execute()
                except redis.RedisError as e:
                    logger.warning("client %s: could not remove its heartbeat: %s", self.client_id, e)
            self._redis.close()

    def wait_subscribed(self, timeout: float) -> bool:
        """True once the output subscription is up (within `timeout` seconds)."""
        self.start()
        return self.table.wait_subscribed(timeout)

    # ----------------------------------------------------------------- requests

    def submit(self, add: AddRequest, engine_id: str | None = None) -> RequestHandle:
        """Place `add` on `engine_id` or on the least loaded READY engine; see the module rules."""
        self.start()
        self._check_pid()
        if not add.client_id:
            add.client_id = self.client_id
        elif add.client_id != self.client_id:
            raise ValueError(f"AddRequest.client_id {add.client_id!r} is not this client ({self.client_id!r})")
        info = self._place(add) if engine_id is None else self._choose(engine_id, add.prompt_token_ids)
        payload = encode(add)
        n = add.params.n
        mb = Mailbox(add=add, engine_id=info["engine_id"], incarnation=info.get("incarnation"), n=n)
        self._register(mb)
        cap = self.settings.max_stream_len
        try:
            added = self._bounded_xadd(keys=[self.keys.request_stream(mb.engine_id)], args=[cap, STREAM_FIELD, payload])
        except redis.RedisError as e:
            self.table.drop(mb)
            raise BrokerUnavailable(f"could not send request {add.request_id} to Redis: {e}") from e
        if added is None:
            self.table.drop(mb)
            raise EngineOverloaded(f"engine {mb.engine_id} already holds {cap} requests unread or in flight; "
                                   "retry later")
        return RequestHandle(self.table, self.sender, mb)

    def abort(self, request_ids: Iterable[str], engine_id: str) -> None:
        """ABORT `request_ids` on `engine_id`; this client's own handles end at once with "abort"."""
        ids = list(request_ids)
        self.table.abort_ids(ids)
        self.sender.send_aborts(engine_id, ids)

    def call_utility(self, engine_id: str, method: str, args: Iterable[Any] = (), timeout: float = 10.0) -> Any:
        """Run `method(*args)` on a live engine and return its result.

        Raises UtilityError (the engine reported an error, or the call was cut off),
        TimeoutError (no answer in `timeout` s), NoEngineAvailable (engine not live).
        """
        self.start()
        self._check_pid()
        self._await_subscription()
        live = self._live_engines()
        if engine_id not in live:
            raise NoEngineAvailable(f"engine {engine_id} is not live")
        self.table.note_incarnation(engine_id, live[engine_id].get("incarnation"))
        call = UtilityCall(uuid.uuid4().hex, self.client_id, method, list(args))
        answer = self.table.add_call(call.call_id, engine_id)
        try:
            self.sender.send_to_engine(engine_id, encode(call))
            result: UtilityResult = answer.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"engine {engine_id} did not answer {method!r} within {timeout}s") from None
        except redis.RedisError as e:
            raise BrokerUnavailable(f"could not send {method!r} to engine {engine_id}: {e}") from e
        finally:
            self.table.forget_call(call.call_id)
        if result.error is not None:
            raise UtilityError(f"{method} on engine {engine_id}: {result.error}")
        return result.result

    def ready_engines(self) -> list[dict[str, Any]]:
        """READY engines with a live heartbeat (cached up to `engine_refresh` s, but read afresh when the
        cache has none, so an engine that just came up is seen at once), e.g. for /health."""
        self.start()
        ready = [info for info in self._live_engines().values() if info.get("state") == EngineState.READY]
        if not ready:
            ready = [info for info in self._live_engines(max_age=0).values() if info.get("state") == EngineState.READY]
        return ready

    def in_flight(self) -> int:
        return self.table.in_flight()

    # ----------------------------------------------------------------- submit helpers

    def _check_pid(self) -> None:
        if self._pid is not None and self._pid != os.getpid():
            raise RuntimeError(
                f"this BrokerClient was started in another process (pid {self._pid}); "
                "create one per process after fork"
            )

    def _live_engines(self, max_age: float | None = None) -> dict[str, dict[str, Any]]:
        try:
            return self.selector.live_engines(max_age)
        except redis.RedisError as e:
            raise BrokerUnavailable(f"could not read the engine list from Redis: {e}") from e

    def _choose(self, engine_id: str | None, token_ids: list[int] | None = None) -> dict[str, Any]:
        if engine_id is None:
            try:
                info = self.selector.select(exclude=self.table.gone_engines(), token_ids=token_ids)
            except redis.RedisError as e:
                raise BrokerUnavailable(f"could not read the engine list from Redis: {e}") from e
        else:
            info = self._live_engines().get(engine_id)
            if info is None or info.get("state") != EngineState.READY:
                raise NoEngineAvailable(f"engine {engine_id} is not ready (not registered, not READY or no heartbeat)")
        self.table.note_incarnation(info["engine_id"], info.get("incarnation"))
        return info

    def _place(self, add: AddRequest) -> dict[str, Any]:
        """The engine for a new request. With both a prefill and a decode pool READY, a request that can be split
        (`handoff_blocker`) goes to the prefill pool marked `handoff`, one that is all prefill (max_tokens 1) to
        the prefill pool, any other to the decode pool; otherwise any engine."""
        gone = self.table.gone_engines()
        roles = None
        try:
            if self.selector.has_role(PREFILL_ROLES, gone) and self.selector.has_role(DECODE_ROLES, gone):
                add.handoff = handoff_blocker(add.params) is None
                roles = PREFILL_ROLES if add.handoff or add.params.max_tokens == 1 else DECODE_ROLES
            info = self.selector.select(exclude=gone, token_ids=add.prompt_token_ids, roles=roles)
        except redis.RedisError as e:
            raise BrokerUnavailable(f"could not read the engine list from Redis: {e}") from e
        self.table.note_incarnation(info["engine_id"], info.get("incarnation"))
        return info

    def _await_subscription(self) -> None:
        timeout = self.settings.subscribe_timeout
        if not self.table.wait_subscribed(timeout):
            raise BrokerUnavailable(
                f"not subscribed to {self.keys.output_channel(self.client_id)} after {timeout}s: is Redis reachable?"
            )

    def _register(self, mb: Mailbox) -> None:
        while True:
            self._await_subscription()
            if self.table.register(mb):
                return

    def _fetch_engines(self):
        return self._registry.live_engines(), read_lb_snapshot(self._redis, self.keys)
