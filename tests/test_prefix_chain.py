"""Prefix-chain hashes: a cached block is reused only when the whole prefix before it matches, not just its
own tokens; the hash is the documented BLAKE2b one (the API and other hosts recompute it)."""

from __future__ import annotations

import hashlib
import struct

import pytest

from engine.block_manager import BlockManager
from engine.request import Request
from protocol.prefix_hash import ROOT_HASH, block_hashes, chain_hash
from protocol.sampling_params import SamplingParams

BS = 4
X, Y, Z, W = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]


def _cache(bm: BlockManager, rid: str, tokens: list[int]) -> Request:
    req = Request(rid, tokens, SamplingParams(max_tokens=4))
    assert bm.allocate_slots(req, len(tokens), bm.get_computed_blocks(req))
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    return req


def test_block_after_a_different_prefix_is_not_reused() -> None:
    bm = BlockManager(16, BS)
    _cache(bm, "xy", X + Y + [0])
    _cache(bm, "zw", Z + W + [0])
    # Z is cached (from "zw") and Y's tokens are cached (from "xy"), but Y's KV there follows X, not Z.
    hits = bm.get_computed_blocks(Request("zy", Z + Y + [0], SamplingParams(max_tokens=4)))
    assert len(hits) == 1
    # The same prefix as before reuses both blocks.
    assert len(bm.get_computed_blocks(Request("xy2", X + Y + [0], SamplingParams(max_tokens=4)))) == 2


def _spec_hash(prev: int, tokens: list[int]) -> int:
    """The documented hash, written out with struct: BLAKE2b-64 over little-endian int64s, read signed."""
    h = hashlib.blake2b(struct.pack("<q", prev), digest_size=8)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return struct.unpack("<q", h.digest())[0]


def test_block_hash_is_the_documented_blake2b_of_little_endian_int64s() -> None:
    # Other processes and hosts (and anyone reading the Redis index) recompute these; the bytes are the contract.
    first = _spec_hash(ROOT_HASH, X)
    assert block_hashes(X + Y + [0], BS) == [first, _spec_hash(first, Y)]
    assert chain_hash(None, X) == chain_hash(ROOT_HASH, X) == first
    negative_prev = -(2**63) + 5
    assert chain_hash(negative_prev, Z) == _spec_hash(negative_prev, Z)


def test_block_size_one_hashes_every_token_and_zero_is_refused() -> None:
    assert len(block_hashes([3, 1, 4], 1)) == 3
    assert block_hashes([3, 1, 4], 1)[0] == chain_hash(None, [3])
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        block_hashes([3, 1, 4], 0)
