"""Paged attention on CUDA as Triton kernels: the step's K/V written through the slot mapping, then one
attention launch per layer over the whole flattened batch (decodes and prefill chunks alike).

Imports triton at the top: load it through ``worker.layers.attention.triton_attention()``, which returns
None where triton is missing, so the rest of the project imports without it. Under ``TRITON_INTERPRET=1``
(set before triton is first imported and while the kernels run: triton reads it when it decorates a
kernel, its own library's included, and when it launches one) the kernels run on CPU tensors, which is
how the tests check them without a GPU.

Layout (as ``PagedAttention``): q [T, H, d] (rows of one sequence are consecutive), the cache per layer
``[2, num_slots, KVH, d]`` with slot = block * block_size + offset, and a ``UnifiedBatch``: sequence s
owns query rows ``[query_start_loc[s], query_start_loc[s + 1])``, ``seq_lens[s]`` keys (its new tokens
included, so its first query sits at position seq_lens[s] - query_len) and the blocks
``block_tables[s]``.

Rules:
- One program serves one KV head and a tile of ``BLOCK_Q`` consecutive queries of one sequence, with the
  query heads that share that KV head packed in as rows (``BLOCK_Q * GROUP_PAD`` rows): each K/V tile is
  loaded once per KV head, never once per query head. Programs find their sequence by a binary search
  over ``query_start_loc``: sequence s's tiles start at ``query_start_loc[s] // BLOCK_Q + s``, so the
  grid is ``T // BLOCK_Q + num_seqs`` tiles (a few spare ones return at once) and needs no per-step
  tile table.
- Keys are walked in tiles of ``TILE_N`` positions, each position's slot looked up in the block table,
  from the first key any row of the tile may see (the window's start) to the last (causal end). Masks:
  key k is visible to the query at position q when k <= q and, with a window W, k > q - W (the Hugging
  Face rule); ``softcap`` c maps scores s to c * tanh(s / c) before masking. Scores, the running max
  and sum, and the output accumulate in float32 (online softmax); float32 inputs multiply as IEEE
  float32 (no TF32), so they agree with the torch path to float32 rounding.
- Split-KV (flash decoding): with ``num_splits`` > 1 every program takes only its share of the key tiles
  and writes its partial output (normalised over its own keys) and their log-sum-exp; a second kernel
  combines the splits per (token, head), weighting each by exp(lse - max lse). ``choose_num_splits``
  turns it on only when the batch gives too few programs to fill the GPU and the context is long. Under
  CUDA graphs the count is fixed per batch bucket (``UnifiedBatch.num_splits``) whatever the lengths:
  splits past a short context's last tile get no keys, write lse = -inf and weigh nothing.
- Negative slots in the slot mapping are skipped by the K/V write (the padding rows of a CUDA-graph
  batch, ``worker.cuda_graphs``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

TILE_N = 32  # keys per inner step
SPLIT_MIN_CONTEXT = 1024  # shorter contexts never split
SPLIT_MIN_TILES = 4  # key tiles each split gets at least
MAX_SPLITS = 16


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                     k_stride_t, k_stride_h, v_stride_t, v_stride_h, cache_stride_slot, cache_stride_h,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
                     DIM_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, HEADS_PAD)[:, None]
        dims = tl.arange(0, DIM_PAD)[None, :]
        mask = (heads < KV_HEADS) & (dims < HEAD_DIM)
        k = tl.load(k_ptr + token * k_stride_t + heads * k_stride_h + dims, mask=mask)
        v = tl.load(v_ptr + token * v_stride_t + heads * v_stride_h + dims, mask=mask)
        dest = slot * cache_stride_slot + heads * cache_stride_h + dims
        tl.store(k_cache_ptr + dest, k, mask=mask)
        tl.store(v_cache_ptr + dest, v, mask=mask)


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): saturates to +-1 without overflow trouble (e^2x -> inf or 0)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                      block_tables_ptr, query_start_ptr, seq_lens_ptr,
                      num_seqs, scale, softcap,
                      q_stride_t, q_stride_h, out_stride_t, out_stride_h,
                      cache_stride_slot, cache_stride_h, table_stride,
                      NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                      HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      BLOCK_Q: tl.constexpr, TILE: tl.constexpr, WINDOW: tl.constexpr,
                      USE_SOFTCAP: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The last sequence whose first query tile is at or before this one.
    lo = tile * 0
    hi = tile * 0 + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        starts_before = tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(starts_before, mid, lo)
        hi = tl.where(starts_before, hi, mid - 1)
    seq = lo
    first_row = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - first_row
    q_tile = tile - (first_row // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - query_len  # the position of the sequence's first query

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    query = q_tile * BLOCK_Q + rows // GROUP_PAD  # within the sequence
    in_group = rows % GROUP_PAD
    row_ok = (query < query_len) & (in_group < GROUP)
    head = kv_head * GROUP + in_group
    token = (first_row + query).to(tl.int64)
    q_pos = first_pos + query
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # Keys any row of this tile may see: [key_begin, key_end).
    key_end = tl.minimum(first_pos + (q_tile + 1) * BLOCK_Q, seq_len)
    key_begin = 0
    if WINDOW > 0:
        key_begin = tl.maximum(first_pos + q_tile * BLOCK_Q - WINDOW + 1, 0)
    tile_begin = key_begin // TILE
    tile_end = (key_end + TILE - 1) // TILE
    if NUM_SPLITS > 1:
        per_split = (tile_end - tile_begin + NUM_SPLITS - 1) // NUM_SPLITS
        tile_begin = tile_begin + split * per_split
        tile_end = tl.minimum(tile_end, tile_begin + per_split)

    m = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile gives no NaN
    denom = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * table_stride
    for t in range(tile_begin, tile_end):
        keys = t * TILE + tl.arange(0, TILE)
        key_ok = keys < key_end
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + keys % BLOCK_SIZE
        offsets = slot[:, None] * cache_stride_slot + kv_head * cache_stride_h + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (keys[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    out_mask = row_ok[:, None] & dim_ok[None, :]
    safe = tl.maximum(denom, 1.0e-30)  # 0 only for rows no key reached (padding rows, empty splits)
    if NUM_SPLITS == 1:
        out = acc / safe[:, None]
        tl.store(out_ptr + token[:, None] * out_stride_t + head[:, None] * out_stride_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc / safe[:, None], mask=out_mask)
        lse = tl.where(denom > 0, m + tl.log(safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _combine_kernel(part_out_ptr, part_lse_ptr, out_ptr, out_stride_t, out_stride_h,
                    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    DIM_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    parts = (token * NUM_HEADS + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    lse = tl.load(part_lse_ptr + parts)
    # Splits that got no keys (a fixed split count over a short context) hold lse = -inf and weigh 0; split 0
    # always gets the first key tile of the row's range, so the max is finite for every row with a key.
    weight = tl.exp(lse - tl.max(lse, 0))
    partial = tl.load(part_out_ptr + parts[:, None] * HEAD_DIM + dims[None, :], mask=dim_ok[None, :], other=0.0)
    out = tl.sum(partial * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + token * out_stride_t + head * out_stride_h + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_ok)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """``k_cache[slots] = k`` and ``v_cache[slots] = v`` in one launch; rows whose slot is negative are
    skipped. k, v: [T, KVH, d] (views into the qkv output are fine); caches: [num_slots, KVH, d]."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (k, v))
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(kv_heads), DIM_PAD=triton.next_power_of_2(head_dim))


