"""Offline throughput: this engine vs transformers `generate` (static batching) vs a matmul-only forward.

Prints output tokens/s for N prompts of IN tokens in / OUT tokens out (ignore_eos) and the time per
output token at batch 1, all in one run so the figures compare as ratios.

    python benchmarks/bench_offline.py [--model DIR] [--num-prompts 64] [--input-len 128] [--output-len 128]

Every figure is measured on the engine's device (CUDA when present): the transformers baseline and the
matmul-only forward run there too, and the device is synchronised before each timer is read.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine import LLM, SamplingParams
from engine.tiny_model import ensure_default_model


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


def bench_transformers(model_dir: str, dtype: torch.dtype, device: torch.device, prompts: list[list[int]],
                       out_len: int) -> float:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
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
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="engine TP size (transformers runs TP 1)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (transformers runs there too)")
    args = parser.parse_args()
    model_dir = str(args.model or ensure_default_model())
    dtype = getattr(torch, args.dtype)
    llm = LLM(model_dir, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size, device=args.device)
    device = torch.device(llm.config.device)
    vocab = llm.engine.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab)
    total = args.num_prompts * args.output_len
    bench_engine(llm, prompts[:4], 8)
    rows = []
    t = bench_engine(llm, prompts, args.output_len)
    rows.append((f"redserve engine, batch {args.num_prompts}", total / t, t / args.output_len * 1e3))
    t1 = bench_engine(llm, prompts[:1], args.output_len)
    rows.append(("redserve engine, batch 1", args.output_len / t1, t1 / args.output_len * 1e3))
    if args.tensor_parallel_size == 1:
        tm = bench_matmul_only(llm, args.num_prompts, args.output_len)
        rows.append((f"matmul-only decode, batch {args.num_prompts}", total / tm, tm / args.output_len * 1e3))
    llm.shutdown()
    if not args.skip_transformers:
        th = bench_transformers(model_dir, dtype, device, prompts, args.output_len)
        rows.append((f"transformers generate, batch {args.num_prompts}", total / th, th / args.output_len * 1e3))
        th1 = bench_transformers(model_dir, dtype, device, prompts[:1], args.output_len)
        rows.append(("transformers generate, batch 1", args.output_len / th1, th1 / args.output_len * 1e3))
    print(f"model={model_dir} device={device} dtype={args.dtype} tp={args.tensor_parallel_size} prompts={args.num_prompts} in={args.input_len} "
          f"out={args.output_len} threads={torch.get_num_threads()}")
    print(f"{'what':44s} {'out tok/s':>10s} {'ms/step':>9s}")
    for name, tps, ms in rows:
        print(f"{name:44s} {tps:10.0f} {ms:9.2f}")


if __name__ == "__main__":
    main()
