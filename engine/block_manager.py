"""Paged KV-cache block manager with prefix caching.

Rules:
- Blocks hold ``block_size`` token slots. A request's ``block_ids`` cover its computed tokens and the
  ones scheduled this step.
- Only full blocks are hashed; a block's hash chains the previous block's hash with its tokens, so a
  hit means the whole prefix matches. Hits are confirmed by comparing tokens (hash collisions never
  return wrong KV).
- Freed blocks keep their hash and go to the back of the free queue; allocation takes from the front,
  so cached blocks are reused least-recently-freed first. A request's blocks are freed tail first, so a
  prefix outlives its tail.
- Check/commit pairs: ``allocate_slots`` only changes state when it can satisfy the whole request.
- Block hashes come from ``protocol.prefix_hash`` (the API computes the same ones to route requests).
- KV tier (``engine.kv_tier``): with ``record_computed`` on, every prompt block this engine computed and cached
  is appended to ``computed`` (hash, block id, tokens) for the tier to store (blocks holding generated tokens
  are not, as LMCache's default: a next turn's prompt stores them; a resumed request's prompt holds them); ``adopt_blocks`` takes free blocks
  for KV loaded from the tier and caches them like computed ones (free, at the back of the free queue, so the
  request they were loaded for finds them when it is admitted), without recording them again.
- With ``track_events()`` on, every change to the set of cached hashes (``hash_to_block``'s keys) is
  recorded in ``events`` (stored / removed / cleared) for the engine to publish; ``take_events``
  returns and resets what changed since the last call, a hash stored then removed in between cancels.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from engine.request import Request
from protocol.prefix_hash import chain_hash

__all__ = ["Block", "BlockManager", "CacheEvents", "chain_hash"]


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


@dataclass
class CacheEvents:
    """Changes to the cached hash set since the last take: `cleared` first, then stored/removed."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared)


class _EventLog:
    __slots__ = ("changes", "cleared")

    def __init__(self) -> None:
        self.changes: dict[int, bool] = {}  # hash -> stored (True) / removed (False); the last change wins
        self.cleared = False

    def take(self) -> CacheEvents:
        events = CacheEvents([h for h, s in self.changes.items() if s], [h for h, s in self.changes.items() if not s],
                             self.cleared)
        self.changes = {}
        self.cleared = False
        return events


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._events: _EventLog | None = None
        self.record_computed = False
        self.computed: list[tuple[int, int, tuple[int, ...]]] = []  # (hash, block id, tokens) for the KV tier

    def track_events(self) -> None:
        """Start recording cache changes; the first ``take_events`` resyncs (cleared + every cached hash)."""
        self._events = _EventLog()
        self.resync_events()

    def resync_events(self) -> None:
        """Make the next ``take_events`` describe the whole cache (after the published copy was lost)."""
        if self._events is not None:
            self._events.cleared = True
            self._events.changes = dict.fromkeys(self.hash_to_block, True)

    def take_events(self) -> CacheEvents:
        """What changed since the last call (empty when not tracking)."""
        return self._events.take() if self._events is not None else CacheEvents()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend ``request.block_hashes`` to cover the full blocks among its first ``num_tokens`` tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            prev = hashes[-1] if hashes else None
            hashes.append(chain_hash(prev, tuple(request.token_ids[i * bs:(i + 1) * bs])))

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks matching the request's prefix (at least one token is always left to compute)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        self.update_hashes(request, max_blocks * bs)
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self.hash_to_block.get(request.block_hashes[i])
            if block_id is None:
                break
            if self.blocks[block_id].token_ids != tuple(request.token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(block_id)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * bs
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Give the request blocks for its computed tokens, ``computed_blocks`` and ``num_new_tokens``
        more. Returns False (changing nothing) when the free pool cannot cover it."""
        if not computed_blocks and request.num_computed_tokens + num_new_tokens <= len(request.block_ids) * self.block_size:
            return True  # a decode inside its last block: the common case, nothing to take
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(request.block_ids) - len(computed_blocks)
        reused_free = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if needed > self.num_free_blocks - reused_free:
            return False
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        request.block_ids.extend(computed_blocks)
        for _ in range(max(needed, 0)):
            request.block_ids.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block_id:
            del self.hash_to_block[block.block_hash]
            if self._events is not None:
                self._events.changes[block.block_hash] = False
        block.block_hash = None
        block.token_ids = ()
        block.ref_count = 1
        return block_id

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(request.num_computed_tokens // bs, len(request.block_ids))
        if num_full <= request.num_cached_blocks:
            return  # no block filled since the last call (a decode fills one every block_size steps)
        self.update_hashes(request, num_full * bs)
        for i in range(request.num_cached_blocks, num_full):
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is not None:
                continue
            block.block_hash = request.block_hashes[i]
            block.token_ids = tuple(request.token_ids[i * bs:(i + 1) * bs])
            self._publish(block)
            if self.record_computed and (i + 1) * bs <= request.num_prompt_tokens:
                self.computed.append((block.block_hash, block.block_id, block.token_ids))
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def _publish(self, block: Block) -> None:
        if self.hash_to_block.setdefault(block.block_hash, block.block_id) == block.block_id \
                and self._events is not None:
            self._events.changes[block.block_hash] = True

    def cached_prefix_length(self, block_hashes: list[int]) -> int:
        """How many of these leading hashes the cache holds now (hashes only: a lookup, not a hit)."""
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self.hash_to_block:
            n += 1
        return n

    def adopt_blocks(self, blocks: list[tuple[int, tuple[int, ...]]]) -> list[int | None]:
        """Take a free block for each (hash, tokens) whose KV is about to be written from the tier, and cache
        it. Returns each one's block id, None for a hash the cache already holds (nothing to write); [] when
        the free pool cannot take them all."""
        wanted = sum(1 for h, _ in blocks if h not in self.hash_to_block)
        if wanted > self.num_free_blocks:
            return []
        block_ids: list[int | None] = []
        for block_hash, token_ids in blocks:
            if block_hash in self.hash_to_block:
                block_ids.append(None)
                continue
            block_id = self._take_free_block()
            block = self.blocks[block_id]
            block.block_hash, block.token_ids, block.ref_count = block_hash, token_ids, 0
            self._publish(block)
            self.free_queue[block_id] = None  # back of the queue: the newest cached, the last reused
            block_ids.append(block_id)
        return block_ids

    def take_computed(self) -> list[tuple[int, int, tuple[int, ...]]]:
        computed, self.computed = self.computed, []
        return computed

    def free(self, request: Request) -> None:
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        request.block_ids = []
        request.num_cached_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.hash_to_block.clear()
        if self._events is not None:
            self._events.changes = {}
            self._events.cleared = True
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = ()
        return True
