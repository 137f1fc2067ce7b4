"""The engine's side of the broker: read its request stream, publish outputs, keep its registration.

Rules for the engine process:
- At startup: `RequestReader.reset()` (a fresh stream: requests sent to a previous incarnation are
  not replayed; their clients re-place or fail them), then `EngineRegistry.register`, heartbeat,
  load the model, `mark_ready`.
- Input thread: `reader.read(block_ms, count)` in a loop. It never raises for a Redis outage
  (it logs, backs off and returns []), re-creates the consumer group if Redis restarted empty, and
  drops (logs + acks) entries that do not decode. It acks AbortRequests / UtilityCall / StartWave
  itself; an AddRequest stays in the pending list until the engine acks it when the request
  finishes (pass its message id in `OutputPublisher.publish(ack_ids=...)`), so the pending list
  holds exactly the requests in flight. Acked entries are also XDEL'd: the stream holds only
  unread and in-flight messages. A retried XADD can deliver an ADD twice: ignore a request id
  you already have.
- Output thread: one `publisher.publish(...)` per step: one PUBLISH per client (all that client's
  new tokens; SPUBLISH on a cluster, `broker.channels`), the acks and the stats, in one pipeline (on a
  cluster redis-py splits it per node: the engine's own keys are on one, the channels on their clients'). It returns the number of subscribers per
  client: 0 means the primary has no subscriber. `publisher.gone_clients(receivers)` names those of them whose
  heartbeat key is gone too: abort the requests whose outputs were in it (their client is dead). A client
  still alive is left alone: it is resubscribing (it re-places or resumes its requests itself), or on a cluster
  it is subscribed on a replica of its channel's shard (a restarted primary that rejoined as a replica keeps
  the subscriptions it took while it still believed it was the primary): the replica relays SPUBLISH, but
  SPUBLISH counts only the primary's own subscribers. A live client is checked at most once a second
  (`ALIVE_RECHECK`). -1 means the step could not be delivered (Redis down for longer than the retries), so do
  not conclude anything.
  Sequence numbers per client only ever grow: a client that resubscribes keeps deduplicating.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import redis
from redis.client import Pipeline

from broker.channels import is_cluster, publish
from broker.keys import RedisKeys
from broker.registry import EngineHeartbeat, EngineRegistry, encode_fields
from protocol.errors import MessageError
from protocol.messages import (
    AddRequest,
    EngineOutputs,
    ErrorCode,
    Message,
    RequestOutput,
    UtilityResult,
    decode,
    encode,
    make_error,
)

__all__ = ["EngineHeartbeat", "EngineRegistry", "OutputPublisher", "RequestReader", "STREAM_FIELD"]

logger = logging.getLogger(__name__)

STREAM_FIELD = b"m"  # each stream entry is {m: <msgpack message>}
_OUTAGE = (redis.ConnectionError, redis.TimeoutError)
ALIVE_RECHECK = 1.0  # seconds an unheard client found alive is not asked about again


class _Backoff:
    """Exponential sleep after consecutive failures (50 ms doubling up to `cap`)."""

    def __init__(self, cap: float) -> None:
        self.cap = cap
        self.failures = 0

    def sleep(self) -> None:
        time.sleep(min(self.cap, 0.05 * 2**self.failures))
        self.failures += 1

    def reset(self) -> None:
        self.failures = 0


class RequestReader:
    """Reads one engine's request stream through its consumer group; see the module rules."""

    def __init__(
        self,
        redis_client: redis.Redis,
        keys: RedisKeys | None,
        engine_id: str,
        consumer: str = "engine",
        *,
        backoff_cap: float = 1.0,
    ) -> None:
        self._redis = redis_client
        self.keys = keys or RedisKeys()
        self.engine_id = engine_id
        self.consumer = consumer
        self.stream = self.keys.request_stream(engine_id)
        self._group_ready = False
        self._backoff = _Backoff(backoff_cap)

    def reset(self) -> None:
        """Delete the stream and create it empty with its group. Call once at engine startup."""
        p = self._redis.pipeline(transaction=True)
        p.delete(self.stream)
        p.xgroup_create(self.stream, self.keys.consumer_group, id="0", mkstream=True)
        p.execute()
        self._group_ready = True

    def ensure_group(self) -> None:
        """Create the stream and group if missing (reads from the start: the stream holds only
        unread and in-flight entries, and after a Redis restart everything in it is new)."""
        try:
            self._redis.xgroup_create(self.stream, self.keys.consumer_group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    def read(self, block_ms: int = 100, count: int = 64) -> list[tuple[str, Message]]:
        """Up to `count` new messages, waiting up to `block_ms` (<= 0: not at all); [] on timeout or trouble.

        Keep `block_ms` well under the connection's socket timeout (5 s by default).
        """
        try:
            if not self._group_ready:
                self.ensure_group()
            reply = self._redis.xreadgroup(
                self.keys.consumer_group, self.consumer, {self.stream: ">"}, count=count, block=block_ms if block_ms > 0 else None
            )
        except redis.ResponseError as e:
            self._group_ready = False
            if "NOGROUP" in str(e):
                logger.warning("engine %s: consumer group missing (Redis restarted?), re-creating it", self.engine_id)
            else:
                logger.error("engine %s: XREADGROUP on %s failed: %s", self.engine_id, self.stream, e)
                self._backoff.sleep()
            return []
        except _OUTAGE as e:
            self._group_ready = False
            log = logger.warning if self._backoff.failures == 0 else logger.debug
            log("engine %s: Redis unreachable while reading requests (%s); retrying with backoff", self.engine_id, e)
            self._backoff.sleep()
            return []
        self._backoff.reset()
        return self._decode_entries(reply[0][1] if reply else [])

    def _decode_entries(self, entries: list) -> list[tuple[str, Message]]:
        messages: list[tuple[str, Message]] = []
        done: list[str] = []
        for raw_id, fields in entries:
            message_id = raw_id.decode()
            try:
                msg = decode((fields or {}).get(STREAM_FIELD, b""))
            except MessageError as e:
                logger.warning("engine %s: dropping bad stream entry %s: %s", self.engine_id, message_id, e)
                done.append(message_id)
                continue
            if not isinstance(msg, AddRequest):
                done.append(message_id)
            messages.append((message_id, msg))
        if done:
            self.ack(done)
        return messages

    def ack(self, message_ids: Sequence[str], pipe: Pipeline | None = None) -> None:
        """XACK and XDEL `message_ids`. Without `pipe`, Redis errors are logged, never raised."""
        if not message_ids:
            return
        p = pipe if pipe is not None else self._redis.pipeline(transaction=False)
        p.xack(self.stream, self.keys.consumer_group, *message_ids)
        p.xdel(self.stream, *message_ids)
        if pipe is None:
            try:
                p.execute(raise_on_error=False)
            except redis.RedisError as e:
                logger.warning("engine %s: could not ack %d entries: %s", self.engine_id, len(message_ids), e)

    def pending(self) -> dict[str, Any]:
        """XPENDING summary: {"count", "min", "max", "consumers": {name: count}}."""
        try:
            s = self._redis.xpending(self.stream, self.keys.consumer_group)
        except redis.ResponseError as e:
            if "NOGROUP" in str(e):
                return {"count": 0, "min": None, "max": None, "consumers": {}}
            raise
        ids = [None if x is None else x.decode() for x in (s["min"], s["max"])]
        consumers = {c["name"].decode(): int(c["pending"]) for c in s["consumers"]}
        return {"count": int(s["pending"]), "min": ids[0], "max": ids[1], "consumers": consumers}


class OutputPublisher:
    """Publishes one engine's step outputs; see the module rules."""

    def __init__(
        self,
        redis_client: redis.Redis,
        keys: RedisKeys | None,
        engine_id: str,
        *,
        attempts: int = 2,
        backoff_cap: float = 1.0,
    ) -> None:
        self._redis = redis_client
        self._sharded = is_cluster(redis_client)
        self.keys = keys or RedisKeys()
        self.engine_id = engine_id
        self._stream = self.keys.request_stream(engine_id)
        self._alive_at: dict[str, float] = {}  # unheard clients found alive -> when
        self._attempts = attempts
        self._backoff = _Backoff(backoff_cap)
        self._seq: dict[str, int] = {}

    def publish(
        self,
        outputs_by_client: Mapping[str, EngineOutputs],
        ack_ids: Sequence[str] = (),
        stats: Mapping[str, Any] | None = None,
    ) -> dict[str, int]:
        """Send one step; return {client_id: subscribers} (-1 for all if the step was dropped)."""
        clients = list(outputs_by_client)
        payloads = [self._encode(c, outputs_by_client[c]) for c in clients]
        for attempt in range(self._attempts):
            p = self._redis.pipeline(transaction=False)
            for client_id, payload in zip(clients, payloads, strict=True):
                publish(p, self.keys.output_channel(client_id), payload, self._sharded)
            if ack_ids:
                p.xack(self._stream, self.keys.consumer_group, *ack_ids)
                p.xdel(self._stream, *ack_ids)
            if stats:
                p.hset(self.keys.engine(self.engine_id), mapping=encode_fields(stats))
            try:
                replies = p.execute(raise_on_error=False)
            except _OUTAGE as e:
                logger.warning("engine %s: publish attempt %d failed: %s", self.engine_id, attempt + 1, e)
                if attempt + 1 < self._attempts:
                    self._backoff.sleep()
                continue
            self._backoff.reset()
            for r in replies[len(clients):]:
                if isinstance(r, Exception):
                    logger.warning("engine %s: ack/stats write failed: %s", self.engine_id, r)
            return {c: (r if isinstance(r, int) else -1) for c, r in zip(clients, replies, strict=False)}
        logger.error(
            "engine %s: dropped one step of outputs for %d client(s) and %d acks: Redis unreachable",
            self.engine_id, len(clients), len(ack_ids),
        )  # fmt: skip
        return dict.fromkeys(clients, -1)

    def gone_clients(self, receivers: Mapping[str, int]) -> list[str]:
        """Of the clients `publish` reached no subscriber of (0), those whose heartbeat key is gone (see the module
        rules); none when Redis cannot say."""
        now = time.monotonic()
        unheard = [c for c, n in receivers.items() if n == 0 and now - self._alive_at.get(c, -ALIVE_RECHECK) >= ALIVE_RECHECK]
        if not unheard:
            return []
        try:
            p = self._redis.pipeline(transaction=False)
            for client_id in unheard:
                p.exists(self.keys.client_alive(client_id))
            alive = p.execute()
        except redis.RedisError as e:
            logger.debug("engine %s: could not tell whether %d unheard client(s) live: %s", self.engine_id,
                         len(unheard), e)
            return []
        gone = []
        for client_id, found in zip(unheard, alive, strict=True):
            if found:
                self._alive_at[client_id] = now
            else:
                self._alive_at.pop(client_id, None)
                gone.append(client_id)
        if len(self._alive_at) > 1024:  # forget clients not asked about for a while
            self._alive_at = {c: t for c, t in self._alive_at.items() if now - t < 60}
        return gone

    def _encode(self, client_id: str, outs: EngineOutputs) -> bytes:
        seq = self._seq.get(client_id, 0) + 1
        self._seq[client_id] = seq
        outs.seq = seq
        try:
            return encode(outs)
        except MessageError as e:
            logger.error("engine %s: outputs for %s not encodable (%s); failing the bad items", self.engine_id, client_id, e)
        # Slow path, only for a bug upstream (e.g. numpy floats in logprobs): fail what cannot be sent.
        outs.outputs = [o if _packable(o) else _failed_output(o) for o in outs.outputs]
        outs.utility_results = [u if _packable(u) else _failed_utility(u) for u in outs.utility_results]
        return encode(outs)


def _packable(item: RequestOutput | UtilityResult) -> bool:
    try:
        msgpack.packb(item.to_wire(), use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return False
    return True


def _failed_output(o: RequestOutput) -> RequestOutput:
    return RequestOutput.failure(str(o.request_id), ErrorCode.ENGINE_ERROR,
                                 "engine produced an output that cannot be encoded", index=int(o.index))


def _failed_utility(u: UtilityResult) -> UtilityResult:
    return UtilityResult(str(u.call_id), None, make_error(ErrorCode.ENGINE_ERROR, "utility result is not msgpack-able"))