def query_tile(group: int, max_query_len: int) -> int:
    """Queries per program: 16 rows (queries x padded group) for decode-only steps, 64 otherwise; at least
    one query, so a group of more than 16 heads still fits."""
    rows = 16 if max_query_len <= 1 else 64
    return max(1, rows // triton.next_power_of_2(group))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def choose_num_splits(programs: int, max_seq_len: int, device: torch.device, tile: int = TILE_N) -> int:
    """Split the keys only when the batch has fewer programs than two per multiprocessor and some context
    is long; as many splits (a power of two, at most ``MAX_SPLITS``) as fill the GPU while each keeps at
    least ``SPLIT_MIN_TILES`` key tiles."""
    target = 2 * _multiprocessors(device)
    if programs >= target or max_seq_len < SPLIT_MIN_CONTEXT:
        return 1
    wanted = min(-(-target // programs), max_seq_len // (tile * SPLIT_MIN_TILES), MAX_SPLITS)
    return 1 << (max(wanted, 1).bit_length() - 1)


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      batch, *, scale: float, sliding_window: int | None = None, softcap: float | None = None,
                      num_splits: int | None = None, tile: int = TILE_N) -> torch.Tensor:
    """Attention of every query row of ``batch`` (a ``UnifiedBatch``) into ``out`` [T, H, d].
    ``num_splits`` None takes ``batch.num_splits`` (set under CUDA graphs) or else chooses
    (``choose_num_splits``); a power of two forces it."""
    num_tokens, num_heads, head_dim = q.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    kv_heads = k_cache.shape[1]
    group = num_heads // kv_heads
    block_q = query_tile(group, batch.max_query_len)
    tiles = num_tokens // block_q + batch.num_seqs
    if num_splits is None:
        num_splits = batch.num_splits
    if num_splits is None:  # decode-only: one busy tile per sequence; else the grid bounds it
        busy = batch.num_seqs if batch.max_query_len == 1 else tiles
        num_splits = choose_num_splits(busy * kv_heads, batch.max_seq_len, q.device, tile)
    assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    if num_splits > 1:
        part_out, part_lse = batch.scratch(num_tokens, num_heads, num_splits, head_dim, q.device)
    else:
        part_out = part_lse = out  # unused
    dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot takes no dimension under 16 on a GPU
    _attention_kernel[(tiles, kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, batch.block_tables, batch.query_start_loc, batch.seq_lens,
        batch.num_seqs, scale, softcap or 0.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        batch.block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        DIM_PAD=dim_pad, BLOCK_SIZE=batch.block_size, BLOCK_Q=block_q, TILE=tile,
        WINDOW=sliding_window or 0, USE_SOFTCAP=softcap is not None, NUM_SPLITS=num_splits,
        PRECISION="ieee" if q.dtype == torch.float32 else None)
    if num_splits > 1:
        _combine_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), NUM_HEADS=num_heads, NUM_SPLITS=num_splits,
            HEAD_DIM=head_dim, DIM_PAD=dim_pad)
    return out


def smoke_test(device: torch.device, dtype: torch.dtype = torch.float16) -> None:
    """Compile and run both kernels once on ``device`` (a decode and a chunk over a cached prefix); raises if
    either fails to compile or gives a non-finite value. `worker.layers.attention.use_triton` calls it once
    per device, so a toolchain that cannot build them leaves serving on the torch path, not broken."""
    from types import SimpleNamespace

    kv_heads, group, dim, block_size = 2, 2, 64, 16
    cache = torch.zeros(2, 4 * block_size, kv_heads, dim, dtype=dtype, device=device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    k, v = (torch.randn(24, kv_heads, dim, generator=generator).to(device, dtype) for _ in range(2))
    write_kv(k, v, cache[0], cache[1], torch.arange(24, device=device))
    batch = SimpleNamespace(  # sequence 0: 1 query over 9 keys; sequence 1: 8 queries over 24 keys (blocks 2, 3)
        block_size=block_size, num_seqs=2, max_query_len=8, max_seq_len=24,
        block_tables=torch.tensor([[0, 1], [0, 1]], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, 1, 9], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([9, 24], dtype=torch.int32, device=device))
    q = torch.randn(9, kv_heads * group, dim, generator=generator).to(device, dtype)
    out = torch.empty_like(q)
    unified_attention(q, cache[0], cache[1], out, batch, scale=dim ** -0.5, num_splits=1)
    if not torch.isfinite(out).all():
        raise RuntimeError("the Triton attention kernel gave non-finite values on its smoke test")

