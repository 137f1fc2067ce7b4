"""Unit tests of cache-aware routing: the shared block hash (engine == API, stable across processes), the
block manager's cache events, the probe positions and the routing cost formula in `EngineSelector`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from broker.load_balance import EngineSelector, RoutingConfig, route_costs
from broker.prefix_index import leading_blocks, probe_positions
from engine.block_manager import BlockManager
from engine.request import Request
from protocol.engine_load import EngineLoad
from protocol.prefix_hash import block_hashes, chain_hash
from protocol.sampling_params import SamplingParams

BS = 4


def _computed(bm: BlockManager, rid: str, tokens: list[int]) -> Request:
    req = Request(rid, tokens, SamplingParams(max_tokens=8))
    hits = bm.get_computed_blocks(req)
    assert bm.allocate_slots(req, req.num_tokens - len(hits) * BS, hits)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    return req


def test_api_hashes_equal_the_engine_block_hashes():
    bm = BlockManager(16, BS)
    tokens = list(range(100, 123))  # 5 full blocks + 3 tokens
    req = _computed(bm, "a", tokens)
    assert req.block_hashes == block_hashes(tokens, BS)
    assert set(bm.hash_to_block) == set(block_hashes(tokens, BS))
    assert block_hashes(tokens, BS, max_blocks=2) == req.block_hashes[:2]
    assert block_hashes(tokens[:3], BS) == []


def test_hashes_chain_and_are_the_same_in_another_process():
    first = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS)
    assert first[0] == chain_hash(None, [1, 2, 3, 4])
    assert block_hashes([9, 2, 3, 4, 5, 6, 7, 8], BS)[1] != first[1]  # the chain carries the first block
    assert all(-(2**63) <= h < 2**63 for h in first)  # int64: a compact Redis set
    code = "import json; from protocol.prefix_hash import block_hashes; print(json.dumps(block_hashes(list(range(1, 9)), 4)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    assert json.loads(out) == first


def test_cache_events_mirror_the_cached_hash_set():
    bm = BlockManager(4, BS)
    bm.track_events()
    assert bm.take_events().cleared  # the first take resyncs: clear, then everything cached (nothing yet)
    a = _computed(bm, "a", list(range(10, 19)))  # 2 full blocks cached
    ev = bm.take_events()
    assert ev.stored == block_hashes(list(range(10, 19)), BS) and not ev.removed and not ev.cleared
    assert not bm.take_events()
    bm.free(a)
    assert not bm.take_events()  # freed blocks keep their hash: still cached
    _computed(bm, "b", list(range(50, 66)))  # 4 blocks: evicts both cached ones
    ev = bm.take_events()
    assert set(ev.removed) == set(block_hashes(list(range(10, 19)), BS))
    assert ev.stored == block_hashes(list(range(50, 66)), BS)
    bm.resync_events()
    ev = bm.take_events()
    assert ev.cleared and set(ev.stored) == set(bm.hash_to_block)


def test_reset_prefix_cache_is_a_clear_event():
    bm = BlockManager(4, BS)
    bm.track_events()
    bm.take_events()
    bm.free(_computed(bm, "a", list(range(8))))
    bm.take_events()
    assert bm.reset_prefix_cache()
    ev = bm.take_events()
    assert ev.cleared and not ev.stored and not ev.removed


def test_probe_positions_are_bounded_and_cover_the_prompt():
    assert probe_positions(5, 64) == [0, 1, 2, 3, 4]
    many = probe_positions(1000, 64)
    assert len(many) <= 64 and many[0] == 0 and many[-1] == 999 and many == sorted(many)
    assert leading_blocks([0, 1, 2], [True, True, False]) == 2
    assert leading_blocks([0, 10, 20], [True, True, True]) == 21
    assert leading_blocks([0, 10], [False, True]) == 0


def test_cost_formula():
    config = RoutingConfig(cache_weight=8, spill_factor=1.25, spill_slack=4)
    assert route_costs({"a": 0, "b": 0}, {"a": 1.0}, config) == {"a": -8.0, "b": 0.0}
    assert route_costs({"a": 4, "b": 0}, {"a": 0.5}, config) == {"a": 0.0, "b": 0.0}
    # a = 12 > 1.25 * 6 + 4: above the spill line, its cache bonus is gone
    assert route_costs({"a": 12, "b": 0}, {"a": 1.0}, config) == {"a": 12.0, "b": 0.0}
    with pytest.raises(ValueError):
        RoutingConfig(policy="random")


def test_routing_config_round_trips_through_the_environment(monkeypatch):
    config = RoutingConfig(policy="load", cache_weight=3.5, spill_factor=2.0, spill_slack=1.0, max_probes=16)
    for k, v in config.env().items():
        monkeypatch.setenv(k, v)
    assert RoutingConfig.from_env() == config


class FakeIndex:
    """`PrefixIndexReader` over in-memory sets."""

    def __init__(self, held: dict[str, set[int]]):
        self.sets = held
        self.lookups = 0

    def held(self, probes):
        self.lookups += 1
        return {e: [h in self.sets.get(e, set()) for h in hashes] for e, hashes in probes.items()}


def _selector(index, routing=None, now=1000.0, stats_at=1000.0, loads=None):
    engines = [{"engine_id": e, "state": "ready", "incarnation": e, "block_size": BS, "stats_at": stats_at}
               for e in ("e0", "e1")]
    decisions = []
    sel = EngineSelector(lambda: (engines, dict(loads or {})), clock=lambda: now, wall_clock=lambda: now,
                         prefix_index=index, routing=routing or RoutingConfig(),
                         count_decision=lambda e, reason: decisions.append((e, reason)))
    return sel, decisions


PROMPT = list(range(1, 42))  # 10 full blocks (the last token is never a cache hit)


def test_the_engine_holding_the_prefix_wins_until_its_load_spills():
    index = FakeIndex({"e1": set(block_hashes(PROMPT, BS))})
    sel, decisions = _selector(index)
    picks = []
    for _ in range(6):
        e = sel.select(token_ids=PROMPT)["engine_id"]
        sel.on_submit(e)
        picks.append(e)
    assert picks[:2] == ["e1", "e1"], picks  # e1 holds it all: preferred until 2 more requests wait there
    assert "e0" in picks[2:], picks  # then the load term wins: the flood spills
    assert decisions[0] == ("e1", "cache") and sel.decisions["cache"] >= 2 and sel.decisions["load"] >= 1


def test_no_hits_stale_index_and_load_policy_route_by_load():
    hashes = set(block_hashes(PROMPT, BS))
    sel, decisions = _selector(FakeIndex({}))
    assert [sel.select(token_ids=PROMPT)["engine_id"] for _ in range(4)] == ["e0", "e1", "e0", "e1"]
    assert {r for _, r in decisions} == {"load"}
    stale, _ = _selector(FakeIndex({"e1": hashes}), now=1100.0, stats_at=1000.0)
    assert [stale.select(token_ids=PROMPT)["engine_id"] for _ in range(2)] == ["e0", "e1"]
    index = FakeIndex({"e1": hashes})
    load_only, _ = _selector(index, routing=RoutingConfig(policy="load"))
    assert [load_only.select(token_ids=PROMPT)["engine_id"] for _ in range(2)] == ["e0", "e1"]
    assert index.lookups == 0


def test_partial_prefix_and_exclude():
    index = FakeIndex({"e0": set(block_hashes(PROMPT, BS)[:3]), "e1": set(block_hashes(PROMPT, BS)[:8])})
    sel, _ = _selector(index, loads={"e0": EngineLoad(ts=1000.0), "e1": EngineLoad(ts=1000.0)})
    assert sel.prefix_hits(PROMPT) == {"e0": 0.3, "e1": 0.8}
    assert sel.select(token_ids=PROMPT)["engine_id"] == "e1"
    assert sel.select(exclude=["e1"], token_ids=PROMPT)["engine_id"] == "e0"


def test_status_and_metrics_show_hit_rates_index_and_routing_reasons(redis_client, redis_keys):
    from api.metrics import EngineStatsCollector
    from broker.prefix_index import PrefixIndexWriter, RoutingCounter, read_routing_counts
    from broker.registry import EngineRegistry
    from redserve.status import collect_status, format_status

    registry = EngineRegistry(redis_client, redis_keys)
    registry.register("e0", {"dp_rank": 0})
    registry.heartbeat("e0", 5.0)
    registry.mark_ready("e0", 100, BS, 512)
    registry.update_stats("e0", {"prefix_cache_hit_rate": 0.75, "prefix_cache_hits": 30, "prefix_cache_queries": 40})
    writer = PrefixIndexWriter(redis_client, redis_keys, "e0", ttl=15.0)
    assert writer.publish(block_hashes(PROMPT, BS), [], cleared=True)
    assert writer.sent_commands == 3 and writer.sent_bytes > 10 * 8
    count = RoutingCounter(redis_client, redis_keys)
    count("e0", "cache")
    count("e0", "cache")
    count("e0", "load")
    assert read_routing_counts(redis_client, redis_keys) == {"e0": {"cache": 2, "load": 1}}

    engine = collect_status(redis_client, redis_keys)["engines"][0]
    assert engine["prefix_index_blocks"] == 10 and engine["routed"] == {"cache": 2, "load": 1}
    assert "routed c/l" in format_status(collect_status(redis_client, redis_keys))
    collector = EngineStatsCollector("m", registry.live_engines, None,
                                     lambda: read_routing_counts(redis_client, redis_keys))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for m in collector.collect() for s in m.samples}
    assert samples[("redserve:prefix_cache_hit_rate", (("engine", "e0"), ("model_name", "m")))] == 0.75
    assert samples[("redserve:routing_decisions_total",
                    (("engine", "e0"), ("model_name", "m"), ("reason", "cache")))] == 2

    assert 0 < redis_client.pttl(redis_keys.engine_blocks("e0")) <= 15_000
    registry.register("e0", {"dp_rank": 0})  # a restart: the new incarnation's cache is empty
    assert not redis_client.exists(redis_keys.engine_blocks("e0"))


def test_an_engine_with_a_stale_index_is_skipped_not_the_rest():
    engines = [{"engine_id": "e0", "state": "ready", "incarnation": "e0", "block_size": BS, "stats_at": 900.0},
               {"engine_id": "e1", "state": "ready", "incarnation": "e1", "block_size": BS, "stats_at": 1000.0}]
    loads = {"e0": EngineLoad(ts=1000.0), "e1": EngineLoad(waiting=1, ts=1000.0)}
    sel = EngineSelector(lambda: (engines, dict(loads)), clock=lambda: 1000.0, wall_clock=lambda: 1000.0,
                         prefix_index=FakeIndex({"e0": set(block_hashes(PROMPT, BS)),
                                                 "e1": set(block_hashes(PROMPT, BS))}),
                         routing=RoutingConfig())
    assert sel.prefix_hits(PROMPT) == {"e1": 1.0}  # e0's index is 100 s old: it counts for nothing
    assert sel.select(token_ids=PROMPT)["engine_id"] == "e1"  # 4 - 16 beats e0's idle 0
    loads["e1"] = EngineLoad(waiting=5, ts=1000.0)  # 20 > 1.25 * 10 + 4: e1 spills
    sel.refresh()
    assert sel.select(token_ids=PROMPT)["engine_id"] == "e0"
    assert sel.decisions == {"cache": 1, "load": 1}


def test_routing_config_bounds_and_messages():
    assert RoutingConfig(spill_factor=1.0, cache_weight=0.0, spill_slack=0.0, max_probes=1).spill_factor == 1.0
    with pytest.raises(ValueError, match=r"^cache routing needs weight >= 0, spill factor >= 1 and spill slack >= 0$"):
        RoutingConfig(spill_factor=0.5)
    with pytest.raises(ValueError, match=r"^cache routing needs max_probes >= 1$"):
        RoutingConfig(max_probes=0)
