"""The shared-memory collectives of CPU tensor parallelism agree with gloo and leave nothing behind."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from worker.shm_allreduce import ShmCommunicator


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    comm = ShmCommunicator(rank, world, slot_bytes=1 << 16)
    try:
        failures = []
        for step in range(200):
            dtype = (torch.float32, torch.bfloat16)[step % 2]
            shape = (step % 7 + 1, 33)
            x = torch.randn(shape, generator=torch.Generator().manual_seed(step * 31 + rank)).to(dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            got = comm.all_reduce(x.clone())
            # Same bits as gloo for two ranks; with more, the summation order may differ from gloo's.
            exact = world == 2
            if exact and not torch.equal(got, expected) or not torch.allclose(got.float(), expected.float(),
                                                                                 rtol=1e-2, atol=1e-2):
                failures.append(("all_reduce", step))
            every = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(every, got)
            if not all(torch.equal(e, got) for e in every):
                failures.append(("ranks disagree", step))
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x)
            if not torch.equal(comm.all_gather_last_dim(x), torch.cat(parts, dim=-1)):
                failures.append(("all_gather", step))
        big = torch.zeros(1 << 15, dtype=torch.float32)
        results[rank] = {"failures": failures, "fits_big": comm.fits(big), "fits_small": comm.fits(big[:100])}
    finally:
        comm.close()
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_shm_collectives_match_gloo_and_leave_no_segment(world: int) -> None:
    before = {n for n in os.listdir("/dev/shm") if n.startswith("rs_ar_")}
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(_worker, args=(world, _port(), results), nprocs=world, start_method="spawn")
    for rank in range(world):
        assert results[rank]["failures"] == []
        assert results[rank]["fits_small"] and not results[rank]["fits_big"]
    assert {n for n in os.listdir("/dev/shm") if n.startswith("rs_ar_")} == before


def _input(rank: int, step: int, numel: int) -> torch.Tensor:
    return torch.full((numel,), float(rank + 1), dtype=torch.float32) * (step % 13 + 1)


def _back_to_back_worker(rank: int, world: int, port: int, results: dict) -> None:
    """Collectives with nothing in between: a fast rank starts the next one while a slower rank may
    still be reading the last; the double buffer keeps it from overwriting what is being read."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    comm = ShmCommunicator(rank, world)
    try:
        numel = 1 << 20
        wrong = []
        for step in range(150):
            got = comm.all_reduce(_input(rank, step, numel))
            if rank == 1:  # the slow reader: checks every element before the next collective
                expected = sum(r + 1 for r in range(world)) * (step % 13 + 1)
                if not bool((got == expected).all()):
                    wrong.append(step)
        results[rank] = wrong
    finally:
        comm.close()
        dist.destroy_process_group()


def test_back_to_back_collectives_never_read_a_slot_being_rewritten() -> None:
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(_back_to_back_worker, args=(2, _port(), results), nprocs=2, start_method="spawn")
    assert results[1] == []
