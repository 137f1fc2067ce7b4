"""Unit tests for engine.block_manager: paged KV blocks, prefix cache (hash chain + token check), LRU reuse."""

from __future__ import annotations

import pytest

import engine.block_manager as bm_module
from engine.block_manager import BlockManager, CacheEvents
from engine.request import Request
from protocol.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def compute_all(bm: BlockManager, req: Request, computed: list[int] = ()) -> None:
    """Allocate the request's remaining tokens (after ``computed`` blocks), mark them computed, cache them."""
    done = req.num_computed_tokens + len(computed) * bm.block_size
    assert bm.allocate_slots(req, req.num_tokens - done, computed)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)


def test_allocation_and_free_counts() -> None:
    bm = BlockManager(10, BS)
    assert bm.num_free_blocks == 10 and bm.usage == 0.0
    req = make_request("a", list(range(10, 20)))  # 10 tokens -> 3 blocks
    assert bm.allocate_slots(req, 10)
    assert len(req.block_ids) == 3 and len(set(req.block_ids)) == 3
    assert bm.num_free_blocks == 7
    assert bm.usage == pytest.approx(0.3)
    req.num_computed_tokens = 10
    req.append_output_token(5)
    assert bm.allocate_slots(req, 1)  # token 11 still fits in block 3
    assert len(req.block_ids) == 3 and bm.num_free_blocks == 7
    req.num_computed_tokens = 11
    for t in (6, 7):
        req.append_output_token(t)
    assert bm.allocate_slots(req, 2)  # tokens 12, 13 -> a 4th block
    assert len(req.block_ids) == 4 and bm.num_free_blocks == 6
    assert all(bm.blocks[b].ref_count == 1 for b in req.block_ids)
    bm.free(req)
    assert req.block_ids == [] and req.num_cached_blocks == 0
    assert bm.num_free_blocks == 10
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_allocate_is_all_or_nothing() -> None:
    bm = BlockManager(3, BS)
    other = make_request("x", [1, 2, 3, 4, 5])
    assert bm.allocate_slots(other, 5)  # 2 blocks, 1 left
    req = make_request("a", list(range(10, 19)))  # 9 tokens -> 3 blocks
    assert not bm.allocate_slots(req, 9)
    assert req.block_ids == [] and bm.num_free_blocks == 1
    assert bm.allocate_slots(req, 4)  # a chunk that fits
    assert len(req.block_ids) == 1 and bm.num_free_blocks == 0
    req.num_computed_tokens = 4
    assert not bm.allocate_slots(req, 1)  # the 5th token needs a new block
    assert len(req.block_ids) == 1


def test_only_full_blocks_are_cached_and_hit() -> None:
    bm = BlockManager(16, BS)
    a = make_request("a", list(range(100, 110)))  # 10 tokens: 2 full blocks + 2 tokens
    compute_all(bm, a)
    assert len(bm.hash_to_block) == 2
    assert set(bm.hash_to_block.values()) == set(a.block_ids[:2])
    assert bm.blocks[a.block_ids[2]].block_hash is None  # the partial block is never published
    assert a.num_cached_blocks == 2

    same = make_request("b", list(range(100, 110)))
    assert bm.get_computed_blocks(same) == a.block_ids[:2]
    longer = make_request("c", list(range(100, 112)) + [1, 2, 3])
    assert bm.get_computed_blocks(longer) == a.block_ids[:2]  # the 3rd block was never full in a
    diverge_in_block_2 = make_request("d", list(range(100, 106)) + [7, 7, 7, 7])
    assert bm.get_computed_blocks(diverge_in_block_2) == a.block_ids[:1]
    diverge_in_block_1 = make_request("e", [999] + list(range(101, 110)))
    assert bm.get_computed_blocks(diverge_in_block_1) == []
    # Chained: the same tokens as a's 2nd block, but after a different first block, do not hit.
    shifted = make_request("f", [5, 5, 5, 5] + list(range(104, 110)))
    assert bm.get_computed_blocks(shifted) == []


def test_full_hit_leaves_one_token_to_compute() -> None:
    bm = BlockManager(16, BS)
    a = make_request("a", list(range(100, 108)))  # exactly 2 full blocks
    compute_all(bm, a)
    assert len(bm.hash_to_block) == 2
    b = make_request("b", list(range(100, 108)))
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_ids[:1]
    assert b.num_tokens - len(hits) * BS >= 1
    c = make_request("c", list(range(100, 104)))  # one full block, entirely cached
    assert bm.get_computed_blocks(c) == []


