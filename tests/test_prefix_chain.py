"""A cached block is reused only when the whole prefix before it matches, not just its own tokens."""

from __future__ import annotations

from broker.sampling_params import SamplingParams
from engine.block_manager import BlockManager
from engine.request import Request

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
