"""The handle a caller reads one request's outputs from (the client side of one request).

The handle is read by exactly one caller thread (the Flask request thread or the Celery task); the
request's `Mailbox` behind it is changed only by the in-flight table. The handle reaches the rest of the
client through two narrow parts, never the client itself: the table (to expire, abort or stop a sequence
of its request) and the sender (to send ABORTs).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterator

from broker.client.in_flight import InFlightTable
from broker.client.mailbox import Mailbox
from broker.client.sender import Sender
from protocol.messages import RequestOutput

logger = logging.getLogger(__name__)


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

    def __init__(self, table: InFlightTable, sender: Sender, mailbox: Mailbox) -> None:
        self._table = table
        self._sender = sender
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
                    self._table.expire(self._mb)
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
        ended = self._table.abort(self._mb)
        if ended is not None:
            self._sender.send_aborts(*ended)

    def abort_sequence(self, index: int) -> None:
        """Ask the engine to stop sequence `index` of this request (n > 1); its "abort" output arrives
        like any other, and the handle ends when every sequence has ended. Best effort: if Redis is
        unreachable the sequence simply runs on until the request ends."""
        if self._mb.done:
            return
        engine_id, wire_id, wire_index = self._table.abandon_sequence(self._mb, index)
        self._sender.send_aborts(engine_id, [wire_id], wire_index)

    def close(self) -> None:
        if not self._mb.done:
            self.abort()

    def __enter__(self) -> RequestHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