def test_hits_are_confirmed_by_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_module, "chain_hash", lambda prev, tokens: 42)  # every block collides
    bm = BlockManager(16, BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute_all(bm, a)
    b = make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert bm.get_computed_blocks(b) == []  # same hash, different tokens: no hit
    c = make_request("c", [1, 2, 3, 4, 9, 9])
    assert bm.get_computed_blocks(c) == a.block_ids[:1]


def test_ref_counts_when_sharing_blocks() -> None:
    bm = BlockManager(8, BS)
    a = make_request("a", list(range(100, 110)))
    compute_all(bm, a)
    free_before = bm.num_free_blocks
    b = make_request("b", list(range(100, 110)))
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    compute_all(bm, b, hits)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] != a.block_ids[2]
    assert [bm.blocks[i].ref_count for i in b.block_ids] == [2, 2, 1]
    assert bm.num_free_blocks == free_before - 1  # only b's own tail block was taken
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_ids] == [1, 1, 1]
    assert not any(i in bm.free_queue for i in b.block_ids)
    assert a.block_ids == []
    bm.free(b)
    assert bm.num_free_blocks == 8
    assert all(blk.ref_count == 0 for blk in bm.blocks)


def test_hit_on_freed_cached_blocks_takes_them_out_of_the_free_queue() -> None:
    bm = BlockManager(6, BS)
    a = make_request("a", list(range(100, 112)))  # 3 full blocks
    compute_all(bm, a)
    cached = list(a.block_ids)
    bm.free(a)
    assert bm.num_free_blocks == 6
    b = make_request("b", list(range(100, 112)) + [1])
    hits = bm.get_computed_blocks(b)
    assert hits == cached
    assert bm.allocate_slots(b, 1, hits)
    assert b.block_ids[:3] == cached
    assert all(i not in bm.free_queue for i in b.block_ids)
    assert bm.num_free_blocks == 2
    assert [bm.blocks[i].ref_count for i in b.block_ids] == [1, 1, 1, 1]


def test_reused_free_blocks_count_against_the_pool() -> None:
    bm = BlockManager(4, BS)
    a = make_request("a", list(range(100, 108)))
    compute_all(bm, a)
    bm.free(a)
    other = make_request("x", [1, 2, 3, 4, 5])
    assert bm.allocate_slots(other, 5)  # takes the 2 never-used blocks
    b = make_request("b", list(range(100, 108)) + [1, 2, 3, 4, 5])  # 13 tokens -> 4 blocks
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    # Needs 2 more blocks, but the only free blocks are the 2 cached ones it is reusing.
    assert not bm.allocate_slots(b, b.num_tokens - 8, hits)
    assert b.block_ids == [] and bm.num_free_blocks == 2
    assert all(bm.blocks[i].ref_count == 0 for i in hits)


def test_lru_eviction_of_freed_cached_blocks() -> None:
    bm = BlockManager(8, BS)
    a = make_request("a", list(range(100, 112)))  # 3 full blocks: 0, 1, 2
    compute_all(bm, a)
    c = make_request("c", list(range(200, 212)))  # 3 full blocks: 3, 4, 5
    compute_all(bm, c)
    bm.free(a)  # freed first -> evicted first; tail before head
    bm.free(c)
    assert list(bm.free_queue) == [6, 7, 2, 1, 0, 5, 4, 3]

    x = make_request("x", list(range(300, 312)))  # 3 blocks: 6, 7, then a's tail block 2
    assert bm.allocate_slots(x, 12)
    assert x.block_ids == [6, 7, 2]
    assert bm.get_computed_blocks(make_request("a2", list(range(100, 113)))) == [0, 1]
    assert bm.get_computed_blocks(make_request("c2", list(range(200, 213)))) == [3, 4, 5]
    y = make_request("y", list(range(400, 408)))  # 2 more: a's blocks 1 then 0
    assert bm.allocate_slots(y, 8)
    assert y.block_ids == [1, 0]
    assert bm.get_computed_blocks(make_request("a3", list(range(100, 113)))) == []
    assert bm.get_computed_blocks(make_request("c3", list(range(200, 213)))) == [3, 4, 5]
    assert bm.blocks[0].block_hash is None and bm.blocks[0].token_ids == ()


def test_reset_prefix_cache() -> None:
    bm = BlockManager(8, BS)
    a = make_request("a", list(range(100, 110)))
    compute_all(bm, a)
    assert not bm.reset_prefix_cache()  # blocks in use
    assert len(bm.hash_to_block) == 2
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.hash_to_block == {}
    assert all(b.block_hash is None for b in bm.blocks)
    assert bm.get_computed_blocks(make_request("b", list(range(100, 110)))) == []


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_request("a", list(range(100, 110)))
    compute_all(bm, a)
    assert bm.hash_to_block == {}
    assert bm.get_computed_blocks(make_request("b", list(range(100, 110)))) == []
    assert bm.prefix_queries == 0


