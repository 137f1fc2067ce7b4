"""Moving a started request of a `BrokerClient` to another engine (see the rules in `broker.client`).

`Migrator.resume(mb, reason)` continues every running sequence of `mb` on one live engine as the ADDs of
`broker.request_resume` and points the mailbox's routes at them, so the caller's stream goes on with no
token lost or repeated. It is called by the maintenance thread once `mb`'s engine is declared gone.

Rules:
- A request moves at most `max_migrations` times; past that, or when `request_resume.resume_blocker`
  says it cannot, it ends with engine_gone (or the engine's own engine_failed error) as before.
- The routes change and the continuation ADDs are built in one step of the in-flight table
  (`InFlightTable.move_to_continuations`), so no output of the old engine can slip in between (the old
  wire ids are unrouted: late outputs for them are dropped); the XADDs happen after, outside its lock.
- The old engine gets ABORTs for the old ids when it still looks live (it restarted, or only its
  presence subscription dropped), so a sequence never runs twice.
- With no engine READY the request waits like an unstarted one (`replace_wait`, then no_engine).
- Every move is logged with the old and new engine and reported to `on_migration(reason, old, new)`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import redis

from broker.engine_link import STREAM_FIELD
from broker.errors import NoEngineAvailable
from broker.messages import ErrorCode, encode
from broker.request_handle import Mailbox
from broker.request_resume import resume_blocker

if TYPE_CHECKING:
    from broker.client import BrokerClient

logger = logging.getLogger(__name__)


class Migrator:
    """Resumes one client's started requests elsewhere; holds no state besides the client."""

    def __init__(self, client: BrokerClient) -> None:
        self._client = client

    def blocker(self, mb: Mailbox) -> str | None:
        """Why `mb` may not move now, or None (called by the in-flight table, under its lock)."""
        limit = self._client.settings.max_migrations
        if limit == 0:
            return "resuming is off (--max-migrations 0)"
        if mb.migrations >= limit:
            return f"it was moved {mb.migrations} time(s) already (--max-migrations {limit})"
        return resume_blocker(mb.add.params)

    def resume(self, mb: Mailbox, reason: str, wait_for_engine: Callable[[Mailbox], None]) -> None:
        """Continue `mb` on another live engine, or on its own once restarted; `wait_for_engine(mb)` parks it
        if none is READY (until `replace_wait`)."""
        c = self._client
        # Its own engine is a fine target again once it is back as a new incarnation (a restart: DP=1).
        cached = c.selector.live_engines(max_age=float("inf")).get(mb.engine_id, {})
        gone = c.table.gone_engines()
        exclude = [mb.engine_id, *gone] if cached.get("incarnation") == mb.incarnation else gone
        try:
            info = c.selector.select(exclude=exclude, token_ids=mb.add.prompt_token_ids)
        except NoEngineAvailable:
            wait_for_engine(mb)
            return
        c.table.note_incarnation(info["engine_id"], info.get("incarnation"))
        moved = c.table.move_to_continuations(mb, info["engine_id"], info.get("incarnation"))
        if moved is None:
            return
        old, old_ids, adds = moved
        tokens = {index: len(mb.delivered.get(index, [])) for index, _ in adds.values()}
        logger.info("client %s: %s: resumed request %s from engine %s on engine %s as %s after %s token(s) "
                    "(migration %d)", c.client_id, reason, mb.request_id, old, mb.engine_id, ", ".join(adds),
                    ", ".join(map(str, tokens.values())), mb.migrations)
        try:
            p = c.redis.pipeline(transaction=False)
            for _, add in adds.values():
                p.xadd(c.keys.request_stream(mb.engine_id), {STREAM_FIELD: encode(add)})
            p.execute()
        except redis.RedisError as e:
            c.table.fail(mb, ErrorCode.BROKER_DISCONNECTED, f"could not resume the request: {e}", abort=False)
            return
        if old in c.selector.live_engines(max_age=float("inf")):
            c.send_aborts(old, old_ids)
        if c.on_migration is not None:
            c.on_migration(reason, old, mb.engine_id)
