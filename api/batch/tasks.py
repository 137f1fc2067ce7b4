"""The Celery app of batch jobs and its one task, `run_chunk`.

Rules:
- Broker and result backend are the stack's Redis (its redis://, rediss:// or unix:// URL, translated for
  Celery by `api.batch.celery_redis`; on a cluster, the primary that owns the Celery keys' slot now). Every Celery
  key lives under ``RedisKeys.celery()`` (``{rs}:celery:``, kombu's ``global_keyprefix``), the queue is `QUEUE`, so
  Celery shares a Redis database with the stack without touching its keys. Messages and results
  are JSON (never pickle): a task message is only ``(batch_id, chunk)``; the items stay in Redis.
- Reliability: ``acks_late`` + ``reject_on_worker_lost``: a task is acknowledged when it has finished;
  a pool process killed mid-task requeues its chunk at once; a whole worker killed (or its machine
  lost) leaves the message unacknowledged, and kombu delivers it again `visibility_timeout` seconds
  after it was taken (checked every `restore_interval` s). The visibility timeout should exceed the
  longest chunk run (its items run at once, each bounded by ``request_timeout + retry_for``): a chunk
  still running when it expires is delivered again, which is harmless (item claims, `api.batch.chunk`)
  but holds a worker slot while the copy waits.
- Redis errors (and broker-client errors) retry the task with backoff; items already done are skipped.
- Under that, every worker process runs a `BatchSweeper` (one sweeps at a time): a batch with no
  progress for longer than the visibility timeout, that nobody works on while the queue is empty, gets
  its unfinished chunks queued again (kombu can lose a message taken by a worker killed at the wrong
  moment; see `api.batch.sweeper`).
- Per-process state (`WorkerContext`: ApiState with its BrokerClient and tokenizer, BatchStore) is
  built after fork, in a thread started at ``worker_process_init`` (or by the first task, whichever
  comes first), and stopped at ``worker_process_shutdown``. Process titles are ``redserve-batch``.
- `configure(settings)` must run before tasks are sent or run: ``redserve batch`` does it; a plain
  ``celery -A api.batch.tasks worker`` takes the settings from the environment (`BatchSettings.from_env`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery, signals

from api.batch.celery_redis import RETRY_SETTINGS, celery_redis_settings, celery_transport_options
from api.batch.chunk import run_chunk
from api.batch.runner import ItemRunner
from api.batch.store import BatchStore
from api.batch.sweeper import BatchSweeper
from api.config import ApiConfig
from api.log_safety import printable
from api.state import ApiState
from broker.connection import connect
from broker.errors import BrokerError, BrokerUnavailable
from broker.keys import RedisKeys
from common.proctitle import set_title

logger = logging.getLogger(__name__)

TITLE = "redserve-batch"
QUEUE = "batch"
TASK_NAME = "redserve.batch.run_chunk"

app = Celery("redserve.batch", set_as_current=False)


@dataclass
class BatchSettings:
    """Where batch jobs run and how; checked once (ValueError says what to fix).

    `model` (a model directory: its tokenizer and chat template) is needed to run tasks, not to
    submit them. `served_model_names` must match the API's, so that a batch body's "model" means
    the same as over HTTP.
    """

    redis_url: str
    key_prefix: str = "rs"
    model: str | None = None
    served_model_names: list[str] = field(default_factory=list)
    visibility_timeout: float = 1200.0
    request_timeout: float = 600.0
    retry_for: float = 300.0
    max_queued_requests: int = 1024

    def __post_init__(self) -> None:
        if not self.redis_url:
            raise ValueError("no Redis URL: pass --redis-url, set REDSERVE_REDIS_URL, or run `redserve serve`")
        RedisKeys(self.key_prefix)
        celery_redis_settings(self.redis_url)  # a URL Celery cannot use fails here, with the reason
        if self.visibility_timeout < 1:
            raise ValueError("--visibility-timeout must be at least 1 second")
        if self.request_timeout <= 0 or self.retry_for < 0:
            raise ValueError("--request-timeout must be positive and --retry-for not negative")

    @property
    def keys(self) -> RedisKeys:
        return RedisKeys(self.key_prefix)

    @property
    def restore_interval(self) -> float:
        """How often a worker looks for messages to deliver again (a tenth of the visibility timeout)."""
        return max(1.0, min(10.0, self.visibility_timeout / 10))

    @property
    def queue_key(self) -> str:
        """The Redis list of the Celery queue."""
        return self.keys.celery() + QUEUE

    def api_config(self) -> ApiConfig:
        """The `ApiConfig` of a worker's `ApiState` (ValueError without a valid model directory)."""
        if not self.model:
            raise ValueError("a batch worker needs the model directory: pass --model or set REDSERVE_MODEL")
        return ApiConfig(model=self.model, redis_url=self.redis_url,
                         served_model_names=list(self.served_model_names), key_prefix=self.key_prefix,
                         max_queued_requests=self.max_queued_requests, request_timeout=self.request_timeout)

    @classmethod
    def from_env(cls) -> BatchSettings:
        env = os.environ
        names = env.get("REDSERVE_SERVED_MODEL_NAME", "").split()
        return cls(redis_url=env.get("REDSERVE_REDIS_URL", ""), key_prefix=env.get("REDSERVE_KEY_PREFIX", "rs"),
                   model=env.get("REDSERVE_MODEL"), served_model_names=names,
                   visibility_timeout=float(env.get("REDSERVE_BATCH_VISIBILITY_TIMEOUT", 1200)))


_settings: BatchSettings | None = None


