"""Attention over the paged KV cache, for prefill (with or without a cached prefix) and decode.

The flattened batch puts decode tokens (one query per request) first, then each prefill chunk.
K/V of the step are written to their slots first; every query then reads its context from the cache
through its block table. The cache is slot-major, ``[2, num_slots, kv_heads, head_dim]``: gathering a
batch's context is one row-wise ``index_select`` (whole 2*kv_heads*d-byte rows, the fastest gather on
CPU). Decode attention then runs as two batched matmuls against all KV heads at once, with each query
masked to its own head's block (``head_mask``): the extra multiply-adds by zero cost far less than the
copies a per-head layout would need, and K/V are never repeated for GQA. Prefill chunks use SDPA on 4-D
tensors with ``enable_gqa`` (K/V never repeated), the layout torch's fused flash kernel takes on the CPU:
2x faster than the unfused path at 512 tokens, 3-6x at 2048 (one thread, fp32, AVX2; a chunk with no
cached prefix and no window runs ``is_causal``, the rest with the chunk's [tokens, context] mask). Adjacent
fresh chunks of one length (a wave of new prompts alike) go through one SDPA call with the chunks as its batch
(``AttentionMetadata.prefill_runs``): bit-identical to a call each, and on a 2-core Xeon (bfloat16, SmolLM2's
9 / 3 heads, one layer of 16 prompts x 128 tokens) 2.37-3.00 -> 1.87-2.19 ms. Runs on CPU and CUDA with plain
torch ops.

On CPU, when the C++ kernel builds (``worker.kernels``, csrc/paged_attention.cpp), the step's K/V rows are
written by one kernel call (``write_kv``) instead of two ``index_copy_``, and decodes go
through one kernel call per layer that reads each cached K/V row once, straight from the cache through
the block tables (``PagedBatch``), GQA groups sharing each read. The kernel serves prefill chunks over
a cached prefix too, but SDPA's GEMMs win from about 8 queries on, so ``InputBatch`` (which decides the
layout a step carries) sends it decodes and short cached-prefix chunks only.

On CUDA, where triton imports (``use_triton``), the step carries a ``UnifiedBatch`` instead and nothing
else: one Triton launch writes its K/V through the slot mapping and one launch per layer attends every
query row, decodes and prefill chunks alike (``worker.kernels.triton_attention``), with no per-request
loop, no gather and no multiply by other heads' zeros. The torch path above stays for CUDA without triton.

Rules:
- A layer with a ``sliding_window`` W lets the query at position q read only keys at k > q - W (the
  Hugging Face rule), in decode and in every prefill chunk. All blocks stay allocated: older tokens are
  masked, never freed (freeing blocks outside the window is an optimization left undone).
- ``softcap`` c (Gemma 2) maps scores s to c * tanh(s / c) before masking; prefill then computes the
  scores by hand since SDPA cannot cap them.
- Window masks are built once per step and window size, and shared by every layer (cached on the
  metadata), and so are the output buffer and the split-KV scratch: nothing is allocated per layer that
  could live for the step.
- The kernel and the torch path agree to float rounding (tests/test_paged_attention.py), and so do the
  Triton kernels, interpreted on the CPU in float32 and float16, bfloat16 on CUDA only
  (tests/test_triton_attention.py).
- Which device takes the Triton path, and how ``REDSERVE_TRITON_ATTENTION`` overrides it: ``worker.layers.triton_path``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F

from worker.kernels import load_extension
from worker.layers.triton_path import triton_module, triton_smoke_test, use_triton  # noqa: F401 (re-exported)


@dataclass
class PrefillChunk:
    start: int
    num_tokens: int
    num_computed: int
    slot_index: torch.Tensor | None
    causal_mask: torch.Tensor | None
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, window: int) -> torch.Tensor:
        """``causal_mask`` ([tokens, context]) narrowed to keys within ``window``."""
        if window not in self.window_masks:
            context = self.num_computed + self.num_tokens
            device = self.causal_mask.device
            queries = torch.arange(self.num_computed, context, device=device)
            keys = torch.arange(context, device=device)
            self.window_masks[window] = self.causal_mask & (keys.unsqueeze(0) > queries.unsqueeze(1) - window)
        return self.window_masks[window]


@dataclass
class PagedBatch:
    """The sequences the C++ kernel serves in a step, as int32 CPU tensors: sequence s owns query rows
    ``[query_start[s], query_start[s] + query_lens[s])`` and ``context_lens[s]`` cached keys (its new
    tokens included); ``block_tables[s]`` lists its blocks."""

    block_size: int
    block_tables: torch.Tensor
    query_start: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor


@dataclass
class UnifiedBatch:
    """Every sequence of a step, for the Triton kernel (``worker.kernels.triton_attention``), as int32
    tensors on the device: sequence s owns query rows ``[query_start_loc[s], query_start_loc[s + 1])``
    and ``seq_lens[s]`` keys (its new tokens included); ``block_tables[s]`` lists its blocks. The host
    ints size the launch without reading the device. ``num_splits`` fixes the split-KV count (CUDA graphs
    need launches that do not depend on the step's lengths); None lets each step choose."""

    block_size: int
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    split_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    num_splits: int | None = None

    def scratch(self, tokens: int, heads: int, splits: int, head_dim: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The split-KV partial outputs [T, H, splits, d] and log-sum-exps [T, H, splits] (float32), shared
        by every layer of the step."""
        shape = (tokens, heads, splits, head_dim)
        if self.split_buffers is None or self.split_buffers[0].shape != shape:
            self.split_buffers = (torch.empty(shape, dtype=torch.float32, device=device),
                                  torch.empty(shape[:3], dtype=torch.float32, device=device))
        return self.split_buffers


def attention_layers(model: torch.nn.Module) -> list[PagedAttention]:
    """The model's `PagedAttention` objects (each attention module's ``attn``)."""
    return [m.attn for m in model.modules() if isinstance(getattr(m, "attn", None), PagedAttention)]


# The most queries a prefill chunk sends to the kernel's native prefill path, by dtype (more go to SDPA). One layer,
# two threads, 2-core AMD EPYC (Zen 4), 6 Dec 2026, the kernel against SDPA on the same chunks: bfloat16
# (csrc/prefill_bf16.h, AVX512-BF16) faster at every length (16 x 128 tokens 1.55 against 5.1 ms, 1 x 2048 19.3
# against 34.7); float32 (csrc/prefill_f32.h, AVX2) faster up to 512 (16 x 128 3.4-3.9 against 5.1-7.8 ms, 2 x 512
# 5.8 against 7.2), slower from 1024 (1 x 1024 11.6 against 9.9 ms; 1 x 2048 49.4 against 39.2): SDPA's GEMMs win there.
PREFILL_KERNEL_MAX_QUERIES = {torch.bfloat16: 1 << 30, torch.float32: 512}


def kernel_prefill_max_queries(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """The most queries of a prefill chunk that go to the C++ kernel's native prefill path (csrc/prefill_bf16.h,
    csrc/prefill_f32.h) instead of SDPA: ``PREFILL_KERNEL_MAX_QUERIES`` where that path serves every attention layer
    of the model in ``dtype``, else 0. ``REDSERVE_NO_KERNELS`` naming ``prefill`` turns it off (A/B runs)."""
    kernel = paged_attention_kernel()
    if kernel is None or "prefill" in os.environ.get("REDSERVE_NO_KERNELS", "").split(","):
        return 0
    layers = attention_layers(model)
    if not layers or not all(kernel.native_prefill(dtype, a.head_dim, a.softcap or 0.0) for a in layers):
        return 0
    return PREFILL_KERNEL_MAX_QUERIES.get(dtype, 0)


def paged_attention_kernel():
    """The compiled CPU kernel module, or None (one warning line) where it cannot be built."""
    return load_extension("paged_attention")


def triton_attention() -> ModuleType | None:
    """``worker.kernels.triton_attention``, or None where triton is not installed."""
    return triton_module("triton_attention")


@dataclass
class AttentionMetadata:
    """Per-step layout shared by every layer. ``decode_slots`` [B, L] holds the cache slot of each
    context position of each decode request (padding points at slot 0 and is masked out)."""

    slot_mapping: torch.Tensor
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    paged: PagedBatch | None = None
    unified: UnifiedBatch | None = None
    decode_window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    out_buffer: torch.Tensor | None = None
    _prefill_runs: list[list[PrefillChunk]] | None = field(default=None, repr=False)

    def prefill_runs(self) -> list[list[PrefillChunk]]:
        """``prefills`` in runs: adjacent fresh chunks (nothing cached before them) of one length share a run,
        which one batched SDPA call serves; every other chunk is a run of its own. Built once per step."""
        if self._prefill_runs is None:
            runs: list[list[PrefillChunk]] = []
            for chunk in self.prefills:
                last = runs[-1][-1] if runs else None
                if (last is not None and chunk.num_computed == 0 and last.num_computed == 0
                        and chunk.num_tokens == last.num_tokens and chunk.start == last.start + last.num_tokens):
                    runs[-1].append(chunk)
                else:
                    runs.append([chunk])
            self._prefill_runs = runs
        return self._prefill_runs

    def output_like(self, q: torch.Tensor) -> torch.Tensor:
        """One [T, H, d] output buffer for the step, reused by every layer (each layer's o_proj reads it
        before the next layer writes it)."""
        buf = self.out_buffer
        if buf is None or buf.shape != q.shape or buf.dtype != q.dtype or buf.device != q.device:
            self.out_buffer = buf = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return buf

    def decode_window_mask(self, window: int) -> torch.Tensor:
        """``decode_mask`` that also masks every position at or before (query position - window)."""
        if window not in self.decode_window_masks:
            lengths = (~self.decode_mask).sum(dim=-1, keepdim=True)
            positions = torch.arange(self.decode_mask.shape[-1], device=self.decode_mask.device)
            self.decode_window_masks[window] = self.decode_mask | (positions <= lengths - 1 - window)
        return self.decode_window_masks[window]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """``k_cache[slots] = k`` and ``v_cache[slots] = v``: one C++ call on the CPU when the kernel builds and
    each token's K/V row is contiguous (also as views into the qkv output), else two ``index_copy_``."""
    kernel = paged_attention_kernel() if k_cache.device.type == "cpu" else None
    if kernel is not None and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v)):
        kernel.write_kv(k_cache, v_cache, slots, k, v)
        return
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


class PagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *, scale: float | None = None,
                 sliding_window: int | None = None, softcap: float | None = None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        self._head_mask: torch.Tensor | None = None

    def head_mask(self, like: torch.Tensor) -> torch.Tensor:
        """[H, KVH, 1]: 1 where query head h reads KV head h // group, else 0."""
        if self._head_mask is None or self._head_mask.dtype != like.dtype or self._head_mask.device != like.device:
            mask = torch.zeros(self.num_heads, self.num_kv_heads, 1, dtype=like.dtype, device=like.device)
            mask[torch.arange(self.num_heads), torch.arange(self.num_heads) // self.group] = 1
            self._head_mask = mask
        return self._head_mask

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, d]; k, v: [T, KVH, d]; kv_cache: [2, num_slots, KVH, d]. Returns [T, H*d]."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        out = meta.output_like(q)
        if meta.unified is not None:  # the whole batch: one K/V write and one attention launch
            kernels = triton_attention()
            kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            kernels.unified_attention(q, k_cache, v_cache, out, meta.unified, scale=self.scale,
                                      sliding_window=self.sliding_window, softcap=self.softcap)
            return out.view(q.shape[0], -1)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.paged is not None:
            self._paged(q, k_cache, v_cache, meta.paged, out)
        if meta.num_decodes:
            out[:meta.num_decodes] = self._decode(q[:meta.num_decodes], k_cache, v_cache, meta)
        for run in meta.prefill_runs():
            if len(run) > 1 and self.softcap is None and self.sliding_window is None:
                self._fresh_prefills(q, k, v, run, out)
                continue
            for chunk in run:
                rows = slice(chunk.start, chunk.start + chunk.num_tokens)
                out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk)
        return out.view(q.shape[0], -1)

    def _fresh_prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: list[PrefillChunk],
                        out: torch.Tensor) -> None:
        """Adjacent fresh chunks of one length, causal: one SDPA call over [chunks, heads, tokens, d] views of the
        step's rows (no copies in), the batch dimension walked by torch's flash kernel."""
        count, n = len(run), run[0].num_tokens
        rows = slice(run[0].start, run[0].start + count * n)
        queries = q[rows].view(count, n, self.num_heads, self.head_dim).transpose(1, 2)
        keys = k[rows].view(count, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        values = v[rows].view(count, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        result = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=self.scale,
                                                enable_gqa=True)
        out[rows].view(count, n, self.num_heads, self.head_dim).copy_(result.transpose(1, 2))

    def _paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
               out: torch.Tensor) -> None:
        paged_attention_kernel().paged_attention(
            out, q, k_cache, v_cache, batch.block_tables, batch.query_start, batch.query_lens,
            batch.context_lens, batch.block_size, self.scale, self.sliding_window or 0, self.softcap or 0.0)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        batch, length = meta.decode_slots.shape
        width = self.num_kv_heads * self.head_dim
        slots = meta.decode_slots.view(-1)
        keys = k_cache.view(-1, width).index_select(0, slots).view(batch, length, width)
        values = v_cache.view(-1, width).index_select(0, slots).view(batch, length, width)
        queries = (q.unsqueeze(2) * self.head_mask(q)).view(batch, self.num_heads, width)
        scores = self._capped(torch.bmm(queries, keys.transpose(1, 2)).float() * self.scale)
        mask = meta.decode_mask if self.sliding_window is None else meta.decode_window_mask(self.sliding_window)
        scores.masked_fill_(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.bmm(probs, values).view(batch, self.num_kv_heads, self.group, self.num_kv_heads, self.head_dim)
        return torch.diagonal(out, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(batch, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        n = chunk.num_tokens
        if chunk.num_computed:
            k = k_cache.index_select(0, chunk.slot_index)
            v = v_cache.index_select(0, chunk.slot_index)
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
        mask = chunk.causal_mask if self.sliding_window is None else chunk.window_mask(self.sliding_window)
        if self.softcap is None:
            # 4-D with enable_gqa: the shape torch's fused (flash) CPU kernel takes; a chunk with nothing
            # before it and no window is plainly causal, which lets the kernel skip the masked tiles.
            causal = chunk.num_computed == 0 and self.sliding_window is None
            out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0),
                                                 values.unsqueeze(0), attn_mask=None if causal else mask,
                                                 is_causal=causal, scale=self.scale, enable_gqa=True)
            return out[0].transpose(0, 1)
        queries = q.transpose(0, 1).reshape(self.num_kv_heads, self.group * n, self.head_dim)
        scores = self._capped(torch.matmul(queries, keys.transpose(1, 2)).float() * self.scale)
        probs = torch.softmax(scores.masked_fill_(~mask.repeat(self.group, 1), float("-inf")), dim=-1).to(q.dtype)
        return torch.matmul(probs, values).view(self.num_heads, n, self.head_dim).transpose(0, 1)

    def _capped(self, scores: torch.Tensor) -> torch.Tensor:
        if self.softcap is None:
            return scores
        return torch.tanh(scores / self.softcap) * self.softcap
