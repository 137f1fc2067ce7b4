"""The GPU engine against its targets and floors, one command, one table (issue: the GPU engine at the
hardware's speed).

    python benchmarks/bench_gpu.py [--model DIR] [--dtype bfloat16] [--batch 256] [--input-len 128]
        [--output-len 128] [--concurrency 1,64] [--hbm-tbps 4.8] [--skip-served] [--skip-transformers]
        [--enforce-eager] [--async-scheduling auto|on|off] [--device cuda] [--kernels N] [--json FILE]

Without ``--model`` it makes (once, ~35 s) the random-weight model with Llama-3.2-1B's shape that the
project's GPU figures use (``~/.cache/redserve/bench-1b``). Rows, all in one sitting:

- offline ``LLM``: batch ``--batch`` output tok/s and ms a step, batch 1 ms a token, and transformers
  ``generate`` at the same batch (its ratio);
- matmul-only decode at ``--batch`` (every linear layer and the LM head, the engine's own paths): a floor;
- steady decode under ``torch.profiler`` at ``--batch``: device busy time / wall time, and CPU time per step
  against device time per step;
- served (``redserve serve`` + ``redserve bench serve``, 128 in / 128 out): TPOT p50 and output tok/s at each
  ``--concurrency``;
- the weight-streaming floor of one decode step: the model's weight bytes / ``--hbm-tbps`` (H200: 4.8 TB/s).

Each figure sits beside its target from the issue. On a CPU (``--device cpu``) it runs as a smoke test of the
script itself: the device rows say "n/a".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import torch  # noqa: E402

from benchmarks.bench_offline import (  # noqa: E402
    bench_engine,
    bench_matmul_only,
    bench_transformers,
    load_transformers,
    random_prompts,
    synchronize,
)
from benchmarks.bench_servers import free_port, redserve_spec, running_server  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from redserve.bench_serve import bench_args, measure  # noqa: E402

ONE_B_SHAPE = {"hidden_size": 2048, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8, "intermediate_size": 8192,
               "vocab_size": 32000}
SERVED_NAME = "bench-gpu"
ASYNC = {"auto": None, "on": True, "off": False}
TARGETS = {"served_c1_tpot_ms": "<= 1.5", "served_c64_tok_s": ">= 25,000", "offline_batch_tok_s": ">= 50,000",
           "offline_vs_transformers": ">= 5x", "busy_fraction": ">= 0.85", "cpu_vs_device_ms": "CPU < device"}


def one_b_model() -> str:
    from worker.models.tiny_model import make_tiny_model

    path = Path.home() / ".cache" / "redserve" / "bench-1b"
    if not (path / "config.json").is_file():
        make_tiny_model(path, arch="llama", seed=0, max_position_embeddings=4096, **ONE_B_SHAPE)
    return str(path)


def weight_bytes(llm: LLM) -> int:
    model = llm.engine.executor.runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def profiled_decode(llm: LLM, batch: int, input_len: int, steps: int, top: int = 0) -> dict:
    """Device busy / wall and CPU / device time per step over ``steps`` steady decode steps at ``batch``;
    with ``top`` also the profiler's table of the ``top`` ops by device time (``kernels``)."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(llm.config.device)
    vocab = llm.engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    engine = llm.engine
    for i, prompt in enumerate(random_prompts(batch, input_len, vocab, seed=4242)):
        engine.add_request(f"profiled-{i}", prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # every prompt prefilled (many steps at a large batch), then into steady decode
        started.update(out.request_id for out in engine.step())
    for _ in range(4):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(steps):
            engine.step()
        synchronize(device)
        wall, cpu = time.perf_counter() - wall_start, time.process_time() - cpu_start
    while engine.has_unfinished_requests():
        engine.step()
    averages = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in averages) if device.type == "cuda" else 0.0
    kernels = {"kernels": averages.table(sort_by="self_device_time_total" if device_us else "self_cpu_time_total",
                                         row_limit=top)} if top else {}
    return {**kernels, "wall_ms_per_step": wall / steps * 1e3, "cpu_ms_per_step": cpu / steps * 1e3,
            "device_ms_per_step": device_us / 1e3 / steps if device_us else None,
            "busy_fraction": device_us / 1e6 / wall if device_us else None}


def offline(args: argparse.Namespace, model_dir: str) -> dict:
    llm = LLM(model_dir, dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager,
              max_num_seqs=max(args.batch, 1), async_scheduling=ASYNC[args.async_scheduling])
    device = torch.device(llm.config.device)
    vocab = llm.engine.vocab_size
    bench_engine(llm, random_prompts(4, args.input_len, vocab, seed=999), 8)  # warm-up (and graph replays)
    total = args.batch * args.output_len
    batch_s = bench_engine(llm, random_prompts(args.batch, args.input_len, vocab, seed=1), args.output_len)
    one_s = bench_engine(llm, random_prompts(1, args.input_len, vocab, seed=2), args.output_len)
    result = {"device": str(device), "weight_bytes": weight_bytes(llm),
              "offline_batch_tok_s": total / batch_s, "offline_batch_ms_per_step": batch_s / args.output_len * 1e3,
              "offline_batch1_ms_per_token": one_s / args.output_len * 1e3,
              "matmul_only_ms_per_step": bench_matmul_only(llm, args.batch, 16) / 16 * 1e3,
              **profiled_decode(llm, args.batch, args.input_len, steps=16, top=args.kernels)}
    if args.kernels:
        one = profiled_decode(llm, 1, args.input_len, steps=16, top=args.kernels)
        result["batch1_profile"] = {k: v for k, v in one.items() if k != "kernels"}
        result["kernels_batch1"] = one["kernels"]
    llm.shutdown()
    if not args.skip_transformers:
        hf = load_transformers(model_dir, getattr(torch, args.dtype), device)
        hf_s = bench_transformers(hf, device, random_prompts(args.batch, args.input_len, vocab, seed=1), args.output_len)
        result["transformers_tok_s"] = total / hf_s
        del hf
    return result