def test_hit_counters() -> None:
    bm = BlockManager(8, BS)
    a = make_request("a", list(range(100, 110)))
    assert bm.get_computed_blocks(a) == []
    compute_all(bm, a)
    b = make_request("b", list(range(100, 110)))
    bm.get_computed_blocks(b)
    assert bm.prefix_queries == 20
    assert bm.prefix_hits == 8


def test_incremental_caching_across_chunks_and_decodes() -> None:
    bm = BlockManager(8, BS)
    a = make_request("a", list(range(100, 106)))
    assert bm.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    assert bm.hash_to_block == {} and a.num_cached_blocks == 0
    assert bm.allocate_slots(a, 3)
    a.num_computed_tokens = 6
    bm.cache_full_blocks(a)
    assert a.num_cached_blocks == 1 and len(bm.hash_to_block) == 1
    a.append_output_token(7)
    a.append_output_token(8)
    assert bm.allocate_slots(a, 2)  # the uncomputed output token plus one more slot
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    assert a.num_cached_blocks == 2 and len(bm.hash_to_block) == 2
    b = make_request("b", list(range(100, 106)) + [7, 8, 9])
    assert bm.get_computed_blocks(b) == a.block_ids[:2]


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, BS)


def test_cache_events_are_truthy_exactly_when_something_changed() -> None:
    bm = BlockManager(2, BS)
    assert bm.take_events() == CacheEvents()  # not tracking: always empty
    bm.track_events()
    assert bm.take_events() == CacheEvents(cleared=True)
    assert bm.take_events() == CacheEvents()  # nothing since: the engine publishes nothing
    a = make_request("a", list(range(100, 105)))
    compute_all(bm, a)
    stored = bm.take_events()
    assert stored and stored.stored and not stored.removed  # a store alone is something to publish
    bm.free(a)
    compute_all(bm, make_request("b", list(range(200, 208))))  # takes both blocks: evicts a's cached one
    removed = bm.take_events()
    assert set(removed.removed) == set(stored.stored)
    evicted_only = CacheEvents(removed=removed.removed)
    assert evicted_only and CacheEvents(cleared=True) and not CacheEvents()


def test_a_request_that_reused_a_prefix_caches_its_own_new_blocks() -> None:
    bm = BlockManager(16, BS)
    compute_all(bm, make_request("a", list(range(100, 109))))  # caches blocks 100.. and 104..
    b = make_request("b", list(range(100, 113)))  # a's 2 blocks, then one new full block
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    compute_all(bm, b, hits)
    assert len(bm.hash_to_block) == 3
    c = make_request("c", list(range(100, 113)) + [1])
    assert bm.get_computed_blocks(c) == b.block_ids[:3]


def test_hit_counters_accumulate_over_queries() -> None:
    bm = BlockManager(8, BS)
    compute_all(bm, make_request("a", list(range(100, 110))))
    for rid in ("b", "c"):
        bm.get_computed_blocks(make_request(rid, list(range(100, 110))))
    assert (bm.prefix_queries, bm.prefix_hits) == (20, 16)


def test_evicting_a_duplicate_block_keeps_the_cached_original() -> None:
    bm = BlockManager(5, BS)
    bm.track_events()
    bm.take_events()
    first, twin = make_request("first", [1, 2, 3, 4, 5]), make_request("twin", [1, 2, 3, 4, 6])
    assert bm.allocate_slots(first, 5) and bm.allocate_slots(twin, 5)  # both before either is cached
    for req in (first, twin):
        req.num_computed_tokens = 5
        bm.cache_full_blocks(req)
    assert bm.hash_to_block == {bm.blocks[first.block_ids[0]].block_hash: first.block_ids[0]}
    bm.take_events()
    bm.free(twin)  # twin's copy of the block is evicted by the next allocation
    assert bm.allocate_slots(make_request("x", list(range(12))), 12)  # the free block, then twin's 2
    assert list(bm.hash_to_block.values()) == [first.block_ids[0]]
    assert not bm.take_events().removed
    assert bm.get_computed_blocks(make_request("again", [1, 2, 3, 4, 9])) == first.block_ids[:1]


def test_a_one_block_pool_works_and_an_empty_one_is_refused_with_a_reason() -> None:
    bm = BlockManager(1, BS)
    assert bm.allocate_slots(make_request("a", [1, 2, 3]), 3) and bm.num_free_blocks == 0
    with pytest.raises(ValueError, match="^num_blocks must be >= 1$"):
        BlockManager(0, BS)
