"""Rate-limited warnings: one log line per key per interval, for things met again on every read.

Rules:
- `warn_every(logger, key, seconds, msg, *args)` logs `msg % args` at WARNING the first time `key` is
  seen, then at most once every `seconds` for that key; each line says how many like it were held
  back since the previous one. Keys are strings naming what is wrong and where (the Redis key, the
  field), so two different bad entries each get their line.
- It returns True when it logged. It is thread-safe and never raises.
- The table of keys is bounded (`MAX_KEYS`): a flood of distinct bad entries cannot grow memory;
  past the bound, expired keys are dropped first, then the whole table.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

BAD_ENTRY_INTERVAL = 60.0  # seconds between two lines about the same bad entry in Redis
MAX_KEYS = 4096


@dataclass(slots=True)
class _Seen:
    until: float
    suppressed: int = 0


_clock = time.monotonic  # replaced in tests
_seen: dict[tuple[str, str], _Seen] = {}
_lock = threading.Lock()


def warn_every(logger: logging.Logger, key: str, seconds: float, msg: str, *args: object,
               exc_info: BaseException | bool | None = None) -> bool:
    """Log a warning unless the same `key` was logged less than `seconds` ago; True if logged."""
    now = _clock()
    slot = (logger.name, key)
    with _lock:
        seen = _seen.get(slot)
        if seen is not None and now < seen.until:
            seen.suppressed += 1
            return False
        suppressed = seen.suppressed if seen is not None else 0
        if len(_seen) >= MAX_KEYS:
            _prune(now)
        _seen[slot] = _Seen(now + seconds)
    if suppressed:
        msg, args = f"{msg} (%d more like this since the last such line)", (*args, suppressed)
    logger.warning(msg, *args, exc_info=exc_info)
    return True


def reset() -> None:
    """Forget every key (tests)."""
    with _lock:
        _seen.clear()


def _prune(now: float) -> None:
    for slot in [s for s, seen in _seen.items() if seen.until <= now]:
        del _seen[slot]
    if len(_seen) >= MAX_KEYS:
        _seen.clear()
