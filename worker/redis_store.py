"""A torch.distributed store kept in Redis: the rendezvous of process groups that span hosts.

The workers of one engine on several hosts (pipeline stages joined by ``redserve worker``) need one store
they can all reach. The only thing every host already reaches is Redis, so the pipeline group's store is a
set of keys there, under a prefix that the engine draws anew for each start (``rs:engine:{id}:rdzv:{nonce}:``);
nothing of the rendezvous listens on a port of its own. Rules:

- Keys expire ``ttl`` seconds after their last write (a crashed engine leaves nothing behind for long);
  ``clear(redis, prefix)`` deletes them at shutdown.
- ``get`` and ``wait`` poll until the keys exist or the store's timeout passes (``TimeoutError``), as torch's
  own stores block; gloo and NCCL rendezvous only set a handful of keys, so polling costs nothing.
- Values are bytes, as torch hands them over; ``add`` is INCRBY, ``compare_set`` a WATCH transaction.
"""

from __future__ import annotations

import time
from datetime import timedelta

import redis
import torch.distributed as dist

from broker.connection import connect

POLL_SECONDS = 0.01


class RedisStore(dist.Store):
    def __init__(self, redis_url: str, prefix: str, timeout: float = 300.0, ttl: float = 600.0):
        super().__init__()
        self.redis = connect(redis_url, socket_timeout=30, connect_timeout=10)
        self.prefix = prefix
        self.ttl_ms = int(ttl * 1000)
        self._timeout = timeout

    def _key(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value) -> None:
        self.redis.set(self._key(key), bytes(value) if not isinstance(value, str | bytes) else value, px=self.ttl_ms)

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self.redis.get(self._key(key))
        if value is None:
            raise KeyError(f"store key {key!r} vanished while being read")
        return value

    def add(self, key: str, amount: int) -> int:
        with self.redis.pipeline() as pipe:
            pipe.incrby(self._key(key), amount)
            pipe.pexpire(self._key(key), self.ttl_ms)
            return int(pipe.execute()[0])

    def compare_set(self, key: str, expected, desired) -> bytes:
        name = self._key(key)
        with self.redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(name)
                    current = pipe.get(name)
                    expected_b, desired_b = bytes(expected), bytes(desired)
                    if (current is None and expected_b == b"") or current == expected_b:
                        pipe.multi()
                        pipe.set(name, desired_b, px=self.ttl_ms)
                        pipe.execute()
                        return desired_b
                    return current if current is not None else expected_b
                except redis.WatchError:
                    continue

    def check(self, keys: list[str]) -> bool:
        return self.redis.exists(*(self._key(k) for k in keys)) == len(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = self._timeout if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"store keys {keys} not set within {limit:.0f}s (is every worker host up?)")
            time.sleep(POLL_SECONDS)

    def delete_key(self, key: str) -> bool:
        return bool(self.redis.delete(self._key(key)))

    def num_keys(self) -> int:
        return sum(1 for _ in self.redis.scan_iter(match=self.prefix + "*", count=100))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout.total_seconds()


def clear(client: redis.Redis, prefix: str) -> int:
    """Delete every key of the store at `prefix`; returns how many there were."""
    keys = list(client.scan_iter(match=prefix + "*", count=100))
    return client.delete(*keys) if keys else 0
