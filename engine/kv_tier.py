"""The engine's side of the KV tier: full prefix blocks go out to a shared store, and come back on a miss.

Rules:
- Store: after each step, the prompt blocks this engine computed and cached (``BlockManager.computed``; a block
  with generated tokens in it is not stored) are read off the device (``Executor.save_kv_blocks``, queued
  behind the step) and handed to the store thread, which encodes (``protocol.kv_blocks``) and writes them. A
  hash stored or loaded lately (``RECENT_HASHES``) is not written again. If more than ``MAX_PENDING_BYTES``
  wait to be written, new blocks are dropped (counted). The store thread runs at nice ``STORE_NICE``: on a
  host whose cores the engine keeps busy (a CPU engine) storing takes the slack, not the engine's time.
- Load: a new request whose prefix the local cache lacks goes to ``WAITING_FOR_KV`` and its missing full blocks
  (never its last token's) are looked up by the load thread, which fetches the leading run the store holds and
  checks each block (``decode_block``). At the start of the next step the busy loop (``apply_loaded``) takes
  free blocks for the run (``BlockManager.adopt_blocks``), writes them (``Executor.load_kv_blocks``) and puts
  the request back to ``WAITING`` (with lookups out it first waits up to ``LOOKUP_WAIT`` for them, so a miss
  costs a new request a round trip, not a step): the scheduler then finds those blocks as prefix-cache hits,
  exactly as if this engine had computed them. Other requests keep stepping meanwhile; the scheduler skips a request that
  waits for KV.
- Handoff (prefill/decode disaggregation): ``after_stored(then)`` queues ``then`` behind the blocks handed to the
  store thread so far; it runs once they are written (or dropped), so a prefill engine answers a handed-off
  request only when a decode engine can find its prompt's blocks.
- Failure never fails a request: a block that fails its check ends the run there (the rest is recomputed), a
  store error is a miss, and after one the tier is skipped for ``RETRY_AFTER`` seconds (lookups answer at once,
  blocks to store are dropped), then tried again.
- Counters (``stats``): lookups, blocks and tokens hit and missed, corrupt blocks, bytes in and out, seconds
  spent loading (from the lookup to the request's readmission), store errors, dropped blocks and the store's
  memory (read by the store thread every ``MEMORY_EVERY`` seconds).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from broker.connection import mask_url
from broker.kv_tier_store import KVTierStore, open_store
from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from protocol.kv_blocks import CorruptBlock, decode_block, encode_block, kv_namespace, kv_namespace_fields

logger = logging.getLogger(__name__)

RECENT_HASHES = 65536
MAX_PENDING_BYTES = 256 << 20
RETRY_AFTER = 5.0
MEMORY_EVERY = 5.0
LOOKUP_WAIT = 0.002  # seconds a step waits for lookups out before it schedules without them
STORE_NICE = 10  # the store thread yields the cores to the engine's compute threads when they want them


@dataclass
class _Lookup:
    request_id: str
    blocks: list[tuple[int, tuple[int, ...]]]  # (hash, tokens) of the blocks the local cache lacks, in order
    started: float
    pieces: list[list] = field(default_factory=list)  # of the leading run found and checked, filled by the thread
    corrupt: int = 0


@dataclass
class _Barrier:
    then: Callable[[], None]  # run by the store thread once every block queued before it is written (or dropped)


@dataclass
class _Store:
    blocks: list[tuple[int, tuple[int, ...]]]
    read: Callable[[], list[list]]
    nbytes: int


class KVTier:
    def __init__(self, store: KVTierStore, block_manager: BlockManager, executor, block_bytes: int):
        self.store = store
        self.block_manager = block_manager
        self.executor = executor
        self.block_size = block_manager.block_size
        self.block_bytes = block_bytes
        block_manager.record_computed = True
        self._recent: OrderedDict[int, None] = OrderedDict()
        self._lookups: queue.SimpleQueue[_Lookup | None] = queue.SimpleQueue()
        self._stores: queue.SimpleQueue[_Store | _Barrier | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[_Lookup] = queue.SimpleQueue()
        self._done_event = threading.Event()
        self._waiting: set[str] = set()
        self._barriers = 0
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.counters = dict.fromkeys(
            ("lookups", "hit_blocks", "hit_tokens", "miss_blocks", "miss_tokens", "corrupt_blocks", "stored_blocks",
             "bytes_in", "bytes_out", "errors", "dropped_blocks"), 0)
        self.load_seconds = 0.0
        self.memory: dict = {}
        self._threads = [threading.Thread(target=self._load_loop, name="kv-tier-load", daemon=True),
                         threading.Thread(target=self._store_loop, name="kv-tier-store", daemon=True)]
        for thread in self._threads:
            thread.start()

    # -- busy loop side -------------------------------------------------------------------------------------

    @property
    def has_pending(self) -> bool:
        """Lookups or ``after_stored`` calls not done yet: the busy loop has something to wait for."""
        return bool(self._waiting) or self._barriers > 0

    def lookup(self, request: Request) -> bool:
        """Send a new request's missing prefix blocks to be looked up; True when it now waits for them."""
        if request.params.prompt_logprobs is not None or self._is_down():
            return False
        bm, bs = self.block_manager, self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        bm.update_hashes(request, max_blocks * bs)
        start = bm.cached_prefix_length(request.block_hashes[:max_blocks])
        if start >= max_blocks:
            return False
        blocks = [(request.block_hashes[i], tuple(request.token_ids[i * bs:(i + 1) * bs]))
                  for i in range(start, max_blocks)]
        request.status = RequestStatus.WAITING_FOR_KV
        self._waiting.add(request.request_id)
        self._lookups.put(_Lookup(request.request_id, blocks, time.perf_counter()))
        return True

    def apply_loaded(self, requests: dict[str, Request]) -> None:
        """Write the runs the load thread found and put their requests back in line (see the module rules). With
        lookups out, first wait up to ``LOOKUP_WAIT`` for them: most answer within a millisecond, and a request
        whose lookup is done now joins this step instead of the next."""
        deadline = time.monotonic() + LOOKUP_WAIT
        while self._waiting and self._done.empty() and (left := deadline - time.monotonic()) > 0:
            self._done_event.wait(left)
            self._done_event.clear()
        while True:
            try:
                found = self._done.get_nowait()
            except queue.Empty:
                break
            self._waiting.discard(found.request_id)
            request = requests.get(found.request_id)
            if request is None or request.status != RequestStatus.WAITING_FOR_KV:
                continue  # aborted while it waited
            self._write(found)
            request.status = RequestStatus.WAITING
            self.load_seconds += time.perf_counter() - found.started

    def _write(self, found: _Lookup) -> None:
        run = found.blocks[:len(found.pieces)]
        c = self.counters
        c["lookups"] += 1
        c["corrupt_blocks"] += found.corrupt
        c["miss_blocks"] += len(found.blocks) - len(run)
        c["miss_tokens"] += (len(found.blocks) - len(run)) * self.block_size
        if not run:
            return
        block_ids = self.block_manager.adopt_blocks(run)
        if not block_ids:
            c["miss_blocks"] += len(run)
            c["miss_tokens"] += len(run) * self.block_size
            return
        writes = [(block_id, pieces) for block_id, pieces in zip(block_ids, found.pieces, strict=True)
                  if block_id is not None]
        self.executor.load_kv_blocks([b for b, _ in writes], [p for _, p in writes])
        c["hit_blocks"] += len(run)
        c["hit_tokens"] += len(run) * self.block_size
        c["bytes_in"] += sum(len(piece) for _, pieces in writes for piece in pieces)
        for block_hash, _ in run:
            self._remember(block_hash)

    def save_computed(self) -> None:
        """Start storing the blocks computed since the last call (see the module rules)."""
        computed = self.block_manager.take_computed()
        if not computed:
            return
        fresh = [(h, b, t) for h, b, t in computed if h not in self._recent]
        if not fresh:
            return
        if self._is_down() or self._pending_bytes > MAX_PENDING_BYTES:
            self.counters["dropped_blocks"] += len(fresh)
            return
        for block_hash, _, _ in fresh:
            self._remember(block_hash)
        nbytes = len(fresh) * self.block_bytes
        with self._lock:
            self._pending_bytes += nbytes
        read = self.executor.save_kv_blocks([b for _, b, _ in fresh])
        self._stores.put(_Store([(h, t) for h, _, t in fresh], read, nbytes))

    def after_stored(self, then: Callable[[], None]) -> None:
        """Run ``then`` (on the store thread) once the blocks handed over so far are written, or dropped."""
        with self._lock:
            self._barriers += 1
        self._stores.put(_Barrier(then))

    def wait(self, timeout: float) -> None:
        """Block until a lookup or an ``after_stored`` is done (or ``timeout``): the busy loop's wait when nothing
        else can run."""
        self._done_event.wait(timeout)
        self._done_event.clear()

    def _remember(self, block_hash: int) -> None:
        self._recent[block_hash] = None
        self._recent.move_to_end(block_hash)
        if len(self._recent) > RECENT_HASHES:
            self._recent.popitem(last=False)

    def _is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _failed(self, what: str, exc: Exception) -> None:
        self.counters["errors"] += 1
        if not self._is_down():
            logger.warning("KV tier %s failed (%s: %s); skipping the tier for %.0f s", what, type(exc).__name__,
                           exc, RETRY_AFTER)
        self._down_until = time.monotonic() + RETRY_AFTER

    def stats(self) -> dict:
        return {**self.counters, "load_seconds": round(self.load_seconds, 4), "pending_bytes": self._pending_bytes,
                "store_used_bytes": self.memory.get("used_bytes", 0),
                "store_max_bytes": self.memory.get("max_bytes", 0),
                "store_evicted_keys": self.memory.get("evicted_keys", 0)}

    def close(self) -> None:
        self._lookups.put(None)
        self._stores.put(None)
        for thread in self._threads:
            thread.join(timeout=5)
        self.store.close()

    # -- the tier's threads ---------------------------------------------------------------------------------

    def _load_loop(self) -> None:
        while (lookup := self._lookups.get()) is not None:
            if not self._is_down():
                try:
                    values = self.store.get_run([h for h, _ in lookup.blocks])
                except Exception as exc:  # noqa: BLE001 - a tier that fails is a miss
                    self._failed("lookup", exc)
                    values = []
                for value, (_, tokens) in zip(values, lookup.blocks, strict=False):
                    try:
                        lookup.pieces.append(decode_block(value, tokens))
                    except CorruptBlock as exc:
                        logger.warning("KV tier: dropping a stored block of request %s: %s", lookup.request_id, exc)
                        lookup.corrupt += 1
                        break
            self._done.put(lookup)
            self._done_event.set()

    def _store_loop(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # Linux: a thread is a task with a nice value of its own
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), STORE_NICE)
        next_memory = 0.0
        while (job := self._stores.get()) is not None:
            if isinstance(job, _Barrier):
                job.then()
                with self._lock:
                    self._barriers -= 1
                self._done_event.set()
                continue
            try:
                pieces = job.read()
                values = [encode_block(tokens, block) for (_, tokens), block in zip(job.blocks, pieces, strict=True)]
                if not self._is_down():
                    self.store.put([(h, v) for (h, _), v in zip(job.blocks, values, strict=True)])
                    self.counters["stored_blocks"] += len(values)
                    self.counters["bytes_out"] += sum(len(v) for v in values)
                else:
                    self.counters["dropped_blocks"] += len(values)
            except Exception as exc:  # noqa: BLE001 - blocks that cannot be stored are recomputed by whoever needs them
                self._failed("store", exc)
                self.counters["dropped_blocks"] += len(job.blocks)
            finally:
                with self._lock:
                    self._pending_bytes -= job.nbytes
            if time.monotonic() >= next_memory and not self._is_down():
                next_memory = time.monotonic() + MEMORY_EVERY
                try:
                    self.memory = self.store.memory()
                except Exception as exc:  # noqa: BLE001 - figures only: the tier itself may be fine
                    logger.debug("KV tier: cannot read the store's memory: %s", exc)


