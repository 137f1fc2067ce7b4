"""The maintenance thread of a `BrokerClient` (see the rules in `broker.client`).

Every `_TICK` seconds it fails requests past their deadline (deadline_exceeded); while the output
subscription is up it also refreshes the client heartbeat key (every `heartbeat_ttl / 3` s), reads the
presence channels of the engines its requests are on (every `presence_interval` s; see
`broker.engine_presence`), checks engine liveness (every `liveness_interval` s, and at once when an
engine was declared gone by its presence or its engine_failed outputs: requests of a gone or restarted
engine are re-placed if they have produced no output yet, resumed from their delivered tokens
(`broker.client_migration`) if they have, else failed with engine_gone; with no engine READY to take
them, they wait up to `replace_wait` s for one, e.g. the same engine restarted) and sends deferred
ABORTs to engines that are live again.

`Maintenance` holds no state of its own besides the client: it reads and changes the client's
shared state (`_mailboxes`, `_incarnations`, `_last_seq`, `_pending_aborts`) only under
`client._lock`, and never does Redis I/O while holding it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from typing import TYPE_CHECKING

import redis

from broker.client_migration import Migrator
from broker.control_state import warn_bad
from broker.errors import NoEngineAvailable
from broker.log_limits import warn_every
from broker.messages import ErrorCode, encode
from broker.request_handle import Mailbox

if TYPE_CHECKING:
    from broker.client import BrokerClient

logger = logging.getLogger(__name__)

_TICK = 0.05


class Maintenance:
    """The body of one client's maintenance thread; `run` returns once the client is stopping."""

    def __init__(self, client: BrokerClient) -> None:
        self._client = client
        self._migrator = Migrator(client)
        self._absent: set[tuple[str, str]] = set()  # (engine, incarnation) with no presence at the last read

    def run(self) -> None:
        c = self._client
        next_heartbeat = 0.0
        next_liveness = time.monotonic() + c._liveness_interval
        next_presence = 0.0
        while not c._stopping.wait(_TICK):
            try:
                self._expire_deadlines()
                if not c._subscribed:
                    continue  # Redis is down: the listener is reconnecting; only deadlines matter now
                now = time.monotonic()
                if now >= next_heartbeat:
                    self._heartbeat()
                    next_heartbeat = now + c._heartbeat_ttl / 3
                if now >= next_presence:
                    self.check_presence()
                    next_presence = now + c._presence_interval
                if now >= next_liveness or c._liveness_due.is_set():
                    c._liveness_due.clear()
                    self.check_engines()
                    next_liveness = time.monotonic() + c._liveness_interval
                self.flush_aborts()
            except Exception as e:  # noqa: BLE001 - deadlines must keep being enforced
                warn_every(logger, f"maintenance:{type(e).__name__}", 60.0, "client %s: maintenance step failed",
                           c.client_id, exc_info=e)

    def _heartbeat(self) -> None:
        c = self._client
        try:
            p = c._redis.pipeline(transaction=False)
            p.set(c.keys.client_alive(c.client_id), f"{socket.gethostname()} {os.getpid()}", px=int(c._heartbeat_ttl * 1000))
            p.sadd(c.keys.clients(), c.client_id)
            replies = p.execute(raise_on_error=False)
        except redis.RedisError as e:
            logger.warning("client %s: heartbeat failed: %s", c.client_id, e)
            return
        for reply in replies:
            if isinstance(reply, redis.RedisError):  # e.g. WRONGTYPE: rs:clients is not a set
                warn_bad(f"{c.keys.clients()}:heartbeat", "client %s: heartbeat write failed: %s", c.client_id, reply)

    def _expire_deadlines(self) -> None:
        c = self._client
        now = time.time()
        with c._lock:
            expired = [mb for mb in c._mailboxes.values() if mb.deadline is not None and mb.deadline <= now]
            for mb in expired:
                c._fail_locked(mb, ErrorCode.DEADLINE_EXCEEDED, f"request {mb.request_id} ran past its deadline")
            waited_out = [mb for mb in c._mailboxes.values() if mb.lost_with_redis and mb.orphaned_at is not None
                          and time.monotonic() - mb.orphaned_at >= c._replace_wait]
            for mb in waited_out:
                c._fail_locked(mb, ErrorCode.BROKER_DISCONNECTED,
                               f"lost the connection to Redis and it was not back within {c._replace_wait:.0f} s")

    def check_presence(self) -> None:
        """Declare gone the engines (of requests in flight) whose presence channel was empty on two reads in a
        row; forget that verdict if the channel fills again (the engine only lost its connection: Redis restarted)."""
        c = self._client
        with c._lock:
            used = {(mb.engine_id, mb.incarnation) for mb in c._mailboxes.values() if mb.incarnation is not None}
            exited = {(e, inc) for e, (inc, reason) in c._gone.items() if reason == "engine_exited"}
        engines = c.selector.live_engines(max_age=float("inf"))
        watched = sorted((e, inc) for e, inc in used | exited
                         if engines.get(e, {}).get("presence") == 1 and engines[e].get("incarnation") == inc)
        if not watched:
            self._absent.clear()
            return
        try:
            counts = c._redis.pubsub_numsub(*(c.keys.engine_presence(e, inc) for e, inc in watched))
        except redis.RedisError as e:
            logger.debug("client %s: presence check skipped: %s", c.client_id, e)
            return
        absent = {engine for engine, (_, count) in zip(watched, counts, strict=True) if count == 0}
        gone = (absent & self._absent) - exited
        self._absent = absent
        with c._lock:
            for engine_id, incarnation in exited - absent:
                if c._gone.get(engine_id) == (incarnation, "engine_exited") and (engine_id, incarnation) in watched:
                    del c._gone[engine_id]
            for engine_id, incarnation in gone:
                c._gone.setdefault(engine_id, (incarnation, "engine_exited"))
        if gone:
            c._liveness_due.set()

    def check_engines(self) -> None:
        """Re-place, resume or fail requests whose engine is no longer live (or restarted)."""
        c = self._client
        try:
            live = c.selector.refresh()
        except redis.RedisError as e:
            logger.debug("client %s: engine liveness check skipped: %s", c.client_id, e)
            return
        replace: list[Mailbox] = []
        resend: list[Mailbox] = []
        resume: list[tuple[Mailbox, str]] = []
        with c._lock:
            declared = dict(c._gone)  # the verdicts, kept for the reasons below even when the registry caught up
            for engine_id, (incarnation, _) in list(c._gone.items()):
                if live.get(engine_id, {}).get("incarnation") != incarnation:
                    del c._gone[engine_id]  # deregistered, declared dead or restarted: the registry knows now
            live = {e: info for e, info in live.items() if e not in c._gone}
            for engine_id, incarnation in list(c._incarnations.items()):
                if live.get(engine_id, {}).get("incarnation") != incarnation:
                    del c._incarnations[engine_id]
                    c._last_seq.pop(engine_id, None)
                    c._fail_calls_locked(engine_id, f"engine {engine_id} is gone")
            for mb in list(c._mailboxes.values()):
                if mb.lost_with_redis:
                    resend.append(mb)
                    continue
                if mb.engine_id in live and live[mb.engine_id].get("incarnation") == mb.incarnation:
                    continue
                if not mb.got_output and mb.resubmits < c._resubmit_limit:
                    replace.append(mb)
                elif mb.got_output and (blocker := self._migrator.blocker(mb)) is None:
                    mb.gone_reason = mb.gone_reason or self._reason(mb, live, declared)
                    resume.append((mb, mb.gone_reason))
                else:
                    self._fail_gone_locked(mb, blocker if mb.got_output else None)
        for mb in replace:
            self._replace(mb)
        for mb in resend:
            self._replace(mb, after_outage=True)
        for mb, reason in resume:
            self._migrator.resume(mb, reason, self._wait_for_engine)

    @staticmethod
    def _reason(mb: Mailbox, live: dict, declared: dict[str, tuple[str | None, str]]) -> str:
        """Why `mb`'s engine counts as gone: engine_exited, engine_failed, engine_restarted or heartbeat_expired.
        `declared` is the client's verdicts as they were before this check pruned those the registry now
        agrees with (an engine that failed and deregistered at once still failed, it did not expire)."""
        if mb.engine_error is not None:
            return "engine_failed"
        gone = declared.get(mb.engine_id)
        if gone is not None and gone[0] == mb.incarnation:
            return gone[1]
        return "engine_restarted" if mb.engine_id in live else "heartbeat_expired"

    def _fail_gone_locked(self, mb: Mailbox, blocker: str | None) -> None:
        c = self._client
        if mb.engine_error is not None:
            c._fail_locked(mb, ErrorCode.ENGINE_FAILED, mb.engine_error.split(":", 1)[-1].strip(), abort=False)
            return
        why = f"; not resumed: {blocker}" if blocker else ""
        c._fail_locked(mb, ErrorCode.ENGINE_GONE, f"engine {mb.engine_id} is gone{why}", abort=False)

    def _replace(self, mb: Mailbox, after_outage: bool = False) -> None:
        """Send `mb`'s ADD to a READY engine again. After a Redis outage (`after_outage`) any engine will do,
        its own included, and the request gets a fresh id: Redis may have lost the ADD (a restart) or kept
        it (a blip, with outputs lost meanwhile), so the old id is aborted and anything still coming for it
        is ignored; the caller never sees the id change (it reads outputs from the handle)."""
        c = self._client
        old, old_id = mb.engine_id, mb.request_id
        # The old engine is a fine target again once it is back as a new incarnation (a restart: DP=1).
        cached = c.selector.live_engines(max_age=float("inf")).get(old, {})
        same_engine = cached.get("incarnation") == mb.incarnation and not after_outage
        try:
            info = c.selector.select(exclude=[old, *c._gone_engines()] if same_engine else c._gone_engines())
        except NoEngineAvailable:
            self._wait_for_engine(mb)
            return
        c._note_incarnation(info["engine_id"], info.get("incarnation"))
        with c._lock:
            if mb.done:
                return
            c.selector.on_finish(old)
            mb.engine_id, mb.incarnation = info["engine_id"], info.get("incarnation")
            mb.resubmits += 1
            mb.orphaned_at = None
            mb.engine_error = mb.gone_reason = None
            if after_outage:
                self._rename_locked(mb, f"{old_id.split('~r')[0]}~r{mb.resubmits}")
                c._pending_aborts.setdefault(old, set()).add(old_id)
            c.selector.on_submit(mb.engine_id)
        logger.info("client %s: %s; re-placed request %s on %s as %s", c.client_id,
                    "Redis came back" if after_outage else f"engine {old} is gone", old_id, mb.engine_id,
                    mb.request_id)
        try:
            c._xadd(mb.engine_id, encode(mb.add))
        except redis.RedisError as e:
            with c._lock:
                c._fail_locked(mb, ErrorCode.BROKER_DISCONNECTED, f"could not re-place the request: {e}", abort=False)
            return
        if old != mb.engine_id and old in c.selector.live_engines(max_age=float("inf")):
            c._send_aborts(old, [old_id])  # it restarted or came back: do not run it twice

    def _rename_locked(self, mb: Mailbox, request_id: str) -> None:
        c = self._client
        for rid in mb.routes:
            if c._mailboxes.get(rid) is mb:
                del c._mailboxes[rid]
        mb.add = dataclasses.replace(mb.add, request_id=request_id)
        mb.routes = {request_id: None}
        mb.lost_with_redis = False
        c._mailboxes[request_id] = mb

    def _wait_for_engine(self, mb: Mailbox) -> None:
        """No engine is READY to take `mb` over (e.g. the only one is restarting): it stays parked and
        is tried again at every liveness check, until `replace_wait` s have passed (then no_engine)."""
        c = self._client
        now = time.monotonic()
        with c._lock:
            if mb.done:
                return
            if mb.orphaned_at is None:
                mb.orphaned_at = now
                logger.info("client %s: engine %s is gone and no engine is ready; request %s waits up to %.0f s "
                            "for one", c.client_id, mb.engine_id, mb.request_id, c._replace_wait)
            elif now - mb.orphaned_at >= c._replace_wait:
                c._fail_locked(mb, ErrorCode.NO_ENGINE, f"engine {mb.engine_id} is gone and no engine became "
                               f"ready within {c._replace_wait:.0f} s", abort=False)

    def flush_aborts(self) -> None:
        """Send the deferred ABORTs to their engines that are live; those for gone engines are dropped.

        If the engine list cannot be read, everything stays deferred for the next try.
        """
        c = self._client
        with c._lock:
            if not c._pending_aborts:
                return
            pending, c._pending_aborts = c._pending_aborts, {}
        try:
            live = c.selector.live_engines(max_age=c._liveness_interval)
        except redis.RedisError:
            with c._lock:
                for engine_id, ids in pending.items():
                    c._pending_aborts.setdefault(engine_id, set()).update(ids)
            return
        for engine_id, ids in pending.items():
            if engine_id in live:
                c._send_aborts(engine_id, sorted(ids))
