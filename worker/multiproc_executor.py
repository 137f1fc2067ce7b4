"""MultiprocExecutor: TP > 1. One spawned worker process per rank, driven over shared memory.

The engine owns every segment: one broadcast queue (engine writes, every rank reads) and one
response queue per rank (the rank writes, the engine reads), so a killed worker leaves nothing in
/dev/shm. The TP rendezvous is a file store in a 0700 directory of the engine's
(``worker.parallel_state``), removed at shutdown, or by the workers when the engine dies: nothing of
TP setup listens on a network port. Each worker gets a ready pipe (READY or the startup error) and a
death pipe (EOF when the engine goes away). A monitor thread waits on the workers' process sentinels: when one dies, pending
and later calls raise ``WorkerDied`` at once and the engine fails its requests and exits non-zero.
``execute_model`` broadcasts one scheduler output per step and reads one reply, from rank 0.
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
from multiprocessing.connection import wait
from typing import Any

from engine.config import EngineConfig
from engine.step_types import (
    ModelRunnerOutput,
    SchedulerOutput,
    runner_output_from_wire,
    scheduler_output_to_wire,
)
from worker.shm_queue import MessageQueue, QueueClosed
from worker.worker_proc import SHUTDOWN, worker_main

logger = logging.getLogger(__name__)

OUTPUT_RANK = 0


class WorkerDied(RuntimeError):
    """A TP worker process exited; the engine cannot continue."""


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, startup_timeout: float = 600.0, dp_rank: int = 0):
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.failure: str | None = None
        self._closed = False
        tag = f"e{dp_rank}"
        self.broadcast = MessageQueue.create(self.world_size, tag=tag)
        self.responses = [MessageQueue.create(1, tag=f"{tag}r{r}", reader_rank=0) for r in range(self.world_size)]
        self.rendezvous_dir = tempfile.mkdtemp(prefix=f"redserve-tp-{os.getpid()}-")  # mode 0700
        store_path = os.path.join(self.rendezvous_dir, "store")
        ctx = mp.get_context("spawn")
        self.procs: list[mp.process.BaseProcess] = []
        self._death_writers = []
        ready_readers = []
        for rank in range(self.world_size):
            ready_reader, ready_writer = ctx.Pipe(duplex=False)
            death_reader, death_writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=worker_main, name=f"redserve-worker-{dp_rank}-{rank}", daemon=True,
                args=(dataclasses.asdict(config), rank, f"redserve-worker-{dp_rank}-{rank}", store_path,
                      self.broadcast.handle(), self.responses[rank].handle(), ready_writer, death_reader))
            proc.start()
            ready_writer.close()
            death_reader.close()
            self.procs.append(proc)
            self._death_writers.append(death_writer)
            ready_readers.append(ready_reader)
        try:
            self._wait_ready(ready_readers, startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        threading.Thread(target=self._monitor, name="worker-monitor", daemon=True).start()
        blocks = self.collective_rpc("determine_num_kv_blocks")
        self.num_kv_blocks = min(blocks)
        self.collective_rpc("init_kv_cache", (self.num_kv_blocks,))
        info = self.collective_rpc("info", unique_reply_rank=OUTPUT_RANK)[0]
        self.max_model_len = info["max_model_len"]
        self.eos_token_ids = info["eos_token_ids"]
        self.vocab_size = info["vocab_size"]

    def _wait_ready(self, readers, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(readers))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"TP workers {sorted(pending)} not ready after {timeout:.0f}s")
            for conn in wait(list(pending.values()) + [p.sentinel for p in self.procs], timeout=left):
                rank = next((r for r, c in pending.items() if c is conn), None)
                if rank is None:
                    dead = [p for p in self.procs if not p.is_alive()]
                    if dead:
                        raise WorkerDied(f"{dead[0].name} exited with code {dead[0].exitcode} during startup")
                    continue
                try:
                    msg = conn.recv()
                except EOFError:
                    raise WorkerDied(f"TP worker {rank} closed its ready pipe during startup") from None
                if msg["status"] != "ready":
                    raise RuntimeError(f"TP worker {rank} failed to start: {msg['error']}\n{msg.get('traceback', '')}")
                del pending[rank]

    def _monitor(self) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        ready = wait(list(sentinels))
        if self._closed:
            return
        proc = sentinels[ready[0]]
        self.failure = f"TP worker {proc.name} (pid {proc.pid}) died with exit code {proc.exitcode}"
        logger.error("%s; the engine cannot continue", self.failure)
        self.broadcast.close()

    def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = 300.0,
                       unique_reply_rank: int | None = None) -> list[Any]:
        """Run ``method(*args)`` on every rank's model runner; replies from all ranks, or only one."""
        self._send([method, list(args), unique_reply_rank])
        ranks = range(self.world_size) if unique_reply_rank is None else [unique_reply_rank]
        results = []
        for rank in ranks:
            status, value = self._receive(rank, timeout)
            if status != "ok":
                raise RuntimeError(f"{method} failed on TP rank {rank}: {value}")
            results.append(value)
        return results

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._send(["execute_model", [scheduler_output_to_wire(sched)], OUTPUT_RANK])
        _, value = self._receive(OUTPUT_RANK, timeout=None)
        return runner_output_from_wire(value)

    def _send(self, message: list) -> None:
        if self.failure:
            raise WorkerDied(self.failure)
        try:
            self.broadcast.enqueue(message, timeout=60)
        except QueueClosed:
            raise WorkerDied(self.failure or "TP workers are shut down") from None

    def _receive(self, rank: int, timeout: float | None) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.failure:
                raise WorkerDied(self.failure)
            try:
                return self.responses[rank].dequeue(timeout=0.5)
            except QueueClosed:
                time.sleep(0.2)
                raise WorkerDied(self.failure or f"TP rank {rank} stopped answering") from None
            except TimeoutError:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"TP rank {rank} did not reply within {timeout}s") from None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.failure:
            with contextlib.suppress(QueueClosed, TimeoutError):
                self.broadcast.enqueue([SHUTDOWN, [], None], timeout=2)
        for conn in self._death_writers:
            conn.close()
        deadline = time.monotonic() + 5
        for proc in self.procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.broadcast.close()
        for queue in self.responses:
            queue.close()
        shutil.rmtree(self.rendezvous_dir, ignore_errors=True)
        logger.info("TP workers of pid %d stopped", os.getpid())
