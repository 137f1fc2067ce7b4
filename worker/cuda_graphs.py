"""Decode steps under CUDA graphs: one captured forward pass per batch-size bucket, replayed with the step's
inputs copied into static buffers, so a decode step costs a few copies and one graph launch instead of
hundreds of kernel launches.

``GraphRunner`` holds the static inputs (token ids, positions, slot mapping, block tables as wide as
max_model_len needs, query_start_loc, seq_lens) and the static outputs: the final hidden stream and, given a
``logits`` function, every row's float32 logits (a decode-only step samples every row, in row order, so
the final norm and the LM head run inside the graph too; sampling stays eager). Its
backend is ``CudaGraph`` (torch.cuda.CUDAGraph) or ``EagerGraph``, a stand-in whose "replay" calls the
captured function again: the CPU tests run bucketing, padding and the static buffers through the same
code, everything but the capture itself.

Rules:
- Only decode-only steps on the Triton path (a ``UnifiedBatch`` whose sequences each have one query) of
  at most the largest bucket run under a graph; prefill and mixed steps, and bigger batches, stay eager.
- Buckets (``capture_sizes``): 1, 2, 4, then multiples of 8 up to the first that holds ``max_num_seqs``
  (at most ``MAX_CAPTURE_SIZE``). A batch of n runs the smallest bucket >= n.
- Padding rows (n..bucket) are harmless sequences: slot -1 (the K/V write skips negative slots), one
  query over one key (``seq_lens`` 1, read from whatever block id their row of the table holds: a zero
  or a stale, valid id of an earlier step), their outputs ignored. A sequence with zero queries would
  leave its output rows unwritten (``torch.empty``), and could feed NaNs into later layers' padding
  rows; one key costs the same and keeps every row finite. Rows are reset to padding only when the
  batch shrinks (``_real_rows``), so a steady batch pays no fills.
- The launches are fixed per bucket: the Triton grid by the bucket size, the split-KV count by
  ``choose_num_splits`` at max_model_len for that bucket (``UnifiedBatch.num_splits``), so long
  contexts at small batches keep the split they get eagerly; shorter contexts leave the later splits
  without keys, which write lse = -inf and weigh nothing in the combine.
- Capture runs after the KV cache is allocated (the graphs bind its addresses), largest bucket first,
  every graph in one memory pool, each after one eager warm-up run of the same function (compiles the
  Triton kernels, allocates the step's output and split buffers outside the graph, opens NCCL's
  communicator under TP). Nothing in the captured function reads the device from the host.
- Under TP every worker captures its own graphs, the NCCL all-reduce (torch.distributed) inside them:
  ProcessGroupNCCL skips its watchdog bookkeeping while a stream captures (torch >= 2.2) and NCCL >=
  2.9.6 captures collectives. Pipeline parallelism stays eager (the stage link sends from the host).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable

import torch

from worker.layers.attention import AttentionMetadata, UnifiedBatch

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """1, 2, 4, 8, 16, 24, ...: up to the first size that holds ``max_num_seqs``, at most ``limit``."""
    sizes = []
    for size in itertools.chain((1, 2, 4), itertools.count(8, 8)):
        if size > limit:
            break
        sizes.append(size)
        if size >= max_num_seqs:
            break
    return sizes


def graphs_off_reason(*, device: torch.device, enforce_eager: bool, use_triton: bool,
                      pipeline_parallel_size: int) -> str | None:
    """Why a model runner with these settings runs every step eagerly, or None when it captures graphs."""
    if device.type != "cuda":
        return "not a CUDA device"
    if enforce_eager:
        return "--enforce-eager"
    if not use_triton:
        return "the torch attention path (no Triton kernels)"
    if pipeline_parallel_size > 1:
        return "pipeline parallelism"
    return None


class EagerGraph:
    """The stand-in backend: ``capture`` keeps the function, ``replay`` calls it again."""

    def __init__(self) -> None:
        self.fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None], pool) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class CudaGraph:
    """torch.cuda.CUDAGraph: ``capture`` records one call of the function into ``pool``."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], None], pool) -> None:
        with torch.cuda.graph(self.graph, pool=pool):
            fn()

    def replay(self) -> None:
        self.graph.replay()


Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
Logits = Callable[[torch.Tensor], torch.Tensor]


