"""The linear layers of one decode step of the tiny model (8 layers of qkv, o, gate/up, down, then the LM
head) through ``F.linear`` vs the ``small_gemm`` kernel, at a few row counts.

    python benchmarks/bench_small_gemm.py [--threads 1] [--rows 1,2,4,8,16] [--repeats 10] [--rounds 5]
        [--dtype float32|bfloat16]

Each layer has its own weights (128 MB in float32, 64 in bfloat16: far over the L3), so every product reads its weight from
memory as a decode step does. With one thread the time is the thread's CPU time (``time.thread_time``),
which other work on a shared machine does not inflate; with more, wall-clock. Prints the best round of
each, ms per step, the two paths alternating.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from worker.layers.small_gemm import small_gemm_kernel

LAYER_SHAPES = [(1024, 512), (512, 512), (2816, 512), (512, 1408)]  # (out, in): qkv, o, gate/up, down
LM_HEAD = (8192, 512)


def best_ms(fn, repeats: int, rounds: int, clock) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = clock()
        for _ in range(repeats):
            fn()
        best = min(best, (clock() - start) / repeats * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    kernel = small_gemm_kernel()
    if kernel is None:
        raise SystemExit("the small_gemm kernel does not build here")
    weights = [torch.randn(*shape).to(dtype) for _ in range(8) for shape in LAYER_SHAPES]
    weights.append(torch.randn(*LM_HEAD).to(dtype))
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6
    print(f"{args.dtype}, threads={args.threads}, {megabytes:.0f} MB of weights, ms per step")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(dtype) for w in weights}
        outs = [torch.empty(rows, w.shape[0], dtype=dtype) for w in weights]

        def with_torch(inputs=inputs):
            for w in weights:
                F.linear(inputs[w.shape[1]], w)

        def with_kernel(inputs=inputs, outs=outs):
            for w, out in zip(weights, outs, strict=True):
                kernel.small_linear(out, inputs[w.shape[1]], w, None)

        times = {"F.linear": float("inf"), "small_gemm": float("inf")}
        for _ in range(2):
            times["F.linear"] = min(times["F.linear"], best_ms(with_torch, args.repeats, args.rounds, clock))
            times["small_gemm"] = min(times["small_gemm"], best_ms(with_kernel, args.repeats, args.rounds, clock))
        print(f"rows {rows:3d}: F.linear {times['F.linear']:6.2f}  small_gemm {times['small_gemm']:6.2f}  "
              f"({times['F.linear'] / times['small_gemm']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
