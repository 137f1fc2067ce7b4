"""Tensor- and pipeline-parallel groups of this process: ranks, sizes and the communication the layers use.

TP = 1 never touches torch.distributed. TP > 1 uses NCCL on CUDA; on CPU the collectives go through
shared memory (``worker.shm_allreduce``), with gloo for setup and for tensors too large for its
slots.

Pipeline parallelism (PP > 1): an engine's workers are numbered ``rank = stage * TP + tp_rank`` (TP inside
PP). torch's default process group is the worker's own stage's TP group (its store keys prefixed by the
stage), so the TP layers and ``worker.shm_allreduce`` work as without PP; stages talk point to point over
a second process group spanning every worker (gloo on CPU, NCCL on CUDA), built directly on a prefixed
view of the same file store. A stage sends to the same TP rank of the next stage.

Rules (nothing of TP setup is reachable from the network):
- The rendezvous is a ``FileStore`` at `store_path`, a file in a directory only the engine's user can
  enter (the engine makes it 0700, one per engine, and removes it). torch's ``TCPStore`` is not used:
  its server listens on every interface whatever host it is given.
- gloo's and NCCL's own connections between ranks bind the loopback interface
  (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` = ``lo``): every rank of a TP group is on this host.
- Stages on other hosts (``redserve worker``, see ``worker.worker_host``): then ``pp_link`` names the
  pipeline group's rendezvous, a ``worker.redis_store.RedisStore`` under a prefix drawn per engine start,
  and the address of this host's interface towards the others; the pipeline group's gloo device binds that
  address (NCCL: its interface). TP groups stay on this host and keep the file store and loopback.
- Nothing unpickles what a peer sends: no ``*_object*`` collective is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

LOOPBACK_INTERFACE = "lo"


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1


@dataclass
class PPGroup:
    """This worker's pipeline stage; ``tp_size`` maps a (stage, tp rank) to its global rank."""

    stage: int = 0
    size: int = 1
    tp_size: int = 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def global_rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp_size + tp_rank


_TP = TPGroup()
_PP = PPGroup()
_SHM = None
_PP_PROCESS_GROUP = None


def tp_group() -> TPGroup:
    return _TP


def pp_group() -> PPGroup:
    return _PP


def init_tensor_parallel(rank: int, size: int, store_path: str, device: torch.device) -> None:
    """Join this engine's TP group through the file store at `store_path` (a no-op for size 1)."""
    init_model_parallel(rank, size, 1, store_path, device)


def init_model_parallel(rank: int, tp_size: int, pp_size: int, store_path: str, device: torch.device,
                        pp_link: dict | None = None) -> None:
    """Join the TP group of this worker's stage and, for PP > 1, the pipeline's point-to-point group.
    ``rank`` is the worker's global rank (``stage * tp_size + tp_rank``); ``pp_link`` (stages on several
    hosts): ``{"redis_url", "prefix", "address", "timeout"}``, see the module rules."""
    global _TP, _PP, _SHM, _PP_PROCESS_GROUP
    stage, tp_rank = divmod(rank, tp_size)
    _TP, _PP = TPGroup(tp_rank, tp_size), PPGroup(stage, pp_size, tp_size)
    if tp_size * pp_size == 1:
        return
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = LOOPBACK_INTERFACE
    store = dist.FileStore(store_path, tp_size * pp_size)
    if pp_size > 1 and pp_link is not None:
        _PP_PROCESS_GROUP = _cross_host_group(pp_link, rank, tp_size * pp_size, device)
    elif pp_size > 1:
        _PP_PROCESS_GROUP = _point_to_point_group(dist.PrefixStore("pp", store), rank, tp_size * pp_size, device)
    if tp_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"tp{stage}", store), rank=tp_rank,
                                world_size=tp_size)
        if device.type == "cpu":
            from worker.shm_allreduce import ShmCommunicator
            _SHM = ShmCommunicator(tp_rank, tp_size)


def _point_to_point_group(store, rank: int, size: int, device: torch.device):
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size)


def _cross_host_group(link: dict, rank: int, size: int, device: torch.device):
    """The pipeline group of stages on several hosts (see the module rules)."""
    from worker.redis_store import RedisStore
    timeout = timedelta(seconds=link["timeout"])
    store = RedisStore(link["redis_url"], link["prefix"], timeout=link["timeout"])
    if device.type == "cuda":
        from worker.remote_link import interface_of
        os.environ["NCCL_SOCKET_IFNAME"] = interface_of(link["address"]) or LOOPBACK_INTERFACE
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=link["address"])]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, options)


def destroy_tensor_parallel() -> None:
    global _TP, _PP, _SHM, _PP_PROCESS_GROUP
    if _SHM is not None:
        _SHM.close()
        _SHM = None
    if _TP.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _TP, _PP, _PP_PROCESS_GROUP = TPGroup(), PPGroup(), None


def pp_send(tensor: torch.Tensor, stage: int):
    """Start sending `tensor` to this TP rank's peer in `stage`; returns the work handle to ``wait()`` on
    before the tensor may be reused."""
    return _PP_PROCESS_GROUP.send([tensor], _PP.global_rank(stage, _TP.rank), 0)


def pp_recv(tensor: torch.Tensor, stage: int) -> torch.Tensor:
    """Receive into `tensor` from this TP rank's peer in `stage` (blocks until it arrives)."""
    _PP_PROCESS_GROUP.recv([tensor], _PP.global_rank(stage, _TP.rank), 0).wait()
    return tensor


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
