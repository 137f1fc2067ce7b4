"""``x @ W^T (+ b)`` for decode at small batch through the ``small_gemm`` C++ kernel
(worker/kernels/csrc/small_gemm.cpp), ``F.linear`` otherwise.

Why: at one to a few rows a linear layer is a matrix-vector product bound by reading W from memory, and
the BLAS behind ``F.linear`` (MKL on an AMD CPU) reads it well below the memory bandwidth and takes a
matrix-matrix path from two rows on. Measured on a 2-core AVX2 EPYC (shared, loaded), one thread's CPU
time, float32, the tiny model's 33 projections of one decode step, 111 MB of weights
(benchmarks/bench_small_gemm.py --rows 1,2,4,8,16,32), ms per step F.linear -> kernel: 1 row 17.8 -> 13.1,
2 rows 34.3 -> 13.9, 4 rows 35.5 -> 16.3, 8 rows 48.5 -> 22.0, 16 rows 47.7 -> 35.6, 32 rows 67.5 -> 63.9
(a wash, hence ``MAX_ROWS``). An earlier quieter run: 1 row 13.3 -> 13.0 / 16.6 -> 10.5 in two sittings.

Rules:
- The kernel serves float32 and bfloat16 CPU tensors (x, W and bias of one dtype), x 2-D [M, K] with
  M <= ``MAX_ROWS`` and contiguous, W contiguous; everything else (more rows, float16, mixed dtypes, CUDA, no
  compiler, ``REDSERVE_NO_KERNELS`` naming ``small_gemm``) goes to ``F.linear``.
- bfloat16 multiplies with the CPU's bf16 dot products where it has them (AVX-512 BF16 ``vdpbf16ps``, four
  rows of W by two of x per pass), else widens to float32 (AVX2 FMAs); either way it reads half the bytes of
  float32. Measured on a 2-core AMD EPYC with avx512_bf16 (4 Dec 2026), the same projections in bfloat16
  (56 MB), one thread's CPU time, ms per step F.linear -> kernel: 1 row 6.97 -> 2.94, 2 rows 7.18 -> 3.28,
  4 rows 8.11 -> 3.91, 8 rows 8.50 -> 4.80, 16 rows 11.08 -> 8.33 (float32 1 row: 10.15 -> 5.12). In the
  engine, offline batch 1, tiny model: 6.96-7.00 -> 4.36-4.61 ms a token (float32 with its kernel: 7.30).
- Results equal ``F.linear``'s to summation order (bfloat16: to one rounding of a float32 sum;
  tests/test_small_gemm.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.kernels import load_extension

MAX_ROWS = 16  # more rows: F.linear's GEMM
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def small_gemm_kernel():
    """The compiled kernel module, or None (one warning line) where it cannot be built."""
    return load_extension("small_gemm")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the kernel where the module rules allow."""
    if (x.dim() != 2 or x.shape[0] > MAX_ROWS or x.dtype not in KERNEL_DTYPES or weight.dtype != x.dtype
            or (bias is not None and bias.dtype != x.dtype) or x.device.type != "cpu"
            or not (x.is_contiguous() and weight.is_contiguous())):
        return F.linear(x, weight, bias)
    kernel = small_gemm_kernel()
    if kernel is None:
        return F.linear(x, weight, bias)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    kernel.small_linear(out, x, weight, bias)
    return out
