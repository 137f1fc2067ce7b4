"""Tensor-parallel group of this process: rank, size and the collectives the TP layers use.

TP = 1 never touches torch.distributed. TP > 1 uses NCCL on CUDA; on CPU the collectives go through
shared memory (``worker.shm_allreduce``), with gloo for setup and for tensors too large for its
slots.

Rules (nothing of TP setup is reachable from the network):
- The rendezvous is a ``FileStore`` at `store_path`, a file in a directory only the engine's user can
  enter (the engine makes it 0700, one per engine, and removes it). torch's ``TCPStore`` is not used:
  its server listens on every interface whatever host it is given.
- gloo's and NCCL's own connections between ranks bind the loopback interface
  (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` = ``lo``): every rank of a TP group is on this host.
- Nothing unpickles what a peer sends: no ``*_object*`` collective is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

LOOPBACK_INTERFACE = "lo"


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1


_TP = TPGroup()
_SHM = None


def tp_group() -> TPGroup:
    return _TP


def init_tensor_parallel(rank: int, size: int, store_path: str, device: torch.device) -> None:
    """Join this engine's TP group through the file store at `store_path` (a no-op for size 1)."""
    global _TP, _SHM
    _TP = TPGroup(rank, size)
    if size == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = LOOPBACK_INTERFACE
    store = dist.FileStore(store_path, size)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=size)
    if device.type == "cpu":
        from worker.shm_allreduce import ShmCommunicator
        _SHM = ShmCommunicator(rank, size)


def destroy_tensor_parallel() -> None:
    global _TP, _SHM
    if _SHM is not None:
        _SHM.close()
        _SHM = None
    if _TP.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _TP = TPGroup()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size > 1:
        if _SHM is not None and _SHM.fits(x):
            return _SHM.all_reduce(x)
        dist.all_reduce(x)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
    if _SHM is not None and _SHM.fits(x):
        return _SHM.all_gather_last_dim(x)
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