class GraphRunner:
    """The static buffers and one graph per bucket (see the module rules). ``forward(input_ids, positions,
    meta)`` is the model's forward pass over this rank's KV cache, returning the hidden stream [T, hidden];
    ``num_splits(size)`` the split-KV count the bucket's graph uses; ``logits(hidden)`` (optional, with
    ``vocab_size``) the float32 logits of hidden rows, captured too (``logits``, valid as ``hidden``)."""

    def __init__(self, forward: Forward, *, sizes: list[int], max_blocks: int, block_size: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, max_seq_len: int, num_splits: Callable[[int], int],
                 backend: type = CudaGraph, logits: Logits | None = None, vocab_size: int = 0):
        self.forward = forward
        self.logits_fn = logits
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.num_splits = num_splits
        self.backend = backend
        self.device = device
        rows = self.sizes[-1]
        with torch.inference_mode():
            self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
            self.positions = torch.zeros(rows, dtype=torch.long, device=device)
            self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
            self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)
            self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)  # one query per row
            self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
            self.hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
            self.logits = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device) if logits else None
        self.graphs: dict[int, CudaGraph | EagerGraph] = {}
        self.metas: dict[int, AttentionMetadata] = {}
        self._real_rows = 0  # rows [0, _real_rows) may hold an earlier step's data; the rest are padding

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds ``num_seqs`` sequences, or None when none does."""
        at = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[at] if at < len(self.sizes) else None

    def can_run(self, inputs) -> bool:
        """Whether this step (``StepInputs``) runs under a graph: decode-only, on the Triton path, and small
        enough for a bucket."""
        batch = inputs.meta.unified
        return (bool(self.graphs) and batch is not None and batch.max_query_len == 1 and not inputs.meta.prefills
                and batch.num_seqs <= self.max_size)

    def _meta(self, size: int) -> AttentionMetadata:
        batch = UnifiedBatch(self.block_size, self.block_tables[:size], self.query_start_loc[:size + 1],
                             self.seq_lens[:size], size, 1, self.max_seq_len, num_splits=self.num_splits(size))
        return AttentionMetadata(slot_mapping=self.slot_mapping[:size], unified=batch)

    def _step(self, size: int) -> None:
        """What a graph holds: the forward pass over the first ``size`` static rows, into ``hidden``."""
        hidden = self.forward(self.input_ids[:size], self.positions[:size], self.metas[size])
        self.hidden[:size].copy_(hidden)
        if self.logits_fn is not None:
            self.logits[:size].copy_(self.logits_fn(hidden))

    def _pad(self, rows: int) -> None:
        """Rows from ``rows`` on become padding (slot -1, one key)."""
        if self._real_rows > rows:
            self.slot_mapping[rows:self._real_rows].fill_(-1)
            self.seq_lens[rows:self._real_rows].fill_(1)
        self._real_rows = rows

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket, largest first, into one pool; logs the time and the device memory taken."""
        cuda = self.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        if cuda:
            torch.cuda.synchronize(self.device)
            free_before = torch.cuda.mem_get_info(self.device)[0]
        started = time.perf_counter()
        self._pad(0)
        for size in reversed(self.sizes):
            self.metas[size] = self._meta(size)
            self._step(size)  # warm-up, eager
            graph = self.backend()
            graph.capture(lambda size=size: self._step(size), pool)
            self.graphs[size] = graph
        if cuda:
            torch.cuda.synchronize(self.device)
            used = free_before - torch.cuda.mem_get_info(self.device)[0]
            logger.info("captured %d CUDA graphs (decode batches %d..%d) in %.1fs, %.0f MiB of device memory",
                        len(self.graphs), self.sizes[0], self.max_size, time.perf_counter() - started, used / 2**20)
        else:
            logger.info("prepared %d decode graphs (batches %d..%d, %s) in %.1fs", len(self.graphs), self.sizes[0],
                        self.max_size, self.backend.__name__, time.perf_counter() - started)

    def run(self, inputs) -> torch.Tensor:
        """The step's hidden stream [n, hidden] (a view of the static output, valid until the next run); its
        logits, when captured, are ``logits[:n]``."""
        batch = inputs.meta.unified
        rows = batch.num_seqs
        size = self.bucket(rows)
        self.input_ids[:rows].copy_(inputs.input_ids)
        self.positions[:rows].copy_(inputs.positions)
        self.slot_mapping[:rows].copy_(inputs.meta.slot_mapping)
        self.block_tables[:rows, :batch.block_tables.shape[1]].copy_(batch.block_tables)
        self.seq_lens[:rows].copy_(batch.seq_lens)
        self._pad(rows)
        self.graphs[size].replay()
        return self.hidden[:rows]
