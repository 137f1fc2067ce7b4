"""RMSNorm as Llama uses it (x * w) and as Gemma uses it (x * (1 + w), computed in float32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma stores w - 1: the scale is (1 + w), applied in float32 before casting back (as HF does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
