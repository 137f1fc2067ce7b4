"""Engine registration, state and heartbeats in Redis (the `rs:engine:*` keys and `{rs}:engines`).

Rules:
- An engine calls `register` (state=starting, fresh `incarnation`), starts heartbeating
  (`EngineHeartbeat` or `heartbeat()` every ttl/3), loads the model, then `mark_ready`. It leaves
  with `set_state(DRAINING)`, finishing its requests, then stopping the heartbeat and `deregister`.
- The heartbeat key `rs:engine:{id}:alive` holds the engine's incarnation with a TTL. An engine is
  *live* when that key exists and equals the `incarnation` in its hash: a restarted engine with the
  same id gets a new incarnation, so clients can tell that the old one (and its requests) is gone.
- Clients route new requests only to READY live engines (`ready_engines`); requests in flight
  stay valid while their engine is READY or DRAINING and live (`live_engines`).
- `heartbeat()` restores the hash and the set entry if they vanished (Redis restarted empty),
  from what this registry object last wrote; stats come back with the next `update_stats`.
- Hash values are plain strings so they read well in `redis-cli`; reading them back turns
  numeric-looking values into int/float, except the fields in `STR_FIELDS`.
- Reads validate what they find (`broker.control_state`): a malformed member of `{rs}:engines`, an
  engine hash of the wrong type or without a valid state/incarnation, is skipped with a rate-limited
  warning; a field that is not UTF-8 or not the number it must be is dropped. Reads raise only for
  Redis outages.
- The prefix-cache index `rs:engine:{id}:blocks` (`broker.prefix_index`) is deleted by `register`
  and `deregister`; the heartbeat keeps its TTL at 3 x ttl, so it outlives no dead engine for long.
- A transaction touches one engine's keys only (one hash-tag slot); its `{rs}:engines` entry is written by a
  command of its own (`register` adds it after the hash exists, `deregister` removes it first).
- Methods that write take an optional pipeline (`pipe`); without one they run immediately.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis
from redis.client import Pipeline

from broker.control_state import STR_FIELDS, decode_fields, parse_engine, read_members
from broker.keys import EngineState, RedisKeys

logger = logging.getLogger(__name__)

__all__ = ["STR_FIELDS", "DeclaredDead", "EngineHeartbeat", "EngineRegistry", "decode_fields", "encode_fields"]


def encode_fields(values: Mapping[str, Any]) -> dict[str, str]:
    """Hash field values as redis-cli friendly strings (None is skipped; dict/list/bool as JSON)."""
    out = {}
    for k, v in values.items():
        if v is None:
            continue
        if isinstance(v, (dict, list, tuple, bool)):
            out[k] = json.dumps(v)
        elif isinstance(v, float):
            out[k] = repr(v)
        else:
            out[k] = str(v)
    return out


class DeclaredDead(Exception):
    """This engine incarnation was declared dead; it must register again (a new incarnation)."""


class EngineRegistry:
    """Reads and writes engine registrations; see the module docstring for the rules."""

    def __init__(self, redis_client: redis.Redis, keys: RedisKeys | None = None) -> None:
        self._redis = redis_client
        self.keys = keys or RedisKeys()
        self._records: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()

    def register(self, engine_id: str, info: Mapping[str, Any], pipe: Pipeline | None = None) -> str:
        """Write a fresh hash (state=starting, started_at, incarnation, host, pid + `info`); return incarnation.

        `info` should carry dp_rank, tp and model; host and pid default to this process.
        """
        incarnation = uuid.uuid4().hex
        record = encode_fields(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                **info,
                "engine_id": engine_id,
                "state": EngineState.STARTING.value,
                "started_at": time.time(),
                "incarnation": incarnation,
            }
        )
        with self._lock:
            self._records[engine_id] = dict(record)
        p = pipe if pipe is not None else self._redis.pipeline(transaction=True)  # the engine's slot only
        p.delete(self.keys.engine(engine_id), self.keys.engine_blocks(engine_id))  # a new incarnation's cache is empty
        p.hset(self.keys.engine(engine_id), mapping=record)
        if pipe is None:
            p.execute()
        (pipe if pipe is not None else self._redis).sadd(self.keys.engines(), engine_id)  # the control slot
        return incarnation

    def mark_ready(
        self,
        engine_id: str,
        num_kv_blocks: int,
        block_size: int,
        max_model_len: int,
        pipe: Pipeline | None = None,
    ) -> None:
        """Publish the KV cache size and switch to state=ready: clients may now route to it."""
        self._write(
            engine_id,
            {
                "num_kv_blocks": num_kv_blocks,
                "block_size": block_size,
                "max_model_len": max_model_len,
                "state": EngineState.READY.value,
                "ready_at": time.time(),
            },
            pipe,
        )

    def set_state(self, engine_id: str, state: EngineState, pipe: Pipeline | None = None) -> None:
        self._write(engine_id, {"state": EngineState(state).value}, pipe)

    def update_stats(self, engine_id: str, stats: Mapping[str, Any], pipe: Pipeline | None = None) -> None:
        """Live counters (waiting, running, kv_usage, num_steps, ...) into the hash; not kept for restore."""
        if not stats:
            return
        p = pipe if pipe is not None else self._redis
        p.hset(self.keys.engine(engine_id), mapping=encode_fields(stats))

    def heartbeat(self, engine_id: str, ttl: float) -> bool:
        """Refresh the alive key (TTL `ttl` seconds); return True if the registration had to be restored.

        Raises `DeclaredDead` if the coordinator marked this incarnation dead (its heartbeat lapsed, e.g.
        the process was paused): its requests were already failed or re-placed, so it must rejoin.
        """
        with self._lock:
            record = self._records.get(engine_id)
        incarnation = record["incarnation"] if record else "unknown"
        p = self._redis.pipeline(transaction=False)
        p.set(self.keys.engine_alive(engine_id), incarnation, px=max(1, int(ttl * 1000)))
        p.pexpire(self.keys.engine_blocks(engine_id), max(1, int(3 * ttl * 1000)))  # no-op without an index
        p.sadd(self.keys.engines(), engine_id)
        p.hmget(self.keys.engine(engine_id), "incarnation", "state")
        stored, state = p.execute()[3]
        if state == EngineState.DEAD.value.encode() and stored == incarnation.encode():
            raise DeclaredDead(f"engine {engine_id} was declared dead (its heartbeat lapsed)")
        # Compare the incarnation, not the key's existence: after a restart a stats write can
        # re-create the hash with counters only, which must not pass for a registration.
        if record is None or stored == incarnation.encode():
            return False
        logger.warning("engine %s: registration missing from Redis (restarted?), restoring it", engine_id)
        self._redis.hset(self.keys.engine(engine_id), mapping=record)
        return True

    def deregister(self, engine_id: str, pipe: Pipeline | None = None) -> None:
        """Remove the hash, heartbeat, set entry and request stream. Stop heartbeating first."""
        with self._lock:
            self._records.pop(engine_id, None)
        (pipe if pipe is not None else self._redis).srem(self.keys.engines(), engine_id)  # the control slot
        p = pipe if pipe is not None else self._redis.pipeline(transaction=True)  # the engine's slot only
        p.delete(self.keys.engine(engine_id), self.keys.engine_alive(engine_id), self.keys.request_stream(engine_id),
                 self.keys.engine_blocks(engine_id))
        if pipe is None:
            p.execute()

    def get(self, engine_id: str) -> dict[str, Any] | None:
        """The engine's hash (decoded), with `alive` (bool) added; None if not registered."""
        found = self._read([engine_id])
        return found[0] if found else None

    def all_engines(self) -> list[dict[str, Any]]:
        """Every registered engine (any state, alive or not), each with `alive` added, sorted by id."""
        return self._read(read_members(self._redis, self.keys.engines(), "engine"))

    def live_engines(self, states: Iterable[EngineState] = (EngineState.READY, EngineState.DRAINING)) -> list[dict[str, Any]]:
        """Engines in one of `states` whose heartbeat is live (matches their incarnation)."""
        wanted = {EngineState(s).value for s in states}
        return [e for e in self.all_engines() if e["alive"] and e.get("state") in wanted]

    def ready_engines(self) -> list[dict[str, Any]]:
        """READY engines with a live heartbeat: where clients may send new requests."""
        return self.live_engines((EngineState.READY,))

    def _write(self, engine_id: str, values: Mapping[str, Any], pipe: Pipeline | None) -> None:
        fields = encode_fields(values)
        with self._lock:
            if engine_id in self._records:
                self._records[engine_id].update(fields)
        p = pipe if pipe is not None else self._redis
        p.hset(self.keys.engine(engine_id), mapping=fields)

    def _read(self, ids: list[str]) -> list[dict[str, Any]]:
        if not ids:
            return []
        p = self._redis.pipeline(transaction=False)
        for engine_id in ids:
            p.hgetall(self.keys.engine(engine_id))
            p.get(self.keys.engine_alive(engine_id))
        replies = p.execute(raise_on_error=False)
        engines = []
        for engine_id, raw, alive in zip(ids, replies[0::2], replies[1::2], strict=True):
            info = parse_engine(engine_id, raw, alive, self.keys.engine(engine_id))
            if info is not None:
                engines.append(info)
        return engines


