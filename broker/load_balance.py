"""Engine choice for new requests, and the coordinator's load snapshot format (`{rs}:lb`).

Snapshot: the coordinator (its single writer) keeps `{rs}:lb` as a hash engine_id -> an `EngineLoad`
(`protocol.engine_load`) as JSON `{"waiting": int, "running": int, "kv_usage": float, "step": int,
"ts": wall-clock seconds}`, replaced as a whole by `write_lb_snapshot`; `redis-cli HGETALL {rs}:lb` shows it
as is. Readers skip an entry whose id or JSON is not valid, or whose counters are not non-negative ints /
finite numbers (`EngineLoad.from_json`).

Choice (`EngineSelector.select`), among READY engines with a live heartbeat:
- score = 4 * waiting + running; the lowest wins; ties go round-robin over the engine ids.
- With a fresh snapshot entry for an engine (ts younger than `snapshot_max_age`): waiting and
  running come from it, plus the requests this process has sent to that engine since that entry
  was written and that have not finished yet (counted as waiting: they are not scheduled yet).
- Without one (no coordinator, or it is stale): waiting = this process's own requests in flight on
  that engine, running = 0. With no snapshot at all this is "fewest in flight from here".
The engine list is cached for `refresh_interval` seconds, so placing a request is normally no Redis
round trip at all. The selector is pure logic over a `fetch` callable and is thread-safe.

Cache-aware routing (`RoutingConfig.policy == "cache"`, the default, and `select(token_ids=...)`
with two or more candidates): the prompt's full-block hashes are computed with each engine's
`block_size` (`protocol.prefix_hash`, as the engine does), a bounded set of probe positions
(`max_probes`, see `broker.prefix_index.probe_positions`) is looked up in every candidate's index in
one pipeline, and

    hit(e)  = leading prompt blocks engine e holds / full blocks of the prompt   (0..1)
    load(e) = the load score above (4 * waiting + running)
    cost(e) = load(e) - cache_weight * hit(e)    if load(e) <= spill_factor * mean(load) + spill_slack
            = load(e)                            otherwise (a flood on one engine's prefix spills over)

the lowest cost wins (ties round-robin). With the defaults (weight 16, factor 1.25, slack 4) an engine
holding the whole prefix is preferred over an idle one holding none until the spill line stops it
(load > 10.7, about 3 waiting requests; between two busy engines, up to 4 more waiting than the other;
half the prefix is worth half that). Weight 16 kept a multi-turn benchmark at 94% of one engine's hit
rate with DP=2 (8 gave 79%: a turn-2 prompt holds half its blocks, worth only one waiting request). An engine whose stats (`stats_at`) are older than `snapshot_max_age` counts as hit 0 (stale
index); if no candidate holds anything, or the lookup fails, the choice is the load-only one.
Each choice is counted by reason: "cache" when the chosen engine holds more of the prompt than
some other candidate, else "load" (`decisions`, and `{rs}:routing` when a `prefix_index` is given).
Roles (prefill/decode disaggregation): `select(roles=...)` keeps the candidates of those roles (`engine_role`:
the registry's `role` field, `both` when absent); the client places new requests on the prefill pool and hands
them to the decode pool (`DECODE_ROLES`: decode and both engines), each balanced as above on its own.
Environment (read by `RoutingConfig.from_env`): REDSERVE_ROUTING (cache | load),
REDSERVE_CACHE_ROUTING_WEIGHT, REDSERVE_CACHE_ROUTING_SPILL (factor), REDSERVE_CACHE_ROUTING_SLACK,
REDSERVE_CACHE_ROUTING_PROBES.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.client import Pipeline

from broker.control_state import is_wrong_type, utf8, warn_bad
from broker.errors import NoEngineAvailable
from broker.keys import EngineState, RedisKeys, check_id
from broker.prefix_index import PrefixIndexReader, leading_blocks, probe_positions
from protocol.engine_load import EngineLoad
from protocol.prefix_hash import block_hashes

logger = logging.getLogger(__name__)

ROUTING_POLICIES = ("cache", "load")
MAX_HASHED_BLOCKS = 8192  # longest prompt prefix (in blocks) hashed for routing


PREFILL_ROLES = frozenset({"prefill"})
DECODE_ROLES = frozenset({"decode", "both"})


def engine_role(info: Mapping[str, Any]) -> str:
    """An engine's role in prefill/decode disaggregation (its registry field; ``both`` when it has none)."""
    role = info.get("role")
    return role if role in ("prefill", "decode") else "both"


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How `EngineSelector` trades cached prefix against load; see the module docstring."""

    policy: str = "cache"
    cache_weight: float = 16.0
    spill_factor: float = 1.25
    spill_slack: float = 4.0
    max_probes: int = 64

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, got {self.policy!r}")
        if not (self.cache_weight >= 0 and self.spill_factor >= 1 and self.spill_slack >= 0):
            raise ValueError("cache routing needs weight >= 0, spill factor >= 1 and spill slack >= 0")
        if self.max_probes < 1:
            raise ValueError("cache routing needs max_probes >= 1")

    @classmethod
    def from_env(cls) -> RoutingConfig:
        """From REDSERVE_ROUTING and REDSERVE_CACHE_ROUTING_* (unset: the defaults)."""
        env = os.environ
        d = cls()
        return cls(policy=env.get("REDSERVE_ROUTING", d.policy) or d.policy,
                   cache_weight=float(env.get("REDSERVE_CACHE_ROUTING_WEIGHT", d.cache_weight)),
                   spill_factor=float(env.get("REDSERVE_CACHE_ROUTING_SPILL", d.spill_factor)),
                   spill_slack=float(env.get("REDSERVE_CACHE_ROUTING_SLACK", d.spill_slack)),
                   max_probes=int(env.get("REDSERVE_CACHE_ROUTING_PROBES", d.max_probes)))

    def env(self) -> dict[str, str]:
        """The environment variables that `from_env` reads back as this config."""
        return {"REDSERVE_ROUTING": self.policy, "REDSERVE_CACHE_ROUTING_WEIGHT": repr(self.cache_weight),
                "REDSERVE_CACHE_ROUTING_SPILL": repr(self.spill_factor),
                "REDSERVE_CACHE_ROUTING_SLACK": repr(self.spill_slack),
                "REDSERVE_CACHE_ROUTING_PROBES": str(self.max_probes)}


def route_costs(loads: Mapping[str, float], hits: Mapping[str, float], config: RoutingConfig) -> dict[str, float]:
    """cost(e) per the module docstring: load minus the cache bonus, no bonus above the spill line."""
    if not loads:
        return {}
    spill_line = config.spill_factor * sum(loads.values()) / len(loads) + config.spill_slack
    return {e: load - config.cache_weight * hits.get(e, 0.0) if load <= spill_line else float(load)
            for e, load in loads.items()}


def write_lb_snapshot(
    redis_client: redis.Redis, keys: RedisKeys, loads: Mapping[str, EngineLoad], pipe: Pipeline | None = None
) -> None:
    """Replace `{rs}:lb` with `loads` atomically (MULTI: DEL + HSET)."""
    p = pipe if pipe is not None else redis_client.pipeline(transaction=True)
    p.delete(keys.lb())
    if loads:
        p.hset(keys.lb(), mapping={e: load.to_json() for e, load in loads.items()})
    if pipe is None:
        p.execute()


def read_lb_snapshot(redis_client: redis.Redis, keys: RedisKeys) -> dict[str, EngineLoad]:
    """The current snapshot; entries that do not parse are skipped with a rate-limited log line.

    A `{rs}:lb` of the wrong type reads as no snapshot (clients then count their own requests).
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
        prefix_index: PrefixIndexReader | None = None,
        routing: RoutingConfig | None = None,
        count_decision: Callable[[str, str], None] | None = None,
    ) -> None:
        self._fetch = fetch
        self._prefix_index = prefix_index
        self.routing = routing if routing is not None else RoutingConfig.from_env()
        self._count_decision = count_decision
        self.decisions: dict[str, int] = {"cache": 0, "load": 0}
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

    def select(self, exclude: Iterable[str] = (), token_ids: Sequence[int] | None = None,
               roles: Iterable[str] | None = None) -> dict[str, Any]:
        """The chosen engine's info dict; raise NoEngineAvailable if no READY live engine remains.

        With `token_ids` (the prompt) and the cache policy, engines holding its prefix are preferred. `roles`:
        only engines of these roles (`engine_role`) are candidates.
        """
        engines = self.live_engines()
        excluded = set(exclude)
        ready = self._ready_ids(engines, excluded, roles)
        if not ready:
            engines = self.refresh()  # an engine may have just come up
            ready = self._ready_ids(engines, excluded, roles)
        if not ready:
            raise NoEngineAvailable("no engine is ready: none registered, all starting or draining, or heartbeats expired")
        hits = self._prefix_hits(engines, ready, token_ids)
        with self._lock:
            start = self._rr % len(ready)
            self._rr += 1
            order = ready[start:] + ready[:start]
            if not any(hits.values()):
                chosen = min(order, key=self._score_locked)
                reason = "load"
            else:
                costs = route_costs({e: self._score_locked(e) for e in ready}, hits, self.routing)
                chosen = min(order, key=costs.__getitem__)
                reason = "cache" if hits.get(chosen, 0.0) > min(hits.get(e, 0.0) for e in ready) else "load"
            if len(ready) > 1:
                self.decisions[reason] += 1
        if len(ready) > 1 and self._count_decision is not None:
            self._count_decision(chosen, reason)
        return engines[chosen]

    def prefix_hits(self, token_ids: Sequence[int], exclude: Iterable[str] = ()) -> dict[str, float]:
        """hit(e) of every READY engine for this prompt (see the module docstring), e.g. for tools."""
        engines = self.live_engines()
        return self._prefix_hits(engines, self._ready_ids(engines, set(exclude)), token_ids)

    def _prefix_hits(self, engines: Mapping[str, dict[str, Any]], ready: list[str],
                     token_ids: Sequence[int] | None) -> dict[str, float]:
        if (token_ids is None or self._prefix_index is None or self.routing.policy != "cache"
                or len(ready) < 2 or len(token_ids) < 2):
            return {}
        probes: dict[str, list[int]] = {}
        positions: dict[str, list[int]] = {}
        num_blocks: dict[str, int] = {}
        by_size: dict[int, list[int]] = {}
        now = self._wall_clock()
        for e in ready:
            info = engines[e]
            bs, stats_at = info.get("block_size"), EngineLoad.from_stats(info).ts  # missing: 0, stale
            if type(bs) is not int or bs < 1 or now - stats_at > self._snapshot_max_age:
                continue  # no block size yet, or a stale index
            if bs not in by_size:  # at least one prompt token is always computed, as in the engine
                by_size[bs] = block_hashes(token_ids[:len(token_ids) - 1], bs, MAX_HASHED_BLOCKS)
            hashes = by_size[bs]
            if not hashes:
                continue
            positions[e] = probe_positions(len(hashes), self.routing.max_probes)
            probes[e] = [hashes[i] for i in positions[e]]
            num_blocks[e] = len(hashes)
        if not probes:
            return {}
        try:
            held = self._prefix_index.held(probes)
        except redis.RedisError as exc:
            logger.warning("prefix index lookup failed (%s): routing by load", exc)
            return {}
        return {e: leading_blocks(positions[e], held[e]) / num_blocks[e] for e in probes}

    def score(self, engine_id: str) -> int:
        with self._lock:
            return self._score_locked(engine_id)

    def on_submit(self, engine_id: str) -> None:
        with self._lock:
            self._in_flight[engine_id] = self._in_flight.get(engine_id, 0) + 1
            self._sent_since[engine_id] = self._sent_since.get(engine_id, 0) + 1

    def on_finish(self, engine_id: str) -> None:
        """A request placed here ended: it no longer counts as in flight, nor as sent since the snapshot."""
        with self._lock:
            for counts in (self._in_flight, self._sent_since):
                n = counts.get(engine_id, 0) - 1
                if n > 0:
                    counts[engine_id] = n
                else:
                    counts.pop(engine_id, None)

    def in_flight(self, engine_id: str) -> int:
        with self._lock:
            return self._in_flight.get(engine_id, 0)

    def has_role(self, roles: Iterable[str], exclude: Iterable[str] = ()) -> bool:
        """Whether a READY live engine of one of `roles` is known (from the cached engine list)."""
        return bool(self._ready_ids(self.live_engines(), set(exclude), roles))

    @staticmethod
    def _ready_ids(engines: Mapping[str, dict[str, Any]], excluded: set[str],
                   roles: Iterable[str] | None = None) -> list[str]:
        wanted = None if roles is None else set(roles)
        return sorted(e for e, info in engines.items() if info.get("state") == EngineState.READY and e not in excluded
                      and (wanted is None or engine_role(info) in wanted))

    def _score_locked(self, engine_id: str) -> int:
        load = self._loads.get(engine_id)
        if load is not None and self._wall_clock() - load.ts <= self._snapshot_max_age:
            return 4 * (load.waiting + self._sent_since.get(engine_id, 0)) + load.running
        return 4 * self._in_flight.get(engine_id, 0)
