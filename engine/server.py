"""The engine process: an EngineCore served through Redis.

Threads (as vLLM's EngineCoreProc):
1. input thread: XREADGROUP on this engine's request stream (blocking, batched) -> ``input_queue``.
2. busy loop (main thread): drain ``input_queue`` -> ``core.step()`` -> group outputs by client ->
   ``output_queue``. It blocks on the input queue only when there is no work.
3. output thread: one pipeline per step: one PUBLISH per client with all its new tokens, the XACKs
   of finished requests, the stats. Before it, with the stats (~0.1 s) and whenever the engine is idle,
   the prefix-cache changes (``broker.prefix_index``: the set ``rs:engine:{id}:blocks``). Requests
   whose outputs reached no subscriber are aborted.

Data parallelism: ``engine.dp_wave.DpWaves`` keeps this engine's wave (START_DP_WAVE to the others
when it gets work outside a running wave) and runs lockstep dummy steps; the busy loop flushes the
stats as soon as the wave state changes, and the output thread sends StartWave after them.

Roles (``--role``): a ``prefill`` engine gets new requests marked ``handoff`` from the clients and answers each
with its first token once the tier holds the prompt's blocks (``engine.core``); a ``decode`` engine gets the
continuations; ``both`` (the default) does everything. The role is a field of the engine's registry hash.

Lifecycle: register (starting) -> heartbeat -> load the model -> READY. SIGTERM/SIGINT drain: state
DRAINING (clients stop routing here), requests in flight finish, or are aborted with an error after
``drain_timeout``; then deregister and exit 0. A failure inside a step fails every request in
flight with an engine_error, deregisters and exits non-zero.

The busy loop's input queue carries typed items (``engine.input_items``): stream messages, and the
control events of the other threads (client gone, rejoin, drain); ``_handle`` dispatches on them.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from dataclasses import dataclass, field

from broker.connection import connect, wait_for_redis
from broker.engine_link import OutputPublisher, RequestReader
from broker.engine_presence import EnginePresence
from broker.errors import BrokerUnavailable
from broker.keys import EngineState, RedisKeys
from broker.prefix_index import PrefixIndexWriter
from broker.registry import EngineHeartbeat, EngineRegistry
from engine.block_manager import CacheEvents
from engine.core import EngineCore
from engine.dp_wave import IDLE_WAIT, DpWaves
from engine.input_items import ClientGone, Drain, InputItem, Received, Rejoin
from protocol.messages import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    ErrorCode,
    FinishReason,
    RequestOutput,
    StartWave,
    UtilityCall,
    UtilityResult,
)
from worker.config import EngineConfig
from worker.multiproc_executor import WorkerDied

logger = logging.getLogger(__name__)
ROLES = ("both", "prefill", "decode")  # prefill/decode disaggregation (README 'Prefill/decode disaggregation')


@dataclass
class InFlight:
    client_id: str
    message_id: str
    deadline: float | None
    remaining: int


@dataclass
class StepBatch:
    """What the output thread sends for one step."""

    by_client: dict[str, EngineOutputs] = field(default_factory=dict)
    ack_ids: list[str] = field(default_factory=list)
    stats: dict | None = None
    start_wave: StartWave | None = None
    cache_events: CacheEvents | None = None

    def add(self, engine_id: str, client_id: str, output: RequestOutput) -> None:
        self._outputs(engine_id, client_id).outputs.append(output)

    def add_utility(self, engine_id: str, client_id: str, result: UtilityResult) -> None:
        self._outputs(engine_id, client_id).utility_results.append(result)

    def _outputs(self, engine_id: str, client_id: str) -> EngineOutputs:
        if client_id not in self.by_client:
            self.by_client[client_id] = EngineOutputs(engine_id, [], time.time())
        return self.by_client[client_id]

    def __bool__(self) -> bool:
        return bool(self.by_client or self.ack_ids or self.stats or self.cache_events)


class EngineServer:
    def __init__(self, config: EngineConfig, redis_url: str, dp_rank: int = 0, engine_id: str | None = None,
                 key_prefix: str = "rs", heartbeat_ttl: float = 5.0, drain_timeout: float = 30.0,
                 dp_lockstep: bool = False, worker_address: str | None = None, worker_port: int = 0,
                 worker_link_timeout: float = 10.0, role: str = "both"):
        if role not in ROLES:
            raise ValueError(f"unknown engine role {role!r}; use one of {', '.join(ROLES)}")
        if role != "both" and not config.kv_tier_url:
            raise ValueError(f"a {role} engine hands requests over through the KV tier: give it --kv-tier-url")
        self.role = role
        self.config = config
        self.dp_rank = dp_rank
        self.engine_id = engine_id or str(dp_rank)
        self.keys = RedisKeys(key_prefix)
        self.redis_url = redis_url
        self.redis = connect(redis_url, client_name=f"engine-{self.engine_id}")
        self.heartbeat_ttl = heartbeat_ttl
        self.drain_timeout = drain_timeout
        self.registry = EngineRegistry(self.redis, self.keys)
        self.reader = RequestReader(connect(redis_url), self.keys, self.engine_id, consumer=f"engine-{self.engine_id}")
        self.publisher = OutputPublisher(connect(redis_url), self.keys, self.engine_id)
        # SimpleQueue: its put() is reentrant, so the SIGTERM handler (`request_drain`) may call it while the
        # busy loop is inside get(); a queue.Queue there can deadlock on its own mutex (the drain never starts).
        self.input_queue: queue.SimpleQueue[InputItem] = queue.SimpleQueue()
        self.output_queue: queue.Queue = queue.Queue()
        self.in_flight: dict[str, InFlight] = {}
        self.stop_event = threading.Event()
        self.draining_since: float | None = None
        self.core: EngineCore | None = None
        self.waves = DpWaves(self.redis, self.keys, self.engine_id, lockstep=dp_lockstep)
        self._last_stats = 0.0
        self._last_deadline_check = 0.0
        self.incarnation = ""
        self.presence = EnginePresence(redis_url, self.keys, self.engine_id, lambda: self.incarnation)
        self._index_lost = threading.Event()
        self.prefix_index = PrefixIndexWriter(connect(redis_url), self.keys, self.engine_id, ttl=3 * heartbeat_ttl,
                                              on_lost=self._index_lost.set)
        self.worker_rendezvous = None
        if config.remote_stages:
            from worker.remote_stages import WorkerRendezvous
            self.worker_rendezvous = WorkerRendezvous(redis_url, self.keys, self.engine_id, worker_address,
                                                      worker_port, worker_link_timeout)

    def run(self) -> int:
        """Serve until drained (returns 0) or until the engine fails (returns 1)."""
        try:
            wait_for_redis(self.redis_url, timeout=60)
        except BrokerUnavailable as exc:
            logger.error("engine %s: %s", self.engine_id, exc)
            return 1
        self.reader.reset()
        self._register()
        self.presence.start()
        heartbeat = EngineHeartbeat(self.registry, self.engine_id, ttl=self.heartbeat_ttl,
                                    on_declared_dead=lambda: self.input_queue.put(Rejoin()),
                                    on_restored=self._index_lost.set).start()  # Redis lost the index too
        try:
            self.core = EngineCore(self.config, dp_rank=self.dp_rank, rendezvous=self.worker_rendezvous)
        except Exception:
            logger.exception("engine %s failed to start", self.engine_id)
            heartbeat.stop()
            self.presence.stop()
            self.registry.deregister(self.engine_id)
            return 1
        self.waves.load()
        self.waves.start_polling()  # `{rs}:wave` read off the busy loop (engine.dp_wave rules)
        self.core.block_manager.track_events()
        self._mark_ready()
        logger.info("engine %s READY: %d KV blocks of %d tokens, max_model_len %d", self.engine_id,
                    self.core.num_kv_blocks, self.config.block_size, self.core.max_model_len)
        threads = [threading.Thread(target=self._input_loop, name="engine-input", daemon=True),
                   threading.Thread(target=self._output_loop, name="engine-output", daemon=True)]
        for t in threads:
            t.start()
        code = 0
        try:
            self._busy_loop()
        except Exception as exc:
            logger.exception("engine %s failed", self.engine_id)
            # A dead TP worker is the machine's fault, not the requests': clients may resume them elsewhere.
            kind = ErrorCode.ENGINE_FAILED if isinstance(exc, WorkerDied) else ErrorCode.ENGINE_ERROR
            self._fail_all(kind, f"engine {self.engine_id} failed: {exc}")
            code = 1
        self.stop_event.set()
        self.output_queue.put(None)
        threads[1].join(timeout=10)
        threads[0].join(timeout=2)  # its read blocks 0.2 s at most: let it end before the stream is deleted
        self.waves.stop_polling()
        heartbeat.stop()
        self.registry.deregister(self.engine_id)
        self.presence.stop()
        self.core.shutdown()
        logger.info("engine %s stopped", self.engine_id)
        return code

    def _register(self) -> None:
        self.incarnation = self.registry.register(
            self.engine_id, {"dp_rank": self.dp_rank, "tp": self.config.tensor_parallel_size,
                             "pp": self.config.pipeline_parallel_size, "remote_stages": self.config.remote_stages,
                             "model": self.config.model, "heartbeat_ttl": self.heartbeat_ttl, "presence": 1,
                             "role": self.role})

    def _mark_ready(self) -> None:
        if not self.presence.wait_subscribed(timeout=5.0):  # clients read a missing presence as a dead engine
            logger.warning("engine %s: presence subscription not up after 5 s; marking READY anyway", self.engine_id)
        self.registry.mark_ready(self.engine_id, self.core.num_kv_blocks, self.config.block_size,
                                 self.core.max_model_len)

    def _rejoin(self, batch: StepBatch) -> None:
        """Declared dead (e.g. paused past the heartbeat TTL): clients already failed or re-placed its
        requests, so end them here too and come back as a new incarnation with a fresh stream."""
        info = self.registry.get(self.engine_id)
        if info is not None and info.get("state") != EngineState.DEAD:
            return  # already rejoined (the heartbeat reports at every beat until then)
        logger.warning("engine %s: rejoining as a new incarnation; ending %d requests", self.engine_id,
                       len(self.in_flight))
        self._abort_all(batch, ErrorCode.ENGINE_GONE, f"engine {self.engine_id} was declared dead")
        batch.ack_ids.clear()
        self.reader.reset()
        self._register()  # deletes the prefix index: publish the whole cache again
        self.core.block_manager.resync_events()
        self.registry.heartbeat(self.engine_id, self.heartbeat_ttl)
        self._mark_ready()

    def request_drain(self, *_: object) -> None:
        """Signal handler: stop taking traffic, finish what is in flight, then exit."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()
            self.input_queue.put(Drain())

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.request_drain)
        signal.signal(signal.SIGINT, self.request_drain)

    def _input_loop(self) -> None:
        while not self.stop_event.is_set():
            for message_id, msg in self.reader.read(block_ms=200, count=256):
                self.input_queue.put(Received(message_id, msg))

    def _output_loop(self) -> None:
        while True:
            batch = self.output_queue.get()
            if batch is None:
                return
            if batch.cache_events:  # before the outputs: a client that saw a request end finds its blocks
                ev = batch.cache_events
                self.prefix_index.publish(ev.stored, ev.removed, ev.cleared)
            receivers = self.publisher.publish(batch.by_client, batch.ack_ids, batch.stats)
            if batch.start_wave is not None:
                self.waves.notify_others(batch.start_wave)
            lost = [o.request_id for c in self.publisher.gone_clients(receivers)
                    for o in batch.by_client[c].outputs if o.finish_reason is None]
            if lost:
                self.input_queue.put(ClientGone(lost))

    def _busy_loop(self) -> None:
        core = self.core
        announced_drain = False
        while True:
            if self.draining_since is not None and not announced_drain:
                self.registry.set_state(self.engine_id, EngineState.DRAINING)
                announced_drain = True
            batch = StepBatch()
            self._drain_input(batch, block=not core.has_unfinished_requests(), timeout=self.waves.idle_wait())
            if self.draining_since is not None:
                if not core.has_unfinished_requests() and self.input_queue.empty():
                    self._flush(batch, force_stats=True)
                    return
                if time.monotonic() - self.draining_since > self.drain_timeout:
                    self._abort_all(batch, ErrorCode.ENGINE_GONE, "engine shut down while draining")
                    self._flush(batch, force_stats=True)
                    return
            self._expire_deadlines(batch)
            busy = core.has_unfinished_requests()
            batch.start_wave = self.waves.update(busy)
            if self.waves.take_changed():
                self._flush(batch, force_stats=True)  # before the step: the coordinator sees the wave state now
                batch = StepBatch()
            if busy:
                for out in core.step():
                    self._emit(batch, out)
            elif self.waves.dummy_step_due(busy):
                self.waves.dummy_step(core.executor)
            self._flush(batch)

    def _drain_input(self, batch: StepBatch, block: bool, timeout: float = IDLE_WAIT) -> None:
        try:
            item = self.input_queue.get(timeout=timeout) if block else self.input_queue.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(batch, item)
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return

    def _handle(self, batch: StepBatch, item: InputItem) -> None:
        match item:
            case Received(message_id, AddRequest() as msg):
                self._add(batch, message_id, msg)
            case Received(_, AbortRequests() as msg):
                self._abort_message(batch, msg)
            case Received(_, UtilityCall() as msg):
                batch.add_utility(self.engine_id, msg.client_id, self._call_utility(msg))
            case Received(_, StartWave() as msg):
                self.waves.on_start_wave(msg)
            case Received(message_id, msg):
                logger.warning("engine %s: ignoring a %s on its request stream (entry %s)", self.engine_id,
                               type(msg).__name__, message_id)
            case ClientGone(request_ids):
                self._client_gone(batch, request_ids)
            case Rejoin():
                self._rejoin(batch)
            case Drain():
                pass  # it only woke the busy loop: request_drain has already set draining_since

    def _abort_message(self, batch: StepBatch, msg: AbortRequests) -> None:
        ids = [rid for rid in msg.request_ids if rid in self.in_flight]
        if msg.index is None:
            self._abort(batch, ids)
            return
        for rid in ids:
            for out in self.core.abort_sequence(rid, msg.index):
                self._emit(batch, out)

    def _client_gone(self, batch: StepBatch, request_ids: list[str]) -> None:
        """Outputs of these requests reached no subscriber and their client's heartbeat is gone: the client is
        dead (`OutputPublisher.gone_clients`). Only these requests: a client that is back may already have sent
        new ones. Sequence numbers are never reset (see OutputPublisher)."""
        ids = [rid for rid in dict.fromkeys(request_ids) if rid in self.in_flight]
        if ids:
            logger.info("engine %s: aborting %d requests whose client is gone", self.engine_id, len(ids))
            self._abort(batch, ids)

    def _add(self, batch: StepBatch, message_id: str, msg: AddRequest) -> None:
        if msg.request_id in self.in_flight:
            return
        try:
            params = msg.params.validate()  # decoding checked the types; the ranges are checked here, once
            self.core.add_request(msg.request_id, msg.prompt_token_ids, params, msg.arrival_time, handoff=msg.handoff)
        except (ValueError, TypeError) as exc:
            batch.add(self.engine_id, msg.client_id,
                      RequestOutput.failure(msg.request_id, ErrorCode.INVALID_REQUEST, str(exc)))
            batch.ack_ids.append(message_id)
            return
        self.in_flight[msg.request_id] = InFlight(msg.client_id, message_id, msg.deadline, params.n)

    def _abort(self, batch: StepBatch, request_ids: list[str]) -> None:
        for out in self.core.abort_request(request_ids):
            self._emit(batch, out)

    def _emit(self, batch: StepBatch, out: RequestOutput, error: tuple[ErrorCode, str] | None = None) -> None:
        flight = self.in_flight.get(out.request_id)
        if flight is None:
            return
        if error is not None:
            out.finish_reason = FinishReason.ERROR
            out.error_code, out.error_message = error
        batch.add(self.engine_id, flight.client_id, out)
        if out.finish_reason is not None or out.handoff:  # a handed-off sequence is done here too
            flight.remaining -= 1
            if flight.remaining <= 0:
                del self.in_flight[out.request_id]
                batch.ack_ids.append(flight.message_id)

    def _expire_deadlines(self, batch: StepBatch) -> None:
        now = time.time()
        if now - self._last_deadline_check < 0.5:
            return
        self._last_deadline_check = now
        expired = [rid for rid, f in self.in_flight.items() if f.deadline is not None and f.deadline < now]
        if expired:
            self._abort(batch, expired)

    def _call_utility(self, msg: UtilityCall) -> UtilityResult:
        methods = {"reset_prefix_cache": self.core.reset_prefix_cache, "get_stats": self._stats}
        method = methods.get(msg.method)
        if method is None:
            return UtilityResult(msg.call_id, error=f"unknown utility method {msg.method!r}")
        try:
            return UtilityResult(msg.call_id, result=method(*msg.args))
        except Exception as exc:
            return UtilityResult(msg.call_id, error=f"{type(exc).__name__}: {exc}")

    def _stats(self) -> dict:
        s = self.core.stats()
        return {**s.load.stats_fields(),
                "generated_tokens": s.generated_tokens, "prompt_tokens": s.prompt_tokens,
                "num_preemptions": s.num_preemptions, "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits, "histograms": s.histograms,
                "prefix_cache_hit_rate": round(s.prefix_cache_hit_rate, 4), **s.load.stats_stamp(),
                "prefix_index_bytes": self.prefix_index.sent_bytes,
                "prefix_index_commands": self.prefix_index.sent_commands,
                **{f"kv_tier_{name}": value for name, value in (s.kv_tier or {}).items()},
                **self.waves.fields()}

    def _flush(self, batch: StepBatch, force_stats: bool = False) -> None:
        now = time.monotonic()
        if force_stats or now - self._last_stats > 0.1:
            self._last_stats = now
            batch.stats = self._stats()
        if batch.stats is not None or not self.core.has_unfinished_requests():
            if self._index_lost.is_set():
                self._index_lost.clear()
                self.core.block_manager.resync_events()
            batch.cache_events = self.core.block_manager.take_events() or None
        if batch:
            self.output_queue.put(batch)

    def _abort_all(self, batch: StepBatch, code: ErrorCode, message: str) -> None:
        for out in self.core.abort_request(list(self.in_flight)):
            self._emit(batch, out, error=(code, message))

    def _fail_all(self, code: ErrorCode, message: str) -> None:
        batch = StepBatch()
        for request_id, flight in list(self.in_flight.items()):
            batch.add(self.engine_id, flight.client_id, RequestOutput.failure(request_id, code, message))
            batch.ack_ids.append(flight.message_id)
        self.in_flight.clear()
        self.output_queue.put(batch)
