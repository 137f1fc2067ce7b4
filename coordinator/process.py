"""The DP coordinator (`redserve coordinator`): load snapshot, wave counter, engine liveness.

Rules:
- One coordinator is active: the holder of `{rs}:coordinator:lock` (`coordinator.leader_lock`). Any
  number of standbys try to take the lock every `standby_poll` seconds, so one takes over within
  the lock's TTL (+ one poll) of the active one dying. Every write of the active one is fenced by
  the lock (a WATCHed transaction or a Lua check), so one that lost the lock while paused writes
  nothing. It imports no torch: it starts in a fraction of a second and needs no accelerator.
- Each tick reads every registered engine (hash + heartbeat) and `{rs}:wave`: every `interval`
  seconds while an engine has work or the loads just moved, every `idle_interval` otherwise.
- It rewrites `{rs}:lb` (and its own `{rs}:coordinator` hash) when the loads moved, and at least
  every `refresh_interval` seconds; the same transaction sets `{rs}:wave` to W + 1 when wave W is
  complete (rules in `coordinator.rules`).
- An engine found dead (its heartbeat gone: `DeathWatch`) is marked state=dead (the hash is kept
  `dead_record_ttl` seconds for inspection), removed from `{rs}:engines` and its request stream is
  deleted (and its prefix-cache index `rs:engine:{id}:blocks`), by two Lua scripts, one per hash-tag slot (a
  cluster runs no script across slots): the first checks the lock and removes the id from `{rs}:engines`, the
  second checks that the engine has not come back and marks it. An engine that came back in between is back
  in `{rs}:engines` at its next heartbeat; a coordinator that lost the lock in between marks dead only an engine
  whose heartbeat is gone, as the new one would.
  Its requests are NOT re-sent from here: clients re-place those that had not started (they know
  which) and fail the others with engine_gone; re-sending here as well would run them twice.
- Client ids whose heartbeat has expired are removed from `{rs}:clients` every `client_sweep_interval`.
- Redis errors are logged and retried at the next tick; they never stop the coordinator. Nor does
  anything else: an unexpected error in one step is logged (rate-limited, with its traceback) and the
  next step runs; only `stop` ends `run`.
- What it reads is validated (`broker.control_state`): bad members of `{rs}:engines` / `{rs}:clients` and
  bad engine hashes are skipped. A `{rs}:wave` that is not a wave number (or not a string) is logged and
  overwritten with the coordinator's own count at the next write; `{rs}:coordinator` is replaced as a
  whole (DEL + HSET), so a key of the wrong type there or in `{rs}:lb` is repaired by the next write.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis
from redis.client import Pipeline

from broker.control_state import is_wrong_type, parse_int, read_members, utf8, warn_bad
from broker.keys import RedisKeys
from broker.load_balance import write_lb_snapshot
from broker.log_limits import warn_every
from broker.registry import EngineRegistry, encode_fields
from coordinator.leader_lock import LeaderLock
from coordinator.rules import DeathWatch, EngineReport, WaveTracker, build_snapshot, same_loads
from protocol.engine_load import EngineLoad

logger = logging.getLogger(__name__)

_FORGET_ENGINE = """
-- KEYS: lock, engines set (the control slot); ARGV: lock token, engine id
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
redis.call('SREM', KEYS[2], ARGV[2])
return 0
"""

_MARK_DEAD = """
-- KEYS: engine hash, engine alive key, request stream, prefix-cache index (the engine's slot)
-- ARGV: incarnation, now, dead record ttl
if redis.call('HGET', KEYS[1], 'incarnation') ~= ARGV[1] then return -2 end
if redis.call('GET', KEYS[2]) == ARGV[1] then return -2 end
local entries = redis.call('XLEN', KEYS[3])
redis.call('HSET', KEYS[1], 'state', 'dead', 'dead_at', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('DEL', KEYS[3], KEYS[4])
return entries
"""

_FORGET_CLIENT = """
-- KEYS: client alive key, clients set; ARGV: client id
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.call('SREM', KEYS[2], ARGV[1]) end
return 0
"""


@dataclass
class CoordinatorConfig:
    """Timings in seconds; see the module rules."""

    interval: float = 0.1
    idle_interval: float = 0.5
    refresh_interval: float = 1.0
    lock_ttl: float = 3.0
    standby_poll: float = 0.5
    death_confirm: float = 1.0
    dead_record_ttl: int = 600
    client_sweep_interval: float = 5.0
    lockstep: bool = False

    def __post_init__(self) -> None:
        for name in ("interval", "idle_interval", "refresh_interval", "lock_ttl", "standby_poll"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if max(self.interval, self.idle_interval) > self.lock_ttl / 3:
            raise ValueError(f"lock_ttl {self.lock_ttl}s is too short: the lock is renewed once per tick, "
                             f"so it must be at least 3 x idle_interval ({self.idle_interval}s)")


def default_coordinator_id() -> str:
    host = socket.gethostname().replace(":", "_").replace(" ", "_") or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Coordinator:
    """One coordinator process's logic; `run(stop)` until `stop` is set. See the module rules."""

    def __init__(self, redis_client: redis.Redis, keys: RedisKeys, config: CoordinatorConfig | None = None,
                 coordinator_id: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.redis = redis_client
        self.keys = keys
        self.config = config or CoordinatorConfig()
        self.id = coordinator_id or default_coordinator_id()
        self._clock = clock
        self.lock = LeaderLock(redis_client, keys.coordinator_lock(), self.id, self.config.lock_ttl, clock)
        self.registry = EngineRegistry(redis_client, keys)
        self._forget_engine = redis_client.register_script(_FORGET_ENGINE)
        self._mark_dead = redis_client.register_script(_MARK_DEAD)
        self._forget_client = redis_client.register_script(_FORGET_CLIENT)
        self.active_since: float | None = None
        self.waves = WaveTracker()
        self.deaths = DeathWatch(self.config.death_confirm)
        self._loads: dict[str, EngineLoad] = {}
        self._last_write = self._last_move = self._next_client_sweep = float("-inf")
        self._failing = False
        self._wave_bad = False

    @property
    def active(self) -> bool:
        return self.active_since is not None and self.lock.held

    def run(self, stop: threading.Event) -> None:
        logger.info("coordinator %s started; active once it holds %s", self.id, self.keys.coordinator_lock())
        try:
            while not stop.wait(self.step()):
                pass
        finally:
            self.resign()

    def step(self) -> float:
        """Take over if the lock is free, else tick if active; return the seconds to the next step."""
        try:
            if not self.lock.held:
                if self.active_since is not None:
                    self._step_down("its lock expired or was taken")
                if not self.lock.acquire():
                    return self.config.standby_poll
                self._take_over()
            wait = self._tick()
        except redis.RedisError as e:
            (logger.debug if self._failing else logger.warning)("coordinator %s: Redis error: %s", self.id, e)
            self._failing = True
            return self.config.standby_poll
        except Exception as e:  # noqa: BLE001 - one bad step must not stop the coordinator
            warn_every(logger, f"step:{type(e).__name__}", 60.0, "coordinator %s: step failed (%s: %s); "
                       "retrying", self.id, type(e).__name__, e, exc_info=e)
            return self.config.standby_poll
        self._failing = False
        return wait

    def resign(self) -> None:
        """Give the lock up (and clear `{rs}:coordinator`) if held, so a standby takes over at once."""
        if self.active_since is None:
            return
        try:
            self.lock.transaction(lambda p: p.delete(self.keys.coordinator()))
            self.lock.release()
        except redis.RedisError as e:
            logger.warning("coordinator %s: could not release its lock (it expires by itself): %s", self.id, e)
        self.active_since = None
        logger.info("coordinator %s resigned", self.id)

    def _take_over(self) -> None:
        self.active_since = time.time()
        self.waves = WaveTracker(self._read_wave() or 0)
        self.deaths = DeathWatch(self.config.death_confirm)
        self._loads, self._last_write = {}, float("-inf")
        logger.info("coordinator %s is active (wave %d, lockstep %s)", self.id, self.waves.wave,
                    "on" if self.config.lockstep else "off")

    def _step_down(self, why: str) -> None:
        logger.warning("coordinator %s is standby again: %s", self.id, why)
        self.active_since = None

    def _tick(self) -> float:
        now = self._clock()
        reports = [EngineReport.from_registry(info, time.time()) for info in self.registry.all_engines()]
        stored = self._read_wave()
        gone = {r.engine_id for r in self.deaths.check(reports, now) if self._declare_dead(r)}
        live = [r for r in reports if r.live and r.engine_id not in gone]
        self.waves.sync(stored, live)
        advance = self.waves.due(live)
        loads = build_snapshot(live)
        moved = not same_loads(loads, self._loads)
        if moved:
            self._last_move = now
        if advance or moved or self._wave_bad or now - self._last_write >= self.config.refresh_interval:
            if not self._write(loads, advance):
                self._step_down("lost its lock")
                return self.config.standby_poll
        elif self.lock.remaining() < self.config.lock_ttl * 2 / 3 and not self.lock.renew():
            self._step_down("lost its lock")
            return self.config.standby_poll
        if now >= self._next_client_sweep:
            self._next_client_sweep = now + self.config.client_sweep_interval
            self._sweep_clients()
        busy = any(r.busy or r.wave_running for r in live) or now - self._last_move < self.config.refresh_interval
        return self.config.interval if busy else self.config.idle_interval

    def _write(self, loads: dict[str, EngineLoad], advance: bool) -> bool:
        wave = self.waves.wave + 1 if advance else self.waves.wave
        info = {"coordinator_id": self.id, "host": socket.gethostname(), "pid": os.getpid(),
                "active_since": self.active_since, "lockstep": int(self.config.lockstep),
                "lb_written_at": round(time.time(), 3), "wave": wave}

        def write(p: Pipeline) -> None:
            write_lb_snapshot(self.redis, self.keys, loads, pipe=p)
            # starts at 0, so GET {rs}:wave always answers; garbage there is replaced
            p.set(self.keys.wave(), wave, nx=not (advance or self._wave_bad))
            p.delete(self.keys.coordinator())
            p.hset(self.keys.coordinator(), mapping=encode_fields(info))

        if not self.lock.transaction(write):
            return False
        self._loads, self._last_write = loads, self._clock()
        if self._wave_bad:
            logger.info("coordinator %s: rewrote %s as %d", self.id, self.keys.wave(), wave)
            self._wave_bad = False
        if advance:
            self.waves.advanced()
            logger.info("wave %d complete: every engine is idle; %s = %d", wave - 1, self.keys.wave(), wave)
        return True

    def _declare_dead(self, r: EngineReport) -> bool:
        """Run the mark-dead script; True if the engine is now marked dead."""
        k = self.keys
        try:
            result = self._forget_engine(keys=[k.coordinator_lock(), k.engines()], args=[self.id, r.engine_id])
            if result == 0:
                result = self._mark_dead(
                    keys=[k.engine(r.engine_id), k.engine_alive(r.engine_id), k.request_stream(r.engine_id),
                          k.engine_blocks(r.engine_id)],
                    args=[r.incarnation, round(time.time(), 3), self.config.dead_record_ttl])
        except redis.ResponseError as e:  # a key of the wrong type: skip this engine, keep ticking
            warn_bad(f"{k.engine(r.engine_id)}:mark-dead", "coordinator %s: cannot mark engine %s dead: %s",
                     self.id, r.engine_id, e)
            return False
        if result == -1:
            self.lock.renew()  # records that the lock is gone; the next step stands down
            return False
        if result < 0:
            logger.info("engine %s came back or re-registered; not declared dead", r.engine_id)
            return False
        logger.warning("engine %s (%s pid %s) lost its heartbeat: marked dead and removed; its request stream "
                       "(%d entries) deleted. Clients re-place its unstarted requests and fail the others.",
                       r.engine_id, r.host or "?", r.pid or "?", result)
        return True

    def _read_wave(self) -> int | None:
        """`{rs}:wave` as a wave number; None if absent or not one (then `_wave_bad`: the next write fixes it)."""
        try:
            raw = self.redis.get(self.keys.wave())
        except redis.ResponseError as e:
            if not is_wrong_type(e):
                raise
            return self._bad_wave(str(e))
        wave = None if raw is None else parse_int(utf8(raw) or "")
        if raw is not None and wave is None:
            return self._bad_wave(f"{raw[:64]!r} is not a wave number")
        self._wave_bad = False
        return wave

    def _bad_wave(self, problem: str) -> None:
        self._wave_bad = True
        warn_bad(f"{self.keys.wave()}:bad", "coordinator %s: ignoring %s: %s", self.id, self.keys.wave(), problem)

    def _sweep_clients(self) -> None:
        ids = read_members(self.redis, self.keys.clients(), "client")
        if not ids:
            return
        p = self.redis.pipeline(transaction=False)
        for client_id in ids:
            p.exists(self.keys.client_alive(client_id))
        gone = [c for c, alive in zip(ids, p.execute(), strict=True) if not alive]
        removed = sum(int(self._forget_client(keys=[self.keys.client_alive(c), self.keys.clients()], args=[c]))
                      for c in gone)
        if removed:
            logger.info("removed %d client(s) with an expired heartbeat from %s", removed, self.keys.clients())


def run_from_args(args) -> int:
    """`redserve coordinator`: run until SIGTERM/SIGINT, then hand the lock over."""
    from broker.connection import connect, wait_for_redis
    from broker.errors import BrokerUnavailable
    from common.proctitle import set_title

    set_title("redserve-coordinator")
    try:
        wait_for_redis(args.redis_url, timeout=60)
    except BrokerUnavailable as e:
        logger.error("coordinator: %s", e)
        return 1
    config = CoordinatorConfig(lock_ttl=args.lock_ttl, lockstep=args.dp_lockstep)
    coordinator = Coordinator(connect(args.redis_url, client_name="redserve-coordinator"),
                              RedisKeys(args.key_prefix), config, coordinator_id=args.coordinator_id)
    stop = threading.Event()
    _stop_on_signals(stop)
    coordinator.run(stop)
    return 0


def _stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM/SIGINT set `stop` from a thread of their own (sigwait), never from a signal handler.

    A handler that calls `stop.set()` runs in the main thread between two bytecodes, possibly while
    that thread holds the Event's internal lock inside `stop.wait()`: `set()` then waits forever for
    a lock its own thread holds. The coordinator never resigns and lingers until it is SIGKILLed.
    """
    signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)  # before any other thread starts: all inherit it

    def wait() -> None:
        signal.sigwait(signals)
        stop.set()

    threading.Thread(target=wait, name="coordinator-signals", daemon=True).start()
