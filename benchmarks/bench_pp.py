"""Offline decode throughput of PP=1 vs PP=2 vs TP=2 at concurrency 1 and 64 (one run, so the figures
compare as ratios).

    python benchmarks/bench_pp.py [--model DIR] [--input-len 32] [--output-len 64] [--concurrency 1 64]
        [--configs PP=1 PP=2 TP=2 "PP=2 one batch"]

"PP=2 one batch" is PP=2 with the batch queue off (one step in flight), to show what the queue buys.

Each configuration gets a fresh ``LLM``; a short warm-up generate runs first. tok/s counts generated
tokens over the wall time of one ``generate`` of ``concurrency`` prompts. On a CPU host every worker shares
the same cores (set ``OMP_NUM_THREADS``): PP and TP there measure overheads, not added compute.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine import LLM, SamplingParams
from worker.models.tiny_model import ensure_default_model

CONFIGS = {"PP=1": dict(), "PP=2": dict(pipeline_parallel_size=2), "TP=2": dict(tensor_parallel_size=2),
           "PP=2 one batch": dict(pipeline_parallel_size=2)}


def one_batch_in_flight(llm: LLM) -> None:
    """Turn the batch queue off: what PP=2 does when the engine waits for each step before the next."""
    llm.engine.executor.max_in_flight = 1
    llm.engine.scheduler.config.max_batches_in_flight = 1


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def tokens_per_second(llm: LLM, batch: list[list[int]], out_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the tiny llama (8 layers, hidden 512)")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS)[:3], choices=list(CONFIGS))
    args = parser.parse_args()
    model = args.model or str(ensure_default_model())
    results: dict[str, dict[int, float]] = {}
    for name in args.configs:
        llm = LLM(model, dtype="float32", **CONFIGS[name])
        try:
            if name == "PP=2 one batch":
                one_batch_in_flight(llm)
            vocab = llm.engine.vocab_size
            llm.generate(prompts(2, args.input_len, vocab), SamplingParams(max_tokens=4), use_tqdm=False)
            results[name] = {c: tokens_per_second(llm, prompts(c, args.input_len, vocab), args.output_len)
                             for c in args.concurrency}
        finally:
            llm.shutdown()
        print(name, {c: round(v, 1) for c, v in results[name].items()}, flush=True)
    print(f"\n| config | {' | '.join(f'c={c} tok/s' for c in args.concurrency)} |")
    print(f"|---|{'---|' * len(args.concurrency)}")
    for name, row in results.items():
        print(f"| {name} | {' | '.join(f'{row[c]:.1f}' for c in args.concurrency)} |")


if __name__ == "__main__":
    main()
