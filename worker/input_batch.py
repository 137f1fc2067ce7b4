"""Per-request state a model runner keeps between steps, and the tensors one step is built from.

The scheduler sends a request in full once; afterwards the runner knows its tokens (it sampled them)
and gets only new block ids and the computed-token count. Decodes go first in the flattened batch,
then prefill chunks, as ``PagedAttention`` expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from protocol.sampling_params import SamplingParams
from protocol.step_types import SchedulerOutput
from worker.layers import attention
from worker.layers.attention import AttentionMetadata, PagedBatch, PrefillChunk, paged_attention_kernel
from worker.sampler import SampledBatch, SamplingBatch
from worker.transfer import to_device

PLACEHOLDER_TOKEN = -1  # a sampled token not read back yet (async scheduling); never reaches the model


@dataclass
class PendingToken:
    """A request's token sampled by a step whose output is not back: where it will go in ``token_ids`` and
    where it is on the device (row ``row`` of ``samples.token_ids``)."""

    position: int
    samples: SampledBatch
    row: int


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    prompt_logprobs: list[list] | None = None  # accumulated over prefill chunks when asked
    prompt_logprobs_sent: bool = False
    pending: PendingToken | None = None  # its last token, while the step that sampled it is in flight
    row: int = -1  # its row of the InputBatch's BlockTable

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent


@dataclass
class PromptLogprobRows:
    """Where one request's prompt positions sit in this step's flattened batch, and the next tokens."""

    state: CachedRequestState
    hidden_indices: list[int]
    next_token_ids: list[int]


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampled_states: list[CachedRequestState]
    prompt_rows: list[PromptLogprobRows]
    placeholders: list[tuple[int, PendingToken]] = field(default_factory=list)  # (row of input_ids, its token)


class HostBuffer:
    """A numpy buffer that lives for the run: ``take`` hands out a view of its first rows (and columns),
    growing it (doubling) only when a step needs more. Contents past what a step writes are stale."""

    def __init__(self, dtype: type, columns: int | None = None):
        self.dtype = dtype
        self.array = np.zeros((64,) if columns is None else (64, columns), dtype=dtype)

    def take(self, rows: int, columns: int | None = None) -> np.ndarray:
        shape = self.array.shape
        if rows > shape[0] or (columns is not None and columns > shape[1]):
            grown = [max(rows, 2 * shape[0])] + ([] if columns is None else [max(columns, 2 * shape[1])])
            self.array = np.zeros(grown, dtype=self.dtype)
        return self.array[:rows] if columns is None else self.array[:rows, :columns]


class BlockTable:
    """Every live request's block ids as one row of a numpy array that lives for the run, written only when a
    request arrives or gets new blocks; a step's table is one gather of its requests' rows (``take``)
    instead of a Python copy of every request's block list every step. Past a row's blocks: stale ids."""

    def __init__(self, rows: int = 64, columns: int = 64):
        self.array = np.zeros((rows, columns), dtype=np.int32)
        self.free = list(range(rows - 1, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        if not self.free:
            rows = self.array.shape[0]
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self.free = list(range(2 * rows - 1, rows - 1, -1))
        row = self.free.pop()
        self.write(row, block_ids)
        return row

    def write(self, row: int, block_ids: list[int], start: int = 0) -> None:
        end = start + len(block_ids)
        if end > self.array.shape[1]:
            grown = np.zeros((self.array.shape[0], max(end, 2 * self.array.shape[1])), dtype=np.int32)
            grown[:, :self.array.shape[1]] = self.array
            self.array = grown
        self.array[row, start:end] = block_ids

    def release(self, row: int) -> None:
        self.free.append(row)

    def take(self, rows: list[int], width: int) -> np.ndarray:
        """[len(rows), width]: the first ``width`` block ids of each row (a new array)."""
        return self.array[rows, :width]


@dataclass
class StepBuffers:
    """The host buffers one step's input tensors are views of (``HostBuffer``)."""

    input_ids: HostBuffer = field(default_factory=lambda: HostBuffer(np.int64))
    positions: HostBuffer = field(default_factory=lambda: HostBuffer(np.int64))
    slots: HostBuffer = field(default_factory=lambda: HostBuffer(np.int64))


