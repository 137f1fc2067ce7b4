"""Per-request mailbox and the handle a caller reads outputs from (the client side of one request).

The mailbox is filled and changed only by the client's in-flight table (`broker.in_flight`, under its
lock: the listener, deadline and liveness checks go through it); the handle is read by exactly one caller
thread (the Flask request thread or the Celery task). Every queue item is (output, last): `last` is
decided once, by the table, so the handle never guesses whether a request is over.

A mailbox is reached by one or more wire ids (`routes`): at first the request's own id (outputs keep
their index); once its sequences were resumed on another engine (`broker.request_resume`), one
continuation id per running sequence, each mapped to the sequence's index. `delivered` keeps every
token handed to the caller, per index, which is what a continuation replays.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis

from broker.messages import AbortRequests, AddRequest, RequestOutput, encode

if TYPE_CHECKING:
    from broker.client import BrokerClient

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Mailbox:
    """State of one request in flight; changed only by `InFlightTable`, under its lock."""

    add: AddRequest
    engine_id: str
    incarnation: str | None
    n: int
    outputs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    finished_indices: set[int] = field(default_factory=set)
    got_output: bool = False
    done: bool = False
    resubmits: int = 0
    orphaned_at: float | None = None  # monotonic time its engine was found gone with no engine to take it
    lost_with_redis: bool = False  # no output yet when the subscription dropped: re-sent once Redis is back
    routes: dict[str, int | None] = field(default_factory=dict)  # wire id -> index (None: the output's own)
    delivered: dict[int, list[int]] = field(default_factory=dict)  # index -> tokens handed to the caller
    abandoned: set[int] = field(default_factory=set)  # indices the caller stopped (a stop string)
    migrations: int = 0
    engine_error: str | None = None  # its engine failed as a whole (engine_failed): the message, if not resumed
    gone_reason: str | None = None  # why its engine was declared gone, kept until the request has moved

    def __post_init__(self) -> None:
        if not self.routes:
            self.routes = {self.add.request_id: None}

    @property
    def request_id(self) -> str:
        return self.add.request_id

    @property
    def running(self) -> list[int]:
        """Indices still generating (not finished, not stopped by the caller)."""
        return [i for i in range(self.n) if i not in self.finished_indices and i not in self.abandoned]

    def wire_id(self, index: int) -> tuple[str, int | None]:
        """(wire id, index inside that wire request) that carries sequence `index`."""
        for rid, mapped in self.routes.items():
            if mapped is None:
                return rid, index
            if mapped == index:
                return rid, 0
        return self.request_id, index

    @property
    def deadline(self) -> float | None:
        return self.add.deadline


class RequestHandle:
    """A submitted request: read its outputs with `get()` or by iterating; `close()` when done.

    - `get(timeout)` returns the next `RequestOutput`, or None on timeout or once the request has
      ended and every output was read. The last output of a request has a `finish_reason` (for
      each index when n > 1) or an `error_code`; errors made by the client itself (deadline, engine
      gone, broker disconnected) arrive the same way, as a `RequestOutput.failure` output.
    - Iterating yields outputs until the request ends (blocking; bounded by the deadline if any).
    - `abort()` tells the owning engine to stop and ends the request here at once (a final output
      with finish_reason "abort"); idempotent. `close()` aborts if still running and forgets the
      request: call it in a `finally` (or use the handle as a context manager).
    - `engine_id` can change if the request is re-placed because its engine died before answering, or
      resumed on another engine after it had started (`migrations` counts those moves).
    """

    def __init__(self, client: BrokerClient, mailbox: Mailbox) -> None:
        self._client = client
        self._mb = mailbox
        self._ended = False

    @property
    def request_id(self) -> str:
        return self._mb.request_id

    @property
    def engine_id(self) -> str:
        return self._mb.engine_id

    @property
    def migrations(self) -> int:
        return self._mb.migrations

    @property
    def finished(self) -> bool:
        """True once the last output has been read."""
        return self._ended

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        if self._ended:
            return None
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if end is None else max(0.0, end - time.monotonic())
            deadline = self._mb.deadline
            if deadline is not None:
                until_deadline = deadline - time.time()
                if until_deadline <= 0:
                    self._client.table.expire(self._mb)
                    until_deadline = 0.0
                wait = until_deadline if wait is None else min(wait, until_deadline)
            try:
                output, last = self._mb.outputs.get(timeout=wait)
            except queue.Empty:
                if end is not None and time.monotonic() >= end:
                    return None
                continue  # the deadline passed: loop to expire the request and read its error
            if last:
                self._ended = True
            return output

    def __iter__(self) -> Iterator[RequestOutput]:
        while (output := self.get()) is not None:
            yield output

    def abort(self) -> None:
        ended = self._client.table.abort(self._mb)
        if ended is not None:
            self._client.send_aborts(*ended)

    def abort_sequence(self, index: int) -> None:
        """Ask the engine to stop sequence `index` of this request (n > 1); its "abort" output arrives
        like any other, and the handle ends when every sequence has ended. Best effort: if Redis is
        unreachable the sequence simply runs on until the request ends."""
        if self._mb.done:
            return
        c = self._client
        engine_id, wire_id, wire_index = c.table.abandon_sequence(self._mb, index)
        try:
            c.send_to_engine(engine_id, encode(AbortRequests([wire_id], c.client_id, wire_index)))
        except redis.RedisError as e:
            logger.info("client %s: could not abort sequence %d of %s (%s)", c.client_id, index, self.request_id, e)

    def close(self) -> None:
        if not self._mb.done:
            self.abort()

    def __enter__(self) -> RequestHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
