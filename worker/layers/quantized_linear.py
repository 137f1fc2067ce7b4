"""Weights kept as GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0; Q4_K, Q6_K) and multiplied without a float copy.

Why: a decode step at one stream reads every weight once, so its time follows the weight bytes; a Q4_1
weight is 0.625 bytes a value (Q4_K 0.5625, Q6_K 0.82) against 4 (float32) or 2 (bfloat16). Measured on a
2-core AMD EPYC with avx512_vnni, see README "Quantized GGUF weights".

Rules:
- `BlockQuantizedWeight` holds a [rows, in_features] matrix as the file's blocks (uint8 [rows, row bytes]),
  each row its ``in_features / fmt.block_weights`` blocks in GGML's layout (32 weights a block; 256 for the
  k-quants Q4_K and Q6_K, whose torch dequantization and kernel live in `worker.layers.k_quants`); it
  dequantizes rows on demand (the embedding lookup) in the model dtype.
- `quant_linear(x, weight, bias)` on the CPU, float32 or bfloat16 x, takes one of five paths by its rows:
  - up to ``KERNEL_MAX_ROWS`` (the k-quants: ``K_QUANT_KERNEL_MAX_ROWS``): the C++ kernel's int8 path
    (worker/kernels/csrc/quant_gemm.cpp, ``quant_gemm_k.cpp`` for the k-quants: x quantized to int8 per block
    of 32, int8 dot products, per-block scales), within the activation rounding of the float product;
  - opt-in (``REDSERVE_Q8_ACTIVATIONS=1``), more rows of Q4_0, Q4_1, Q5_0 and Q4_K (17 rows for Q4_K), on a
    CPU with AVX-512 VNNI: ``quant_matmul_q8``, the weights decoded once a call to byte codes and x rounded
    once to int8 per block of 32 (llama.cpp's q8 activations: within e / 2 a value, e = max|x| / 127), 64 byte
    products a vpdpbusd. Opt-in because that rounding moves greedy choices of a small model: SmolLM2 Q4_1's
    perplexity stays within 1% of llama.cpp's (-0.45%, -0.82% without), but its chat answer to the tests'
    capital-of-France prompt and 40% of a Q4_K file's greedy tokens change;
  - more rows of Q8_0 (its weights as precise as q8 activations), and of the others by default or without
    VNNI: ``quant_matmul``, the weights decoded once a call and x multiplied in its own dtype: float32 to float
    rounding; bfloat16 natively where the CPU computes it (the kernel's ``native_bf16_matmul()``: AMX tiles,
    ``amx_matmul()``, else AVX-512 BF16 dot products), each weight rounded once to bfloat16 first, as a
    dequantized bfloat16 model's: also for more rows of Q4_K and Q6_K (quant_gemm_k.cpp's ``quant_matmul``);
  - from ``DEQUANTIZED_GEMM_MIN_ROWS`` rows of bfloat16 x on a CPU with AMX (a prefill's chunk), for a weight of
    at most ``DEQUANTIZED_GEMM_MAX_WEIGHTS``: the weight dequantized to bfloat16 by the kernel (``dequantize_rows``,
    the same bits as `dequantize`) and multiplied by ``F.linear`` (oneDNN's AMX GEMM), 2.3-2.5x faster than
    ``quant_matmul``'s tiles at 2048 rows (``dequantized_linear``; figures below). The copy lives for the call:
    nothing stays resident but the blocks. Larger weights (an LM head, a 1B model's MLP) keep the tiles: oneDNN
    lost there at every size measured (SmolLM2's 49152 x 576 LM head at 512 rows 51 ms against 32; 8192 x 2048
    at 128 rows 15 against 5). Only on AMX: with AVX-512 BF16 dot products ``quant_matmul`` is as fast as oneDNN
    at every size (SmolLM2's projections x 30 layers, Q4_1, 2 threads, Zen 4, 6 Dec 2026: 128 rows 80.5 against
    143.4 ms, 256 rows 152.6 / 197.0, 512 rows 308.6 / 327.6, 2048 rows 1,209 / 1,215);
  - more rows of Q6_K (and of Q4_K without VNNI) in float32 or without native bfloat16, and wherever the kernel
    is not built (no compiler, ``REDSERVE_NO_KERNELS`` naming ``quant_gemm`` or ``quant_gemm_k``, CUDA): the
    weight dequantized ``TILE_WEIGHTS`` at a time into x's
    dtype (by the kernel's ``dequantize_rows`` where it is built, else in torch) and multiplied with
    ``F.linear`` (float rounding only), so no whole float copy of the weight is ever made.
- `QuantizedGemm` is the ``gemm`` of a layer whose weight is a `BlockQuantizedWeight` (the interface of
  ``packed_gemm.PackedWeight``: ``matmul(x, weight, bias)``, ``invalidate()``).
"""

