"""What a `BrokerClient` sends to engines outside a bounded submit: ABORTs, utility calls, re-placed and
continuation ADDs. Shared by the client, its handles and its maintenance thread, which need nothing more.

Rules:
- Sends are plain XADDs on the engine's request stream: never capped, never trimmed, never refused.
- They run outside the in-flight table's lock; an ABORT that cannot be sent (Redis down) is deferred in
  the table, and the maintenance thread sends it once the engine is reachable (`Maintenance.flush_aborts`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from broker.client.in_flight import InFlightTable
from broker.engine_link import STREAM_FIELD
from broker.keys import RedisKeys
from protocol.messages import AbortRequests, AddRequest, encode

logger = logging.getLogger(__name__)


class Sender:
    """Writes to engines' request streams for one client; `connection()` is the client's Redis (after start)."""

    def __init__(self, client_id: str, keys: RedisKeys, table: InFlightTable,
                 connection: Callable[[], redis.Redis]) -> None:
        self.client_id = client_id
        self.keys = keys
        self._table = table
        self._connection = connection

    def send_to_engine(self, engine_id: str, payload: bytes) -> None:
        """XADD `payload` to the engine's request stream. Raises redis.RedisError."""
        self._connection().xadd(self.keys.request_stream(engine_id), {STREAM_FIELD: payload})

    def send_adds(self, engine_id: str, adds: list[AddRequest]) -> None:
        """XADD these ADDs to one engine in one round trip. Raises redis.RedisError."""
        pipe = self._connection().pipeline(transaction=False)
        for add in adds:
            pipe.xadd(self.keys.request_stream(engine_id), {STREAM_FIELD: encode(add)})
        pipe.execute()

    def send_aborts(self, engine_id: str, request_ids: list[str], index: int | None = None) -> None:
        """ABORT these wire ids (only sequence `index` of each, if given) on `engine_id`; deferred when Redis
        cannot be reached (a whole-request ABORT is sent later, a sequence's is dropped: best effort)."""
        try:
            self.send_to_engine(engine_id, encode(AbortRequests(request_ids, self.client_id, index)))
        except redis.RedisError as e:
            if index is not None:
                logger.info("client %s: could not abort sequence %d of %s (%s)", self.client_id, index,
                            request_ids, e)
                return
            logger.info("client %s: ABORT to %s deferred (%s)", self.client_id, engine_id, e)
            self._table.defer_aborts(engine_id, request_ids)
