"""Control state read from Redis is data from outside: the checks every reader applies to it.

Anyone who can write to Redis can leave anything in a control key (`redis-cli SADD {rs}:engines 'a:b'`,
`SET {rs}:lb x`, a hash with `waiting=lots`). Readers use these helpers so that a bad entry is skipped
with one rate-limited warning (`broker.log_limits`) and never raises into a request, the coordinator
or an engine.

Rules:
- Set members (`member_ids`) must be UTF-8 and valid ids (`broker.keys.check_id`); others are skipped.
- A key of the wrong type (WRONGTYPE) reads as missing (`read_members`, `is_wrong_type`). Other Redis
  errors (connection, permissions) still raise: they are outages, not bad data.
- Hash fields (`decode_fields`): names and values must be UTF-8. Fields in `INT_FIELDS` must hold an
  int in [0, 2**63); fields in `NUMBER_FIELDS` a finite number >= 0 (an engine's load figures take
  their types from `protocol.engine_load`); a field that does not is dropped
  (its reader falls back to its default). Fields in `STR_FIELDS` stay strings; any other field becomes
  an int or a finite float when it reads as one, else stays a string. An engine's ``histograms`` (JSON,
  `engine.step_metrics`) is a string here; its reader (`api.metrics`) checks its shape.
- An engine entry (`parse_engine`) needs a `state` that is an `EngineState` and a non-empty
  `incarnation`; a READY one also needs `max_model_len`, `num_kv_blocks` and `block_size` (ints > 0:
  `mark_ready` writes them with the state). Entries without them are skipped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import redis

from broker.keys import EngineState, check_id
from broker.log_limits import BAD_ENTRY_INTERVAL, warn_every
from protocol.engine_load import MAX_COUNT, STATS_INT_FIELDS, STATS_NUMBER_FIELDS

logger = logging.getLogger(__name__)

STR_FIELDS = frozenset({"engine_id", "host", "model", "state", "incarnation", "coordinator_id", "histograms", "role"})
INT_FIELDS = STATS_INT_FIELDS | {
    "pid", "dp_rank", "tp", "num_kv_blocks", "block_size", "max_model_len",
    "generated_tokens", "prompt_tokens", "num_preemptions", "wave", "wave_running", "dp_lockstep", "dummy_steps",
    "lockstep", "prefix_cache_queries", "prefix_cache_hits",
}
NUMBER_FIELDS = STATS_NUMBER_FIELDS | {
    "heartbeat_ttl", "started_at", "ready_at", "prefix_cache_hit_rate", "dead_at",
    "active_since", "lb_written_at",
}
READY_FIELDS = ("max_model_len", "num_kv_blocks", "block_size")
_STATES = frozenset(s.value for s in EngineState)


def warn_bad(key: str, msg: str, *args: object) -> None:
    """The one rate-limited warning about a bad entry (`key` names the entry and the problem)."""
    warn_every(logger, key, BAD_ENTRY_INTERVAL, msg, *args)


def is_wrong_type(error: object) -> bool:
    """True for Redis's WRONGTYPE reply (a key holding another type than the command needs)."""
    return isinstance(error, redis.ResponseError) and str(error).startswith("WRONGTYPE")


def utf8(raw: bytes | None) -> str | None:
    """`raw` as text, or None if it is missing or not UTF-8."""
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def member_ids(members: Iterable[bytes], kind: str, where: str) -> list[str]:
    """The members of set `where` that are valid `kind` ids, sorted; the others are skipped and logged."""
    ids = []
    for raw in members:
        text = utf8(raw)
        try:
            ids.append(check_id(kind, text))
        except ValueError as e:
            warn_bad(f"{where}:member:{raw!r}", "ignoring member %r of %s: %s", raw, where, e)
    return sorted(ids)


def read_members(r: redis.Redis, key: str, kind: str) -> list[str]:
    """SMEMBERS `key` as valid `kind` ids; a key of the wrong type reads as an empty set (logged)."""
    try:
        members = r.smembers(key)
    except redis.ResponseError as e:
        if not is_wrong_type(e):
            raise
        warn_bad(f"{key}:wrongtype", "ignoring %s: %s", key, e)
        return []
    return member_ids(members, kind, key)


def parse_int(text: str) -> int | None:
    """An int in [0, 2**63) or None."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 <= value < MAX_COUNT else None


def parse_number(text: str) -> int | float | None:
    """A finite number >= 0 (an int when it reads as one) or None."""
    value = parse_int(text)
    if value is not None:
        return value
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def decode_fields(raw: Mapping[bytes, bytes], where: str = "a hash") -> dict[str, Any]:
    """A HGETALL reply as typed values (see the module rules); bad fields are dropped and logged."""
    out: dict[str, Any] = {}
    for raw_name, raw_value in raw.items():
        name, text = utf8(raw_name), utf8(raw_value)
        if name is None or text is None:
            warn_bad(f"{where}:{raw_name!r}:utf8", "ignoring field %r of %s: not UTF-8", raw_name, where)
            continue
        value = _typed(name, text)
        if value is None:
            kind = "an int in [0, 2**63)" if name in INT_FIELDS else "a finite number >= 0"
            warn_bad(f"{where}:{name}:type", "ignoring field %r of %s: %r is not %s", name, where, text, kind)
            continue
        out[name] = value
    return out


def _typed(name: str, text: str) -> Any:
    if name in STR_FIELDS:
        return text
    if name in INT_FIELDS:
        return parse_int(text)
    if name in NUMBER_FIELDS:
        return parse_number(text)
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return text
    return number if math.isfinite(number) else text


def parse_engine(engine_id: str, raw: Any, alive: Any, where: str) -> dict[str, Any] | None:
    """One engine entry from its HGETALL and heartbeat GET replies (either may be an error reply).

    Returns the decoded hash with `engine_id` and `alive` added, or None when there is no valid entry.
    """
    if isinstance(raw, Exception):
        if not is_wrong_type(raw):
            raise raw
        warn_bad(f"{where}:wrongtype", "ignoring engine %s: %s: %s", engine_id, where, raw)
        return None
    if not raw:
        return None
    info = decode_fields(raw, where)
    problem = _engine_problem(info)
    if problem:
        warn_bad(f"{where}:{problem}", "ignoring engine %s (%s): %s", engine_id, where, problem)
        return None
    if isinstance(alive, Exception) and not is_wrong_type(alive):
        raise alive
    info["engine_id"] = engine_id
    info["alive"] = alive == info["incarnation"].encode()
    return info


def _engine_problem(info: Mapping[str, Any]) -> str | None:
    if info.get("state") not in _STATES:
        return f"state {info.get('state')!r} is not one of {sorted(_STATES)}"
    if not info.get("incarnation"):
        return "no incarnation"
    if info["state"] == EngineState.READY.value:
        missing = [f for f in READY_FIELDS if not isinstance(info.get(f), int) or info[f] <= 0]
        if missing:
            return f"ready without a valid {', '.join(missing)}"
    return None
