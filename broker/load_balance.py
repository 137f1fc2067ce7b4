"""Engine choice for new requests, and the coordinator's load snapshot format (`rs:lb`).

Snapshot: the coordinator (its single writer) keeps `rs:lb` as a hash engine_id -> JSON
`{"waiting": int, "running": int, "kv_usage": float, "step": int, "ts": wall-clock seconds}`,
replaced as a whole by `write_lb_snapshot`; `redis-cli HGETALL rs:lb` shows it as is. Readers skip
an entry whose id or JSON is not valid, or whose counters are not non-negative ints / finite numbers.

Choice (`EngineSelector.select`), among READY engines with a live heartbeat:
- score = 4 * waiting + running; the lowest wins; ties go round-robin over the engine ids.
- With a fresh snapshot entry for an engine (ts younger than `snapshot_max_age`): waiting and
  running come from it, plus the requests this process has sent to that engine since that entry
  was written (counted as waiting: they are not scheduled yet).
- Without one (no coordinator, or it is stale): waiting = this process's own requests in flight on
  that engine, running = 0. With no snapshot at all this is "fewest in flight from here".
The engine list is cached for `refresh_interval` seconds, so placing a request is normally no Redis
round trip at all. The selector is pure logic over a `fetch` callable and is thread-safe.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import redis
from redis.client import Pipeline

from broker.control_state import MAX_INT, is_wrong_type, utf8, warn_bad
from broker.errors import NoEngineAvailable
from broker.keys import EngineState, RedisKeys, check_id


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine's entry in the coordinator snapshot."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    step: int = 0
    ts: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> EngineLoad:
        """Parse an entry; raise ValueError if it is not one (absent fields take their defaults)."""
        try:
            d = json.loads(text)
        except RecursionError:
            raise ValueError("load entry is nested too deeply") from None
        if not isinstance(d, dict):
            raise ValueError("load entry must be a JSON object")
        return cls(waiting=_count(d, "waiting"), running=_count(d, "running"), kv_usage=_number(d, "kv_usage"),
                   step=_count(d, "step"), ts=_number(d, "ts"))


def _count(d: Mapping[str, Any], name: str) -> int:
    value = d.get(name, 0)
    if type(value) is not int or not 0 <= value < MAX_INT:
        raise ValueError(f"{name} must be an int in [0, 2**63), got {value!r}")
    return value


def _number(d: Mapping[str, Any], name: str) -> float:
    value = d.get(name, 0.0)
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def write_lb_snapshot(
    redis_client: redis.Redis, keys: RedisKeys, loads: Mapping[str, EngineLoad], pipe: Pipeline | None = None
) -> None:
    """Replace `rs:lb` with `loads` atomically (MULTI: DEL + HSET)."""
    p = pipe if pipe is not None else redis_client.pipeline(transaction=True)
    p.delete(keys.lb())
    if loads:
        p.hset(keys.lb(), mapping={e: load.to_json() for e, load in loads.items()})
    if pipe is None:
        p.execute()


def read_lb_snapshot(redis_client: redis.Redis, keys: RedisKeys) -> dict[str, EngineLoad]:
    """The current snapshot; entries that do not parse are skipped with a rate-limited log line.

    A `rs:lb` of the wrong type reads as no snapshot (clients then count their own requests).
    """
    try:
        raw_entries = redis_client.hgetall(keys.lb())
    except redis.ResponseError as e:
        if not is_wrong_type(e):
            raise
        warn_bad(f"{keys.lb()}:wrongtype", "ignoring %s: %s", keys.lb(), e)
        return {}
    out = {}
    for raw_id, raw in raw_entries.items():
        engine_id = utf8(raw_id)
        try:
            out[check_id("engine", engine_id)] = EngineLoad.from_json(raw)
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            warn_bad(f"{keys.lb()}:{raw_id!r}", "ignoring bad load entry %r in %s: %s", raw_id, keys.lb(), e)
    return out


Fetch = Callable[[], tuple[list[dict[str, Any]], dict[str, EngineLoad]]]


class EngineSelector:
    """Picks the least loaded READY engine; see the module docstring for the scoring rules.

    `fetch()` returns (live engines as dicts with "engine_id", "state", "incarnation", the load
    snapshot). Callers report `on_submit(engine_id)` / `on_finish(engine_id)` for their requests.
    """

    def __init__(
        self,
        fetch: Fetch,
        refresh_interval: float = 0.5,
        snapshot_max_age: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._fetch = fetch
        self._refresh_interval = refresh_interval
        self._snapshot_max_age = snapshot_max_age
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._engines: dict[str, dict[str, Any]] = {}
        self._loads: dict[str, EngineLoad] = {}
        self._fetched_at: float | None = None
        self._in_flight: dict[str, int] = {}
        self._sent_since: dict[str, int] = {}
        self._seen_ts: dict[str, float] = {}
        self._rr = 0

    def refresh(self) -> dict[str, dict[str, Any]]:
        """Fetch now; return the live engines by id (READY and DRAINING)."""
        engines, loads = self._fetch()
        with self._lock:
            self._engines = {e["engine_id"]: e for e in engines}
            self._loads = loads
            self._fetched_at = self._clock()
            for engine_id, load in loads.items():
                if self._seen_ts.get(engine_id) != load.ts:
                    self._seen_ts[engine_id] = load.ts
                    self._sent_since[engine_id] = 0
            return dict(self._engines)

    def live_engines(self, max_age: float | None = None) -> dict[str, dict[str, Any]]:
        """Live engines by id from the cache, refreshed first if older than `max_age` (default: the interval)."""
        max_age = self._refresh_interval if max_age is None else max_age
        with self._lock:
            fresh = self._fetched_at is not None and self._clock() - self._fetched_at < max_age
            if fresh:
                return dict(self._engines)
        return self.refresh()

    def select(self, exclude: Iterable[str] = ()) -> dict[str, Any]:
        """The chosen engine's info dict; raise NoEngineAvailable if no READY live engine remains."""
        engines = self.live_engines()
        excluded = set(exclude)
        ready = self._ready_ids(engines, excluded)
        if not ready:
            engines = self.refresh()  # an engine may have just come up
            ready = self._ready_ids(engines, excluded)
        if not ready:
            raise NoEngineAvailable("no engine is ready: none registered, all starting or draining, or heartbeats expired")
        with self._lock:
            start = self._rr % len(ready)
            self._rr += 1
            order = ready[start:] + ready[:start]
            chosen = min(order, key=self._score_locked)
            return engines[chosen]

    def score(self, engine_id: str) -> int:
        with self._lock:
            return self._score_locked(engine_id)

    def on_submit(self, engine_id: str) -> None:
        with self._lock:
            self._in_flight[engine_id] = self._in_flight.get(engine_id, 0) + 1
            self._sent_since[engine_id] = self._sent_since.get(engine_id, 0) + 1

    def on_finish(self, engine_id: str) -> None:
        with self._lock:
            n = self._in_flight.get(engine_id, 0) - 1
            if n > 0:
                self._in_flight[engine_id] = n
            else:
                self._in_flight.pop(engine_id, None)

    def in_flight(self, engine_id: str) -> int:
        with self._lock:
            return self._in_flight.get(engine_id, 0)

    @staticmethod
    def _ready_ids(engines: Mapping[str, dict[str, Any]], excluded: set[str]) -> list[str]:
        return sorted(e for e, info in engines.items() if info.get("state") == EngineState.READY and e not in excluded)

    def _score_locked(self, engine_id: str) -> int:
        load = self._loads.get(engine_id)
        if load is not None and self._wall_clock() - load.ts <= self._snapshot_max_age:
            return 4 * (load.waiting + self._sent_since.get(engine_id, 0)) + load.running
        return 4 * self._in_flight.get(engine_id, 0)
