"""CPU time of one decode step (``EngineCore.step()``), one thread, at batch 1, 16 and 64.

    python benchmarks/step_cpu_time.py [--model DIR] [--dtype float32] [--batches 1,16,64] [--steps 16]
                                       [--rounds 5] [--profile] [--quantization auto|none|gguf]

Why CPU time: on a machine shared with other work, wall-clock per step swings by more than the changes
being measured; the CPU time of the one thread that runs the step (``time.thread_time``, torch limited to
one thread) does not count the time others hold the core. Each round times ``--steps`` consecutive steps
of B requests in decode (greedy, ``ignore_eos``, 128-token random prompts); the best round is printed, as
ms per step. ``--profile`` prints the top of a cProfile of one more round instead, by own time.

To compare two trees in one sitting, run this file from each with ``PYTHONPATH=<tree>`` (the engine is
imported from the first tree on the path), alternating.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from step_split import decode_batch  # this directory is on the path when run as a script


def step_ms(llm, steps: int) -> float:
    start = time.thread_time()
    for _ in range(steps):
        llm.engine.step()
    return (time.thread_time() - start) / steps * 1e3


def measure(llm, batch: int, args) -> str:
    ids = decode_batch(llm, batch, args.input_len, max_tokens=(args.rounds + 2) * args.steps + 8)
    step_ms(llm, 2)  # warm-up (new shapes)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(step_ms, llm, args.steps)
        llm.engine.abort_request(ids)
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(25)
        return f"batch {batch}: profiled {args.steps} steps"
    rounds = [step_ms(llm, args.steps) for _ in range(args.rounds)]
    llm.engine.abort_request(ids)
    return f"batch {batch}: best {min(rounds):.3f} ms/step CPU, rounds " + " ".join(f"{r:.2f}" for r in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the tiny test model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: the engine's own choice)")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf", "int8"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    import engine
    from engine import LLM
    from worker.models.tiny_model import ensure_default_model
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(str(args.model or ensure_default_model()), dtype=args.dtype, max_num_seqs=max(batches),
              quantization=args.quantization, **({"device": args.device} if args.device else {}))
    try:
        print(f"engine from {engine.__file__}, model={llm.config.model} dtype={args.dtype} "
              f"quantization={args.quantization}")
        for batch in batches:
            print(measure(llm, batch, args), flush=True)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
