import pytest

from broker.errors import NoEngineAvailable
from broker.load_balance import EngineSelector, read_lb_snapshot, write_lb_snapshot
from protocol.engine_load import EngineLoad


class FakeCluster:
    """What `fetch` would read from Redis, plus a controllable clock."""

    def __init__(self, *engine_ids, state="ready"):
        self.engines = {e: {"engine_id": e, "state": state, "incarnation": "i-" + e} for e in engine_ids}
        self.loads: dict[str, EngineLoad] = {}
        self.fetches = 0
        self.now = 1000.0

    def fetch(self):
        self.fetches += 1
        return list(self.engines.values()), dict(self.loads)

    def selector(self, **kw):
        return EngineSelector(self.fetch, clock=lambda: self.now, wall_clock=lambda: self.now, **kw)


def _pick(sel, n=1):
    picks = []
    for _ in range(n):
        engine_id = sel.select()["engine_id"]
        sel.on_submit(engine_id)
        picks.append(engine_id)
    return picks


def test_without_snapshot_balances_own_in_flight():
    c = FakeCluster("e0", "e1", "e2")
    sel = c.selector()
    assert sorted(_pick(sel, 3)) == ["e0", "e1", "e2"]
    sel.on_finish("e1")
    assert _pick(sel) == ["e1"]


def test_ties_rotate_over_engine_ids():
    c = FakeCluster("e0", "e1")
    sel = c.selector()
    firsts = []
    for _ in range(4):
        engine_id = sel.select()["engine_id"]  # never on_submit: loads stay equal
        firsts.append(engine_id)
    assert set(firsts) == {"e0", "e1"}


def test_snapshot_score_is_waiting_times_four_plus_running():
    c = FakeCluster("e0", "e1")
    c.loads = {"e0": EngineLoad(waiting=1, running=0, ts=c.now), "e1": EngineLoad(waiting=0, running=3, ts=c.now)}
    sel = c.selector()
    assert sel.score("e0") == sel.score("e1") == 0  # before the first fetch: no snapshot known
    sel.refresh()
    assert (sel.score("e0"), sel.score("e1")) == (4, 3)
    assert _pick(sel) == ["e1"]  # e1: 3 < 4
    assert sel.score("e1") == 7  # the request just sent counts as waiting until the next snapshot
    assert _pick(sel) == ["e0"]


def test_new_snapshot_resets_requests_sent_since():
    c = FakeCluster("e0")
    c.loads = {"e0": EngineLoad(waiting=0, running=0, ts=c.now)}
    sel = c.selector(refresh_interval=0.5)
    _pick(sel, 3)
    assert sel.score("e0") == 12
    c.now += 1
    c.loads = {"e0": EngineLoad(waiting=1, running=2, ts=c.now)}
    sel.refresh()
    assert sel.score("e0") == 6


def test_requests_that_finished_since_the_snapshot_no_longer_count():
    """Quick requests between two snapshots (a multi-turn chat) must not pile up as phantom waiting ones."""
    c = FakeCluster("e0", "e1")
    c.loads = {e: EngineLoad(waiting=0, running=0, ts=c.now) for e in ("e0", "e1")}
    sel = c.selector(refresh_interval=60)
    sel.refresh()
    for _ in range(3):
        sel.on_submit("e0")
        sel.on_finish("e0")
    assert sel.score("e0") == 0 and sel.in_flight("e0") == 0
    sel.on_submit("e0")
    assert sel.score("e0") == 4
    sel.refresh()  # a new snapshot already counts it; its finish must not go below zero
    sel.on_finish("e0")
    sel.on_finish("e0")
    assert sel.score("e0") == 0


def test_stale_snapshot_falls_back_to_in_flight():
    c = FakeCluster("e0", "e1")
    c.loads = {"e0": EngineLoad(waiting=100, ts=c.now), "e1": EngineLoad(waiting=0, ts=c.now)}
    sel = c.selector(snapshot_max_age=5.0)
    sel.refresh()
    assert _pick(sel) == ["e1"]
    c.now += 10  # coordinator stopped writing
    assert sel.score("e0") == 0 and sel.score("e1") == 4
    assert _pick(sel) == ["e0"]


def test_engine_list_is_cached():
    c = FakeCluster("e0")
    sel = c.selector(refresh_interval=0.5)
    _pick(sel, 10)
    assert c.fetches == 1
    c.now += 0.6
    _pick(sel)
    assert c.fetches == 2


def test_only_ready_engines_are_chosen_and_none_raises():
    c = FakeCluster("e0", "e1")
    c.engines["e0"]["state"] = "draining"
    sel = c.selector()
    assert set(_pick(sel, 3)) == {"e1"}
    with pytest.raises(NoEngineAvailable):
        sel.select(exclude=["e1"])
    c.engines.clear()
    c.now += 1
    with pytest.raises(NoEngineAvailable):
        sel.select()


def test_empty_cache_refreshes_at_once():
    c = FakeCluster()
    sel = c.selector(refresh_interval=100)
    with pytest.raises(NoEngineAvailable):
        sel.select()
    c.engines = FakeCluster("e0").engines  # an engine came up within the cache interval
    assert sel.select()["engine_id"] == "e0"


def test_snapshot_round_trip_in_redis(redis_client, redis_keys):
    loads = {"e0": EngineLoad(1, 2, 0.5, 10, 123.0), "e1": EngineLoad()}
    write_lb_snapshot(redis_client, redis_keys, loads)
    assert read_lb_snapshot(redis_client, redis_keys) == loads
    assert b'"waiting":1' in redis_client.hget(redis_keys.lb(), "e0")  # readable in redis-cli
    redis_client.hset(redis_keys.lb(), "bad", "{not json")
    assert set(read_lb_snapshot(redis_client, redis_keys)) == {"e0", "e1"}
    write_lb_snapshot(redis_client, redis_keys, {"e1": EngineLoad()})
    assert set(read_lb_snapshot(redis_client, redis_keys)) == {"e1"}


def test_two_requests_in_flight_count_until_both_finish():
    c = FakeCluster("e0")
    c.loads = {"e0": EngineLoad(ts=c.now)}
    sel = c.selector()
    sel.refresh()
    sel.on_submit("e0")
    sel.on_submit("e0")
    sel.on_finish("e0")
    assert sel.in_flight("e0") == 1 and sel.score("e0") == 4  # one still waits
    sel.on_finish("e0")
    assert sel.in_flight("e0") == 0 and sel.score("e0") == 0


def test_load_entry_absent_fields_default_and_bad_ones_say_which():
    assert EngineLoad.from_json('{"waiting": 2}') == EngineLoad(waiting=2)
    assert EngineLoad.from_json("{}") == EngineLoad()
    with pytest.raises(ValueError, match=r"^ts must be a finite number >= 0, got -1$"):
        EngineLoad.from_json('{"ts": -1}')
    with pytest.raises(ValueError, match="^load entry must be a JSON object$"):
        EngineLoad.from_json("[1, 2]")
    with pytest.raises(ValueError, match="^load entry is nested too deeply$"):
        EngineLoad.from_json("[" * 100_000 + "]" * 100_000)


def test_snapshot_key_of_the_wrong_type_reads_as_none_with_a_warning(redis_client, redis_keys, caplog):
    redis_client.set(redis_keys.lb(), "not a hash")
    with caplog.at_level("WARNING"):
        assert read_lb_snapshot(redis_client, redis_keys) == {}
    assert any(f"ignoring {redis_keys.lb()}: WRONGTYPE" in r.getMessage() for r in caplog.records)
