"""Weights prepacked for oneDNN's CPU GEMM: the LM head and every projection, from a few rows up.

Why: torch's ``F.linear`` (MKL on this build) re-lays the weight out on every call and, on an AMD CPU,
multiplies a few dozen rows well below what the cores can do; oneDNN's packed format is laid out once.
Measured on a 2-core AVX2 EPYC (Zen 3), float32, 2 threads, one sitting:
- LM head (benchmarks/bench_packed_gemm.py --threads 1 --cpu-time, two runs): hidden 512 x vocab 8192
  1.5-1.9x faster at 16 rows and 1.5-1.7x at 64, SmolLM2's 576 x 49152 1.7-2.3x and 1.2-1.7x; at one row
  (memory-bound) 0.8-1.4x, a wash, so the head keeps `MIN_ROWS` and smaller batches on ``F.linear``.
- The tiny model's four projections of a layer (in 512-1408, out 512-2816), wall clock: 64 rows 8.2 -> 6.9 ms,
  128 rows 12.6 -> 7.1, 2048 rows (prefill) 101 -> 91; one row 0.48 -> 0.59 (slower: small batches go to the
  `worker.layers.small_gemm` kernel). In the engine, batch-64 decode step 87 -> 66 ms (median of three
  interleaved runs), offline ``LLM.generate`` 64 x 128/128 514 -> 676 tok/s (benchmarks/bench_offline.py).

Rules:
- ``pack_for_gemm(weight)`` returns None (the caller keeps ``F.linear``) unless the weight lives on the CPU in
  float32, or in bfloat16 where oneDNN computes bfloat16 natively (AVX-512 BF16 / AMX / AVX-NE-CONVERT), and
  oneDNN is built in; ``REDSERVE_NO_KERNELS=1`` or a list naming ``packed_gemm`` turns it off.
- `PackedWeight` holds one layer's packed copy, made at the first multiply after the weight changed, and
  sends fewer than its ``min_rows`` rows to ``small_gemm.linear`` on the plain weight.
- The packed copy is extra memory: a packed layer holds its weight twice (the plain one serves small
  batches, the tied embedding and the torch path), so on the CPU the weights take twice their size.
  ``REDSERVE_NO_KERNELS=packed_gemm`` gives that memory back at the cost above.
- Results equal ``F.linear``'s to float rounding (tests/test_packed_gemm.py).
"""

from __future__ import annotations

import logging
import os

import torch

from worker.layers.small_gemm import linear

logger = logging.getLogger(__name__)

_BATCH_HINT = 64  # rows oneDNN tunes the packed layout for; any row count works
MIN_ROWS = 8  # the LM head's: fewer rows go through small_gemm.linear on the plain weight


def _enabled() -> bool:
    disabled = os.environ.get("REDSERVE_NO_KERNELS", "")
    return not (disabled == "1" or "packed_gemm" in disabled.split(","))


def _supported(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_for_gemm(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a [out, in] weight, or None where the plain ``F.linear`` path must serve."""
    if not (_enabled() and _supported(weight)):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)
    except RuntimeError as exc:  # an op this torch build lacks: the plain path is correct
        logger.warning("oneDNN weight packing unavailable (%s); F.linear serves", str(exc)[:160])
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ b)`` with W packed by `pack_for_gemm`; x: [..., in] contiguous in the dtype of W."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedWeight:
    """A layer's weight with its packed copy, made at the first multiply after the weight changed.

    ``matmul(x, weight, bias)`` packs ``weight`` when its storage differs from the one packed last (a reload
    or a tie swaps the Parameter; ``invalidate()`` marks an in-place load), then multiplies through the
    packed copy from ``min_rows`` rows, through ``small_gemm.linear`` below that or where packing cannot serve.
    """

    def __init__(self, min_rows: int) -> None:
        self.min_rows = min_rows
        self.packed: torch.Tensor | None = None
        self._packed_from: int | None = None  # data_ptr of the weight the packed copy was made from

    def invalidate(self) -> None:
        self._packed_from = None

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._packed_from != weight.data_ptr():
            self.packed, self._packed_from = pack_for_gemm(weight), weight.data_ptr()
        if (self.packed is None or x.dtype != weight.dtype or x.numel() < self.min_rows * x.shape[-1]
                or (bias is not None and bias.dtype != weight.dtype)):
            return linear(x, weight, bias)
        return packed_linear(x, self.packed, bias)
