"""Offline throughput: this engine vs transformers `generate` (static batching) vs a matmul-only forward.

Prints output tokens/s for N prompts of IN tokens in / OUT tokens out (ignore_eos) and the time per
output token at batch 1, all in one run so the figures compare as ratios.

    python benchmarks/bench_offline.py [--model DIR] [--num-prompts 64] [--input-len 128] [--output-len 128]
        [--rounds 3]

The batch-N engine and transformers runs alternate, ``--rounds`` times each, every round with prompts of its
own (so the engine's prefix cache never serves an earlier round's); the table shows each row's median and
the engine/transformers ratio of every round. The machine's speed can drift by 30% within minutes here,
and a ratio of two runs seconds apart moves far less than either figure. The engine and the transformers
model are loaded side by side for that (on CUDA both hold device memory at once).

Every figure is measured on the engine's device (CUDA when present): the transformers baseline and the
matmul-only forward run there too, and the device is synchronised before each timer is read.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import LLM, SamplingParams
from worker.models.tiny_model import ensure_default_model


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so a timer read after it covers that work (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_engine(llm: LLM, prompts: list[list[int]], out_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    device = torch.device(llm.config.device)
    synchronize(device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    synchronize(device)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == out_len for o in outputs)
    return elapsed


def load_transformers(model_dir: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def bench_transformers(model, device: torch.device, prompts: list[list[int]], out_len: int) -> float:
    ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        synchronize(device)
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len, min_new_tokens=out_len,
                       do_sample=False, pad_token_id=0)
        synchronize(device)
        return time.perf_counter() - start


def bench_matmul_only(llm: LLM, batch: int, steps: int) -> float:
    """Only the weight matmuls of a decode step (every linear layer + LM head), no attention/sampling, each
    through the path the engine takes at this batch (``gemm.matmul``: packed oneDNN, small-batch kernel or
    F.linear)."""
    model = llm.engine.executor.runner.model
    layers = [m for m in model.modules() if hasattr(m, "gemm") and m.weight.dim() == 2]
    x = {m.weight.shape[1]: torch.randn(batch, m.weight.shape[1], dtype=m.weight.dtype, device=m.weight.device)
         for m in layers}
    device = layers[0].weight.device

    def one_step() -> None:
        for m in layers:
            m.gemm.matmul(x[m.weight.shape[1]], m.weight)

    with torch.inference_mode():
        one_step()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            one_step()
        synchronize(device)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="alternating engine/transformers runs at batch N")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="engine TP size (transformers runs TP 1)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (transformers runs there too)")
    parser.add_argument("--enforce-eager", action="store_true", help="engine without CUDA graphs")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    model_dir = str(args.model or ensure_default_model())
    dtype = getattr(torch, args.dtype)
    llm = LLM(model_dir, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size, device=args.device,
              enforce_eager=args.enforce_eager)
    device = torch.device(llm.config.device)
    vocab = llm.engine.vocab_size
    total = args.num_prompts * args.output_len
    bench_engine(llm, random_prompts(4, args.input_len, vocab, seed=999), 8)
    hf = None if args.skip_transformers else load_transformers(model_dir, dtype, device)
    engine_runs, hf_runs = [], []
    for round_ in range(args.rounds):  # alternate, so a drift of the machine's speed falls on both
        prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=round_)
        engine_runs.append(total / bench_engine(llm, prompts, args.output_len))
        if hf is not None:
            hf_runs.append(total / bench_transformers(hf, device, prompts, args.output_len))
    rows = [(f"redserve engine, batch {args.num_prompts}", engine_runs, args.num_prompts)]
    t1 = bench_engine(llm, random_prompts(1, args.input_len, vocab, seed=1000), args.output_len)
    rows.append(("redserve engine, batch 1", [args.output_len / t1], 1))
    if args.tensor_parallel_size == 1:
        tm = bench_matmul_only(llm, args.num_prompts, args.output_len)
        rows.append((f"matmul-only decode, batch {args.num_prompts}", [total / tm], args.num_prompts))
    llm.shutdown()
    if hf is not None:
        rows.append((f"transformers generate, batch {args.num_prompts}", hf_runs, args.num_prompts))
        th1 = bench_transformers(hf, device, random_prompts(1, args.input_len, vocab, seed=1000), args.output_len)
        rows.append(("transformers generate, batch 1", [args.output_len / th1], 1))
    print(f"model={model_dir} device={device} dtype={args.dtype} tp={args.tensor_parallel_size} prompts={args.num_prompts} in={args.input_len} "
          f"out={args.output_len} threads={torch.get_num_threads()}")
    print(f"{'what':44s} {'out tok/s':>10s} {'ms/step':>9s}")
    for name, runs, batch in rows:  # ms/step: one decode step's share of the run (prefill included)
        tps = statistics.median(runs)
        spread = f"   ({len(runs)} runs: {min(runs):.0f}-{max(runs):.0f})" if len(runs) > 1 else ""
        print(f"{name:44s} {tps:10.0f} {batch * 1e3 / tps:9.2f}{spread}")
    if hf_runs:
        ratios = [e / h for e, h in zip(engine_runs, hf_runs, strict=True)]
        print(f"engine / transformers at batch {args.num_prompts}, by round: " +
              ", ".join(f"{r:.2f}" for r in ratios) + f" (median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