from __future__ import annotations

import os
from enum import IntEnum

import torch
import torch.nn.functional as F
from torch import nn

from worker.kernels import load_extension
from worker.layers import k_quants

BLOCK = 32  # weights a block (of the 32-weight formats; `BlockFormat.block_weights`)
# Where each path serves, from one thread's CPU time over SmolLM2's Q4_1 shapes (a layer's four projections and
# the LM head; 2-core AMD EPYC with avx512_bf16 and avx512_vnni, 4 Dec 2026), ms for the int8 path /
# quant_matmul float32 / quant_matmul bfloat16 / dequantized tiles + F.linear float32, and oneDNN's prepacked
# float weights for scale (float32 / bfloat16): 1 row 1.77 / 12.9 / 9.1 / 7.2 (9.0 / 4.7); 4 rows 5.5 / 13.1 /
# 9.7 / 11.3; 8 rows 10.7 / 12.9 / 9.3 / 16.3; 12 rows 15.9 / 13.4 / 9.7 / 18.3; 16 rows 21.8 / 13.8 / 10.2 /
# 20.9 (12.8 / 6.9); 64 rows 82.8 / 43.5 / 26.1 / 59.6 (39.8 / 20.8); 256 rows 364 / 190 / 95 / 262 (176 / 77).
# quant_matmul_q8 on the same shapes (bfloat16 x, Q4_1, 5 Dec 2026): 16 rows 6.4-6.7 ms against quant_matmul's 9.1;
# 64 rows 18.4 against 26.0; 256 rows 65 against 97 (float32 x: 43 and 163 for quant_matmul).
# dequantized_linear against quant_matmul on AMX (SmolLM2's four projections x 30 layers, bfloat16 x, 2 threads,
# Intel Xeon with amx_bf16, 5 Dec 2026; Q4_K and Q6_K at K 768 / 1536), ms: Q4_1 64 rows 25.4 / 20.2, 128 rows
# 34.2 / 35.7, 256 rows 51.6 / 63.3, 2048 rows 219 / 542; Q4_K 128 rows 46.8 / 57.2, 2048 rows 261 / 655; Q6_K
# 128 rows 68.4 / 75.0, 2048 rows 273 / 645. The dequantization alone: 8.9 ms (Q4_1), 19.8 (Q4_K), 38.1 (Q6_K).
# By shape, Q4_1, 2 threads: 3072 x 576 at 128 rows 0.69 / 0.56 (the tiles win), at 512 rows 1.23 / 1.52.
DEQUANTIZED_GEMM_MIN_ROWS = 256
DEQUANTIZED_GEMM_MAX_WEIGHTS = 1 << 22  # 8 MiB of bfloat16: every projection of SmolLM2 (1.8M at most)
KERNEL_MAX_ROWS = 8  # the int8 path's rows: it costs a row's products (~1.2 ms here) a row; quant_matmul beyond
K_QUANT_KERNEL_MAX_ROWS = 16  # the k-quants' int8 path (no quant_matmul): at 16 rows 1.4-1.7x the tiles
Q8_ACTIVATIONS = os.environ.get("REDSERVE_Q8_ACTIVATIONS", "0") == "1"  # many rows through quant_matmul_q8 (opt-in)
TILE_WEIGHTS = 1 << 18  # weights a dequantized tile holds in the F.linear path (1 MiB of float32: stays in L2)


