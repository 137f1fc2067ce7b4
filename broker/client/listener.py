"""The output listener thread of a `BrokerClient` (see the rules in `broker.client.client`).

It subscribes once to `rs:out:{client_id}` (sharded pub/sub on a cluster, `broker.channels`) and hands each
`EngineOutputs` to the client's in-flight table (`InFlightTable.deliver`: duplicates dropped, a skipped seq
fails that engine's requests with output_lost, continuations renamed to their request, engine_failed outputs
declare the engine gone). When the
subscription drops it tells the table (`lose_subscription`: unstarted requests wait to be sent again, started
ones that may move wait to be resumed from their delivered tokens, the rest and every utility call fail with
broker_disconnected) and resubscribes with backoff (capped at 2 s, 0.25 s behind sentinels or on a cluster).

`OutputListener` holds no state of its own: it is given the channel to read and the in-flight table to feed,
and does its Redis I/O (on a connection of its own) outside the table's lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis
from redis.exceptions import ClusterDownError, RedisClusterUnreachableError

from broker.channels import Subscriber
from broker.client.in_flight import InFlightTable
from broker.client.mailbox import Mailbox
from broker.connection import is_cluster_url, is_sentinel_url
from broker.log_limits import warn_every
from protocol.messages import EngineOutputs, MessageError, decode

logger = logging.getLogger(__name__)

_OUTAGE = (redis.ConnectionError, redis.TimeoutError, OSError, ClusterDownError, RedisClusterUnreachableError)
"""Errors that say Redis is away (on a cluster also: its state is fail, or no node answers): one warning, no trace."""
_BACKOFF_CAP = 2.0
_FAILOVER_BACKOFF_CAP = 0.25


class OutputListener:
    """The body of one client's listener thread; `run` returns once `stopping` is set."""

    def __init__(self, redis_url: str, channel: str, client_id: str, table: InFlightTable,
                 resubmit_limit: int, resume_blocker: Callable[[Mailbox], str | None] | None = None) -> None:
        self._redis_url = redis_url
        self._channel = channel
        self._client_id = client_id
        self._table = table
        self._resubmit_limit = resubmit_limit
        self._resume_blocker = resume_blocker
        # Behind sentinels, or on a cluster that fails over by itself, a new primary is up within seconds: look
        # for it often.
        failover = is_sentinel_url(redis_url) or is_cluster_url(redis_url)
        self._backoff_cap = _FAILOVER_BACKOFF_CAP if failover else _BACKOFF_CAP

    def run(self, stopping: threading.Event) -> None:
        failures = 0
        while not stopping.is_set():
            pubsub = None
            try:
                pubsub = Subscriber(self._redis_url, self._channel, f"redserve-listener-{self._client_id}")
                pubsub.subscribe(self._channel)
                while not stopping.is_set():
                    msg = pubsub.get_message(timeout=0.2)
                    if msg is None:
                        continue
                    if msg["type"] == "message":
                        self.dispatch(msg["data"])
                    elif msg["type"] == "subscribe":
                        failures = 0
                        self._table.set_subscribed(True)
            except Exception as e:  # noqa: BLE001 - the listener must outlive any error
                self._on_subscription_lost(e, failures)
                failures += 1
                stopping.wait(min(self._backoff_cap, 0.05 * 2**failures))
            finally:
                self._table.set_subscribed(False)
                if pubsub is not None:
                    pubsub.close()

    def _on_subscription_lost(self, error: Exception, failures: int) -> None:
        client_id = self._client_id
        if not isinstance(error, _OUTAGE):
            logger.exception("client %s: listener error; resubscribing", client_id, exc_info=error)
        elif failures == 0:
            logger.warning("client %s: output subscription lost (%s); resubscribing", client_id, error)
        failed, kept = self._table.lose_subscription(self._resubmit_limit, self._resume_blocker)
        if failures and not failed:
            return  # still reconnecting: the requests kept were reported on the first failure
        if failed:
            logger.warning("client %s: failed %d request(s) in flight after losing Redis", client_id, failed)
        if kept:
            logger.warning("client %s: %d request(s) will be sent again (or resumed from their delivered tokens) "
                           "once Redis is back", client_id, kept)

    def dispatch(self, data: bytes) -> None:
        """Deliver one message from the output channel."""
        try:
            outs = decode(data, expect=EngineOutputs)
        except MessageError as e:
            warn_every(logger, "bad-output-message", 10.0, "client %s: dropping bad message on its output channel: %s",
                       self._client_id, e)
            return
        self._table.deliver(outs)
