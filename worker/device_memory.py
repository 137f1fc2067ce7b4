"""How much device memory the KV cache may take, measured as vLLM does: profile one forward pass at the
step token budget, read the peak, and give the KV cache what is left of the allowed share.

The device queries sit behind ``DeviceMemory`` so the sizing rule runs on the CPU in tests with made-up
numbers; ``CudaMemory`` is the real one.

Rules:
- The snapshot is read after the profile, once its probe KV cache is freed and torch's cache emptied.
- activations = peak torch allocation during the profile - what stays allocated (the weights) - the probe
  KV cache: the transient memory one step at the full token budget needs.
- budget = total * gpu_memory_utilization - memory used outside torch (CUDA context, NCCL, other
  processes) - torch's memory now - activations, never negative. That is free memory - activations -
  the (1 - utilization) share kept back: memory another process holds is never counted as ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class MemorySnapshot:
    """Bytes, read after the profile run (probe KV cache freed, torch's cache emptied)."""

    total: int
    free: int
    torch_peak: int
    torch_allocated: int
    torch_reserved: int

    @property
    def non_torch(self) -> int:
        """Memory in use that torch's allocator does not hold (CUDA context, NCCL, other processes)."""
        return max(self.total - self.free - self.torch_reserved, 0)


class DeviceMemory(Protocol):
    def reset_peak(self) -> None: ...

    def release_cached(self) -> None: ...

    def snapshot(self) -> MemorySnapshot: ...


class CudaMemory:
    def __init__(self, device: torch.device):
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def snapshot(self) -> MemorySnapshot:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return MemorySnapshot(total=total, free=free, torch_peak=torch.cuda.max_memory_allocated(self.device),
                              torch_allocated=torch.cuda.memory_allocated(self.device),
                              torch_reserved=torch.cuda.memory_reserved(self.device))


def device_memory_for(device: torch.device) -> DeviceMemory | None:
    """The memory reporter of a device whose KV cache is sized by profiling; None for the CPU (fixed budget)."""
    return CudaMemory(device) if device.type == "cuda" else None


def kv_cache_budget(snapshot: MemorySnapshot, gpu_memory_utilization: float, probe_kv_bytes: int = 0) -> int:
    """Bytes the KV cache may take; ``probe_kv_bytes`` is the size of the profile's probe KV cache."""
    activations = max(snapshot.torch_peak - snapshot.torch_allocated - probe_kv_bytes, 0)
    used = snapshot.non_torch + snapshot.torch_reserved + activations
    return max(int(snapshot.total * gpu_memory_utilization - used), 0)
