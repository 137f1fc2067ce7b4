"""The output listener thread of a `BrokerClient` (see the rules in `broker.client`).

It subscribes once to `rs:out:{client_id}`, resubscribes with backoff when the subscription drops
(failing every request and utility call in flight with broker_disconnected), and demuxes each
`EngineOutputs` into the client's mailboxes: duplicates (seq not above the last one) are dropped and
a skipped seq fails that engine's requests with output_lost. Outputs of a resumed request's continuations
are renamed to the request's id and index (`Mailbox.routes`), and every token handed over is kept in
`Mailbox.delivered`. An engine_failed output (the engine failed as a whole) declares its engine gone
instead of ending a request that may still resume: the maintenance thread decides at once.

`OutputListener` holds no state of its own besides the client: it reads and changes the client's
shared state (`_mailboxes`, `_calls`, `_last_seq`, `_subscribed`) only under `client._lock`, and
ends requests through the client's `_*_locked` helpers.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import redis

from broker.connection import connect
from broker.log_limits import warn_every
from broker.messages import EngineOutputs, ErrorCode, MessageError, RequestOutput, decode, error_code
from broker.request_handle import Mailbox

if TYPE_CHECKING:
    from broker.client import BrokerClient

logger = logging.getLogger(__name__)

_OUTAGE = (redis.ConnectionError, redis.TimeoutError, OSError)


class OutputListener:
    """The body of one client's listener thread; `run` returns once the client is stopping."""

    def __init__(self, client: BrokerClient) -> None:
        self._client = client

    def run(self) -> None:
        c = self._client
        failures = 0
        while not c._stopping.is_set():
            pubsub_client = connect(c.redis_url, retries=0, client_name=f"redserve-listener-{c.client_id}")
            pubsub = pubsub_client.pubsub()
            try:
                pubsub.subscribe(c.keys.output_channel(c.client_id))
                while not c._stopping.is_set():
                    msg = pubsub.get_message(timeout=0.2)
                    if msg is None:
                        continue
                    if msg["type"] == "message":
                        self.dispatch(msg["data"])
                    elif msg["type"] == "subscribe":
                        failures = 0
                        self._set_subscribed(True)
            except Exception as e:  # noqa: BLE001 - the listener must outlive any error
                self._on_subscription_lost(e, failures)
                failures += 1
                c._stopping.wait(min(2.0, 0.05 * 2**failures))
            finally:
                self._set_subscribed(False)
                pubsub.close()
                pubsub_client.close()

    def _set_subscribed(self, value: bool) -> None:
        c = self._client
        with c._lock:
            c._subscribed = value
            if value:
                c._subscribed_event.set()
            else:
                c._subscribed_event.clear()

    def _on_subscription_lost(self, error: Exception, failures: int) -> None:
        c = self._client
        if not isinstance(error, _OUTAGE):
            logger.exception("client %s: listener error; resubscribing", c.client_id, exc_info=error)
        elif failures == 0:
            logger.warning("client %s: output subscription lost (%s); resubscribing", c.client_id, error)
        with c._lock:
            c._subscribed = False
            c._subscribed_event.clear()
            lost, kept = [], 0
            for mb in list(c._mailboxes.values()):
                if not mb.got_output and mb.resubmits < c._resubmit_limit:
                    mb.lost_with_redis = True  # nothing reached the caller: run it again once Redis is back
                    mb.orphaned_at = time.monotonic() if mb.orphaned_at is None else mb.orphaned_at
                    kept += 1
                else:
                    lost.append(mb)
                    c._fail_locked(mb, ErrorCode.BROKER_DISCONNECTED, "lost the connection to Redis; output may be incomplete")
            c._fail_calls_locked(None, "lost the connection to Redis")
            c._last_seq.clear()
        if lost:
            logger.warning("client %s: failed %d request(s) in flight after losing Redis", c.client_id, len(lost))
        if kept:
            logger.warning("client %s: %d request(s) with no output yet will be sent again once Redis is back",
                           c.client_id, kept)

    def dispatch(self, data: bytes) -> None:
        """Deliver one message from the output channel."""
        c = self._client
        try:
            outs = decode(data, expect=EngineOutputs)
        except MessageError as e:
            warn_every(logger, "bad-output-message", 10.0, "client %s: dropping bad message on its output channel: %s",
                       c.client_id, e)
            return
        engine_id = outs.engine_id
        with c._lock:
            last = c._last_seq.get(engine_id)
            if last is not None and outs.seq <= last:
                return  # a duplicate from a retried PUBLISH
            c._last_seq[engine_id] = outs.seq
            if last is not None and outs.seq > last + 1:
                self._on_gap_locked(engine_id, outs.seq - last - 1)
            for out in outs.outputs:
                mb = c._mailboxes.get(out.request_id)
                # A request lost with Redis runs again under a fresh id: whatever still comes for the old
                # one (an engine that had read the ADD before Redis went) is dropped, never mixed in.
                if mb is not None and mb.engine_id == engine_id and not mb.lost_with_redis:
                    self._route_locked(mb, out)
            for result in outs.utility_results:
                call = c._calls.pop(result.call_id, None)
                if call is not None:
                    call[1].put(result)

    def _on_gap_locked(self, engine_id: str, missing: int) -> None:
        c = self._client
        victims = [mb for mb in c._mailboxes.values() if mb.engine_id == engine_id and not mb.lost_with_redis]
        logger.warning(
            "client %s: %d message(s) from engine %s were lost; failing its %d request(s)",
            c.client_id, missing, engine_id, len(victims),
        )  # fmt: skip
        for mb in victims:
            c._fail_locked(mb, ErrorCode.OUTPUT_LOST, f"{missing} output message(s) from engine {engine_id} were lost")
        c._fail_calls_locked(engine_id, f"output message(s) from engine {engine_id} were lost")

    def _route_locked(self, mb: Mailbox, out: RequestOutput) -> None:
        index = mb.routes.get(out.request_id)
        if index is not None:  # a continuation: sequence `index` of the original request
            out.request_id, out.index = mb.request_id, index
        if out.error is not None and error_code(out.error) == ErrorCode.ENGINE_FAILED:
            mb.engine_error = out.error
            self._client._gone.setdefault(mb.engine_id, (mb.incarnation, "engine_failed"))
            self._client._liveness_due.set()
            return
        self._deliver_locked(mb, out)

    def _deliver_locked(self, mb: Mailbox, out: RequestOutput) -> None:
        if out.new_token_ids:
            mb.delivered.setdefault(out.index, []).extend(out.new_token_ids)
        mb.got_output = True
        if out.finish_reason is not None:
            mb.finished_indices.add(out.index)
        last = out.error is not None or len(mb.finished_indices) >= mb.n
        mb.outputs.put((out, last))
        if last:
            self._client._finish_locked(mb)
