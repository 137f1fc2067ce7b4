"""MultiprocExecutor: TP x PP > 1. One spawned worker process per rank, driven over shared memory.

The engine owns every segment: one broadcast queue (engine writes, every rank reads) and one
response queue per rank (the rank writes, the engine reads), so a killed worker leaves nothing in
/dev/shm. The TP rendezvous is a file store in a 0700 directory of the engine's
(``worker.parallel_state``), removed at shutdown, or by the workers when the engine dies: nothing of
TP setup listens on a network port. Each worker gets a ready pipe (READY or the startup error) and a
death pipe (EOF when the engine goes away). A monitor thread waits on the workers' process sentinels: when one dies, pending
and later calls raise ``WorkerDied`` at once and the engine fails its requests and exits non-zero.
``execute_model`` broadcasts one scheduler output per step and reads one reply, from the output rank:
the first TP rank of the last pipeline stage (rank 0 without PP).

Pipeline parallelism: ranks are ``stage * TP + tp_rank``; process titles ``redserve-worker-<dp>-<tp rank>``
without PP (as before) and ``redserve-worker-<dp>-<stage>-<tp rank>`` with it. ``submit_step`` broadcasts a
step without waiting and ``collect_step`` reads the oldest step's reply (replies come in step order), so the
engine can keep one step per stage in flight. Only the last stage samples: the executor keeps each
request's sampled tokens until the request is next scheduled and sends them with that step, so the other
stages' runners hold the same token ids.

Stages on other hosts (``config.remote_stages``, ``worker.remote_stages``): the engine spawns only the
first stages' workers; worker hosts (``redserve worker``) take the rest over the network. Every broadcast
message is also sent to each host, whose relay writes it into its own shm queue; remote ranks' replies come
back over the same link. A host that fails or goes silent is a dead worker, as above.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from protocol.step_types import (
    ModelRunnerOutput,
    SchedulerOutput,
    runner_output_from_wire,
    scheduler_output_to_wire,
)
from worker.config import EngineConfig
from worker.remote_stages import RemoteStages, WorkerRendezvous
from worker.serialization import encode
from worker.shm_queue import MessageQueue, QueueClosed
from worker.worker_proc import SHUTDOWN, stop_workers, worker_main

logger = logging.getLogger(__name__)

OUTPUT_RANK = 0  # without pipeline parallelism


class WorkerDied(RuntimeError):
    """A worker process (TP rank or pipeline stage, here or on a worker host) exited; the engine cannot continue."""


def worker_title(dp_rank: int, rank: int, tp_size: int, pp_size: int) -> str:
    """The worker's process title (see the module docstring)."""
    if pp_size == 1:
        return f"redserve-worker-{dp_rank}-{rank}"
    stage, tp_rank = divmod(rank, tp_size)
    return f"redserve-worker-{dp_rank}-{stage}-{tp_rank}"


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, startup_timeout: float = 600.0, dp_rank: int = 0,
                 rendezvous: WorkerRendezvous | None = None):
        self.config = config
        self.world_size = config.world_size
        self.output_rank = (config.pipeline_parallel_size - 1) * config.tensor_parallel_size
        self.max_in_flight = config.pipeline_parallel_size
        self.overlaps_steps = False  # async scheduling needs the model in the engine's process (EngineConfig)
        self._in_flight = 0
        self._unsent_tokens: dict[str, list[int]] | None = {} if config.pipeline_parallel_size > 1 else None
        self.failure: str | None = None
        self._closed = False
        self.remote: RemoteStages | None = None
        if config.remote_stages:
            if rendezvous is None:
                raise ValueError("remote pipeline stages need Redis to meet their worker hosts (redserve engine)")
            self.remote = RemoteStages(config, rendezvous, self._fail, startup_timeout, dp_rank)
        local_size = self.remote.first_rank if self.remote else self.world_size
        tag = f"e{dp_rank}"
        self.broadcast = MessageQueue.create(local_size, tag=tag)
        self.responses: list = [MessageQueue.create(1, tag=f"{tag}r{r}", reader_rank=0) for r in range(local_size)]
        self.rendezvous_dir = tempfile.mkdtemp(prefix=f"redserve-tp-{os.getpid()}-")  # mode 0700
        store_path = os.path.join(self.rendezvous_dir, "store")
        pp_link = self.remote.pp_link if self.remote else None
        ctx = mp.get_context("spawn")
        self.procs: list[mp.process.BaseProcess] = []
        self._death_writers = []
        ready_readers = []
        for rank in range(local_size):
            ready_reader, ready_writer = ctx.Pipe(duplex=False)
            death_reader, death_writer = ctx.Pipe(duplex=False)
            title = worker_title(dp_rank, rank, config.tensor_parallel_size, config.pipeline_parallel_size)
            proc = ctx.Process(
                target=worker_main, name=title, daemon=True,
                args=(dataclasses.asdict(config), rank, title, store_path,
                      self.broadcast.handle(), self.responses[rank].handle(), ready_writer, death_reader, pp_link))
            proc.start()
            ready_writer.close()
            death_reader.close()
            self.procs.append(proc)
            self._death_writers.append(death_writer)
            ready_readers.append(ready_reader)
        try:
            deadline = time.monotonic() + startup_timeout
            if self.remote:
                self.remote.admit(deadline)
                replies = self.remote.replies()
                self.responses += [replies[rank] for rank in range(local_size, self.world_size)]
            self._wait_ready(ready_readers, deadline, startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        threading.Thread(target=self._monitor, name="worker-monitor", daemon=True).start()
        blocks = self.collective_rpc("determine_num_kv_blocks")
        self.num_kv_blocks = min(blocks)
        self.collective_rpc("init_kv_cache", (self.num_kv_blocks,))
        info = self.collective_rpc("info", unique_reply_rank=self.output_rank)[0]
        self.max_model_len = info["max_model_len"]
        self.eos_token_ids = info["eos_token_ids"]
        self.vocab_size = info["vocab_size"]

    def _wait_ready(self, readers, deadline: float, timeout: float) -> None:
        pending = dict(enumerate(readers))
        while True:
            remote_pending = self.remote.not_ready() if self.remote else []
            if self.failure:
                raise WorkerDied(self.failure)
            if not pending and not remote_pending:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"workers {sorted(pending) + remote_pending} not ready after {timeout:.0f}s")
            wait_for = min(left, 0.5) if self.remote else left
            for conn in wait(list(pending.values()) + [p.sentinel for p in self.procs], timeout=wait_for):
                rank = next((r for r, c in pending.items() if c is conn), None)
                if rank is None:
                    dead = [p for p in self.procs if not p.is_alive()]
                    if dead:
                        raise WorkerDied(f"{dead[0].name} exited with code {dead[0].exitcode} during startup")
                    continue
                try:
                    msg = conn.recv()
                except EOFError:
                    raise WorkerDied(f"worker {rank} closed its ready pipe during startup") from None
                if msg["status"] != "ready":
                    raise RuntimeError(f"worker {rank} failed to start: {msg['error']}\n{msg.get('traceback', '')}")
                del pending[rank]

    def _monitor(self) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        if not sentinels:
            return
        ready = wait(list(sentinels))
        proc = sentinels[ready[0]]
        self._fail(f"worker {proc.name} (pid {proc.pid}) died with exit code {proc.exitcode}")

    def _fail(self, reason: str) -> None:
        """A worker (local or on a worker host) is gone: pending and later calls raise WorkerDied."""
        if self._closed or self.failure:
            return
        self.failure = reason
        logger.error("%s; the engine cannot continue", self.failure)
        self.broadcast.close()

    def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = 300.0,
                       unique_reply_rank: int | None = None) -> list[Any]:
        """Run ``method(*args)`` on every rank's model runner; replies from all ranks, or only one."""
        if self._in_flight:
            raise RuntimeError(f"collective_rpc({method}) while {self._in_flight} steps are in flight")
        self._send([method, list(args), unique_reply_rank])
        ranks = range(self.world_size) if unique_reply_rank is None else [unique_reply_rank]
        results = []
        for rank in ranks:
            status, value = self._receive(rank, timeout)
            if status != "ok":
                raise RuntimeError(f"{method} failed on worker rank {rank}: {value}")
            results.append(value)
        return results

    def save_kv_blocks(self, block_ids: list[int]) -> Callable[[], list[list[bytes]]]:
        by_rank = self.collective_rpc("read_kv_blocks", (block_ids,))  # the workers reply once it is read
        blocks = [list(pieces) for pieces in zip(*by_rank, strict=True)]
        return lambda: blocks

    def load_kv_blocks(self, block_ids: list[int], pieces: list[list[bytes | memoryview]]) -> None:
        by_rank = [[bytes(block[rank]) for block in pieces] for rank in range(self.world_size)]
        self.collective_rpc("write_kv_blocks", (block_ids, by_rank))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for it (no other step may be in flight)."""
        if self._in_flight:
            raise RuntimeError(f"execute_model while {self._in_flight} steps are in flight")
        self.submit_step(sched)
        return self.collect_step()

    def submit_step(self, sched: SchedulerOutput) -> None:
        """Broadcast one step without waiting for it; ``collect_step`` returns its output, in order."""
        self._send(["execute_model", [scheduler_output_to_wire(sched), self._tokens_for(sched)], self.output_rank])
        self._in_flight += 1

    def collect_step(self) -> ModelRunnerOutput:
        """The output of the oldest step in flight (blocks until it is done)."""
        if not self._in_flight:
            raise RuntimeError("collect_step with no step in flight")
        _, value = self._receive(self.output_rank, timeout=None)
        self._in_flight -= 1
        out = runner_output_from_wire(value)
        if self._unsent_tokens is not None:
            for req_id, token in out.sampled.items():
                self._unsent_tokens.setdefault(req_id, []).append(token.token_id)
        return out

    def _tokens_for(self, sched: SchedulerOutput) -> dict[str, list[int]]:
        """The sampled tokens the non-last stages have not seen, for this step's requests (PP only)."""
        unsent = self._unsent_tokens
        if not unsent:
            return {}
        for req_id in sched.finished_req_ids:
            unsent.pop(req_id, None)
        for new in sched.new_requests:  # sent in full
            unsent.pop(new.req_id, None)
        return {req_id: unsent.pop(req_id) for req_id in sched.num_scheduled_tokens if req_id in unsent}

    def _send(self, message: list, timeout: float = 60) -> None:
        if self.failure:
            raise WorkerDied(self.failure)
        try:
            if self.remote is None:
                self.broadcast.enqueue(message, timeout=timeout)
            else:
                payload = encode(message)
                self.remote.send(payload)
                self.broadcast.enqueue_bytes(payload, timeout=timeout)
        except QueueClosed:
            raise WorkerDied(self.failure or "the workers are shut down") from None

    def _receive(self, rank: int, timeout: float | None) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.failure:
                raise WorkerDied(self.failure)
            try:
                return self.responses[rank].dequeue(timeout=0.5)
            except QueueClosed:
                time.sleep(0.2)
                raise WorkerDied(self.failure or f"worker rank {rank} stopped answering") from None
            except TimeoutError:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"worker rank {rank} did not reply within {timeout}s") from None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.failure:
            with contextlib.suppress(QueueClosed, TimeoutError):
                self._send([SHUTDOWN, [], None], timeout=2)
        stop_workers(self.procs, self._death_writers)
        self.broadcast.close()
        for queue in self.responses:
            queue.close()
        if self.remote is not None:
            self.remote.close()
        shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
        logger.info("workers of engine pid %d stopped", os.getpid())
