"""RMSNorm as Llama uses it (x * w) and as Gemma uses it (x * (1 + w), computed in float32), with the
residual add optionally folded in.

Rules:
- ``norm(x)`` returns a new tensor. ``norm(x, residual)`` returns ``(norm(x + residual), x + residual)``
  and may overwrite both arguments (the CPU and Triton kernels work in place): callers keep only what it
  returns. The C++ kernel serves on the CPU, its Triton twin on CUDA (``worker.layers.fused_ops``), with
  the same calls.
- Rounding is Hugging Face's: Llama normalises in float32, rounds to the dtype, then multiplies by w;
  Gemma multiplies by (1 + w) in float32 and rounds once. The kernel and ``reference`` agree exactly in
  bfloat16 and to summation order in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers.fused_ops import fused_ops_for, triton_ops_for


class RMSNorm(nn.Module):
    weight_offset = 0.0  # the kernel scales by (weight_offset + w)

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        ops = fused_ops_for(x, self.weight) or triton_ops_for(x, self.weight)
        if residual is None:
            if ops is None or x.dim() not in (2, 3) or x.stride(-1) != 1:
                return self.reference(x)
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            ops.rms_norm(out, x, self.weight, self.eps, self.weight_offset)
            return out
        if ops is None or x.dim() != 2 or not (x.is_contiguous() and residual.is_contiguous()):
            residual = x + residual
            return self.reference(residual), residual
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps, self.weight_offset)
        return x, residual

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype) * self.weight


class GemmaRMSNorm(RMSNorm):
    """Gemma stores w - 1: the scale is (1 + w), applied in float32 before casting back (as HF does)."""

    weight_offset = 1.0

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
