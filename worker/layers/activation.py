"""Gated activations of the MLP: ``act(gate) * up`` over a packed [T, 2I] gate/up projection.

Rules:
- The product is written into the activation's own output (no third [T, I] tensor), and the activation
  is rounded to the dtype before the multiply, as Hugging Face computes ``act_fn(gate) * up``.
- Plain torch on purpose: a C++ SiLU-and-mul measured about as fast at batch 1 (these two ops take ~4 us)
  and 5-9x slower at batch 64, its scalar exp losing to torch's vectorised one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)
