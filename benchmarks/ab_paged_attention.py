"""Decode attention of two builds of the paged-attention kernel, interleaved, over every layer's cache of a model.

    python benchmarks/ab_paged_attention.py DIR_A DIR_B [--batch 64] [--context 200] [--shape 9,3,64,30]
                                            [--dtype bfloat16] [--threads 2] [--hot] [--flush MB]

DIR_A and DIR_B each hold a ``paged_attention.cpp`` (and the headers it includes), e.g. a copy of
``worker/kernels/csrc`` before a change and the tree after it. Each round times one decode step's attention over
``L`` layers (one call per layer, as the engine makes them) with A, then with B; the medians of 15 rounds are
printed with the KV bytes read per second and the largest difference between A's and B's outputs.

``--shape`` is heads, KV heads, head dim, layers (default SmolLM2-135M's: 9, 3, 64, 30; the tiny test model is
8,4,64,8). The blocks of each sequence sit at random places in the pool, as they do in a served cache. Each layer has
a cache of its own, so the caches come from DRAM as in the engine; ``--hot`` makes every layer share one cache,
which then stays in L2/L3 (the kernel's compute alone); ``--spread`` draws each sequence's context from
[context / 2, 3 * context / 2], as in a served batch whose requests arrived at different times. ``--flush MB``
reads MB megabytes of other memory before each layer's call (untimed: only the calls are timed), as a served step
streams a layer's weights between two attention calls: at small batches the whole KV fits the L3 otherwise
(SmolLM2 at batch 1 x 250: 6 MB), which a served step's weights evict (a Q8_0 layer is 4.8 MB).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.kernels import build  # noqa: E402

BLOCK_SIZE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir_a", type=Path)
    parser.add_argument("dir_b", type=Path)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--shape", default="9,3,64,30", help="heads,kv_heads,head_dim,layers")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hot", action="store_true", help="one cache shared by every layer (stays in cache)")
    parser.add_argument("--spread", action="store_true",
                        help="contexts uniform in [context / 2, 3 * context / 2] (a served batch's mix)")
    parser.add_argument("--flush", type=float, default=0.0, metavar="MB",
                        help="read MB of other memory before each layer's call (untimed), as a step's weights do")
    args = parser.parse_args()
    heads, kv_heads, dim, layers = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    kernels = [build.load_extension(f"ab_{tag}_paged_attention", (folder / "paged_attention.cpp",))
               for tag, folder in (("a", args.dir_a), ("b", args.dir_b))]
    if None in kernels:
        raise SystemExit("a build failed (its error is above)")

    rng = random.Random(0)
    longest = args.context * 3 // 2 if args.spread else args.context
    blocks = -(-longest // BLOCK_SIZE)
    pool = list(range(args.batch * blocks + 8))
    rng.shuffle(pool)
    slots = len(pool) * BLOCK_SIZE
    caches = [torch.randn(2, slots, kv_heads, dim).to(dtype) for _ in range(1 if args.hot else layers)]
    caches = caches * layers if args.hot else caches
    tables = torch.tensor([pool[i * blocks:(i + 1) * blocks] for i in range(args.batch)], dtype=torch.int32)
    starts, lens = torch.arange(args.batch, dtype=torch.int32), torch.ones(args.batch, dtype=torch.int32)
    contexts = torch.tensor([rng.randint(args.context // 2, longest) if args.spread
                             else args.context - rng.randrange(0, BLOCK_SIZE) for _ in range(args.batch)],
                            dtype=torch.int32)
    q = torch.randn(args.batch, heads, dim).to(dtype)
    outs = [torch.empty_like(q), torch.empty_like(q)]
    torch.set_num_threads(args.threads)

    flush = torch.ones(int(args.flush * (1 << 20)) // 4) if args.flush else None

    def step_ms(i: int) -> float:
        if flush is None:
            start = time.perf_counter()
            for cache in caches:
                kernels[i].paged_attention(outs[i], q, cache[0], cache[1], tables, starts, lens, contexts,
                                           BLOCK_SIZE, dim ** -0.5, 0, 0.0)
            return (time.perf_counter() - start) * 1e3
        total = 0.0
        for cache in caches:
            flush.sum()
            start = time.perf_counter()
            kernels[i].paged_attention(outs[i], q, cache[0], cache[1], tables, starts, lens, contexts, BLOCK_SIZE,
                                       dim ** -0.5, 0, 0.0)
            total += time.perf_counter() - start
        return total * 1e3

    times: list[list[float]] = [[], []]
    for _ in range(15):
        for i in (0, 1):
            times[i].append(step_ms(i))
    mb = float(contexts.sum()) * kv_heads * dim * 2 * dtype.itemsize * layers / 1e6
    a, b = (statistics.median(t) for t in times)
    diff = float((outs[0].float() - outs[1].float()).abs().max())
    print(f"batch {args.batch} x context {args.context}, heads {heads}/{kv_heads} x {dim}, {layers} layers, "
          f"{args.dtype}, {args.threads} threads{', hot' if args.hot else ''}{', spread' if args.spread else ''}"
          f"{f', {args.flush:g} MB flushed a layer' if flush is not None else ''}: {mb:.0f} MB of KV a step")
    print(f"A {a:.2f} ms ({mb / a:.1f} GB/s)  B {b:.2f} ms ({mb / b:.1f} GB/s)  B/A {b / a:.3f}  "
          f"max |A - B| {diff:.1e}")


if __name__ == "__main__":
    main()
