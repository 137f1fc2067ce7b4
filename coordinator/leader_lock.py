"""A leader lock in Redis: one holder at a time, renewed while held, with fenced writes.

Rules (the `SET NX` lock of rq's cleanup pass, made safe against a stale holder):
- The key holds the holder's `token` with a TTL. `acquire()` takes it if it is free
  (SET NX PX); it returns True also when this holder already has it.
- `renew()` extends the TTL only while the key still holds our token (a Lua compare-and-pexpire):
  a holder that was paused past its TTL never renews a lock someone else has taken since.
- `transaction(write)` runs `write(pipe)` in MULTI/EXEC under WATCH of the key, after checking
  the token, and renews the TTL in the same transaction: the writes of a holder that has lost
  the lock are never applied. It returns False, having written nothing, if the lock is not ours.
- `release()` deletes the key only if it holds our token (a Lua compare-and-delete).
- A key that no holder can have written (another type than a string, or a string without a TTL, e.g. a
  stray `redis-cli SET`) would keep every candidate out for ever: `acquire()` deletes it (Lua, checked
  atomically), logs that once per interval, and takes the lock.
- `held` is True only within `ttl` of the last successful acquire/renew (measured from before
  the command was sent): a holder cut off from Redis stops acting before anyone can take over.
  Renew at least every ttl/3.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis
from redis.client import Pipeline

from broker.log_limits import BAD_ENTRY_INTERVAL, warn_every

logger = logging.getLogger(__name__)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_CLEAR_INVALID = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return 0 end
if kind ~= 'string' or redis.call('PTTL', KEYS[1]) == -1 then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaderLock:
    """A renewable, fenced lock on `key`; see the module rules."""

    def __init__(self, redis_client: redis.Redis, key: str, token: str, ttl: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl <= 0:
            raise ValueError(f"lock ttl must be positive, got {ttl}")
        self._redis = redis_client
        self.key = key
        self.token = token
        self.ttl = ttl
        self._clock = clock
        self._held_until = 0.0
        self._renew = redis_client.register_script(_RENEW)
        self._release = redis_client.register_script(_RELEASE)
        self._clear_invalid = redis_client.register_script(_CLEAR_INVALID)

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl * 1000))

    @property
    def held(self) -> bool:
        return self._clock() < self._held_until

    def remaining(self) -> float:
        """Seconds the lock is surely ours without another renew (0 if not held)."""
        return max(0.0, self._held_until - self._clock())

    def acquire(self) -> bool:
        """Take the lock if free (or renew it if ours); True if we hold it now."""
        sent = self._clock()
        if self._redis.set(self.key, self.token, nx=True, px=self.ttl_ms):
            self._held_until = sent + self.ttl
            return True
        if self._clear_invalid(keys=[self.key]):
            warn_every(logger, f"invalid-lock:{self.key}", BAD_ENTRY_INTERVAL,
                       "lock %s held a value no holder writes (wrong type or no TTL); removed it", self.key)
            return self.acquire()
        return self.renew()

    def renew(self) -> bool:
        """Extend the TTL if the lock is still ours; False (and `held` False) if it is not."""
        sent = self._clock()
        if self._renew(keys=[self.key], args=[self.token, self.ttl_ms]):
            self._held_until = sent + self.ttl
            return True
        self._held_until = 0.0
        return False

    def transaction(self, write: Callable[[Pipeline], None]) -> bool:
        """Apply `write(pipe)` atomically if and only if we hold the lock; renews it too."""
        sent = self._clock()
        with self._redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(self.key)
                if pipe.get(self.key) != self.token.encode():
                    self._held_until = 0.0
                    return False
                pipe.multi()
                write(pipe)
                pipe.pexpire(self.key, self.ttl_ms)
                pipe.execute()
            except redis.WatchError:
                self._held_until = 0.0
                return False
        self._held_until = sent + self.ttl
        return True

    def release(self) -> bool:
        """Give the lock up if it is ours; True if it was."""
        self._held_until = 0.0
        return bool(self._release(keys=[self.key], args=[self.token]))

    def holder(self) -> tuple[str | None, int]:
        """(token of the current holder or None, its remaining TTL in ms or -2 if none)."""
        p = self._redis.pipeline(transaction=False)
        p.get(self.key)
        p.pttl(self.key)
        token, pttl = p.execute()
        return (None if token is None else token.decode("utf-8", "replace")), int(pttl)