def configure(settings: BatchSettings) -> Celery:
    """Point the Celery app at `settings` (call before sending or running tasks); the app."""
    global _settings
    _settings = settings
    if settings.visibility_timeout <= settings.request_timeout + settings.retry_for:
        logger.warning("visibility timeout %.0fs <= request timeout + retry time (%.0fs): long chunks may be "
                       "delivered twice (harmless, but wasteful)", settings.visibility_timeout,
                       settings.request_timeout + settings.retry_for)
    prefix = settings.keys.celery()
    topology = celery_transport_options(settings.redis_url, route_key=prefix)  # a sentinel or cluster URL
    app.conf.update(
        **{"broker_transport": None, **celery_redis_settings(settings.redis_url, route_key=prefix)},
        broker_transport_options={"global_keyprefix": prefix, "visibility_timeout": settings.visibility_timeout,
                                  "unacked_restore_interval": settings.restore_interval,
                                  "unacked_restore_throttle": 1, **topology},
        result_backend_transport_options={"global_keyprefix": prefix, **topology},
        broker_connection_retry_on_startup=True,
        **RETRY_SETTINGS,
        task_serializer="json", result_serializer="json", accept_content=["json"],
        task_default_queue=QUEUE,
        task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
        result_expires=24 * 3600,
    )
    return app


def settings() -> BatchSettings:
    """The configured settings (from the environment if `configure` was never called)."""
    if _settings is None:
        configure(BatchSettings.from_env())
    return _settings


class WorkerContext:
    """One worker process's ApiState (broker client, tokenizer), item runner and batch store."""

    def __init__(self, config: BatchSettings) -> None:
        self.pid = os.getpid()
        self.config = config
        self.keys = config.keys
        self.state = ApiState(config.api_config())
        self.runner = ItemRunner(self.state, config.retry_for)
        self.store = BatchStore(connect(config.redis_url, client_name=f"redserve-batch-{self.pid}"), self.keys)
        self.sweeper: BatchSweeper | None = None

    @property
    def owner(self) -> str:
        """The claim holder id: this process's broker client id (its heartbeat says it is alive)."""
        return self.state.client.client_id

    def start(self, timeout: float = 15.0) -> WorkerContext:
        """Start the broker client and wait until its heartbeat is in Redis (claims rely on it)."""
        self.state.start()
        deadline = time.monotonic() + timeout
        alive = self.keys.client_alive(self.owner)
        while not (self.state.client.wait_subscribed(0.1) and self.store.redis.exists(alive)):
            if time.monotonic() > deadline:
                raise BrokerUnavailable(f"the broker client did not come up within {timeout:.0f}s")
            time.sleep(0.05)
        config = self.config
        self.sweeper = BatchSweeper(self.store, enqueue, config.queue_key, self.owner, config.restore_interval,
                                    stall_after=config.visibility_timeout + 2 * config.restore_interval).start()
        return self

    def stop(self) -> None:
        if self.sweeper is not None:
            self.sweeper.stop()
        self.state.stop()
        self.store.redis.close()


_context: WorkerContext | None = None
_context_lock = threading.Lock()


def worker_context() -> WorkerContext:
    """This process's started `WorkerContext` (built on first use, again after a fork)."""
    global _context
    with _context_lock:
        if _context is None or _context.pid != os.getpid():
            context = WorkerContext(settings())
            try:
                context.start()
            except BaseException:
                context.stop()
                raise
            _context = context
        return _context


@signals.worker_process_init.connect
def _on_process_init(**_: Any) -> None:
    # Celery kills a pool process that is not up within worker_proc_alive_timeout (4 s): warm up in the
    # background (tokenizer, Redis subscription); the first task waits for it through the context lock.
    set_title(TITLE)
    threading.Thread(target=_warm_up, name="batch-warm-up", daemon=True).start()


def _warm_up() -> None:
    try:
        worker_context()
    except Exception:  # noqa: BLE001 - the first task builds it again (and fails visibly) if this did not
        logger.exception("batch worker process %d: could not start its broker client yet", os.getpid())


@signals.worker_process_shutdown.connect
def _on_process_shutdown(**_: Any) -> None:
    with _context_lock:
        if _context is not None and _context.pid == os.getpid():
            _context.stop()


@signals.worker_ready.connect
def _on_worker_ready(**_: Any) -> None:
    set_title(TITLE)


@app.task(name=TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True,
          autoretry_for=(redis.RedisError, BrokerError), retry_backoff=2, retry_backoff_max=60, max_retries=30)
def run_chunk_task(self: Any, batch_id: str, chunk: int) -> dict[str, Any]:
    """Settle every item of one chunk (see `api.batch.chunk.run_chunk`); a summary of what it did."""
    ctx = worker_context()
    summary = run_chunk(ctx.store, ctx.runner, ctx.owner, batch_id, chunk)
    logger.info("batch %s chunk %d: %d recorded, %d already done%s", printable(batch_id), chunk, summary.recorded,
                summary.skipped, " (the batch is gone)" if summary.gone else "")
    return summary.to_dict()


def enqueue(batch_id: str, chunks: Iterable[int]) -> None:
    """Send one `run_chunk` task per chunk of a stored batch."""
    with app.producer_or_acquire() as producer:
        for chunk in chunks:
            run_chunk_task.apply_async((batch_id, chunk), queue=QUEUE, producer=producer)


@app.on_configure.connect
def _configure_from_env(**_: Any) -> None:
    """``celery -A api.batch.tasks ...`` never calls `configure`: take the settings from the environment."""
    if _settings is None and os.environ.get("REDSERVE_REDIS_URL"):
        configure(BatchSettings.from_env())
