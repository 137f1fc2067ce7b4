"""The maintenance thread of a `BrokerClient` (see the rules in `broker.client.client`).

Every `_TICK` seconds it fails requests past their deadline (deadline_exceeded); while the output
subscription is up it also refreshes the client heartbeat key (every `heartbeat_ttl / 3` s), reads the
presence channels of the engines its requests are on (every `presence_interval` s; see
`broker.engine_presence`), checks engine liveness (every `liveness_interval` s, and at once when an
engine was declared gone by its presence or its engine_failed outputs: requests of a gone or restarted
engine are re-placed if they have produced no output yet, resumed from their delivered tokens
(`broker.client.migration`) if they have, else failed with engine_gone; with no engine READY to take
them, they wait up to `replace_wait` s for one, e.g. the same engine restarted) and sends deferred
ABORTs to engines that are live again.

`Maintenance` holds no state of its own besides the last presence read and how long deferred ABORTs have
waited for their engine: what it decides on is in the client's in-flight table (`broker.client.in_flight`),
which it changes only through its methods. It works through the client's parts, never the client (the
table, the engine selector, the sender, the Redis connection for the heartbeat and presence reads) and
does its Redis I/O outside the table's lock.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

import redis

from broker.channels import subscriber_counts
from broker.client.in_flight import InFlightTable
from broker.client.mailbox import Mailbox
from broker.client.migration import Migrator
from broker.client.sender import Sender
from broker.control_state import warn_bad
from broker.errors import NoEngineAvailable
from broker.keys import RedisKeys
from broker.load_balance import EngineSelector
from broker.log_limits import warn_every
from protocol.messages import ErrorCode, encode

logger = logging.getLogger(__name__)

_TICK = 0.05
PRESENCE_GRACE = 3.0
"""Seconds after the output subscription came back (Redis restarted or failed over) during which an empty
presence channel means nothing: the engines' presence subscriptions were cut too and come back on their own
backoff (up to 1 s). Deaths meanwhile are still seen by the heartbeat."""


class Timings(Protocol):
    """The settings the thread reads (`broker.client.client.ClientSettings`)."""

    heartbeat_ttl: float
    liveness_interval: float
    presence_interval: float
    replace_wait: float
    resubmit_limit: int
    max_migrations: int


class Maintenance:
    """The body of one client's maintenance thread; `run` returns once `stopping` is set."""

    def __init__(self, table: InFlightTable, selector: EngineSelector, sender: Sender,
                 connection: Callable[[], redis.Redis], settings: Timings,
                 on_migration: Callable[[str, str, str], None] | None = None) -> None:
        self._table = table
        self._selector = selector
        self._sender = sender
        self._connection = connection
        self._settings = settings
        self._keys: RedisKeys = sender.keys
        self._client_id = sender.client_id
        self._migrator = Migrator(table, selector, sender, settings.max_migrations, on_migration)
        self._absent: set[tuple[str, str]] = set()  # (engine, incarnation) with no presence at the last read
        self._presence_failed_at = float("-inf")  # monotonic time a presence read last failed
        self._presence_nodes: dict[str, str] = {}  # cluster: presence channel -> the node it was last counted on
        self._aborts_waiting_since: dict[str, float] = {}  # engine -> when its deferred ABORTs first found it not live

    def run(self, stopping: threading.Event) -> None:
        settings = self._settings
        next_heartbeat = 0.0
        next_liveness = time.monotonic() + settings.liveness_interval
        next_presence = 0.0
        while not stopping.wait(_TICK):
            try:
                self._table.fail_overdue(settings.replace_wait)
                if not self._table.subscribed:
                    continue  # Redis is down: the listener is reconnecting; only deadlines matter now
                now = time.monotonic()
                if now >= next_heartbeat:
                    self._heartbeat()
                    next_heartbeat = now + settings.heartbeat_ttl / 3
                if now >= next_presence:
                    self.check_presence()
                    next_presence = now + settings.presence_interval
                if self._table.take_liveness_due() or now >= next_liveness:
                    self.check_engines()
                    next_liveness = time.monotonic() + settings.liveness_interval
                self.flush_aborts()
            except Exception as e:  # noqa: BLE001 - deadlines must keep being enforced
                warn_every(logger, f"maintenance:{type(e).__name__}", 60.0, "client %s: maintenance step failed",
                           self._client_id, exc_info=e)

    def _heartbeat(self) -> None:
        try:
            p = self._connection().pipeline(transaction=False)
            p.set(self._keys.client_alive(self._client_id), f"{socket.gethostname()} {os.getpid()}",
                  px=int(self._settings.heartbeat_ttl * 1000))
            p.sadd(self._keys.clients(), self._client_id)
            replies = p.execute(raise_on_error=False)
        except redis.RedisError as e:
            logger.warning("client %s: heartbeat failed: %s", self._client_id, e)
            return
        for reply in replies:
            if isinstance(reply, redis.RedisError):  # e.g. WRONGTYPE: {rs}:clients is not a set
                warn_bad(f"{self._keys.clients()}:heartbeat", "client %s: heartbeat write failed: %s", self._client_id, reply)

    def check_presence(self) -> None:
        """Declare gone the engines (of requests in flight) whose presence channel was empty on two reads in a
        row; forget that verdict if the channel fills again (the engine only lost its connection: Redis restarted).
        Not within `PRESENCE_GRACE` s of this client's own subscription coming back, nor of a presence read that
        failed: on a cluster one node can restart while this client's subscription, on another node, stays up, and
        the engines' presence subscriptions on that node come back on their own backoff. Nor after a read that
        found a channel on another node than before (`ChannelMoved`: a failover or a resharding moved its slot, and
        the engine's subscription follows on its own)."""
        if (self._table.since_resubscribed() < PRESENCE_GRACE
                or time.monotonic() - self._presence_failed_at < PRESENCE_GRACE):
            self._absent.clear()
            return
        used, exited = self._table.presence_targets()
        engines = self._selector.live_engines(max_age=float("inf"))
        watched = sorted((e, inc) for e, inc in used | exited
                         if engines.get(e, {}).get("presence") == 1 and engines[e].get("incarnation") == inc)
        if not watched:
            self._absent.clear()
            return
        try:
            counts = subscriber_counts(self._connection(), [self._keys.engine_presence(e, inc) for e, inc in watched],
                                       self._presence_nodes)
        except redis.RedisError as e:
            logger.debug("client %s: presence check skipped: %s", self._client_id, e)
            self._presence_failed_at = time.monotonic()
            self._absent.clear()
            return
        absent = {engine for engine, count in zip(watched, counts, strict=True) if count == 0}
        gone = (absent & self._absent) - exited
        self._absent = absent
        self._table.withdraw_exited(pair for pair in exited - absent if pair in watched)
        for engine_id, incarnation in gone:
            self._table.declare_gone(engine_id, incarnation, "engine_exited")

    def check_engines(self) -> None:
        """Re-place, resume or fail requests whose engine is no longer live (or restarted)."""
        try:
            live = self._selector.refresh()
        except redis.RedisError as e:
            logger.debug("client %s: engine liveness check skipped: %s", self._client_id, e)
            return
        orphans = self._table.collect_orphans(live, self._settings.resubmit_limit, self._migrator.blocker)
        for mb in orphans.replace:
            self._replace(mb)
        for mb in orphans.resend:
            self._replace(mb, after_outage=True)
        for mb, reason in orphans.resume:
            self._migrator.resume(mb, reason, self._wait_for_engine)

    def _replace(self, mb: Mailbox, after_outage: bool = False) -> None:
        """Send `mb`'s ADD to a READY engine again. After a Redis outage (`after_outage`) any engine will do,
        its own included, and the request gets a fresh id: Redis may have lost the ADD (a restart) or kept
        it (a blip, with outputs lost meanwhile), so the old id is aborted and anything still coming for it
        is ignored; the caller never sees the id change (it reads outputs from the handle)."""
        old, old_id = mb.engine_id, mb.request_id
        # The old engine is a fine target again once it is back as a new incarnation (a restart: DP=1).
        cached = self._selector.live_engines(max_age=float("inf")).get(old, {})
        same_engine = cached.get("incarnation") == mb.incarnation and not after_outage
        gone = self._table.gone_engines()
        try:
            info = self._selector.select(exclude=[old, *gone] if same_engine else gone)
        except NoEngineAvailable:
            self._wait_for_engine(mb)
            return
        self._table.note_incarnation(info["engine_id"], info.get("incarnation"))
        if not self._table.re_place(mb, info["engine_id"], info.get("incarnation"), after_outage):
            return
        logger.info("client %s: %s; re-placed request %s on %s as %s", self._client_id,
                    "Redis came back" if after_outage else f"engine {old} is gone", old_id, mb.engine_id,
                    mb.request_id)
        try:
            self._sender.send_to_engine(mb.engine_id, encode(mb.add))
        except redis.RedisError as e:
            self._table.fail(mb, ErrorCode.BROKER_DISCONNECTED, f"could not re-place the request: {e}", abort=False)
            return
        if old != mb.engine_id and old in self._selector.live_engines(max_age=float("inf")):
            self._sender.send_aborts(old, [old_id])  # it restarted or came back: do not run it twice

    def _wait_for_engine(self, mb: Mailbox) -> None:
        """No engine is READY to take `mb` over (e.g. the only one is restarting): it stays parked and
        is tried again at every liveness check, until `replace_wait` s have passed (then no_engine)."""
        if self._table.park(mb, self._settings.replace_wait):
            logger.info("client %s: engine %s is gone and no engine is ready; request %s waits up to %.0f s "
                        "for one", self._client_id, mb.engine_id, mb.request_id, self._settings.replace_wait)

    def flush_aborts(self) -> None:
        """Send the deferred ABORTs to their engines that are live. Those for an engine that is not live wait
        for it up to `replace_wait` s (after a Redis restart the client is back before the engine has restored
        its registration, and the engine still runs the request), then are dropped: the engine is gone.

        If the engine list cannot be read, everything stays deferred for the next try.
        """
        pending = self._table.take_deferred_aborts()
        if not pending:
            return
        try:
            live = self._selector.live_engines(max_age=self._settings.liveness_interval)
        except redis.RedisError:
            for engine_id, ids in pending.items():
                self._table.defer_aborts(engine_id, ids)
            return
        now = time.monotonic()
        for engine_id, ids in pending.items():
            if engine_id in live:
                self._aborts_waiting_since.pop(engine_id, None)
                self._sender.send_aborts(engine_id, sorted(ids))
            elif now - self._aborts_waiting_since.setdefault(engine_id, now) < self._settings.replace_wait:
                self._table.defer_aborts(engine_id, ids)
            else:
                del self._aborts_waiting_since[engine_id]
