"""The DP coordinator's decisions, as pure logic over what it reads from Redis (no I/O here).

Rules:
- `EngineReport` is one engine as read from its hash and heartbeat: its `load` (`EngineLoad`, read by
  `EngineLoad.from_stats`) and what only the coordinator needs (state, wave, host, pid). It is *live*
  when its heartbeat matches its incarnation and its state is not dead; only live engines count
  anywhere. A counter that is not a finite number >= 0 (garbage in the hash) reads as its default;
  a missing `stats_at` reads as the time of the read.
- Load snapshot (`build_snapshot`): the `load` of each live READY or DRAINING engine (a STARTING
  engine takes no traffic yet), `kv_usage` to 4 places. `ts` is when the engine wrote those
  counters (`stats_at`), so a hung engine's entry goes stale and clients stop trusting it; `step` is
  its step count. `same_loads` compares two snapshots ignoring `ts`: a change means "load moved".
- Waves (`WaveTracker`): `{rs}:wave` = W means waves below W are complete and W is current. Wave W
  has *started* once any live engine is busy, or reports that it is in wave W (or later). It is
  complete, and the counter advances to W + 1, when it has started and no live engine is busy.
  The tracker never goes backwards: it follows the highest of its own count, the stored counter
  and the waves the engines report (so a Redis that restarted empty does not rewind the wave).
- Death (`DeathWatch`): an engine whose heartbeat is missing (or belongs to another incarnation)
  on reads at least `confirm` seconds apart is dead. The delay covers the instant between an
  engine's registration and its first heartbeat, so a starting engine is never taken for dead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from broker.keys import EngineState
from protocol.engine_load import EngineLoad, stats_number

_TRAFFIC_STATES = frozenset({EngineState.READY.value, EngineState.DRAINING.value})


@dataclass(frozen=True, slots=True)
class EngineReport:
    """One registered engine as the coordinator reads it."""

    engine_id: str
    state: str
    incarnation: str
    alive: bool
    load: EngineLoad = field(default_factory=EngineLoad)
    wave: int = 0
    wave_running: bool = False
    host: str = ""
    pid: int = 0

    @property
    def busy(self) -> bool:
        return self.load.busy

    @property
    def live(self) -> bool:
        return self.alive and self.state != EngineState.DEAD.value

    @classmethod
    def from_registry(cls, info: Mapping[str, Any], now: float) -> EngineReport:
        """From `EngineRegistry.get`/`all_engines` output (decoded hash + `alive`) read at wall time `now`."""
        return cls(
            engine_id=str(info["engine_id"]), state=str(info.get("state", "")),
            incarnation=str(info.get("incarnation", "")), alive=bool(info.get("alive")),
            load=EngineLoad.from_stats(info, default_ts=now), wave=stats_number(info, "wave", int),
            wave_running=bool(stats_number(info, "wave_running", int)), host=str(info.get("host", "")),
            pid=stats_number(info, "pid", int))


def build_snapshot(reports: Iterable[EngineReport]) -> dict[str, EngineLoad]:
    """The `{rs}:lb` entries for `reports` (see the module rules)."""
    return {
        r.engine_id: replace(r.load, kv_usage=round(r.load.kv_usage, 4))
        for r in reports
        if r.live and r.state in _TRAFFIC_STATES
    }


def same_loads(a: Mapping[str, EngineLoad], b: Mapping[str, EngineLoad]) -> bool:
    """True if both snapshots hold the same engines with the same counters (`ts` ignored)."""
    return a.keys() == b.keys() and all(a[e].same_figures(b[e]) for e in a)


class WaveTracker:
    """Decides when the wave counter advances; see the module rules.

    Each tick: `sync(stored, reports)`, then `due(reports)`; once the advance is written, `advanced()`.
    """

    def __init__(self, wave: int = 0) -> None:
        self.wave = wave
        self.started = False

    def sync(self, stored_wave: int | None, reports: Iterable[EngineReport]) -> None:
        """Catch up with the stored counter and the engines' waves (never go backwards)."""
        highest = max([self.wave, stored_wave or 0, *(r.wave for r in reports if r.live)])
        if highest > self.wave:
            self.wave = highest
            self.started = False

    def due(self, reports: Iterable[EngineReport]) -> bool:
        """True when wave `self.wave` has started and every live engine is idle."""
        live = [r for r in reports if r.live]
        if any(r.busy or (r.wave_running and r.wave >= self.wave) for r in live):
            self.started = True
        return self.started and not any(r.busy for r in live)

    def advanced(self) -> int:
        """Record that the counter was advanced; return the new current wave."""
        self.wave += 1
        self.started = False
        return self.wave


class DeathWatch:
    """Tells which engines are dead; see the module rules. Times are monotonic seconds."""

    def __init__(self, confirm: float = 1.0) -> None:
        if confirm < 0:
            raise ValueError(f"confirm must be >= 0, got {confirm}")
        self.confirm = confirm
        self._missing_since: dict[tuple[str, str], float] = {}

    def check(self, reports: Iterable[EngineReport], now: float) -> list[EngineReport]:
        """The engines to declare dead now. One stays in the answer until its report shows it
        dead or gone, so a declaration that failed (Redis error) is retried at the next check."""
        dead, seen = [], set()
        for r in reports:
            if r.alive or r.state == EngineState.DEAD.value:
                continue
            key = (r.engine_id, r.incarnation)
            seen.add(key)
            if now - self._missing_since.setdefault(key, now) >= self.confirm:
                dead.append(r)
        self._missing_since = {k: t for k, t in self._missing_since.items() if k in seen}
        return dead
