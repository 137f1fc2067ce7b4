"""Tensor-parallel group of this process: rank, size and the collectives the TP layers use.

TP = 1 never touches torch.distributed. TP > 1 uses gloo on CPU and NCCL on CUDA, with a rendezvous
address chosen per engine so several engines on one host never collide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1


_TP = TPGroup()


def tp_group() -> TPGroup:
    return _TP


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device) -> None:
    """Join this engine's TP group (a no-op for size 1)."""
    global _TP
    _TP = TPGroup(rank, size)
    if size == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=size)


def destroy_tensor_parallel() -> None:
    global _TP
    if _TP.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _TP = TPGroup()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size > 1:
        dist.all_reduce(x)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
