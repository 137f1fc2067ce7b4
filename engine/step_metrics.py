"""Engine-side metric histograms: per-sequence phase times and tokens per step, as vLLM's.

The engine keeps them as cumulative histograms and writes them with its stats to its Redis hash
(field ``histograms``, one JSON object); the API's `/metrics` exposes them per engine at scrape
time (`api.metrics.EngineStatsCollector`). Carrying the cumulative buckets rather than per-request
timings on the outputs means no wire type changes, nothing lost when a client is gone, and a scrape
of any API worker sees the same numbers.

Rules:
- One observation per sequence and phase (a request with n > 1 counts n times), when the phase ends;
  an aborted sequence is forgotten, so the phases it had not ended are not observed.
- Phases (monotonic clock of the engine process, so no skew with the API's clock): queue = queued ->
  first scheduled; prefill = first scheduled -> first token; decode = first token -> finished;
  inference = first scheduled -> finished. A preempted sequence keeps its first times.
- ``iteration_tokens_total`` gets one observation per step: the tokens scheduled in it.
- `wire()` gives ``{name: {"le": [bounds], "counts": [cumulative counts, +Inf last], "sum": s}}``.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PHASES = ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
          "request_inference_time_seconds")
ITERATION_TOKENS = "iteration_tokens_total"


@dataclass
class CumulativeHistogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, +Inf last
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def wire(self) -> dict:
        cumulative, running = [], 0
        for count in self.counts:
            running += count
            cumulative.append(running)
        return {"le": list(self.bounds), "counts": cumulative, "sum": round(self.total, 6)}


@dataclass
class _Times:
    queued: float
    scheduled: float | None = None
    first_token: float | None = None


class StepMetrics:
    """The engine's histograms; `EngineCore` calls the ``on_*`` hooks (see the module rules)."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._times: dict[str, _Times] = {}
        self.histograms = {name: CumulativeHistogram(PHASE_BUCKETS) for name in PHASES}
        self.histograms[ITERATION_TOKENS] = CumulativeHistogram(ITERATION_TOKEN_BUCKETS)

    def on_queued(self, seq_ids: Iterable[str]) -> None:
        now = self._clock()
        for seq_id in seq_ids:
            self._times[seq_id] = _Times(now)

    def on_scheduled(self, num_scheduled_tokens: Mapping[str, int]) -> None:
        if not num_scheduled_tokens:
            return
        now = self._clock()
        self.histograms[ITERATION_TOKENS].observe(sum(num_scheduled_tokens.values()))
        for seq_id in num_scheduled_tokens:
            times = self._times.get(seq_id)
            if times is not None and times.scheduled is None:
                times.scheduled = now
                self.histograms["request_queue_time_seconds"].observe(now - times.queued)

    def on_token(self, seq_id: str, finished: bool) -> None:
        times = self._times.get(seq_id)
        if times is None or times.scheduled is None or (times.first_token is not None and not finished):
            return
        now = self._clock()
        if times.first_token is None:
            times.first_token = now
            self.histograms["request_prefill_time_seconds"].observe(now - times.scheduled)
        if finished:
            del self._times[seq_id]
            self.histograms["request_decode_time_seconds"].observe(now - times.first_token)
            self.histograms["request_inference_time_seconds"].observe(now - times.scheduled)

    def forget(self, seq_ids: Iterable[str]) -> None:
        for seq_id in seq_ids:
            self._times.pop(seq_id, None)

    def __len__(self) -> int:
        """Sequences being timed (queued or running)."""
        return len(self._times)

    def wire(self) -> dict[str, dict]:
        return {name: h.wire() for name, h in self.histograms.items()}
