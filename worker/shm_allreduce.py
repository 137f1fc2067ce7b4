"""All-reduce and all-gather for CPU tensor parallelism through one shared-memory segment.

gloo over loopback TCP costs about a millisecond per collective on a small CPU host, and a TP step
needs two per layer; ranks on one host can instead exchange through memory (as vLLM's CPU backend
does). Rules:
- One segment per TP group: a counter per rank (its own cache line) and, per rank, two data slots
  of ``slot_bytes``. Rank 0 creates it and unlinks it as soon as every rank has mapped it, so
  nothing is left in /dev/shm whatever happens later.
- Collective number s: each rank copies its tensor into its slot ``s % 2``, fences, publishes
  ``counter = s``, waits until every counter is >= s, then adds the slots up in rank order, so every
  rank computes the same bits (for two ranks, the very bits gloo gives). Two slots suffice: a rank that published s has finished reading
  collective s - 1, so slot ``(s + 1) % 2`` is free once everyone has published s.
- Waiting spins, yielding the CPU (ranks often share cores), then naps; a peer silent for
  ``timeout`` seconds raises TimeoutError instead of hanging.
- Tensors larger than a slot are not handled here: ``fits`` says so and callers use gloo.
- Rank 0 sends the segment's name as a fixed-size byte tensor (never a pickled object); the others
  accept only a name of the form rank 0 makes (``rs_ar_<pid>_<hex>``).
"""

from __future__ import annotations

import os
import re
import time
from multiprocessing.shared_memory import SharedMemory

import torch
import torch.distributed as dist

from worker.shm_ring import attach_untracked, memory_fence

_LINE = 64
SLOT_BYTES = 8 << 20
_SPIN_SECONDS = 0.002


_NAME_BYTES = 64
_NAME = re.compile(r"rs_ar_[0-9]+_[0-9a-f]+")


def _broadcast_name(name: str | None) -> str:
    """Rank 0 passes the segment name; every rank gets it back (ValueError if it is not one of ours)."""
    buf = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
    if name is not None:
        raw = name.encode("ascii")
        buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    received = bytes(buf.tolist()).rstrip(b"\0").decode("ascii", "replace")
    if not _NAME.fullmatch(received):
        raise ValueError(f"TP rank 0 sent an invalid shared-memory segment name {received!r}")
    return received


class ShmCommunicator:
    def __init__(self, rank: int, world_size: int, slot_bytes: int = SLOT_BYTES, timeout: float = 300.0):
        self.rank, self.world_size, self.slot_bytes, self.timeout = rank, world_size, slot_bytes, timeout
        size = world_size * _LINE + world_size * 2 * slot_bytes
        if rank == 0:
            self._shm = SharedMemory(create=True, size=size, name=f"rs_ar_{os.getpid()}_{os.urandom(4).hex()}")
            _broadcast_name(self._shm.name)
        else:
            self._shm = attach_untracked(_broadcast_name(None))
        dist.barrier()
        if rank == 0:
            self._shm.unlink()
        self._counters = self._shm.buf[:world_size * _LINE].cast("q")
        self._data = torch.frombuffer(self._shm.buf, dtype=torch.uint8, offset=world_size * _LINE,
                                      count=world_size * 2 * slot_bytes).view(world_size, 2, slot_bytes)
        self._seq = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``x``; return every rank's copy of it, in rank order (views into the segment)."""
        self._seq += 1
        nbytes = x.numel() * x.element_size()
        slot = self._seq % 2
        mine = self._data[self.rank, slot, :nbytes].view(x.dtype).view(x.shape)
        mine.copy_(x)
        memory_fence()
        self._counters[self.rank * (_LINE // 8)] = self._seq
        self._wait_all(self._seq)
        memory_fence()
        return [self._data[r, slot, :nbytes].view(x.dtype).view(x.shape) for r in range(self.world_size)]

    def _wait_all(self, seq: int) -> None:
        stride = _LINE // 8
        counters = self._counters
        start = time.monotonic()
        nap = 1e-5
        while True:
            if all(counters[r * stride] >= seq for r in range(self.world_size)):
                return
            now = time.monotonic()
            if now - start < _SPIN_SECONDS:
                os.sched_yield()
                continue
            if now - start > self.timeout:
                raise TimeoutError(f"TP rank {self.rank}: peers silent for {self.timeout:.0f}s in collective {seq}")
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (as ``dist.all_reduce``)."""
        parts = self._exchange(x)
        torch.add(parts[0], parts[1], out=x)
        for part in parts[2:]:
            x.add_(part)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(x.contiguous()), dim=-1)

    def close(self) -> None:
        self._counters.release()
        self._data = None
        self._shm.close()
