"""The fused layer ops for the tensors they serve: the ``fused_ops`` C++ kernels on the CPU
(worker/kernels/csrc/fused_ops.cpp) and their Triton twins on CUDA (worker/kernels/triton_ops.py).

Rules:
- ``fused_ops_for(*tensors)`` is the compiled C++ module when every tensor lives on the CPU in float32 or
  bfloat16 and the extension builds; else None (CUDA, float16, meta tensors, no compiler: one warning line,
  from ``worker.kernels``).
- ``triton_ops_for(*tensors)`` is the Triton module when every tensor lives on one device that takes the
  Triton path (``worker.layers.triton_path``: CUDA where the kernels compiled and ran), in float32, float16
  or bfloat16; else None.
- With neither, the caller runs its torch path. Every kernel has a torch reference next to its caller;
  tests/test_fused_ops.py and tests/test_triton_ops.py hold them equal.
"""

from __future__ import annotations

from types import ModuleType

import torch

from worker.kernels import load_extension
from worker.layers.triton_path import triton_module, use_triton

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fused_ops_for(*tensors: torch.Tensor) -> ModuleType | None:
    for t in tensors:
        if t.device.type != "cpu" or t.dtype not in KERNEL_DTYPES:
            return None
    return load_extension("fused_ops")


def triton_ops_for(*tensors: torch.Tensor) -> ModuleType | None:
    device = tensors[0].device
    if any(t.device != device or t.dtype not in TRITON_DTYPES for t in tensors) or not use_triton(device):
        return None
    return triton_module("triton_ops")
