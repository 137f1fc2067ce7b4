"""A batch job's state in Redis (key names from `broker.keys.RedisKeys`).

Layout, for prefix "rs" and batch id B:

    {rs}:batch:B             hash  id, status (in_progress | completed), total, completed, failed,
                                 chunk_size, num_chunks, created_at, progress_at (last result),
                                 completed_at, expires_at, input_file
    {rs}:batch:B:items       list  the input lines, item i at index i (LRANGE reads one chunk)
    {rs}:batch:B:results     hash  item index -> output line (JSON); written once, by HSETNX
    {rs}:batch:B:claims      hash  item index -> client id of the worker generating that item now
    {rs}:batches             set   ids of batches in progress (for `api.batch.sweeper`)

Rules:
- Every key of a batch expires at ``expires_at`` (submission + ttl, default 7 days).
- An item is generated only by the holder of its claim. `claim` gives it to the caller when nobody
  holds it, when the caller already holds it, or when the holder is dead (its broker-client heartbeat
  ``{rs}:client:{id}:alive`` has expired); it answers DONE once the item has a result, HELD while a live
  worker holds it, GONE once the batch no longer exists. Claims are compare-and-set in a Lua script.
- `record` writes an item's result at most once (HSETNX) and, in the same script, counts it
  (completed or failed), sets progress_at, drops its claim and, when every item has a result, marks
  the batch completed and takes it out of ``{rs}:batches``. A second record of the same item changes
  nothing and returns False.
- `create` writes the items in pipelined pages of `PAGE` lines, then the batch hash (and adds the id
  to ``{rs}:batches``): a batch whose hash exists has all its items.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import redis

from api.batch.records import is_failure
from broker.keys import RedisKeys

PAGE = 1000
DEFAULT_TTL = 7 * 24 * 3600

_CLAIM = """
local exp = redis.call('HGET', KEYS[4], 'expires_at')
if not exp then return 'gone' end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 'done' end
local holder = redis.call('HGET', KEYS[1], ARGV[1]) or ''
if holder ~= ARGV[3] then return 'retry' end
if holder ~= '' and holder ~= ARGV[2] and redis.call('EXISTS', KEYS[3]) == 1 then return 'held' end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIREAT', KEYS[1], exp)
return 'claimed'
"""

_RECORD = """
local exp = redis.call('HGET', KEYS[2], 'expires_at')
if not exp then return -1 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('EXPIREAT', KEYS[1], exp)
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
redis.call('HSET', KEYS[2], 'progress_at', ARGV[4])
local b = redis.call('HMGET', KEYS[2], 'completed', 'failed', 'total')
if tonumber(b[1]) + tonumber(b[2]) >= tonumber(b[3]) then
  redis.call('HSET', KEYS[2], 'status', 'completed', 'completed_at', ARGV[4])
  redis.call('DEL', KEYS[3])
  redis.call('SREM', KEYS[4], ARGV[5])
end
return 1
"""

_TOUCH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'progress_at', ARGV[1])
return 1
"""


class BatchStatus(StrEnum):
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"


class Claim(StrEnum):
    """What `BatchStore.claim` found; see the module rules."""

    CLAIMED = "claimed"
    HELD = "held"
    DONE = "done"
    GONE = "gone"