class BlockFormat(IntEnum):
    """GGUF block formats served quantized; the values are GGML's type ids (``gguf.GGMLQuantizationType``)."""

    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q8_0 = 8
    Q4_K = 12
    Q6_K = 14

    @property
    def block_bytes(self) -> int:
        return {BlockFormat.Q4_0: 18, BlockFormat.Q4_1: 20, BlockFormat.Q5_0: 22, BlockFormat.Q8_0: 34,
                BlockFormat.Q4_K: k_quants.Q4_K_BYTES, BlockFormat.Q6_K: k_quants.Q6_K_BYTES}[self]

    @property
    def block_weights(self) -> int:
        return 256 if self in (BlockFormat.Q4_K, BlockFormat.Q6_K) else BLOCK


def dequantize(blocks: torch.Tensor, fmt: BlockFormat, dtype: torch.dtype) -> torch.Tensor:
    """uint8 blocks [..., row bytes] -> the weights [..., row bytes / block bytes * block weights]: computed in
    float32 (exact: the gguf package's values), then rounded once to ``dtype``."""
    if fmt is BlockFormat.Q4_K:
        return k_quants.dequantize_q4_k(blocks).to(dtype)
    if fmt is BlockFormat.Q6_K:
        return k_quants.dequantize_q6_k(blocks).to(dtype)
    shape = blocks.shape[:-1]
    b = blocks.reshape(*shape, -1, fmt.block_bytes)
    halves = b.view(torch.float16)  # every block is an even number of bytes: its scales are aligned halves
    d = halves[..., 0:1].float()
    if fmt is BlockFormat.Q8_0:
        w = b[..., 2:].view(torch.int8).float() * d
    elif fmt is BlockFormat.Q5_0:  # bit j of the 32-bit qh is weight j's fifth bit
        nibbles = b[..., 6:]
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).int()
        qh = b[..., 2:6].int()
        qh = qh[..., 0:1] | qh[..., 1:2] << 8 | qh[..., 2:3] << 16 | qh[..., 3:4] << 24
        q |= ((qh >> torch.arange(32, dtype=torch.int32)) & 1) << 4
        w = (q.float() - 16) * d
    else:
        nibbles = b[..., 4:] if fmt is BlockFormat.Q4_1 else b[..., 2:]
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
        w = torch.addcmul(halves[..., 1:2].float(), q, d) if fmt is BlockFormat.Q4_1 else (q - 8) * d
    return w.reshape(*shape, -1).to(dtype)


