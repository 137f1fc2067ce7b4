"""A weight prepacked for oneDNN's CPU GEMM, for the LM head.

Why: the LM head is the widest matmul of a step ([rows, hidden] x [hidden, vocab]); torch's ``F.linear``
re-lays the weight out on every call, while oneDNN's packed format is laid out once at load. Measured on a
2-core AVX2 EPYC, one thread, float32 (benchmarks/bench_packed_gemm.py --threads 1 --cpu-time, two runs):
hidden 512 x vocab 8192 1.5-1.9x faster at 16 rows and 1.5-1.7x at 64, SmolLM2's 576 x 49152 1.7-2.3x and
1.2-1.7x; at one row (memory-bound) 0.8-1.4x, a wash, so `MIN_ROWS` keeps small batches on ``F.linear``.
The per-layer projections (in 512-1536, out 512-3072) measured within noise at 16-64 rows and 25-50%
slower at one row, so they stay on ``F.linear``.

Rules:
- ``pack_for_gemm(weight)`` returns None (the caller keeps ``F.linear``) unless the weight lives on the CPU in
  float32, or in bfloat16 where oneDNN computes bfloat16 natively (AVX-512 BF16 / AMX / AVX-NE-CONVERT), and
  oneDNN is built in; ``REDSERVE_NO_KERNELS=1`` or a list naming ``packed_gemm`` turns it off.
- The packed copy is extra memory (one more copy of the LM head); the plain weight stays for the embedding
  (tied heads) and for the torch path. Results equal ``F.linear``'s to float rounding (tests/test_packed_gemm.py).
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

_BATCH_HINT = 64  # rows oneDNN tunes the packed layout for; any row count works
MIN_ROWS = 8  # fewer rows go through F.linear on the plain weight


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
        logger.warning("oneDNN weight packing unavailable (%s); the LM head uses F.linear", str(exc)[:160])
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` with W packed by `pack_for_gemm`; x: [..., in] contiguous in the dtype of W."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")
