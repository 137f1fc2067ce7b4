"""F.linear vs the oneDNN-packed weight (`worker.layers.packed_gemm`) for LM head and projection shapes.

Prints one line per (shape, rows): best of ``--repeat`` runs, both paths back to back. With ``--threads 1
--cpu-time`` it times this thread's CPU time, steadier on a shared machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.bench_paged_attention import best_ms  # noqa: E402
from worker.layers.packed_gemm import pack_for_gemm, packed_linear  # noqa: E402

SHAPES = {"tiny lm head": (512, 8192), "smollm2 lm head": (576, 49152), "tiny gate_up": (512, 2816),
          "tiny down": (1408, 512), "smollm2 gate_up": (576, 3072), "smollm2 down": (1536, 576)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cpu-time", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    dtype = getattr(torch, args.dtype)
    print(f"{'shape':18} {'in x out':>12} {'rows':>5} {'F.linear us':>12} {'packed us':>10} {'speedup':>8}")
    with torch.inference_mode():
        for name, (k, n) in SHAPES.items():
            weight = torch.randn(n, k).to(dtype)
            packed = pack_for_gemm(weight)
            if packed is None:
                print(f"{name:18} not packed ({args.dtype} on this CPU, or packing off)")
                continue
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, k).to(dtype)
                plain = 1e3 * best_ms(lambda x=x, weight=weight: F.linear(x, weight), args.iters, args.repeat, clock)
                fast = 1e3 * best_ms(lambda x=x, packed=packed: packed_linear(x, packed), args.iters, args.repeat, clock)
                print(f"{name:18} {f'{k}x{n}':>12} {rows:5} {plain:12.0f} {fast:10.0f} {plain / fast:7.2f}x")


if __name__ == "__main__":
    main()
