"""Pub/sub for the output and presence channels: classic on one server, sharded on a Redis Cluster.

Rules:
- On a cluster (a `redis.RedisCluster` client) a channel belongs to the primary owning its hash slot, and only
  the sharded commands stay there: SPUBLISH, SSUBSCRIBE and PUBSUB SHARDNUMSUB, so output traffic spreads over
  the shards with the clients' channels. Classic PUBLISH would be broadcast over the cluster bus to every node,
  and PUBSUB NUMSUB answers for the one node asked: neither is used on a cluster.
- On one server (or behind sentinels) the classic commands, as before (Redis >= 6.2 has no sharded pub/sub).
- A shard's replicas accept SSUBSCRIBE too and relay what its primary SPUBLISHes, which counts only the primary's
  own subscribers: a subscriber can end up on a replica (a restarted primary that rejoined as a replica keeps the
  subscriptions it took while it still believed it was the primary). `subscriber_counts` adds the replicas'
  subscribers where the primary has none, and an engine aborts an unheard client's requests only once its
  heartbeat is gone too (`broker.engine_link`).
- `Subscriber` holds one plain connection to the node that owns its channels (the first channel's slot; every
  channel one subscriber takes shares it: one client's output channel, one engine's presence channels). Any
  disconnect reaches the caller as an error, and so does a channel moved to another node (the server sends
  SUNSUBSCRIBE): the caller knows messages may have been lost and subscribes again, which finds the node anew.
- Messages read the same in both modes: ``{"type": "message" | "subscribe" | "unsubscribe", "channel", "data"}``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

from broker.connection import connect

_TYPES = {"smessage": "message", "ssubscribe": "subscribe", "sunsubscribe": "unsubscribe"}


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


def publish(pipe: Any, channel: str, payload: bytes, sharded: bool) -> None:
    """Queue one publish on `pipe` (a pipeline or client); its reply is the number of subscribers reached."""
    if sharded:
        pipe.spublish(channel, payload)
    else:
        pipe.publish(channel, payload)


class ChannelMoved(redis.RedisError):
    """A sharded channel that had no subscriber on the node the client's slot map named lives on another node now
    (a failover or a resharding moved its slot): its subscribers are moving too, so no count is final yet."""


def subscriber_counts(client: redis.Redis | RedisCluster, channels: Sequence[str],
                      nodes_seen: dict[str, str] | None = None) -> list[int]:
    """Subscribers of each channel, in order (on a cluster: asked of each channel's own node).

    On a cluster PUBSUB SHARDNUMSUB is never redirected: a node answers 0 for a channel whose slot it gave away,
    and a client's slot map is only corrected by a redirected command. So where a channel reads 0, the slot map is
    read again, and ChannelMoved is raised if that channel's node changed. `nodes_seen` (optional, kept up to date
    by the call, for the channels asked only): channel -> the node of its last count; a channel counted on another
    node than last time also raises ChannelMoved (its subscribers may still be on their way to the new node)."""
    if not channels:
        return []
    if not is_cluster(client):
        return [count for _, count in client.pubsub_numsub(*channels)]
    counts = _shard_counts(client, channels)
    for i, channel in enumerate(channels):
        if counts[i] == 0:  # subscribers on the shard's replicas (see the module rules)
            counts[i] = _replica_count(client, channel)
    empty = {channel: client.get_node_from_key(channel).name for channel, n in zip(channels, counts, strict=True)
             if n == 0}
    if empty:
        client.nodes_manager.initialize()
    moved = sorted(channel for channel, node in empty.items() if client.get_node_from_key(channel).name != node)
    if nodes_seen is not None:
        now = {channel: client.get_node_from_key(channel).name for channel in channels}
        moved += sorted(channel for channel, node in now.items() if nodes_seen.get(channel, node) != node)
        nodes_seen.clear()
        nodes_seen.update(now)
    if moved:
        raise ChannelMoved(f"{len(set(moved))} channel(s) now on another node, e.g. {moved[0]}")
    return counts


def _replica_count(client: RedisCluster, channel: str) -> int:
    replicas = client.nodes_manager.slots_cache.get(client.keyslot(channel), [])[1:]
    total = 0
    for node in replicas:
        try:
            total += sum(int(n) for _, n in client.pubsub_shardnumsub(channel, target_nodes=node))
        except redis.RedisError:
            continue  # a replica that does not answer has no subscriber we could count on
    return total


def _shard_counts(client: RedisCluster, channels: Sequence[str]) -> list[int]:
    by_node: dict[str, list[str]] = defaultdict(list)
    nodes = {}
    for channel in channels:
        node = client.get_node_from_key(channel)
        nodes[node.name] = node
        by_node[node.name].append(channel)
    counts: dict[str, int] = {}
    for name, names in by_node.items():
        reply = client.pubsub_shardnumsub(*names, target_nodes=nodes[name])
        counts.update((_text(ch), int(n)) for ch, n in reply)
    return [counts.get(channel, 0) for channel in channels]


class Subscriber:
    """One connection's subscriptions (see the module rules); not thread-safe, one reader thread."""

    def __init__(self, redis_url: str, route_channel: str, client_name: str) -> None:
        self._client = connect(redis_url, retries=0, client_name=client_name)
        self.sharded = is_cluster(self._client)
        if self.sharded:
            node = self._client.get_node_from_key(route_channel)
            conn = self._client.get_redis_connection(node)
        else:
            conn = self._client
        self._pubsub = conn.pubsub()
        self._leaving: set[str] = set()  # channels this subscriber unsubscribed from, until the server confirms

    def subscribe(self, channel: str) -> None:
        self._leaving.discard(channel)
        (self._pubsub.ssubscribe if self.sharded else self._pubsub.subscribe)(channel)

    def unsubscribe(self, channel: str) -> None:
        self._leaving.add(channel)
        (self._pubsub.sunsubscribe if self.sharded else self._pubsub.unsubscribe)(channel)

    def get_message(self, timeout: float) -> dict | None:
        msg = self._pubsub.get_message(timeout=timeout)
        if msg is None:
            return None
        kind = _TYPES.get(msg["type"], msg["type"])
        if kind == "unsubscribe" and self.sharded:
            channel = _text(msg["channel"])
            if channel not in self._leaving:  # the server dropped it: its slot moved to another node
                raise RedisConnectionError(f"shard channel {channel} left this node (its slot moved)")
            self._leaving.discard(channel)
        return {**msg, "type": kind}

    def close(self) -> None:
        self._pubsub.close()
        self._client.close()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
