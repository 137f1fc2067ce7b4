"""Celery on a Redis Cluster: kombu's Redis transport and Celery's Redis result backend, each connected to the
primary that owns the Celery keys' slot now, found again whenever a connection is made.

Why: Celery has no Redis Cluster transport, and every Celery key carries the control hash tag (``{rs}:celery:``),
so all of them live in one slot and one server can hold them. Pinning Celery to the node that owned the slot at
start (the first way, before these classes) made a batch worker exit on MOVED after a failover of that slot and
wait for the supervisor to start it again; a producer (the batch sweeper) failed the same way.

Rules:
- `SlotOwnerConnection` is a redis-py connection whose address is looked up on every connect: the primary owning
  ``route_key``'s slot as the cluster (its URL's nodes, `broker.connection.cluster_node_for_key`) says now, or
  first the node the last MOVED reply named (the other nodes may still name the old owner for a moment). A
  reply saying this node no longer serves the slot (MOVED, ASK, CLUSTERDOWN, TRYAGAIN, READONLY, or UNBLOCKED for
  a blocked BRPOP of a demoted primary) closes the connection and raises ``redis.ConnectionError``, which kombu and
  the result backend already treat as a lost connection: they reconnect, and the next connect looks again. A
  killed primary: its connections fail, and reconnecting finds the promoted replica once the cluster has failed
  over (kombu and the backend retry until then).
- `ClusterTransport` (Celery's ``broker_transport``) and `ClusterResultBackend` (the ``result_backend`` URL's
  prefix) take the cluster URL and the route key from their transport options, ``cluster_url`` and
  ``cluster_route_key`` (`api.batch.celery_redis` writes all of it). The ``redis://`` URL they are given names a
  node for the credentials only; the address is always looked up.
"""

from __future__ import annotations

from typing import Any

import redis
from celery.backends.redis import RedisBackend
from kombu.transport.redis import Channel, Transport

from broker.connection import cluster_node_for_key

# Replies of a cluster node that does not serve the slot (any more): the slot moved, is moving, has no owner, or
# the node was demoted to a replica (READONLY; UNBLOCKED ends a blocking command there).
_MOVED_REPLIES = (redis.exceptions.AskError, redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError,
                  redis.exceptions.ReadOnlyError)
_UNBLOCKED = "UNBLOCKED"
# (cluster URL, route key) -> the node a MOVED reply named: where the next connect goes first, since the node that
# gave up the slot knows its new owner before every other node's slot map does (gossip takes a moment).
_moved_to: dict[tuple[str, str], tuple[str, int]] = {}


class _SlotOwner:
    """The slot-following part of `SlotOwnerConnection` and `SlotOwnerSSLConnection` (see the module rules)."""

    def __init__(self, *, cluster_url: str, route_key: str, **kwargs: Any) -> None:
        self.cluster_url = cluster_url
        self.route_key = route_key
        super().__init__(**kwargs)

    def _connect(self):
        hint = _moved_to.get((self.cluster_url, self.route_key))
        if hint is not None:
            self.host, self.port = hint
            try:
                return super()._connect()
            except OSError:
                _moved_to.pop((self.cluster_url, self.route_key), None)
        try:
            self.host, self.port = cluster_node_for_key(self.cluster_url, self.route_key)
        except redis.RedisError as e:
            raise redis.ConnectionError(f"no cluster node owns the slot of {self.route_key!r} now: {e}") from e
        return super()._connect()

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except _MOVED_REPLIES as e:
            if isinstance(e, redis.exceptions.MovedError):
                _moved_to[(self.cluster_url, self.route_key)] = (e.host, e.port)
            self._lost(e)
        except redis.ResponseError as e:
            if not str(e).startswith(_UNBLOCKED):
                raise
            self._lost(e)

    def _lost(self, reply: redis.ResponseError) -> None:
        self.disconnect()
        raise redis.ConnectionError(f"{self.host}:{self.port} no longer serves the Celery slot: {reply}") from reply


class SlotOwnerConnection(_SlotOwner, redis.Connection):
    """A connection to whichever primary owns `route_key`'s slot (see the module rules)."""


class SlotOwnerSSLConnection(_SlotOwner, redis.SSLConnection):
    """`SlotOwnerConnection` over TLS (a ``rediss+cluster://`` URL)."""


def _cluster_options(options: dict[str, Any] | None) -> dict[str, str]:
    options = options or {}
    missing = [name for name in ("cluster_url", "cluster_route_key") if not options.get(name)]
    if missing:
        raise ValueError(f"a Celery cluster connection needs the transport option(s) {', '.join(missing)}")
    return {"cluster_url": options["cluster_url"], "route_key": options["cluster_route_key"]}


class ClusterChannel(Channel):
    """kombu's Redis channel, its connections made by `SlotOwnerConnection`."""

    from_transport_options = Channel.from_transport_options + ("cluster_url", "cluster_route_key")
    connection_class = SlotOwnerConnection
    connection_class_ssl = SlotOwnerSSLConnection
    cluster_url: str | None = None
    cluster_route_key: str | None = None

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        params = super()._connparams(asynchronous=asynchronous)
        params.update(_cluster_options({"cluster_url": self.cluster_url, "cluster_route_key": self.cluster_route_key}))
        return params


class ClusterTransport(Transport):
    """kombu's Redis transport on a cluster (``broker_transport = "api.batch.celery_cluster:ClusterTransport"``)."""

    Channel = ClusterChannel


class ClusterResultBackend(RedisBackend):
    """Celery's Redis result backend on a cluster
    (``result_backend = "api.batch.celery_cluster:ClusterResultBackend+redis://..."``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        options = _cluster_options(self.app.conf.get("result_backend_transport_options"))
        tls = issubclass(self.connparams.get("connection_class", redis.Connection), redis.SSLConnection)
        self.connparams.update(connection_class=SlotOwnerSSLConnection if tls else SlotOwnerConnection, **options)
