"""The ``fused_ops`` C++ kernels (worker/kernels/csrc/fused_ops.cpp) for the tensors they serve.

Rules:
- ``fused_ops_for(*tensors)`` is the compiled module when every tensor lives on the CPU in float32 or
  bfloat16 and the extension builds; else None, and the caller runs its torch path (CUDA, float16, meta
  tensors, no compiler: one warning line, from ``worker.kernels``).
- Every kernel has a torch reference next to its caller; tests/test_fused_ops.py holds them equal.
"""

from __future__ import annotations

from types import ModuleType

import torch

from worker.kernels import load_extension

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def fused_ops_for(*tensors: torch.Tensor) -> ModuleType | None:
    for t in tensors:
        if t.device.type != "cpu" or t.dtype not in KERNEL_DTYPES:
            return None
    return load_extension("fused_ops")
