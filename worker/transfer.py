"""Host <-> device copies that never stall the host on the device's queue.

A plain ``tensor.to("cuda")`` from pageable memory waits for everything queued on the stream (torch copies and
then synchronizes), and so does ``.tolist()`` on a device tensor. Under async scheduling the engine launches
step N + 1 while step N still runs, so each step's inputs go up through pinned memory with non-blocking
copies (torch's caching host allocator keeps a pinned block until the copies that read it are done), and its
sampled tokens come down the same way, read only after an event says they have arrived.

On a CPU device every function here is a plain tensor operation: no copies, nothing to wait for.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: Sequence | np.ndarray | torch.Tensor, dtype: torch.dtype | None,
              device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device`` (of ``dtype``; None keeps an array's or tensor's own), copied
    without waiting for the device (CUDA). On a CPU, a tensor over a numpy array (or the tensor given, when
    its dtype is kept) shares its memory."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values)
    elif isinstance(values, torch.Tensor):
        host = values
    else:
        host = torch.tensor(values, dtype=dtype)
    if dtype is not None:
        host = host.to(dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Tensors on their way from the device to the host: ``start`` queues the copies into pinned memory and
    records an event; ``wait`` returns the host tensors once the event has passed (on a CPU, at once)."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.event = None
        if tensors and tensors[0].device.type == "cuda":
            self.host = []
            for tensor in tensors:
                pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                pinned.copy_(tensor, non_blocking=True)
                self.host.append(pinned)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = list(tensors)

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host