_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def open_kv_tier(config, executor, block_manager: BlockManager) -> KVTier:
    """The tier of an engine's config (``kv_tier_url``), in the namespace of its model and KV layout."""
    layout = executor.collective_rpc("kv_layout")[0]
    model_dir = Path(config.model)
    fields = kv_namespace_fields(
        model=Path(config.gguf_file).name if config.gguf_file else model_dir.name,
        model_config=(model_dir / "config.json").read_bytes(), quantization=config.quantization,
        dtype=layout["dtype"], num_layers=layout["num_layers"], num_kv_heads=layout["num_kv_heads"],
        head_size=layout["head_size"], block_size=layout["block_size"],
        tensor_parallel_size=config.tensor_parallel_size)
    namespace = kv_namespace(fields)
    store = open_store(config.kv_tier_url, namespace)
    try:
        store.describe(fields)
    except Exception as exc:  # noqa: BLE001 - a tier that is down at start is tried again later
        logger.warning("KV tier %s not reachable at start (%s); the engine serves without it until it is",
                       mask_url(config.kv_tier_url), exc)
    logger.info("KV tier %s, namespace %s (%s)", mask_url(config.kv_tier_url), namespace,
                ", ".join(f"{k}={v}" for k, v in fields.items()))
    block_bytes = (2 * layout["num_layers"] * layout["block_size"] * layout["num_kv_heads"] * layout["head_size"]
                   * _ELEMENT_BYTES[layout["dtype"]])
    return KVTier(store, block_manager, executor, block_bytes)