class EngineHeartbeat:
    """Daemon thread calling `registry.heartbeat(engine_id, ttl)` every `interval` (default ttl/3).

    Redis errors are logged and retried at the next beat; they never stop the thread. When the
    incarnation was declared dead, `on_declared_dead()` is called (at every beat until it rejoins);
    when the beat had to restore the registration (Redis restarted empty), `on_restored()` is, so the
    engine can publish again what else Redis lost (its prefix index).
    """

    def __init__(self, registry: EngineRegistry, engine_id: str, ttl: float = 10.0, interval: float | None = None,
                 on_declared_dead: Callable[[], None] | None = None,
                 on_restored: Callable[[], None] | None = None) -> None:
        self._registry = registry
        self._on_declared_dead = on_declared_dead
        self._on_restored = on_restored
        self._engine_id = engine_id
        self._ttl = ttl
        self._interval = interval if interval is not None else ttl / 3
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def start(self) -> EngineHeartbeat:
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self._engine_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._beat()

    def _beat(self) -> None:
        try:
            restored = self._registry.heartbeat(self._engine_id, self._ttl)
        except DeclaredDead as e:
            logger.warning("%s", e)
            if self._on_declared_dead is not None:
                self._on_declared_dead()
            restored = False  # the engine rejoins as a new incarnation; the thread beats on for it
        except redis.RedisError as e:
            (logger.debug if self._failing else logger.warning)("engine %s: heartbeat failed: %s", self._engine_id, e)
            self._failing = True
            return
        if self._failing:
            logger.info("engine %s: heartbeat works again", self._engine_id)
            self._failing = False
        if restored and self._on_restored is not None:
            self._on_restored()