@dataclass(frozen=True)
class BatchInfo:
    """A batch's hash, decoded."""

    id: str
    status: str
    total: int
    completed: int
    failed: int
    chunk_size: int
    num_chunks: int
    created_at: int
    progress_at: int
    completed_at: int | None
    expires_at: int
    input_file: str

    @property
    def done(self) -> int:
        """Items with a result, failed ones included."""
        return self.completed + self.failed

    def chunk_items(self, chunk: int) -> range:
        """The item indices of chunk number `chunk` (ValueError if there is no such chunk)."""
        if not 0 <= chunk < self.num_chunks:
            raise ValueError(f"batch {self.id} has chunks 0..{self.num_chunks - 1}, not {chunk}")
        return range(chunk * self.chunk_size, min(self.total, (chunk + 1) * self.chunk_size))

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's batch object shape (request_counts), plus redserve's chunking fields."""
        fields = asdict(self)
        counts = {name: fields.pop(name) for name in ("total", "completed", "failed")}
        return {"id": self.id, "object": "batch", **fields, "request_counts": counts}


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


class BatchStore:
    """Reads and writes batches; see the module rules. Thread-safe (one redis.Redis per process)."""

    def __init__(self, client: redis.Redis, keys: RedisKeys) -> None:
        self.redis = client
        self.keys = keys
        self._claim = client.register_script(_CLAIM)
        self._record = client.register_script(_RECORD)
        self._touch = client.register_script(_TOUCH)

    def create(self, lines: Iterable[str], chunk_size: int, ttl: int = DEFAULT_TTL, input_file: str = "",
               batch_id: str | None = None) -> BatchInfo:
        """Store a new batch (one item per line, blank lines skipped); ValueError if it has no item."""
        if chunk_size < 1 or ttl < 1:
            raise ValueError("chunk_size and ttl must be at least 1")
        batch_id = batch_id or new_batch_id()
        items_key = self.keys.batch_items(batch_id)
        now = int(time.time())
        expires_at = now + ttl
        total = 0
        page: list[str] = []
        for line in lines:
            if line.strip():
                page.append(line.rstrip("\r\n"))
            if len(page) == PAGE:
                total += self._push(items_key, page, expires_at)
                page = []
        total += self._push(items_key, page, expires_at)
        if total == 0:
            raise ValueError("the batch has no requests (every line is blank)")
        info = BatchInfo(batch_id, BatchStatus.IN_PROGRESS.value, total, 0, 0, chunk_size,
                         math.ceil(total / chunk_size), now, now, None, expires_at, input_file)
        fields = {k: v for k, v in asdict(info).items() if v is not None}
        pipe = self.redis.pipeline()
        pipe.hset(self.keys.batch(batch_id), mapping=fields).expireat(self.keys.batch(batch_id), expires_at)
        pipe.sadd(self.keys.batches(), batch_id).execute()
        return info

    def _push(self, items_key: str, page: list[str], expires_at: int) -> int:
        if page:
            self.redis.pipeline().rpush(items_key, *page).expireat(items_key, expires_at).execute()
        return len(page)

    def info(self, batch_id: str) -> BatchInfo | None:
        raw = self.redis.hgetall(self.keys.batch(batch_id))
        if not raw:
            return None
        f = {k.decode(): v.decode() for k, v in raw.items()}
        return BatchInfo(f["id"], f["status"], int(f["total"]), int(f["completed"]), int(f["failed"]),
                         int(f["chunk_size"]), int(f["num_chunks"]), int(f["created_at"]), int(f["progress_at"]),
                         int(f["completed_at"]) if "completed_at" in f else None, int(f["expires_at"]),
                         f.get("input_file", ""))

    def item_lines(self, batch_id: str, items: range) -> list[str]:
        """The input lines of `items` (a contiguous range, as `BatchInfo.chunk_items` gives)."""
        raw = self.redis.lrange(self.keys.batch_items(batch_id), items.start, items.stop - 1)
        return [line.decode("utf-8", errors="replace") for line in raw]

    def claim(self, batch_id: str, index: int, owner: str) -> Claim:
        """Try to become the one worker that generates item `index`; see the module rules."""
        claims = self.keys.batch_claims(batch_id)
        for _ in range(16):
            raw = self.redis.hget(claims, index)
            holder = raw.decode() if raw else ""
            keys = [claims, self.keys.batch_results(batch_id), self.keys.client_alive(holder or owner),
                    self.keys.batch(batch_id)]
            answer = self._claim(keys=keys, args=[index, owner, holder]).decode()
            if answer != "retry":
                return Claim(answer)
        return Claim.HELD

    def record(self, batch_id: str, index: int, line: dict[str, Any]) -> bool:
        """Write item `index`'s output line unless it has one; True if this call wrote it."""
        counter = "failed" if is_failure(line) else "completed"
        keys = [self.keys.batch_results(batch_id), self.keys.batch(batch_id), self.keys.batch_claims(batch_id),
                self.keys.batches()]
        args = [index, json.dumps(line, ensure_ascii=False), counter, int(time.time()), batch_id]
        return self._record(keys=keys, args=args) == 1

    def results(self, batch_id: str, total: int) -> Iterator[dict[str, Any]]:
        """The output lines in item order (items without a result yet are left out)."""
        key = self.keys.batch_results(batch_id)
        for start in range(0, total, PAGE):
            for raw in self.redis.hmget(key, list(range(start, min(total, start + PAGE)))):
                if raw is not None:
                    yield json.loads(raw)

    # -------------------------------------------------------------------- for the sweeper

    def active_batches(self) -> list[str]:
        """Ids of batches in progress (or expired since: `info` is None for those)."""
        return sorted(raw.decode() for raw in self.redis.smembers(self.keys.batches()))

    def mark_progress(self, batch_id: str, now: float) -> None:
        """Set progress_at (if the batch still exists: never recreate an expired hash)."""
        self._touch(keys=[self.keys.batch(batch_id)], args=[int(now)])

    def forget(self, batch_id: str) -> None:
        """Take a batch out of the active set (it expired or completed)."""
        self.redis.srem(self.keys.batches(), batch_id)

    def has_live_claim(self, batch_id: str) -> bool:
        """True if a live worker (its client heartbeat exists) holds an item of the batch."""
        holders = {raw.decode() for raw in self.redis.hvals(self.keys.batch_claims(batch_id))}
        if not holders:
            return False
        pipe = self.redis.pipeline(transaction=False)
        for holder in holders:
            pipe.exists(self.keys.client_alive(holder))
        return any(pipe.execute())

    def incomplete_chunks(self, info: BatchInfo) -> list[int]:
        """The chunks of `info` with at least one item without a result."""
        done = {int(raw) for raw in self.redis.hkeys(self.keys.batch_results(info.id))}
        return [c for c in range(info.num_chunks) if any(i not in done for i in info.chunk_items(c))]