class BlockQuantizedWeight(nn.Module):
    """A [rows, in_features] weight as GGUF blocks of ``fmt``; ``dtype`` is what dequantized rows come out in."""

    def __init__(self, fmt: BlockFormat, rows: int, in_features: int, dtype: torch.dtype):
        super().__init__()
        if in_features % fmt.block_weights:
            raise ValueError(f"a {fmt.name} weight needs in_features divisible by {fmt.block_weights}, "
                             f"got {in_features}")
        self.fmt, self.in_features, self.dtype = fmt, in_features, dtype
        self.register_buffer("blocks", torch.zeros(rows, in_features // fmt.block_weights * fmt.block_bytes,
                                                   dtype=torch.uint8))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.blocks.shape[0], self.in_features))

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The dequantized rows ``index`` (any shape) -> [*index.shape, in_features]."""
        return dequantize(self.blocks[index], self.fmt, self.dtype)

    def block_rows(self, first: int, count: int) -> torch.Tensor:
        """The blocks of rows [first, first + count) (a view, for loading)."""
        return self.blocks[first:first + count]

    def extra_repr(self) -> str:
        return f"{self.fmt.name}, rows={self.blocks.shape[0]}, in_features={self.in_features}"


class ShardedBlockWeight(nn.Module):
    """A fused projection's weight whose shards come in different block formats: a Q4_K_M file of SmolLM2 holds q
    and k in Q5_0 and v in Q8_0 in 14 of its 30 layers. Each run of adjacent shards of one format is one
    `BlockQuantizedWeight` (``parts``, in row order), and the product is theirs side by side, so the layer stays
    as small as the file (dequantized to bfloat16 those 14 qkv weights were 15.5 MB against 5.9 MB of blocks,
    and 0.7 ms of a one-row SmolLM2 step went to multiplying them)."""

    def __init__(self, runs: list[tuple[BlockFormat, int]], in_features: int, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.dtype = in_features, dtype
        self.parts = nn.ModuleList(BlockQuantizedWeight(fmt, rows, in_features, dtype) for fmt, rows in runs)
        self.starts = [0]
        for _, rows in runs:
            self.starts.append(self.starts[-1] + rows)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.starts[-1], self.in_features))

    def spans(self) -> list[tuple[BlockQuantizedWeight, int, int]]:
        """(part, its first output row, one past its last)."""
        return [(part, self.starts[i], self.starts[i + 1]) for i, part in enumerate(self.parts)]

    def block_rows(self, first: int, count: int) -> torch.Tensor:
        """The blocks of rows [first, first + count), which must lie in one part (one shard does)."""
        for part, start, end in self.spans():
            if start <= first and first + count <= end:
                return part.block_rows(first - start, count)
        raise ValueError(f"rows {first}..{first + count} cross the parts of {self.extra_repr()}")

    def extra_repr(self) -> str:
        runs = ", ".join(f"{part.fmt.name} x {end - start}" for part, start, end in self.spans())
        return f"{runs}, in_features={self.in_features}"


def _bias_span(bias: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    return None if bias is None else bias[start:end]


def quant_gemm_kernel():
    """The compiled kernel module, or None (one warning line) where it cannot be built."""
    return load_extension("quant_gemm")


def kernel_for(fmt: BlockFormat):
    """The kernel module that multiplies ``fmt`` (``quant_gemm``, or ``quant_gemm_k`` for the k-quants), or None."""
    return k_quants.quant_gemm_k_kernel() if fmt.block_weights != BLOCK else quant_gemm_kernel()


_K_QUANTS = frozenset({12, 14})  # Q4_K, Q6_K: 256-weight blocks, their own kernel (no quant_matmul)
# quant_matmul_q8's formats: Q4_0, Q4_1, Q5_0, Q4_K, whose own rounding (4-5 bits) dwarfs the activations'. Not
# Q8_0: its weights are as precise as q8 activations, so these would double its error (SmolLM2 with
# `--quantization int8` answered "Paris" through quant_matmul, and not through quant_matmul_q8); not Q6_K: its
# scales are per 16 weights.
_Q8_MATMUL_FORMATS = frozenset({2, 3, 6, 12})


def quant_linear(x: torch.Tensor, weight: BlockQuantizedWeight | ShardedBlockWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ b)`` for x [..., in_features] (see the module rules for the path taken)."""
    if isinstance(weight, ShardedBlockWeight):
        return torch.cat([quant_linear(x, part, _bias_span(bias, start, end)) for part, start, end in weight.spans()],
                         dim=-1)
    rows = x.reshape(-1, weight.in_features)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    m, fmt = rows.shape[0], weight.fmt
    k_quant = fmt in _K_QUANTS
    kernel = None
    if rows.dtype in _KERNEL_DTYPES and rows.is_cpu and (bias is None or bias.dtype == rows.dtype):
        kernel = k_quants.quant_gemm_k_kernel() if k_quant else quant_gemm_kernel()
    if (kernel is not None and m >= DEQUANTIZED_GEMM_MIN_ROWS and rows.dtype == torch.bfloat16
            and weight.blocks.shape[0] * weight.in_features <= DEQUANTIZED_GEMM_MAX_WEIGHTS and kernel.amx_matmul()):
        out = dequantized_linear(rows, weight, bias, kernel)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])
    q8 = kernel is not None and Q8_ACTIVATIONS and m > KERNEL_MAX_ROWS and fmt in _Q8_MATMUL_FORMATS and kernel.q8_matmul()
    bf16 = k_quant and kernel is not None and rows.dtype == torch.bfloat16 and kernel.native_bf16_matmul()
    if kernel is None or (k_quant and m > K_QUANT_KERNEL_MAX_ROWS and not q8 and not bf16):
        out = tiled_linear(rows, weight, bias)
    else:
        out = torch.empty(m, weight.blocks.shape[0], dtype=rows.dtype)
        if m <= (K_QUANT_KERNEL_MAX_ROWS if k_quant else KERNEL_MAX_ROWS):
            kernel.quant_linear(out, rows, weight.blocks, int(fmt), bias)
        elif q8:
            kernel.quant_matmul_q8(out, rows, weight.blocks, int(fmt), bias)
        else:
            kernel.quant_matmul(out, rows, weight.blocks, int(fmt), bias)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def bound_quant_linear(weight: BlockQuantizedWeight | ShardedBlockWeight, bias: torch.Tensor | None = None):
    """``(x, out=None) -> quant_linear(x, weight, bias)`` for 2-D contiguous CPU x, bound once: up to the int8
    path's rows the kernel is called directly (no lookups, no checks but the rows and the dtype) and writes into
    ``out`` when one is given ([rows, out features], x's dtype), else ``quant_linear`` (a new tensor)."""
    if isinstance(weight, ShardedBlockWeight):
        parts = [bound_quant_linear(part, _bias_span(bias, start, end)) for part, start, end in weight.spans()]
        return lambda x, out=None: torch.cat([linear(x) for linear in parts], dim=-1)
    kernel = kernel_for(weight.fmt)
    if kernel is None:
        return lambda x, out=None: quant_linear(x, weight, bias)
    blocks, code, n = weight.blocks, int(weight.fmt), weight.blocks.shape[0]
    max_rows = K_QUANT_KERNEL_MAX_ROWS if weight.fmt in _K_QUANTS else KERNEL_MAX_ROWS
    bias_dtype = None if bias is None else bias.dtype

    def linear(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] > max_rows or x.dtype not in _KERNEL_DTYPES or (bias is not None and bias_dtype != x.dtype):
            return quant_linear(x, weight, bias)
        if out is None:
            out = torch.empty(x.shape[0], n, dtype=x.dtype)
        kernel.quant_linear(out, x, blocks, code, bias)
        return out

    return linear


