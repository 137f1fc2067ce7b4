"""Time one layer of paged attention per step, and the step's input building: torch path vs C++ kernel.

Shapes default to the tiny model (8 heads, 4 KV heads, head_dim 64, block 16). Decode steps at each
batch x context, and one prefill chunk over a cached prefix. Prints one line per case (best of
``--repeat`` runs of ``--iters`` calls: the machine may be shared); both paths run back to back so machine load hits both alike.
"""

from __future__ import annotations

import argparse
import time

import torch

from protocol.sampling_params import SamplingParams
from protocol.step_types import NewRequestData, SchedulerOutput
from worker.input_batch import InputBatch
from worker.layers.attention import PagedAttention


def step(specs: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, block_size: int, dtype: torch.dtype,
         use_kernel: bool):
    sched, first = SchedulerOutput(), 0
    for i, (c, n) in enumerate(specs):
        count = -(-(c + n) // block_size)
        sched.new_requests.append(NewRequestData(f"r{i}", [7] * (c + n), [], SamplingParams(), list(range(first, first + count)), c))
        sched.num_scheduled_tokens[f"r{i}"] = n
        first += count
    batch = InputBatch(block_size, torch.device("cpu"), heads // kv_heads, [1], use_kernel=use_kernel)
    batch.update(sched)
    total = sum(n for _, n in specs)
    cache = torch.randn(2, first * block_size, kv_heads, dim).to(dtype)
    q, k, v = (torch.randn(total, h, dim).to(dtype) for h in (heads, kv_heads, kv_heads))
    attn = PagedAttention(heads, kv_heads, dim)
    meta = batch.prepare(sched).meta
    return lambda: attn(q, k, v, cache, meta), lambda: batch.prepare(sched)


def best_ms(fn, iters: int, repeat: int, clock=time.perf_counter) -> float:
    fn()
    runs = []
    for _ in range(repeat):
        started = clock()
        for _ in range(iters):
            fn()
        runs.append((clock() - started) / iters * 1e3)
    return min(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by this thread's CPU time (with --threads 1: steadier on a busy machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    cases = [(f"decode b={b} ctx={ctx}", [(ctx - 1, 1)] * b) for b in (1, 16, 64) for ctx in (128, 512)]
    cases += [("prefill 64 after 448 cached", [(448, 64)]), ("prefill 256 after 256 cached", [(256, 256)])]
    print(f"{'case':30} {'dtype':8} {'attn ms: torch':>14} {'kernel':>7} {'speedup':>7} "
          f"{'prepare ms: torch':>17} {'kernel':>7}")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for name, specs in cases:
            shape = (args.heads, args.kv_heads, args.dim, args.block_size, dtype)
            with torch.inference_mode():
                plain_attn, plain_prep = step(specs, *shape, use_kernel=False)
                kernel_attn, kernel_prep = step(specs, *shape, use_kernel=True)
                times = [best_ms(fn, args.iters, args.repeat, clock) for fn in (plain_attn, kernel_attn, plain_prep,
                                                                           kernel_prep)]
            print(f"{name:30} {dtype_name:8} {times[0]:14.3f} {times[1]:7.3f} {times[0] / times[1]:6.2f}x "
                  f"{times[2]:17.3f} {times[3]:7.3f}")

if __name__ == "__main__":
    main()