class InputBatch:
    """Rules: on CUDA with triton (``use_triton``; ``REDSERVE_TRITON_ATTENTION`` overrides), every request
    of the step goes to the Triton kernels as one ``UnifiedBatch`` (decodes and prefill chunks alike) and
    none of the torch path's slot tables and masks are built. On CPU, when the C++ paged-attention
    kernel is available (``use_kernel``), decodes (and cached-prefix chunks of at most
    ``kernel_max_queries`` tokens) go to it as one ``PagedBatch``; otherwise (CUDA without triton, or no
    compiler) decodes get padded slot tables and masks for the torch path. Longer chunks go to SDPA: its GEMM-based CPU kernel, gather included, beats the per-row kernel
    from about 8 queries on (measured: 448 cached + 2/4/8/16 new tokens), except where the kernel's native
    prefill path serves the model (``kernel_prefill_max_queries``, set by the runner from
    ``attention.kernel_prefill_max_queries``): chunks of up to that many tokens go to the kernel too. Input tensors on CPU are views
    of ``StepBuffers`` (the token ids, positions and slots) and are valid until the next ``prepare``; block
    tables are gathered from the ``BlockTable``, one row per live request."""

    kernel_max_queries = 4
    kernel_prefill_max_queries = 0  # chunks of up to this many tokens to the kernel (its native prefill path)

    def __init__(self, block_size: int, device: torch.device, num_heads_per_kv: int, eos_token_ids: list[int],
                 use_kernel: bool | None = None, use_triton: bool | None = None):
        self.block_size = block_size
        self.device = device
        self.group = num_heads_per_kv
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, CachedRequestState] = {}
        self.buffers = StepBuffers()
        self.block_table = BlockTable()
        self._positions = np.arange(1024, dtype=np.int64)
        self.use_triton = attention.use_triton(device) if use_triton is None else use_triton
        if use_kernel is None:
            use_kernel = device.type == "cpu" and not self.use_triton and paged_attention_kernel() is not None
        self.use_kernel = use_kernel and not self.use_triton

    def update(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self._forget(req_id)
        for new in sched.new_requests:
            self._forget(new.req_id)
            params = new.sampling
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, new.prompt_token_ids, new.prompt_token_ids + new.output_token_ids, params,
                list(new.block_ids), new.num_computed_tokens, generator, row=self.block_table.add(new.block_ids))
        for cached in sched.cached_requests:
            state = self.requests[cached.req_id]
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
                self.block_table.write(state.row, state.block_ids)
                state.prompt_logprobs = None  # recomputed from the start
            elif cached.new_block_ids:
                self.block_table.write(state.row, cached.new_block_ids, len(state.block_ids))
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _forget(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.block_table.release(state.row)

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        items = sched.num_scheduled_tokens.items()
        order = [item for item in items if item[1] == 1] + [item for item in items if item[1] != 1]
        bs, buf, requests = self.block_size, self.buffers, self.requests
        total = sum(n for _, n in order)
        input_ids, positions, slots = buf.input_ids.take(total), buf.positions.take(total), buf.slots.take(total)
        arange = self._arange(max((requests[r].num_computed_tokens + n for r, n in order), default=0))
        logits_indices: list[int] = []
        sampled: list[CachedRequestState] = []
        prompt_rows: list[PromptLogprobRows] = []
        placeholders: list[tuple[int, PendingToken]] = []
        decodes: list[tuple[list[int], int]] = []
        prefills: list[tuple[int, int, int, list[int]]] = []
        paged: list[tuple[int, int, int, int, int]] = []  # (start, n, context, table row, blocks)
        batched = self.use_triton or self.use_kernel
        start = 0
        for req_id, n in order:
            state = requests[req_id]
            c = state.num_computed_tokens
            end, context = start + n, c + n
            num_blocks = -(-context // bs)
            if n == 1:
                input_ids[start] = state.token_ids[c]
                positions[start] = c
                slots[start] = state.block_ids[c // bs] * bs + c % bs
            else:
                input_ids[start:end] = state.token_ids[c:context]
                positions[start:end] = arange[c:context]
                table = np.asarray(state.block_ids[:num_blocks], dtype=np.int64)
                slots[start:end] = table[arange[c:context] // bs] * bs + arange[c:context] % bs
            if state.pending is not None and c <= state.pending.position < context:
                placeholders.append((start + state.pending.position - c, state.pending))
            if batched and (self.use_triton or n <= self.kernel_prefill_max_queries
                            or ((n == 1 or c) and n <= self.kernel_max_queries)):
                paged.append((start, n, context, state.row, num_blocks))
            elif n == 1:
                decodes.append((state.block_ids[:num_blocks], context))
            else:
                prefills.append((start, n, c, state.block_ids[:num_blocks]))
            if context == len(state.token_ids):
                logits_indices.append(end - 1)
                sampled.append(state)
            if state.params.prompt_logprobs is not None and not state.prompt_logprobs_sent:
                rows = self._prompt_rows(state, start, c, n)
                if rows.hidden_indices:
                    prompt_rows.append(rows)
            start = end
        meta = AttentionMetadata(slot_mapping=self._device(slots))
        if paged and self.use_triton:
            meta.unified = self._unified_batch(paged)
        elif paged:
            meta.paged = self._paged_batch(paged)
        if decodes:
            self._add_decodes(meta, [t for t, _ in decodes], [length for _, length in decodes])
        meta.prefills = [self._prefill_chunk(*spec) for spec in prefills]
        return StepInputs(self._device(input_ids), self._device(positions), meta,
                          self._tensor(logits_indices), sampled, prompt_rows, placeholders)

    @staticmethod
    def _prompt_rows(state: CachedRequestState, start: int, computed: int, n: int) -> PromptLogprobRows:
        """The chunk's positions p < len(prompt) - 1, whose logits predict prompt token p + 1."""
        end = min(computed + n, len(state.prompt_token_ids) - 1)
        positions = range(computed, end)
        return PromptLogprobRows(state, [start + p - computed for p in positions],
                                 [state.prompt_token_ids[p + 1] for p in positions])

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.long, self.device)

    def _arange(self, length: int) -> np.ndarray:
        if len(self._positions) < length:
            self._positions = np.arange(max(length, 2 * len(self._positions)), dtype=np.int64)
        return self._positions

    def _device(self, array: np.ndarray) -> torch.Tensor:
        """A view of a run-long host buffer on CPU; elsewhere a copy that does not wait for the device (it
        goes through pinned memory of its own, so the buffer may be refilled next step)."""
        return to_device(array, None, self.device)

    def _paged_batch(self, specs: list[tuple[int, int, int, int, int]]) -> PagedBatch:
        starts, lens, contexts, rows, blocks = zip(*specs, strict=True)
        tables = self.block_table.take(list(rows), max(blocks))
        return PagedBatch(self.block_size, torch.from_numpy(tables),
                          *(torch.from_numpy(np.array(values, dtype=np.int32)) for values in (starts, lens, contexts)))

    def _unified_batch(self, specs: list[tuple[int, int, int, int, int]]) -> attention.UnifiedBatch:
        starts, lens, contexts, rows, blocks = zip(*specs, strict=True)
        tables = self.block_table.take(list(rows), max(blocks))
        query_start = np.array((*starts, starts[-1] + lens[-1]), dtype=np.int32)
        seq_lens = np.array(contexts, dtype=np.int32)
        return attention.UnifiedBatch(self.block_size, self._device(tables), self._device(query_start),
                                      self._device(seq_lens), len(specs), max(lens), max(contexts))

    def _slot_table(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        table = torch.tensor(padded, dtype=torch.long).to(self.device, non_blocking=True)
        offsets = torch.arange(self.block_size, device=self.device)
        return (table.unsqueeze(-1) * self.block_size + offsets).view(len(tables), -1)

    def _add_decodes(self, meta: AttentionMetadata, tables: list[list[int]], lens: list[int]) -> None:
        # The context is padded to whole blocks, so the attention matmuls see a new shape once per block
        # rather than once per token: CPU kernels (oneDNN) build a primitive per new shape, which costs
        # far more than multiplying a few masked-out padding columns.
        meta.num_decodes = len(tables)
        meta.decode_slots = self._slot_table(tables)
        length = meta.decode_slots.shape[1]
        context = self._tensor(lens)
        positions = torch.arange(length, device=self.device)
        meta.decode_mask = (positions.unsqueeze(0) >= context.unsqueeze(1)).view(len(tables), 1, length)

    def _prefill_chunk(self, start: int, n: int, computed: int, blocks: list[int]) -> PrefillChunk:
        context = computed + n
        slot_index = self._slot_table([blocks])[0, :context] if computed else None
        keys = torch.arange(context, device=self.device)
        queries = torch.arange(computed, context, device=self.device)
        mask = keys.unsqueeze(0) <= queries.unsqueeze(1)
        return PrefillChunk(start, n, computed, slot_index, mask)

    def sampling_batch(self, states: list[CachedRequestState]) -> SamplingBatch:
        def stop_mask(s: CachedRequestState) -> list[int]:
            num_out = len(s.token_ids) - len(s.prompt_token_ids)
            if num_out >= s.params.min_tokens:
                return []
            return list(s.params.stop_token_ids) + ([] if s.params.ignore_eos else list(self.eos_token_ids))

        params = [s.params for s in states]
        needs_history = any(p.needs_penalties for p in params)
        return SamplingBatch(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
            generators=[s.generator for s in states],
            num_logprobs=[p.logprobs for p in params],
            repetition_penalty=[p.repetition_penalty for p in params],
            presence_penalty=[p.presence_penalty for p in params],
            frequency_penalty=[p.frequency_penalty for p in params],
            prompt_token_ids=[s.prompt_token_ids for s in states] if needs_history else [],
            output_token_ids=[s.token_ids[len(s.prompt_token_ids):] for s in states] if needs_history else [],
            stop_token_masks=[stop_mask(s) for s in states],
        )