def dequantized_linear(x: torch.Tensor, weight: BlockQuantizedWeight, bias: torch.Tensor | None, kernel) -> torch.Tensor:
    """``F.linear`` of 2-D x with the weight dequantized by ``kernel`` into x's dtype for the call."""
    w = torch.empty(weight.shape, dtype=x.dtype)
    kernel.dequantize_rows(w, weight.blocks, int(weight.fmt))
    return F.linear(x, w, bias)


def tiled_linear(x: torch.Tensor, weight: BlockQuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``TILE_WEIGHTS`` of the weight dequantized at a time into x's dtype (by the kernel's ``dequantize_rows``
    where it is built, else in torch), ``F.linear`` each."""
    n = weight.blocks.shape[0]
    step = max(1, TILE_WEIGHTS // weight.in_features)
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    kernel = kernel_for(weight.fmt) if x.device.type == "cpu" else None
    for first in range(0, n, step):
        last = min(n, first + step)
        if kernel is not None:
            tile = torch.empty(last - first, weight.in_features)
            kernel.dequantize_rows(tile, weight.blocks[first:last], int(weight.fmt))
            tile = tile.to(x.dtype)
        else:
            tile = dequantize(weight.blocks[first:last], weight.fmt, x.dtype)
        out[:, first:last] = F.linear(x, tile, None if bias is None else bias[first:last])
    return out


class QuantizedGemm:
    """The ``gemm`` of a layer whose weight is a `BlockQuantizedWeight` (nothing to pack or invalidate)."""

    def invalidate(self) -> None:
        pass

    def matmul(self, x: torch.Tensor, weight: BlockQuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        return quant_linear(x, weight, bias)
