"""One engine's load figures (`EngineLoad`): what the engine measures, the coordinator snapshots and the API's
load balancer scores. The one record of them in every tier.

Rules:
- The figures: `waiting` (requests not scheduled yet, held-back n > 1 siblings included), `running`,
  `kv_usage` (share of the KV blocks in use, 0..1), `step` (steps the engine has run) and `ts` (wall-clock
  seconds when the engine measured them). Counters are ints in [0, 2**63); `kv_usage` and `ts` are finite
  numbers >= 0.
- Two wire forms. Tools outside Python read both (`redis-cli`, dashboards), so their names never change:
  - An engine's stats (its hash `rs:engine:{E}`, the `get_stats` utility): `waiting`, `running`, `kv_usage`
    (4 places) and `num_steps` (`stats_fields`), then, after the engine's other stats since it dates them
    all (the prefix index too), `stats_at` to the millisecond (`stats_stamp`). `from_stats` reads them
    leniently: a figure that is not a finite number in [0, 2**63) reads as its default, and a missing
    `stats_at` as `default_ts`. Their types in the hash are `STATS_INT_FIELDS` and `STATS_NUMBER_FIELDS`.
  - An entry of the coordinator's snapshot `{rs}:lb`: compact JSON
    `{"waiting","running","kv_usage","step","ts"}` (`to_json`). `from_json` is strict: it raises ValueError
    on anything that is not such an object (absent fields take their defaults).
- `busy`: anything waiting or running. `same_figures`: equal but for `ts` (a change means the load moved).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

MAX_COUNT = 2**63  # counters are Redis-sized ints: [0, 2**63)
STATS_AT = "stats_at"
STATS_INT_FIELDS = frozenset({"waiting", "running", "num_steps"})
STATS_NUMBER_FIELDS = frozenset({"kv_usage", STATS_AT})


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine's load figures; see the module rules."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    step: int = 0
    ts: float = 0.0

    @property
    def busy(self) -> bool:
        return self.waiting + self.running > 0

    def same_figures(self, other: EngineLoad) -> bool:
        return (self.waiting, self.running, self.kv_usage, self.step) == (
            other.waiting, other.running, other.kv_usage, other.step)

    def stats_fields(self) -> dict[str, int | float]:
        """The figures as the engine's stats begin: waiting, running, kv_usage, num_steps."""
        return {"waiting": self.waiting, "running": self.running, "kv_usage": round(self.kv_usage, 4),
                "num_steps": self.step}

    def stats_stamp(self) -> dict[str, float]:
        """`ts` as the engine's stats carry it: `stats_at`, to the millisecond."""
        return {STATS_AT: round(self.ts, 3)}

    @classmethod
    def from_stats(cls, fields: Mapping[str, Any], default_ts: float = 0.0) -> EngineLoad:
        """Read an engine's stats (e.g. its decoded hash); bad or missing figures take their defaults."""
        return cls(waiting=stats_number(fields, "waiting", int), running=stats_number(fields, "running", int),
                   kv_usage=stats_number(fields, "kv_usage", float, 0.0),
                   step=stats_number(fields, "num_steps", int),
                   ts=stats_number(fields, STATS_AT, float, default_ts))

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> EngineLoad:
        """Parse a `{rs}:lb` entry; ValueError if it is not one (absent fields take their defaults)."""
        try:
            d = json.loads(text)
        except RecursionError:
            raise ValueError("load entry is nested too deeply") from None
        if not isinstance(d, dict):
            raise ValueError("load entry must be a JSON object")
        return cls(waiting=_count(d, "waiting"), running=_count(d, "running"),
                   kv_usage=_number(d, "kv_usage"), step=_count(d, "step"), ts=_number(d, "ts"))


def stats_number(fields: Mapping[str, Any], name: str, kind: type, default: Any = 0) -> Any:
    """`fields[name]` as `kind` if it is a finite number in [0, 2**63), else `default` (lenient: stats)."""
    value = fields.get(name, default)
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value < MAX_COUNT:
        return default
    return kind(value)


def _count(d: Mapping[str, Any], name: str) -> int:
    value = d.get(name, 0)
    if type(value) is not int or not 0 <= value < MAX_COUNT:
        raise ValueError(f"{name} must be an int in [0, 2**63), got {value!r}")
    return value


def _number(d: Mapping[str, Any], name: str) -> float:
    value = d.get(name, 0.0)
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)
