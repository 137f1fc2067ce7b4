"""Per-process state of an API worker: broker client, engine registry reader, tokenizer, in-flight limit.

Rules:
- One `ApiState` per process, built after fork (gunicorn loads the app in each worker). The
  `BrokerClient` and the registry's Redis connection are created on first use, so building the
  state never touches Redis; `start()` (gunicorn's post_worker_init) subscribes early and `stop()`
  (worker_exit) fails and ABORTs whatever is still in flight.
- `InFlightLimiter` bounds this process's generation work: one slot per prompt x n (per sequence
  the engines run), taken before any tokenizing; over the limit a request gets 429 with
  Retry-After at once instead of waiting (gunicorn keeps threads beyond the limit for that: see
  `api.server`). `check_engine_backlog` also answers 429 while every READY engine already has
  `max_engine_waiting` requests waiting (their own counters in the registry, as cached by the
  client's engine selector: no Redis round trip per request).
- `max_model_len()` is the smallest max_model_len among READY live engines (the one every engine
  can serve); no such engine -> NoEngineAvailable (503).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

import redis

from api.config import ApiConfig
from api.errors import ApiError
from api.generation_defaults import describe as describe_generation_defaults
from api.generation_defaults import load_generation_defaults
from api.metrics import REQUEST_MIGRATIONS
from api.prompt_bound import PromptCharBound
from api.tokenizer import ModelTokenizer
from broker.client import BrokerClient
from broker.connection import connect
from broker.control_state import decode_fields, warn_bad
from broker.errors import NoEngineAvailable
from broker.keys import EngineState, RedisKeys
from broker.prefix_index import read_routing_counts
from broker.registry import EngineRegistry
from protocol.engine_load import EngineLoad

logger = logging.getLogger(__name__)


def too_busy(reason: str) -> ApiError:
    """The 429 of an overloaded server: retry after a second."""
    return ApiError(429, f"{reason}; retry later", code="rate_limit_exceeded", headers={"Retry-After": "1"})


class InFlightLimiter:
    """Counts this process's requests in flight; `acquire` raises ApiError 429 over the limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._count = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self._count

    def acquire(self, slots: int = 1) -> None:
        with self._lock:
            if self._count + slots > self.limit:
                raise too_busy(f"too many requests in flight on this server ({self._count} of {self.limit} slots "
                               f"taken, this request needs {slots})")
            self._count += slots

    def release(self, slots: int = 1) -> None:
        with self._lock:
            self._count = max(0, self._count - slots)


class ApiState:
    """Everything one API process shares between its request threads; see the module rules."""

    def __init__(self, config: ApiConfig, tokenizer: ModelTokenizer | None = None,
                 client: BrokerClient | None = None) -> None:
        self.config = config
        self.keys = RedisKeys(config.key_prefix)
        self.tokenizer = tokenizer or ModelTokenizer(
            config.model, trust_request_chat_template=config.trust_request_chat_template,
            render_timeout=config.chat_template_timeout)
        self.generation_defaults = load_generation_defaults(
            getattr(self.tokenizer, "model_dir", config.model), config.generation_config)
        logger.info(describe_generation_defaults(self.generation_defaults, config.generation_config))
        self.limiter = InFlightLimiter(config.max_queued_requests)
        self._client = client
        self._registry: EngineRegistry | None = None
        self._prompt_bound: PromptCharBound | None = None
        self._redis: redis.Redis | None = None
        self._lock = threading.Lock()

    def _count_migration(self, reason: str, old_engine: str, new_engine: str) -> None:
        REQUEST_MIGRATIONS.labels(self.config.model_name, reason).inc()

    @property
    def client(self) -> BrokerClient:
        with self._lock:
            if self._client is None:
                self._client = BrokerClient(self.config.redis_url, self.keys,
                                            max_stream_len=self.config.max_engine_backlog,
                                            max_migrations=self.config.max_migrations,
                                            on_migration=self._count_migration)
            return self._client

    @property
    def registry(self) -> EngineRegistry:
        with self._lock:
            if self._registry is None:
                self._redis = connect(self.config.redis_url, retries=1, client_name="redserve-api-registry")
                self._registry = EngineRegistry(self._redis, self.keys)
            return self._registry

    def start(self) -> None:
        self.client.start()

    def stop(self) -> None:
        with self._lock:
            client = self._client
        if client is not None:
            client.stop()

    def ready_engines(self) -> list[dict[str, Any]]:
        return self.client.ready_engines()

    @property
    def prompt_bound(self) -> PromptCharBound:
        """The character bound of over-long prompts, computed from the vocabulary on first use."""
        with self._lock:
            if self._prompt_bound is None:
                self._prompt_bound = PromptCharBound(self.tokenizer.tokenizer)
            return self._prompt_bound

    def check_engine_backlog(self) -> None:
        """ApiError 429 if every READY engine has `max_engine_waiting` requests waiting (none READY: no-op)."""
        waiting = [EngineLoad.from_stats(e).waiting for e in self.ready_engines()]  # unknown: 0 (< limit)
        if waiting and min(waiting) >= self.config.max_engine_waiting:
            raise too_busy(f"the engines are busy ({min(waiting)} requests waiting on the least busy one, limit "
                           f"{self.config.max_engine_waiting})")

    def max_model_len(self) -> int:
        lengths = [int(e["max_model_len"]) for e in self.ready_engines() if isinstance(e.get("max_model_len"), int)]
        if not lengths:
            raise NoEngineAvailable("no engine is ready to serve requests")
        return min(lengths)

    def live_engines(self) -> list[dict[str, Any]]:
        """READY or DRAINING engines with a live heartbeat, read from Redis now (for /metrics)."""
        return self.registry.live_engines((EngineState.READY, EngineState.DRAINING))

    def routing_counts(self) -> dict[str, dict[str, int]]:
        """Cache-aware routing decisions per engine and reason, from Redis now (for /metrics)."""
        _ = self.registry  # connects on first use
        return read_routing_counts(self._redis, self.keys)

    def child_restarts(self) -> dict[str, int]:
        """Restarts of each child of `redserve serve`, from Redis now (for /metrics); {} without a stack."""
        _ = self.registry  # connects on first use
        try:
            raw = self._redis.hgetall(self.keys.stack_restarts())
        except redis.ResponseError as e:  # WRONGTYPE: a stray write; restarts are only a statistic
            warn_bad(f"restarts-type:{self.keys.stack_restarts()}", "%s is unreadable (%s); skipped",
                     self.keys.stack_restarts(), e)
            return {}
        fields = decode_fields(raw, self.keys.stack_restarts())
        return {name: count for name, count in fields.items() if type(count) is int and count >= 0}


def disconnect_probe(sock: socket.socket | None) -> Callable[[], bool]:
    """A cheap check that the HTTP client closed its connection (peer sent FIN or reset).

    Works on the raw socket gunicorn exposes as ``environ["gunicorn.socket"]``; without one (test
    client) it always answers False. The request has been read, so readable data would be a
    pipelined next request (not a close); only an orderly EOF or an error means "gone".
    """
    if sock is None:
        return lambda: False

    def is_disconnected() -> bool:
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    return is_disconnected
