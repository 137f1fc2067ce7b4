"""The KV tier's store in Valkey: stored prefix blocks by their chained hash, read back as a leading run.

Rules:
- The tier is a Valkey (or Redis) instance of its own, never the control Redis: it runs with ``maxmemory``
  and ``allkeys-lru``, so it forgets the least recently read blocks when full and never refuses a write
  (``redserve serve --kv-tier-memory`` starts one; ``--kv-tier-url`` points at one). A plain
  ``redis+cluster://`` URL spreads the blocks over the cluster's shards.
- One string key per block: ``rskv:{namespace}:{hash as 16 hex digits}``, the value is
  ``protocol.kv_blocks``'s format. The namespace (``protocol.kv_blocks.kv_namespace``) keeps engines whose
  blocks differ in bytes apart; ``rskv:{namespace}:meta`` holds its fields as JSON, for ``redis-cli`` users.
- ``get_run(hashes)`` fetches blocks in order, a pipeline of ``GET_CHUNK`` GETs at a time, and stops at
  the first missing one: only a leading run of a prefix is usable.
- ``put(items)`` writes blocks in one round trip of SETs (no expiry: eviction is the store's LRU), the RESP
  framing written here so the values go to the socket uncopied (a cluster client: a plain pipeline).
- ``open_store`` picks the store of a URL: ``shm://`` is ``broker.kv_tier_shm``'s pool in this host's shared
  memory, anything else a Valkey. Both have this class's methods.
- Every failure surfaces as a ``redis.RedisError`` (or ``OSError``) to the caller, which treats it as a
  miss: a tier that is down never fails a request. The client has short timeouts (a dead tier costs a
  lookup a second, not a minute) and no retries of its own.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import redis

from broker.connection import connect
from broker.kv_tier_shm import ShmKVTierStore

GET_CHUNK = 8  # blocks per pipelined round trip when reading a run
KEY_PREFIX = "rskv"


class KVTierStore:
    def __init__(self, url: str, namespace: str, socket_timeout: float = 2.0, connect_timeout: float = 1.0):
        self.url = url
        self.namespace = namespace
        self.redis = connect(url, socket_timeout=socket_timeout, connect_timeout=connect_timeout, retries=0,
                             client_name="redserve-kv-tier")
        self._prefix = f"{KEY_PREFIX}:{namespace}:"

    def key(self, block_hash: int) -> str:
        return f"{self._prefix}{block_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}"

    def describe(self, fields: dict) -> None:
        """Store the namespace's fields beside its blocks (``rskv:{namespace}:meta``)."""
        self.redis.set(f"{self._prefix}meta", json.dumps(fields, sort_keys=True))

    def get_run(self, hashes: Sequence[int]) -> list[bytes]:
        """The stored blocks of ``hashes``, in order, up to the first one the store does not hold."""
        found: list[bytes] = []
        for start in range(0, len(hashes), GET_CHUNK):
            with self.redis.pipeline(transaction=False) as pipe:
                for block_hash in hashes[start:start + GET_CHUNK]:
                    pipe.get(self.key(block_hash))
                values = pipe.execute()
            for value in values:
                if value is None:
                    return found
                found.append(value)
        return found

    def put(self, items: Sequence[tuple[int, bytes]]) -> None:
        """Store blocks, ``(hash, value)`` each, in one round trip."""
        if not isinstance(self.redis, redis.Redis):  # a cluster client routes each key to its shard
            with self.redis.pipeline(transaction=False) as pipe:
                for block_hash, value in items:
                    pipe.set(self.key(block_hash), value)
                pipe.execute()
            return
        # The SETs written as RESP by hand, each value sent as it is: redis-py's packer copies every value into
        # the command (about 1 s of CPU a GB, the tier's largest cost), where the socket can take it directly.
        chunks: list[bytes] = []
        for block_hash, value in items:
            key = self.key(block_hash).encode()
            chunks += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(key), key, len(value)), value, b"\r\n"]
        pool = self.redis.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(chunks)
            for _ in items:
                conn.read_response()  # raises an error reply (an OOM): the connection is then dropped, below
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def memory(self) -> dict:
        """The store's memory figures: bytes used, its maxmemory (0: none), keys evicted since it started."""
        memory, stats = self.redis.info("memory"), self.redis.info("stats")
        return {"used_bytes": int(memory.get("used_memory", 0)), "max_bytes": int(memory.get("maxmemory", 0)),
                "evicted_keys": int(stats.get("evicted_keys", 0))}

    def close(self) -> None:
        self.redis.close()


def open_store(url: str, namespace: str) -> KVTierStore | ShmKVTierStore:
    """The KV tier's store at ``url``: a shared-memory pool for ``shm://``, a Valkey otherwise."""
    if url.startswith("shm:"):
        return ShmKVTierStore(url, namespace)
    return KVTierStore(url, namespace)
