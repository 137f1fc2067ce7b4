"""Queues the chunks of stalled batches again: the safety net under Celery's own redelivery.

Why: kombu's Redis transport takes a message off the queue (BRPOP) before it records it as
unacknowledged, so a worker killed in between takes the message with it, and no visibility-timeout
redelivery ever comes for that chunk.

Rules:
- Every `interval` seconds at most one process of the deployment sweeps: the one that wins the
  ``SET NX PX`` lock ``{rs}:batches:sweeper`` (it expires after `interval`, so it also spaces sweeps out).
- A batch in ``{rs}:batches`` is stalled when all of these hold: no result was recorded for `stall_after`
  seconds (the visibility timeout: Celery's redelivery had its chance), no live worker holds one of its
  items, and the Celery queue is empty (so its chunks are not just waiting their turn). Its incomplete
  chunks are queued again and its progress_at is reset, so the next try comes `stall_after` later.
- Chunk runs are idempotent (`api.batch.chunk`): a chunk delivered twice costs a skip, never a second
  generation. Batches that completed or expired leave ``{rs}:batches``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from api.batch.store import BatchStore
from api.log_safety import printable

logger = logging.getLogger(__name__)

Enqueue = Callable[[str, Iterable[int]], None]


class BatchSweeper:
    """See the module rules; `sweep_once` is one pass, `start` runs passes in a daemon thread."""

    def __init__(self, store: BatchStore, enqueue: Enqueue, queue_key: str, owner: str, interval: float,
                 stall_after: float) -> None:
        self.store = store
        self.enqueue = enqueue
        self.queue_key = queue_key
        self.owner = owner
        self.interval = interval
        self.stall_after = stall_after
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sweep_once(self, now: float | None = None) -> dict[str, list[int]]:
        """One pass if this process wins the lock; the chunks queued again, by batch id."""
        redis = self.store.redis
        if not redis.set(self.store.keys.batch_sweeper_lock(), self.owner, nx=True, px=int(self.interval * 1000)):
            return {}
        now = time.time() if now is None else now
        requeued: dict[str, list[int]] = {}
        for batch_id in self.store.active_batches():
            info = self.store.info(batch_id)
            if info is None or info.status == "completed":
                self.store.forget(batch_id)
                continue
            if now - info.progress_at < self.stall_after or self.store.has_live_claim(batch_id):
                continue
            if redis.llen(self.queue_key) > 0:
                break  # chunks may be waiting in the queue: not stalled, only slow
            chunks = self.store.incomplete_chunks(info)
            self.store.mark_progress(batch_id, now)
            self.enqueue(batch_id, chunks)
            requeued[batch_id] = chunks
            logger.warning("batch %s: no progress for %.0fs and nobody working on it: queued chunks %s again",
                           printable(batch_id), now - info.progress_at, chunks)
        return requeued

    def start(self) -> BatchSweeper:
        self._thread = threading.Thread(target=self._run, name="batch-sweeper", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sweep_once()
            except Exception:  # noqa: BLE001 - a Redis outage must not end the sweeps
                logger.exception("batch sweep failed; trying again in %.0fs", self.interval)
