"""Data-parallel waves on the engine side (vLLM's START_DP_WAVE), and lockstep dummy steps.

Rules:
- Only the coordinator writes the counter `{rs}:wave`; `{rs}:wave` = W means every wave below W is
  complete. An engine is *in* wave `wave` (`running`) from the moment it gets work, or a
  StartWave for that wave, until it reads `{rs}:wave` > `wave`.
- An engine that gets work while it is not in a running wave joins wave max(its own, `{rs}:wave`)
  and tells every other registered engine: StartWave(wave, exclude_engine=itself), XADDed with
  NOMKSTREAM (a departed engine's stream is not re-created). The server sends it from its output
  thread right after the stats that show this engine busy, so the coordinator never sees the
  others in the wave while this one still looks idle (it would close the wave at once).
- A busy engine that reads `{rs}:wave` ahead of its wave (the coordinator closed the wave just as
  this engine's new work arrived) moves to the new wave and starts it for the others the same way.
- While in a running wave, the engine reads `{rs}:wave` every `poll_interval` seconds (one GET);
  idle and behind it, it leaves the wave (running = False). The server reads it on a thread of its own
  (`start_polling`: "engine-wave") and the busy loop takes the latest value read, so no step waits on a
  Redis round trip: on the busy loop, at one stream of SmolLM2 on a loaded 2-core CPU, those reads were 3.2% of
  its time (py-spy, 6 Dec 2026; a read every 0.1 s took ~3 ms while the kernels' threads held both cores).
  Without `start_polling` (tests), `update` reads it itself. Joining a wave (idle -> busy outside one) still
  reads it on the busy loop: once per burst of work, not once per step.
- StartWave(w): w > wave -> join wave w; w == wave -> running; w < wave -> stale, ignored.
- Lockstep (`--dp-lockstep` here, or the `lockstep` field the coordinator writes in
  `{rs}:coordinator`): an idle engine in a running wave runs a dummy step every
  `dummy_step_interval` seconds, so that a model whose layers hold collectives across DP ranks
  (MoE / expert parallelism) would find every rank stepping. The dummy step is an empty schedule
  through the executor: no KV cache is touched; with TP > 1 it is one broadcast to the workers.
  redserve's dense models have no such collectives, so lockstep only costs a little CPU here.
- Redis errors never escape: waves are bookkeeping, serving goes on without them (logged once).
  A read blocks the busy loop for up to the client's timeout, so after a failed read the next one waits
  `RETRY_MIN` s, doubling up to `RETRY_MAX` while Redis stays unreachable (a cut link stalls a step
  at most once per backoff, not every `poll_interval`).
  Nor does garbage: a `{rs}:wave` that is not a wave number (an int in [0, 2**63)) or not a string reads
  as "no news" and a bad member of `{rs}:engines` gets no StartWave (both logged, rate-limited).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import redis

from broker.control_state import is_wrong_type, parse_int, read_members, utf8, warn_bad
from broker.engine_link import STREAM_FIELD
from broker.keys import RedisKeys
from protocol.messages import StartWave, encode
from protocol.step_types import SchedulerOutput

if TYPE_CHECKING:
    from worker.executor import Executor

logger = logging.getLogger(__name__)

IDLE_WAIT = 0.5  # how long an idle engine outside any wave blocks on its input queue
RETRY_MIN, RETRY_MAX = 1.0, 10.0  # seconds between wave reads while Redis fails (see the rules)


class DpWaves:
    """One engine's view of the DP wave; see the module rules. Used from the busy loop only,
    except `notify_others`, which the output thread calls, and the poller `start_polling` starts."""

    def __init__(self, redis_client: redis.Redis, keys: RedisKeys, engine_id: str, *, lockstep: bool = False,
                 poll_interval: float = 0.1, dummy_step_interval: float = 0.02,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._redis = redis_client
        self.keys = keys
        self.engine_id = engine_id
        self.lockstep_forced = lockstep
        self.lockstep = lockstep
        self.poll_interval = poll_interval
        self.dummy_step_interval = dummy_step_interval
        self._clock = clock
        self.wave = 0
        self.running = False
        self.dummy_steps = 0
        self._was_busy = False
        self._changed = False
        self._next_poll = 0.0
        self._failing = False
        self._retry_at = 0.0
        self._retry_wait = 0.0
        self._read_lock = threading.Lock()  # the poller's reads and the busy loop's (joining a wave)
        self._polled: int | None = None  # the poller's latest read not yet taken by `update`
        self._poller: threading.Thread | None = None
        self._stop_polling = threading.Event()

    def load(self) -> None:
        """Read the current wave and the lockstep setting (at startup)."""
        stored = self._read()
        if stored is not None:
            self.wave = max(self.wave, stored)

    def on_start_wave(self, msg: StartWave) -> None:
        if msg.exclude_engine == self.engine_id or msg.wave < self.wave:
            return
        if msg.wave > self.wave or not self.running:
            self.wave, self.running, self._changed = msg.wave, True, True

    def update(self, busy: bool) -> StartWave | None:
        """Call once per busy-loop iteration, after the input is handled; `busy` = has requests.

        Returns the StartWave to send to the other engines (after this engine's stats), if any.
        """
        became_busy = busy and not self._was_busy
        self._was_busy = busy
        if became_busy:
            self._changed = True
            if not self.running:
                stored = self._read()
                self.wave, self.running = max(self.wave, stored or 0), True
                return StartWave(self.wave, self.engine_id)
        if self._poller is not None:
            stored = self._take_polled() if self.running else None
        elif not self.running or self._clock() < self._next_poll:
            return None
        else:
            stored = self._read()
        if stored is None or stored <= self.wave:
            return None
        self.wave, self._changed = stored, True
        if busy:
            return StartWave(self.wave, self.engine_id)
        self.running = False
        return None

    def start_polling(self) -> None:
        """Read `{rs}:wave` every `poll_interval` on a daemon thread while in a running wave (see the rules)."""
        if self._poller is None:
            self._poller = threading.Thread(target=self._poll_loop, name="engine-wave", daemon=True)
            self._poller.start()

    def stop_polling(self) -> None:
        self._stop_polling.set()
        if self._poller is not None:
            self._poller.join(timeout=5)

    def _poll_loop(self) -> None:
        while not self._stop_polling.wait(self.poll_interval):
            if self.running:
                stored = self._read()
                if stored is not None:
                    self._polled = stored

    def _take_polled(self) -> int | None:
        stored, self._polled = self._polled, None
        return stored

    def take_changed(self) -> bool:
        """True once after the wave state changed or the engine became busy: flush stats now."""
        changed, self._changed = self._changed, False
        return changed

    def idle_wait(self) -> float:
        """How long an idle busy loop may block on its input queue."""
        if not self.running:
            return IDLE_WAIT
        return self.dummy_step_interval if self.lockstep else self.poll_interval

    def dummy_step_due(self, busy: bool) -> bool:
        return self.lockstep and self.running and not busy

    def dummy_step(self, executor: Executor) -> None:
        executor.execute_model(SchedulerOutput())
        self.dummy_steps += 1

    def fields(self) -> dict[str, int]:
        """Stats fields for the engine hash."""
        return {"wave": self.wave, "wave_running": int(self.running), "dp_lockstep": int(self.lockstep),
                "dummy_steps": self.dummy_steps}

    def notify_others(self, msg: StartWave) -> int:
        """XADD `msg` to every other registered engine's stream; return how many got it."""
        try:
            others = [e for e in read_members(self._redis, self.keys.engines(), "engine") if e != self.engine_id]
            if not others:
                return 0
            p = self._redis.pipeline(transaction=False)
            payload = {STREAM_FIELD: encode(msg)}
            for engine_id in others:
                p.xadd(self.keys.request_stream(engine_id), payload, nomkstream=True)
            sent = sum(1 for r in p.execute(raise_on_error=False) if isinstance(r, bytes))
        except redis.RedisError as e:
            logger.warning("engine %s: could not start wave %d on the other engines: %s", self.engine_id, msg.wave, e)
            return 0
        logger.debug("engine %s: started wave %d on %d other engine(s)", self.engine_id, msg.wave, sent)
        return sent

    def _read(self) -> int | None:
        """GET the wave counter and the coordinator's lockstep flag; None if Redis failed (or is in backoff)."""
        with self._read_lock:
            return self._read_locked()

    def _read_locked(self) -> int | None:
        self._next_poll = self._clock() + self.poll_interval
        if self._failing and self._clock() < self._retry_at:
            return None
        try:
            p = self._redis.pipeline(transaction=False)
            p.get(self.keys.wave())
            p.hget(self.keys.coordinator(), "lockstep")
            raw_wave, raw_lockstep = p.execute(raise_on_error=False)
            for reply in (raw_wave, raw_lockstep):
                if isinstance(reply, redis.RedisError) and not is_wrong_type(reply):
                    raise reply
        except redis.RedisError as e:
            (logger.debug if self._failing else logger.warning)("engine %s: cannot read the DP wave: %s", self.engine_id, e)
            self._failing = True
            self._retry_wait = min(RETRY_MAX, max(RETRY_MIN, 2 * self._retry_wait))
            self._retry_at = self._clock() + self._retry_wait
            return None
        self._failing, self._retry_wait = False, 0.0
        self.lockstep = self.lockstep_forced or raw_lockstep == b"1"
        if raw_wave is None:
            return 0
        wave = None if isinstance(raw_wave, Exception) else parse_int(utf8(raw_wave) or "")
        if wave is None:
            shown = raw_wave if isinstance(raw_wave, Exception) else raw_wave[:64]
            warn_bad(f"{self.keys.wave()}:engine", "engine %s: ignoring %s: %r is not a wave number",
                     self.engine_id, self.keys.wave(), shown)
        return wave
