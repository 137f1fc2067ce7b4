"""GGUF k-quant blocks (Q4_K, Q6_K: 256 weights a block) dequantized in torch, and their C++ kernel.

The companion of `worker.layers.quantized_linear` (whose `BlockFormat` names these formats and dispatches to
here); the layouts are spelled out in worker/kernels/csrc/quant_gemm_k.cpp.

Rules:
- ``dequantize_q4_k`` / ``dequantize_q6_k`` take uint8 blocks [..., row bytes] (a multiple of 144 / 210) and
  return float32 [..., row bytes / block bytes * 256]: exactly the gguf package's values (the same float32
  products and differences, in the same order).
- ``quant_gemm_k_kernel()`` is the ``quant_gemm_k`` extension (``quant_linear``, ``dequantize_rows``: the
  interface of ``quant_gemm``), or None (one warning line) where it cannot be built. It serves up to
  ``KERNEL_MAX_ROWS`` rows as the 32-weight kernel does; at 16 rows it is still 1.4x (Q4_K) and 1.7x (Q6_K)
  faster than the dequantized tiles (a 3072 x 1536 weight, one thread's CPU time, 4 Dec 2026).
"""

from __future__ import annotations

import torch

from worker.kernels import load_extension

Q4_K_BYTES, Q6_K_BYTES = 144, 210


def quant_gemm_k_kernel():
    """The compiled k-quant kernel module, or None (one warning line) where it cannot be built."""
    return load_extension("quant_gemm_k")


def _q4_k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes [..., 12] -> 6-bit scales and mins [..., 8] (int32)."""
    b = packed.int()
    d, m, both = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    scales = torch.cat([d & 63, (both & 15) | ((d >> 6) << 4)], dim=-1)
    mins = torch.cat([m & 63, (both >> 4) | ((m >> 6) << 4)], dim=-1)
    return scales, mins


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    shape = blocks.shape[:-1]
    b = blocks.reshape(*shape, -1, Q4_K_BYTES)
    halves = b[..., :4].contiguous().view(torch.float16).float()  # d, dmin
    scales, mins = _q4_k_scales(b[..., 4:16])
    ds = (halves[..., 0:1] * scales.float()).unsqueeze(-1)  # [..., blocks, 8, 1]
    dm = (halves[..., 1:2] * mins.float()).unsqueeze(-1)
    nibbles = b[..., 16:].reshape(*b.shape[:-1], 4, 1, 32)
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-2).reshape(*b.shape[:-1], 8, 32).float()
    return (ds * q - dm).reshape(*shape, -1)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    shape = blocks.shape[:-1]
    b = blocks.reshape(*shape, -1, Q6_K_BYTES)
    d = b[..., 208:210].contiguous().view(torch.float16).float()  # [..., blocks, 1]
    ds = (d * b[..., 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)  # [..., blocks, 16, 1]
    ql = b[..., :128].reshape(*b.shape[:-1], 2, 1, 64)
    ql = torch.cat([ql & 15, ql >> 4], dim=-2).reshape(*b.shape[:-1], 2, 4, 32)  # runs g of each half
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    qh = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-2)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(*b.shape[:-1], 16, 16).float()
    return (ds * q).reshape(*shape, -1)
