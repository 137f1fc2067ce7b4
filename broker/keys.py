"""Every Redis key and channel name used by redserve.

Nobody types a key by hand: build names with `RedisKeys`. The prefix (default "rs") lets several
deployments share one Redis. Names carry Redis Cluster hash tags (the part in braces decides the slot), so
that everything one multi-key command, MULTI or Lua script touches lives in one slot: one engine's keys
share its id's tag, the control keys (coordinator, registries of engines and clients, batches) share the
prefix's tag, each client's output channel has its id's tag. The tags change nothing on a single server.
Layout, for prefix "rs" (all inspectable with plain `redis-cli`; quote the braces in a shell):

    rs:req:{E}                 stream   ADD / ABORT / UTILITY / START_WAVE messages for engine E;
                                        consumer group `RedisKeys.consumer_group`. Holds only unread
                                        and in-flight messages (finished requests are XACK+XDEL'd).
    rs:engine:{E}              hash     registration (host, pid, dp_rank, tp, model, state,
                                        incarnation, num_kv_blocks, block_size, max_model_len, ...)
                                        plus live counters (waiting, running, kv_usage, ...)
    rs:engine:{E}:alive        string   heartbeat, value = the engine's incarnation, with a TTL
    rs:engine:{E}:blocks       set      prefix-cache index: the chained block hashes (int64, see
                                        protocol.prefix_hash) the engine's KV cache holds now; at most
                                        num_kv_blocks members; written by the engine (broker.prefix_index),
                                        deleted at (re)registration, deregistration and death, TTL
                                        refreshed by the heartbeat
    rs:engine:{E}:workers      hash     where worker hosts join the engine's remote pipeline stages
                                        (`redserve worker`, worker.remote_stages): address, port, key
                                        (the link's HMAC key), nonce, stages, tp, pp, link_timeout,
                                        hosts (JSON: joined worker hosts);
                                        written at engine start, deleted at its shutdown
    rs:engine:{E}:rdzv:{nonce}:*  string  torch.distributed store of a pipeline spanning hosts
                                        (worker.redis_store; gloo/NCCL rendezvous), 10 min TTL, deleted
                                        at engine shutdown
    rs:engine:{E}:presence:{incarnation}  pub/sub  held by the engine process (broker.engine_presence)
    rs:out:{C}                 pub/sub  EngineOutputs for client C (an API process / Celery worker);
                                        sharded pub/sub (SPUBLISH / SSUBSCRIBE) on a cluster
    {rs}:engines               set      ids of registered engines
    {rs}:routing               hash     cache-aware routing decisions: "{engine}:{reason}" -> count
                                        (reason cache / load), HINCRBY by the API processes
    {rs}:client:C:alive        string   heartbeat of an API process / Celery worker, with a TTL
    {rs}:clients               set      ids of clients that have started
    {rs}:lb                    hash     coordinator load snapshot: engine id -> JSON
                                        {"waiting", "running", "kv_usage", "step", "ts"}
    {rs}:wave                  string   DP wave counter: waves below it are complete (coordinator)
    {rs}:coordinator:lock      string   SET NX PX lock held by the active coordinator (its id)
    {rs}:coordinator           hash     the active coordinator: coordinator_id, host, pid,
                                        active_since, lockstep, lb_written_at
    {rs}:batch:B               hash     batch job state: status, total, completed, failed, chunk_size,
                                        num_chunks, created_at, progress_at, completed_at, expires_at, input_file
    {rs}:batch:B:items         list     the batch's input lines, one per item, in file order
    {rs}:batch:B:results       hash     item index -> its output line (JSON), written once (HSETNX)
    {rs}:batch:B:claims        hash     item index -> client id of the worker generating it now
    {rs}:batches               set      ids of batches in progress
    {rs}:batches:sweeper       string   SET NX PX lock: the batch sweeper that ran last (rate limit)
    {rs}:stack:restarts        hash     `redserve serve`: child name (engine-0, api, ...) -> restarts
                                        since the stack started
    {rs}:celery:*              -        Celery's broker queues and result backend (kombu's
                                        global_keyprefix; queue `batch`); on a cluster, Celery talks to
                                        the node owning this slot only (`api.batch.celery_redis`)

Batches share the control tag because their claim script reads a client's heartbeat and their record
script updates `{rs}:batches`. Ids (engine, client, batch) and the prefix must be non-empty and contain no
':', braces or whitespace, so that no two names can collide (an engine called "x:alive" would alias the
heartbeat of engine "x") and every tag is the id whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

_BAD_ID_CHARS = frozenset(":{}\r\n\t ")


class EngineState(StrEnum):
    """Lifecycle of an engine, stored as the `state` field of its hash.

    starting -> ready -> draining -> (deregistered); dead is set by whoever finds it gone.
    Clients route new requests only to `ready` engines with a live heartbeat; `draining` engines
    finish what they have.
    """

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


def check_id(kind: str, value: str) -> str:
    """Return `value` if it is usable inside a key name, else raise ValueError saying why."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} id must be a non-empty string, got {value!r}")
    if _BAD_ID_CHARS.intersection(value):
        raise ValueError(f"{kind} id {value!r} must not contain ':', braces or whitespace")
    return value


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Builds every key name; see the module docstring for the layout."""

    prefix: str = "rs"
    consumer_group: ClassVar[str] = "engine"

    def __post_init__(self) -> None:
        check_id("prefix", self.prefix)

    @property
    def control_tag(self) -> str:
        """The hash tag of the control keys (coordinator, registries, batches): the prefix in braces."""
        return f"{{{self.prefix}}}"

    def _engine_key(self, engine_id: str, suffix: str = "") -> str:
        return f"{self.prefix}:engine:{{{check_id('engine', engine_id)}}}{suffix}"

    def _control(self, name: str) -> str:
        return f"{self.control_tag}:{name}"

    def request_stream(self, engine_id: str) -> str:
        return f"{self.prefix}:req:{{{check_id('engine', engine_id)}}}"

    def output_channel(self, client_id: str) -> str:
        return f"{self.prefix}:out:{{{check_id('client', client_id)}}}"

    def engine(self, engine_id: str) -> str:
        return self._engine_key(engine_id)

    def engine_alive(self, engine_id: str) -> str:
        return self._engine_key(engine_id, ":alive")

    def engine_presence(self, engine_id: str, incarnation: str) -> str:
        """Pub/sub channel an engine incarnation stays subscribed to while its process lives (`engine_presence`)."""
        return self._engine_key(engine_id, f":presence:{incarnation}")

    def engine_blocks(self, engine_id: str) -> str:
        return self._engine_key(engine_id, ":blocks")

    def engine_workers(self, engine_id: str) -> str:
        return self._engine_key(engine_id, ":workers")

    def engine_rendezvous(self, engine_id: str, nonce: str) -> str:
        """Prefix of the pipeline group's torch.distributed store keys for one engine start (`worker.redis_store`)."""
        return self._engine_key(engine_id, f":rdzv:{check_id('rendezvous', nonce)}:")

    def engine_keys(self, engine_id: str) -> list[str]:
        """The engine's keys that exist outside a pipeline start (all in one slot), for inspection and tests."""
        return [self.request_stream(engine_id), self.engine(engine_id), self.engine_alive(engine_id),
                self.engine_blocks(engine_id), self.engine_workers(engine_id)]

    def engines(self) -> str:
        return self._control("engines")

    def routing(self) -> str:
        return self._control("routing")

    def client_alive(self, client_id: str) -> str:
        return self._control(f"client:{check_id('client', client_id)}:alive")

    def clients(self) -> str:
        return self._control("clients")

    def lb(self) -> str:
        return self._control("lb")

    def wave(self) -> str:
        return self._control("wave")

    def coordinator_lock(self) -> str:
        return self._control("coordinator:lock")

    def coordinator(self) -> str:
        return self._control("coordinator")

    def batch(self, batch_id: str) -> str:
        return self._control(f"batch:{check_id('batch', batch_id)}")

    def batch_items(self, batch_id: str) -> str:
        return self._control(f"batch:{check_id('batch', batch_id)}:items")

    def batch_results(self, batch_id: str) -> str:
        return self._control(f"batch:{check_id('batch', batch_id)}:results")

    def batch_claims(self, batch_id: str) -> str:
        return self._control(f"batch:{check_id('batch', batch_id)}:claims")

    def batches(self) -> str:
        return self._control("batches")

    def batch_sweeper_lock(self) -> str:
        return self._control("batches:sweeper")

    def stack_restarts(self) -> str:
        return self._control("stack:restarts")

    def celery(self) -> str:
        """The global key prefix of Celery's broker and result-backend keys (ends with ':'); it carries the control
        tag, so every Celery key lives in one slot (`api.batch.celery_redis`, cluster mode)."""
        return self._control("celery:")
