"""Executors: the engine's one interface to its model runner(s).

``UniprocExecutor`` (TP = PP = 1) runs the model runner in the engine's own process: no IPC at all.
``MultiprocExecutor`` (TP x PP > 1, in ``worker.multiproc_executor``) broadcasts each step to worker
processes over shared memory; both expose the same methods.

Steps run either at once (``execute_model``) or as ``submit_step`` now, ``collect_step`` later, in order:
the engine keeps up to ``max_in_flight`` steps submitted (the number of pipeline stages) so every stage
has work. With async scheduling (``overlaps_steps``, the in-process executor only) that is two: the runner
launches a step on the device and returns (``ModelRunner.submit_step``), and the engine schedules and
launches the next one before it waits for the first one's tokens (``ModelRunner.collect_step``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from protocol.step_types import ModelRunnerOutput, SchedulerOutput
from worker.config import EngineConfig
from worker.model_runner import ModelRunner, PendingStep
from worker.parallel_state import init_tensor_parallel


class Executor(Protocol):
    num_kv_blocks: int
    max_model_len: int
    eos_token_ids: list[int]
    vocab_size: int
    max_in_flight: int
    overlaps_steps: bool  # async scheduling: requests run ahead into the next step (engine.scheduler)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def submit_step(self, sched: SchedulerOutput) -> None: ...

    def collect_step(self) -> ModelRunnerOutput: ...

    def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = None) -> list[Any]: ...

    def save_kv_blocks(self, block_ids: list[int]) -> Callable[[], list[list[bytes | memoryview]]]:
        """Start reading whole KV blocks for the KV tier; the returned call gives each block's pieces (one per
        rank, in rank order), waiting for the copy if it must. The blocks may be reused once it returns."""
        ...

    def load_kv_blocks(self, block_ids: list[int], pieces: list[list[bytes | memoryview]]) -> None:
        """Fill whole KV blocks from the tier: ``pieces[i]`` holds block i's pieces, one per rank."""
        ...

    def shutdown(self) -> None: ...


class UniprocExecutor:
    def __init__(self, config: EngineConfig):
        init_tensor_parallel(0, 1, "", torch.device(config.device))
        self.overlaps_steps = config.use_async_scheduling
        self.max_in_flight = 2 if self.overlaps_steps else 1
        self.runner = ModelRunner(config)
        self.num_kv_blocks = self.runner.determine_num_kv_blocks()
        self.runner.init_kv_cache(self.num_kv_blocks)
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = self.runner.eos_token_ids
        self.vocab_size = self.runner.hf_config.vocab_size
        self._submitted: deque[PendingStep] = deque()

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(sched)

    def submit_step(self, sched: SchedulerOutput) -> None:
        self._submitted.append(self.runner.submit_step(sched))

    def collect_step(self) -> ModelRunnerOutput:
        return self.runner.collect_step(self._submitted.popleft())

    def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = None) -> list[Any]:
        return [getattr(self.runner, method)(*args)]

    def save_kv_blocks(self, block_ids: list[int]) -> Callable[[], list[list[bytes | memoryview]]]:
        read = self.runner.start_kv_read(block_ids)  # queued behind the steps in flight; waited for in the call
        return lambda: [[piece] for piece in read.pieces()]

    def load_kv_blocks(self, block_ids: list[int], pieces: list[list[bytes | memoryview]]) -> None:
        self.runner.write_kv_blocks(block_ids, [[block[0] for block in pieces]])

    def shutdown(self) -> None:
        self.runner.kv_caches = []


def make_executor(config: EngineConfig, dp_rank: int = 0, rendezvous=None) -> Executor:
    """``dp_rank`` names the workers and their queues (``worker.multiproc_executor.worker_title``), so the
    engines of one host stay apart; ``rendezvous`` (a ``worker.remote_stages.WorkerRendezvous``) is where
    worker hosts meet an engine with remote pipeline stages."""
    if config.world_size == 1:
        return UniprocExecutor(config)
    from worker.multiproc_executor import MultiprocExecutor
    return MultiprocExecutor(config, dp_rank=dp_rank, rendezvous=rendezvous)