def served(args: argparse.Namespace, model_dir: str) -> dict:
    extra = (("--enforce-eager " if args.enforce_eager else "") + f"--async-scheduling {args.async_scheduling} "
             + args.serve_args)
    spec = redserve_spec(args.redserve_cmd, model_dir, args.dtype, free_port(), SERVED_NAME,
                         args.input_len + args.output_len + 64, extra)
    out = {}
    with running_server(spec, Path(args.log_dir)):
        measure(bench_args(base_url=spec.base_url, model=SERVED_NAME, num_prompts=8, input_len=16, output_len=16,
                           concurrency=4, seed=999))  # warm-up
        for c in args.concurrency:
            report = measure(bench_args(base_url=spec.base_url, model=SERVED_NAME, num_prompts=max(4 * c, 16),
                                        input_len=args.input_len, output_len=args.output_len, concurrency=c,
                                        seed=1000 + c))
            out[c] = {k: report[k] for k in ("output_tok_per_s", "tpot_ms_p50", "ttft_ms_p50", "failed")}
            print(f"[bench] served c={c}: {out[c]}", flush=True)
    return out


def table(args: argparse.Namespace, result: dict) -> str:
    floor_ms = result["weight_bytes"] / (args.hbm_tbps * 1e12) * 1e3
    fmt = lambda v, spec: "n/a" if v is None else spec.format(v)  # noqa: E731
    ratio = (result["offline_batch_tok_s"] / result["transformers_tok_s"]) if "transformers_tok_s" in result else None
    rows = [
        (f"offline batch {args.batch}, output tok/s", fmt(result["offline_batch_tok_s"], "{:,.0f}"),
         TARGETS["offline_batch_tok_s"], f"matmul-only {result['matmul_only_ms_per_step']:.2f} ms/step"),
        (f"offline batch {args.batch} vs transformers generate", fmt(ratio, "{:.2f}x"),
         TARGETS["offline_vs_transformers"], fmt(result.get("transformers_tok_s"), "transformers {:,.0f} tok/s")),
        (f"offline batch {args.batch}, ms a step", fmt(result["offline_batch_ms_per_step"], "{:.2f}"), "",
         f"weights {floor_ms:.2f} ms"),
        ("offline batch 1, ms a token", fmt(result["offline_batch1_ms_per_token"], "{:.2f}"), "",
         f"weights {floor_ms:.2f} ms"),
        ("steady decode: device busy / wall", fmt(result["busy_fraction"], "{:.0%}"), TARGETS["busy_fraction"], ""),
        ("steady decode: CPU ms vs device ms a step",
         f"{result['cpu_ms_per_step']:.2f} vs {fmt(result['device_ms_per_step'], '{:.2f}')}",
         TARGETS["cpu_vs_device_ms"], f"wall {result['wall_ms_per_step']:.2f} ms"),
    ]
    for c, r in result.get("served", {}).items():
        rows.append((f"served c={c}, TPOT p50 ms / output tok/s",
                     f"{r['tpot_ms_p50']:.2f} / {r['output_tok_per_s']:,.0f}" + (f" ({r['failed']} failed)" if r["failed"] else ""),
                     {1: TARGETS["served_c1_tpot_ms"] + " ms", 64: TARGETS["served_c64_tok_s"] + " tok/s"}.get(c, ""),
                     f"TPOT floor {floor_ms:.2f} ms" if c == 1 else ""))
    lines = [f"device {result['device']}, dtype {args.dtype}, {result['weight_bytes'] / 1e9:.2f} GB of weights, "
             f"{args.input_len} in / {args.output_len} out, CUDA graphs "
             f"{'on' if result['device'].startswith('cuda') and not args.enforce_eager else 'off'}, "
             f"async scheduling {args.async_scheduling}", "",
             "| case | measured | target | floor / beside it |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the 1B-shaped random model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", default="1,64", type=lambda s: [int(c) for c in s.split(",") if c])
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="device memory bandwidth for the floor")
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--async-scheduling", choices=list(ASYNC), default="auto",
                        help="overlap each step's scheduling with the last one's device work (auto: on for CUDA)")
    parser.add_argument("--redserve-cmd", default=f"{sys.executable} -m redserve.cli")
    parser.add_argument("--serve-args", default="", help="more `redserve serve` flags, e.g. '--api-workers 8'")
    parser.add_argument("--log-dir", default="/tmp/bench-gpu-logs")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="also print the profiler's top N ops by device time in steady decode (batch and 1)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    model_dir = args.model or one_b_model()
    served_result: dict = {}
    if not args.skip_served:  # first, while this process holds no device memory (the server sizes its KV cache
        try:                  # from what is free)
            served_result = served(args, model_dir)
        except RuntimeError as exc:  # the offline rows still count
            print(f"[bench] served rows skipped: {exc}", flush=True)
    result = offline(args, model_dir)
    result["served"] = served_result
    print(table(args, result), flush=True)
    for key in ("kernels", "kernels_batch1"):
        if key in result:
            print(f"\n{key} (steady decode, {args.batch if key == 'kernels' else 1} sequences, 16 steps):\n"
                  f"{result[key]}", flush=True)
    if "batch1_profile" in result:
        print("batch 1 steady decode:", {k: round(v, 3) for k, v in result["batch1_profile"].items() if v is not None})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
