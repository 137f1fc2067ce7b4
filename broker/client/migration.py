"""Moving a started request of a `BrokerClient` to another engine (see the rules in `broker.client.client`).

`Migrator.resume(mb, reason)` continues every running sequence of `mb` on one live engine as the ADDs of
`broker.client.request_resume` and points the mailbox's routes at them, so the caller's stream goes on with no
token lost or repeated. It is called by the maintenance thread once `mb`'s engine is declared gone.

Rules:
- A handoff (reason `HANDOFF`: a prefill engine finished the request's prompt and first token) is a planned
  move: it goes to the least loaded engine of the decode pool (any engine when there is none), sends no ABORT
  (the prefill engine dropped the request) and does not count against `max_migrations`.
- A request moves at most `max_migrations` times (handoffs aside); past that, or when `request_resume.resume_blocker`
  says it cannot, it ends with engine_gone (or the engine's own engine_failed error) as before.
- The routes change and the continuation ADDs are built in one step of the in-flight table
  (`InFlightTable.move_to_continuations`), so no output of the old engine can slip in between (the old
  wire ids are unrouted: late outputs for them are dropped); the XADDs happen after, outside its lock.
- The old engine gets ABORTs for the old ids when it still looks live (it restarted, or only its
  presence subscription dropped), so a sequence never runs twice. After a lost subscription (`REDIS_LOST`:
  Redis restarted or failed over) the engine itself lives on and is a valid target; its ABORTs are
  deferred, so they reach it once it is registered again.
- With no engine READY the request waits like an unstarted one (`replace_wait`, then no_engine).
- Every move is logged with the old and new engine and reported to `on_migration(reason, old, new)`.
- It works through the client's parts, never the client: the in-flight table, the engine selector and the
  sender.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from broker.client.in_flight import HANDOFF, REDIS_LOST, InFlightTable
from broker.client.mailbox import Mailbox
from broker.client.request_resume import resume_blocker
from broker.client.sender import Sender
from broker.errors import NoEngineAvailable
from broker.load_balance import DECODE_ROLES, EngineSelector
from protocol.messages import ErrorCode

logger = logging.getLogger(__name__)


def migration_blocker(mb: Mailbox, max_migrations: int) -> str | None:
    """Why `mb` may not move now, or None (called by the in-flight table, under its lock)."""
    if max_migrations == 0:
        return "resuming is off (--max-migrations 0)"
    if mb.migrations - mb.handoffs >= max_migrations:
        return f"it was moved {mb.migrations - mb.handoffs} time(s) already (--max-migrations {max_migrations})"
    return resume_blocker(mb.add.params)


class Migrator:
    """Resumes one client's started requests elsewhere; holds no state of its own."""

    def __init__(self, table: InFlightTable, selector: EngineSelector, sender: Sender, max_migrations: int,
                 on_migration: Callable[[str, str, str], None] | None = None) -> None:
        self._table = table
        self._selector = selector
        self._sender = sender
        self.max_migrations = max_migrations
        self._on_migration = on_migration

    def blocker(self, mb: Mailbox) -> str | None:
        return migration_blocker(mb, self.max_migrations)

    def resume(self, mb: Mailbox, reason: str, wait_for_engine: Callable[[Mailbox], None]) -> None:
        """Continue `mb` on another live engine, or on its own once restarted; `wait_for_engine(mb)` parks it
        if none is READY (until `replace_wait`)."""
        table, selector = self._table, self._selector
        handoff = reason == HANDOFF
        # Its own engine is a fine target again once it is back as a new incarnation (a restart: DP=1), or
        # when only Redis was lost (the engine lives on, its outputs could not reach us).
        cached = selector.live_engines(max_age=float("inf")).get(mb.engine_id, {})
        gone = table.gone_engines()
        same = cached.get("incarnation") == mb.incarnation and reason not in (REDIS_LOST, HANDOFF)
        exclude = [mb.engine_id, *gone] if same else gone
        try:
            # A handoff goes to the decode pool (`broker.load_balance.DECODE_ROLES`), any engine when it has none.
            info = selector.select(exclude=exclude, token_ids=mb.add.prompt_token_ids,
                                   roles=DECODE_ROLES if handoff and selector.has_role(DECODE_ROLES, exclude) else None)
        except NoEngineAvailable:
            wait_for_engine(mb)
            return
        table.note_incarnation(info["engine_id"], info.get("incarnation"))
        moved = table.move_to_continuations(mb, info["engine_id"], info.get("incarnation"), handoff=handoff)
        if moved is None:
            return
        old, old_ids, adds = moved
        tokens = {index: len(mb.delivered.get(index, [])) for index, _ in adds.values()}
        logger.info("client %s: %s: resumed request %s from engine %s on engine %s as %s after %s token(s) "
                    "(migration %d)", self._sender.client_id, reason, mb.request_id, old, mb.engine_id,
                    ", ".join(adds), ", ".join(map(str, tokens.values())), mb.migrations)
        try:
            self._sender.send_adds(mb.engine_id, [add for _, add in adds.values()])
        except redis.RedisError as e:
            table.fail(mb, ErrorCode.BROKER_DISCONNECTED, f"could not resume the request: {e}", abort=False)
            return
        if handoff:
            pass  # the prefill engine dropped the request when it handed it over: nothing to abort
        elif reason == REDIS_LOST:
            table.defer_aborts(old, old_ids)  # sent once the engine is live again (it may not have re-registered)
        elif old in selector.live_engines(max_age=float("inf")):
            self._sender.send_aborts(old, old_ids)
        if self._on_migration is not None:
            self._on_migration(reason, old, mb.engine_id)
