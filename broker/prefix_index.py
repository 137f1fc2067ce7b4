"""The prefix-cache index in Redis: which block hashes each engine's KV cache holds now.

Rules:
- One Redis set per engine, `rs:engine:{id}:blocks`, of signed 64-bit block hashes
  (`protocol.prefix_hash`), mirroring the keys of the engine's `BlockManager.hash_to_block`: at most
  `num_kv_blocks` members, so the set is bounded by the engine's cache size.
- The engine (`PrefixIndexWriter.publish`, from its output thread) writes the changes its block
  manager recorded since the last write, in one pipeline: DEL (after a cache reset or a resync),
  SADD of the stored hashes, SREM of the removed ones, PEXPIRE. Writes are batched by the caller
  (every ~0.1 s and whenever the engine goes idle), before that step's outputs are published, so a
  client that saw a request finish also sees its blocks. A failed write is logged and triggers a full
  resync at the next write (the copy in Redis is then rebuilt from the block manager).
- The key is deleted at (re)registration and deregistration, by the coordinator when it declares
  the engine dead, and expires (3 x heartbeat TTL, refreshed by the heartbeat) if nobody does.
- The API (`PrefixIndexReader.held`) asks, in one pipeline, SMISMEMBER of a bounded list of probe
  hashes per engine (`probe_positions`: all blocks of a short prompt, else evenly spaced positions
  from the first to the last full block), and counts the leading probes each engine holds.
- Traffic is counted (`PrefixIndexWriter.sent_bytes` / `sent_commands`, RESP bytes of the commands)
  so that the cost per generated token can be reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import redis

from broker.keys import RedisKeys

logger = logging.getLogger(__name__)

SADD_CHUNK = 4096  # hashes per SADD / SREM command


def probe_positions(num_blocks: int, max_probes: int) -> list[int]:
    """Block positions to look up: all of them up to `max_probes`, else evenly spaced over [0, num_blocks)."""
    if num_blocks <= max_probes:
        return list(range(num_blocks))
    if max_probes < 2:
        return [0]
    step = (num_blocks - 1) / (max_probes - 1)
    return sorted({round(i * step) for i in range(max_probes)})


def leading_blocks(positions: Sequence[int], held: Sequence[bool]) -> int:
    """Blocks covered by the leading run of held probes (position of the last one + 1)."""
    covered = 0
    for pos, ok in zip(positions, held, strict=True):
        if not ok:
            break
        covered = pos + 1
    return covered


def _resp_size(*args: bytes | str | int) -> int:
    size = len(f"*{len(args)}\r\n")
    for a in args:
        n = len(a if isinstance(a, bytes) else str(a).encode())
        size += len(f"${n}\r\n") + n + 2
    return size


class PrefixIndexWriter:
    """One engine's writer; see the module rules. Not thread-safe: call from one thread."""

    def __init__(self, redis_client: redis.Redis, keys: RedisKeys, engine_id: str, ttl: float,
                 on_lost: Callable[[], None] | None = None) -> None:
        self._redis = redis_client
        self._key = keys.engine_blocks(engine_id)
        self._ttl_ms = max(1, int(ttl * 1000))
        self._on_lost = on_lost
        self.sent_bytes = 0
        self.sent_commands = 0

    def publish(self, stored: Sequence[int], removed: Sequence[int], cleared: bool) -> bool:
        """Apply one batch of changes; False (and `on_lost()`, to resync) if Redis refused it."""
        if not (stored or removed or cleared):
            return True
        commands: list[tuple] = []
        if cleared:
            commands.append(("DEL", self._key))
        for i in range(0, len(stored), SADD_CHUNK):
            commands.append(("SADD", self._key, *stored[i:i + SADD_CHUNK]))
        for i in range(0, len(removed), SADD_CHUNK):
            commands.append(("SREM", self._key, *removed[i:i + SADD_CHUNK]))
        commands.append(("PEXPIRE", self._key, self._ttl_ms))
        p = self._redis.pipeline(transaction=False)
        for cmd in commands:
            p.execute_command(*cmd)
        self.sent_commands += len(commands)
        self.sent_bytes += sum(_resp_size(*cmd) for cmd in commands)
        try:
            p.execute()
        except redis.RedisError as e:
            logger.warning("prefix index %s: write failed (%s); resyncing at the next write", self._key, e)
            if self._on_lost is not None:
                self._on_lost()
            return False
        return True


class PrefixIndexReader:
    """Looks up probe hashes in the engines' index sets (one pipeline round trip)."""

    def __init__(self, redis_client: redis.Redis, keys: RedisKeys) -> None:
        self._redis = redis_client
        self._keys = keys

    def held(self, probes: Mapping[str, Sequence[int]]) -> dict[str, list[bool]]:
        """engine id -> for each probe hash, whether that engine's index holds it (all False on errors)."""
        ids = [e for e, hashes in probes.items() if hashes]
        out = {e: [False] * len(probes[e]) for e in probes}
        if not ids:
            return out
        p = self._redis.pipeline(transaction=False)
        for engine_id in ids:
            p.execute_command("SMISMEMBER", self._keys.engine_blocks(engine_id), *probes[engine_id])
        for engine_id, reply in zip(ids, p.execute(raise_on_error=False), strict=True):
            if isinstance(reply, Exception):
                logger.debug("prefix index of engine %s unreadable: %s", engine_id, reply)
                continue
            out[engine_id] = [bool(x) for x in reply]
        return out


def drop_index(redis_client: redis.Redis, keys: RedisKeys, engine_id: str) -> None:
    """Delete one engine's index (e.g. from a test or a tool)."""
    redis_client.delete(keys.engine_blocks(engine_id))


class RoutingCounter:
    """Counts routing decisions in `{rs}:routing` ("{engine}:{reason}" -> n); Redis errors are only logged."""

    def __init__(self, redis_client: redis.Redis, keys: RedisKeys) -> None:
        self._redis = redis_client
        self._key = keys.routing()

    def __call__(self, engine_id: str, reason: str) -> None:
        try:
            self._redis.hincrby(self._key, f"{engine_id}:{reason}", 1)
        except redis.RedisError as e:
            logger.debug("cannot count a routing decision in %s: %s", self._key, e)


def read_routing_counts(redis_client: redis.Redis, keys: RedisKeys) -> dict[str, dict[str, int]]:
    """engine id -> {reason: count} from `{rs}:routing` (malformed fields skipped)."""
    try:
        raw = redis_client.hgetall(keys.routing())
    except redis.ResponseError:
        return {}
    out: dict[str, dict[str, int]] = {}
    for field, value in raw.items():
        try:
            engine_id, reason = field.decode().rsplit(":", 1)
            out.setdefault(engine_id, {})[reason] = int(value)
        except (UnicodeDecodeError, ValueError):
            continue
    return out
