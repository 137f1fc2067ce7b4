"""Prefix-cache block hashes, shared by the engine's block manager and the API's cache-aware routing.

Rules:
- A block is `block_size` consecutive token ids; only full blocks are hashed.
- Block i's hash chains block i-1's hash with its own tokens (`chain_hash`), so equal hashes at
  position i mean (up to a 64-bit collision) the whole prefix up to the end of block i is equal.
- The hash is BLAKE2b with an 8-byte digest over the previous hash and the tokens as little-endian
  int64s, read as a signed 64-bit int: the same in every process, Python version and host (Python's
  own `hash()` is not: `hash(None)` changes between processes before 3.12), and an int64 so a Redis
  set of them stays compact (`SADD`/`SMISMEMBER` take the decimal form).
- The first block chains from `ROOT_HASH`. A collision can only misroute a request; the engine still
  confirms every cache hit by comparing tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = 0


def chain_hash(prev_hash: int | None, token_ids: Sequence[int]) -> int:
    """The hash of a block whose predecessor's hash is `prev_hash` (None or ROOT_HASH for the first)."""
    h = hashlib.blake2b((ROOT_HASH if prev_hash is None else prev_hash).to_bytes(8, "little", signed=True),
                        digest_size=8)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (the first `max_blocks` of them at most)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[int] = []
    prev = None
    for i in range(n):
        prev = chain_hash(prev, token_ids[i * block_size:(i + 1) * block_size])
        out.append(prev)
    return out
