"""CPU tensor-parallel collectives: shared-memory all-reduce vs gloo over loopback, one run, 2 ranks.

    python benchmarks/bench_tp_collectives.py [--world-size 2] [--iters 300]

Prints microseconds per all-reduce for the shapes a decode step of the default tiny model all-reduces
(hidden 512: batch 1 and batch 64, bfloat16) and a prefill chunk (2048 tokens).
"""

from __future__ import annotations

import argparse
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from worker.shm_allreduce import ShmCommunicator

SHAPES = [(1, 512), (64, 512), (2048, 512)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, world: int, port: int, iters: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    comm = ShmCommunicator(rank, world)
    rows = []
    for shape in SHAPES:
        x = torch.randn(shape, dtype=torch.bfloat16)
        for name, op in (("gloo", dist.all_reduce), ("shm", comm.all_reduce)):
            for _ in range(10):
                op(x)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                op(x)
            rows.append((name, shape, (time.perf_counter() - start) / iters * 1e6))
    if rank == 0:
        print(f"{'backend':8s} {'shape':>12s} {'us/all-reduce':>14s}   (world size {world}, bfloat16)")
        for name, shape, us in rows:
            print(f"{name:8s} {str(shape):>12s} {us:14.1f}")
    comm.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    mp.start_processes(_run, args=(args.world_size, _port(), args.iters), nprocs=args.world_size,
                       start_method="spawn")


if __name__ == "__main__":
    main()
