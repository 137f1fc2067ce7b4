"""`protocol.engine_load.EngineLoad`: its two wire forms pinned byte for byte, read back through the
registry's hash encoding, and the lenient read of an engine's stats (the strict `{rs}:lb` parse is in
test_broker_load_balance)."""

from __future__ import annotations

import math

import pytest

from broker.control_state import INT_FIELDS, NUMBER_FIELDS, decode_fields
from broker.registry import encode_fields
from protocol.engine_load import STATS_INT_FIELDS, STATS_NUMBER_FIELDS, EngineLoad

LOAD = EngineLoad(waiting=3, running=2, kv_usage=0.123456, step=41, ts=1700000000.123456)


def test_snapshot_entry_bytes_are_pinned():
    entry = '{"waiting":1,"running":2,"kv_usage":0.5,"step":3,"ts":10.0}'
    assert EngineLoad(1, 2, 0.5, 3, 10.0).to_json() == entry
    assert EngineLoad.from_json(LOAD.to_json()) == LOAD


def test_stats_names_order_and_rounding_are_pinned():
    assert list(LOAD.stats_fields().items()) == [("waiting", 3), ("running", 2), ("kv_usage", 0.1235),
                                                 ("num_steps", 41)]
    assert LOAD.stats_stamp() == {"stats_at": 1700000000.123}
    names = set(LOAD.stats_fields()) | set(LOAD.stats_stamp())
    assert names == STATS_INT_FIELDS | STATS_NUMBER_FIELDS
    assert STATS_INT_FIELDS <= INT_FIELDS and STATS_NUMBER_FIELDS <= NUMBER_FIELDS


def test_stats_read_back_through_the_registry_hash():
    raw = encode_fields({**LOAD.stats_fields(), "generated_tokens": 9, **LOAD.stats_stamp()})
    fields = decode_fields({k.encode(): v.encode() for k, v in raw.items()})
    assert EngineLoad.from_stats(fields) == EngineLoad(3, 2, 0.1235, 41, 1700000000.123)


@pytest.mark.parametrize("bad", ["junk", -1, 2**63, math.inf, math.nan, True, None, [1]])
def test_a_bad_figure_reads_as_its_default(bad):
    fields = {"waiting": bad, "running": 1, "kv_usage": bad, "num_steps": bad, "stats_at": bad}
    load = EngineLoad.from_stats(fields, default_ts=5.0)
    assert load == EngineLoad(running=1, ts=5.0)


def test_missing_stats_read_as_defaults_and_busy_and_same_figures():
    assert EngineLoad.from_stats({}) == EngineLoad()
    assert EngineLoad.from_stats({}, default_ts=7.5).ts == 7.5
    assert EngineLoad.from_stats({"waiting": 2.0}).waiting == 2  # an int-valued float, as a hash may hold
    assert not EngineLoad().busy and EngineLoad(waiting=1).busy and EngineLoad(running=1).busy
    assert LOAD.same_figures(EngineLoad(3, 2, 0.123456, 41, 0.0))
    assert not LOAD.same_figures(EngineLoad(3, 2, 0.123456, 42, LOAD.ts))
