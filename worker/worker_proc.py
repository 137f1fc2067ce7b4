"""A tensor- or pipeline-parallel worker process: one rank of an engine's model (``rank = stage * TP +
tp_rank``; see ``worker.parallel_state``).

Startup: join the TP group of its stage and the pipeline group (gloo on CPU, NCCL on CUDA; rendezvous
through the engine's file store), build the model runner (loading only this rank's shards of its stage's
modules), attach to the engine's broadcast queue as reader ``rank`` and to its own response
queue as writer, then report READY over the ready pipe. Then loop: dequeue one call, run it, reply
when asked. The death pipe's EOF means the engine is gone: the worker exits at once.
Any error while running a step is fatal to the worker (the engine's monitor sees it exit).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from common.proctitle import set_title
from protocol.step_types import runner_output_to_wire, scheduler_output_from_wire
from worker.config import EngineConfig
from worker.model_runner import ModelRunner
from worker.parallel_state import destroy_tensor_parallel, init_model_parallel
from worker.shm_queue import MessageQueue, QueueClosed, QueueHandle

logger = logging.getLogger(__name__)

SHUTDOWN = "shutdown"


def _watch_parent(death_reader: Connection, segments: list[str], rendezvous_dir: str) -> None:
    """Exit when the engine is gone; remove its queues' segments and TP rendezvous directory in case it
    died without cleanup."""
    with contextlib.suppress(EOFError, OSError):
        death_reader.recv()
    for name in segments:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/dev/shm", name))
    shutil.rmtree(rendezvous_dir, ignore_errors=True)
    os._exit(1)


def worker_main(config: dict[str, Any], rank: int, title: str, store_path: str, broadcast: QueueHandle,
                response: QueueHandle, ready_writer: Connection, death_reader: Connection,
                pp_link: dict | None = None, local_rank: int | None = None) -> None:
    """Entry point of the spawned process. ``local_rank`` is the worker's index on its host (its reader rank
    on the broadcast queue and its CUDA device), ``rank`` when all ranks are on one host; ``pp_link`` joins a
    pipeline that spans hosts (``worker.parallel_state``)."""
    local_rank = rank if local_rank is None else local_rank
    set_title(title)
    logging.basicConfig(level=os.environ.get("REDSERVE_LOG_LEVEL", "INFO").upper(),
                        format=f"%(asctime)s %(levelname)s {title}[%(process)d]: %(message)s")
    threading.Thread(target=_watch_parent, daemon=True, name="death-pipe",
                     args=(death_reader, [broadcast.name, response.name], os.path.dirname(store_path))).start()
    try:
        engine_config = EngineConfig(**config)
        device = torch.device(engine_config.device)
        if device.type == "cuda":
            if local_rank >= torch.cuda.device_count():
                raise RuntimeError(f"worker rank {rank} needs cuda:{local_rank} but {torch.cuda.device_count()} CUDA "
                                   f"devices are visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
            torch.cuda.set_device(local_rank)
            engine_config.device = f"cuda:{local_rank}"
            device = torch.device(engine_config.device)
        else:
            # The engine's share of the cores (the stack sets OMP_NUM_THREADS per DP engine), split over its ranks.
            cores = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
            torch.set_num_threads(max(1, cores // broadcast.n_readers))
        init_model_parallel(rank, engine_config.tensor_parallel_size, engine_config.pipeline_parallel_size,
                            store_path, device, pp_link)
        runner = ModelRunner(engine_config)
        inbox = MessageQueue.attach(broadcast, local_rank)
        outbox = MessageQueue.attach_writer(response)
    except Exception as exc:
        ready_writer.send({"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                           "traceback": traceback.format_exc()})
        return
    ready_writer.send({"status": "ready"})
    ready_writer.close()
    try:
        _serve(runner, inbox, outbox, rank)
    finally:
        inbox.close()
        outbox.close()
        runner.graph_runner = None  # graphs holding NCCL calls go before the communicator (pytorch#115388)
        destroy_tensor_parallel()


def stop_workers(procs: list, death_writers: list[Connection], grace: float = 5.0) -> None:
    """Close the workers' death pipes (they exit), wait up to `grace` s in all, then kill what is left."""
    for conn in death_writers:
        conn.close()
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(timeout=max(0.1, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def _serve(runner: ModelRunner, inbox: MessageQueue, outbox: MessageQueue, rank: int) -> None:
    while True:
        try:
            method, args, reply_rank = inbox.dequeue()
        except QueueClosed:
            return
        if method == SHUTDOWN:
            return
        if method == "execute_model":
            sched, new_token_ids = scheduler_output_from_wire(args[0]), args[1]
            result = runner_output_to_wire(runner.execute_model(sched, new_token_ids))
            if reply_rank == rank:
                outbox.enqueue(["ok", result])
            continue
        try:
            result = ["ok", getattr(runner, method)(*args)]
        except Exception as exc:
            result = ["error", f"{type(exc).__name__}: {exc}"]
        if reply_rank is None or reply_rank == rank:
            outbox.enqueue(result)
