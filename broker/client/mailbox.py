"""The per-request mailbox: the state of one request in flight on the client side.

It is filled and changed only by the client's in-flight table (`broker.client.in_flight`, under its lock:
the listener, deadline and liveness checks go through it) and read by the request's handle
(`broker.client.request_handle`). Every queue item is (output, last): `last` is decided once, by the table,
so the handle never guesses whether a request is over.

A mailbox is reached by one or more wire ids (`routes`): at first the request's own id (outputs keep
their index); once its sequences were resumed on another engine (`broker.client.request_resume`), one
continuation id per running sequence, each mapped to the sequence's index. `delivered` keeps every
token handed to the caller, per index, which is what a continuation replays.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

from protocol.messages import AddRequest


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
    handoffs: int = 0  # of the migrations, the planned ones from a prefill engine (never count against the limit)
    handoff_pending: bool = False  # its prefill engine handed it over: it moves to a decode engine next
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
