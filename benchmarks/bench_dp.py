"""Data parallelism: served throughput with DP=2 vs DP=1, and load balance under a skewed request mix.

1. Throughput: for each DP size, `redserve serve --data-parallel-size N` (its own embedded Redis), then
   `redserve bench serve` at `--concurrency` (HTTP, streaming, ignore_eos), one JSON line each.
2. Balance (DP=2, the same kind of stack): `--num-skewed` requests through `BrokerClient` (the client the API
   uses, so the same engine choice), a random mix of long (`--long-fraction`, long prompt and output) and short
   ones, `--concurrency` in flight. Reports, per engine, the requests it got and its prompt / generated tokens
   (from the engine's own counters), so a skew shows up as an uneven token split.

Prints one JSON object at the end. On a machine with few cores, DP=2 shares them with DP=1's work: it is not
expected to be faster there; the run shows what the balance and the broker cost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broker.client import BrokerClient  # noqa: E402
from broker.keys import RedisKeys  # noqa: E402
from broker.registry import EngineRegistry  # noqa: E402
from protocol.messages import AddRequest  # noqa: E402
from protocol.sampling_params import SamplingParams  # noqa: E402
from redserve.redis_server import EmbeddedRedis  # noqa: E402


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "redserve.cli", "--log-level", "WARNING", *argv]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServedStack:
    """`redserve serve` on its own Redis; a context manager that waits for /health."""

    def __init__(self, args: argparse.Namespace, dp: int) -> None:
        self.args, self.dp, self.port = args, dp, _free_port()
        self.redis = EmbeddedRedis().start()
        self.registry = EngineRegistry(redis.Redis.from_url(self.redis.url), RedisKeys("rs"))
        self.keys = self.registry.keys
        argv = ["serve", "--data-parallel-size", str(dp), "--port", str(self.port), "--redis-url", self.redis.url,
                "--dtype", "float32", "--kv-cache-memory", str(args.kv_cache_memory), "--api-workers",
                str(args.api_workers), "--no-batch-worker"]
        if args.model:
            argv += ["--model", args.model]
        self.proc = subprocess.Popen(_cli(*argv), cwd=ROOT, stdin=subprocess.DEVNULL)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServedStack:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redserve serve exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as resp:
                    ready = len(self.registry.ready_engines())
                    if resp.status == 200 and ready == self.dp:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the stack did not become ready in 300 s")

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.redis.stop()

    def engine_counters(self) -> dict[str, dict[str, int]]:
        engines = self.registry.all_engines()
        return {e["engine_id"]: {"prompt_tokens": int(e.get("prompt_tokens", 0)),
                                 "generated_tokens": int(e.get("generated_tokens", 0))} for e in engines}


def throughput(args: argparse.Namespace, dp: int) -> dict:
    with ServedStack(args, dp) as stack:
        bench = ["bench", "serve", "--base-url", stack.base_url, "--num-prompts", str(args.num_prompts),
                 "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                 "--concurrency", str(args.concurrency), "--json"]
        out = subprocess.run(_cli(*bench), cwd=ROOT, capture_output=True, text=True, timeout=1800)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        time.sleep(0.5)  # the engines' last counters
        result["per_engine"] = stack.engine_counters()
        return result


def skewed_balance(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    mix = [rng.random() < args.long_fraction for _ in range(args.num_skewed)]
    prompts = [[rng.randrange(10, 1000) for _ in range(args.long_input if long else args.short_input)] for long in mix]
    with ServedStack(args, 2) as stack:
        before = stack.engine_counters()
        client = BrokerClient(stack.redis.url, keys=stack.keys).start()
        placed: Counter = Counter()
        kinds: Counter = Counter()
        lock = threading.Lock()

        def one(i: int, long: bool) -> None:
            out_len = args.long_output if long else args.short_output
            params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
            with client.submit(AddRequest(f"s{i}", "", prompts[i], params, time.time(), time.time() + 1800)) as h:
                for out in h:
                    if out.error_code is not None:
                        raise RuntimeError(out.error_text())
                with lock:
                    placed[h.engine_id] += 1
                    kinds[(h.engine_id, "long" if long else "short")] += 1

        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(lambda a: one(*a), enumerate(mix)))
        elapsed = time.perf_counter() - started
        client.stop()
        time.sleep(0.5)  # the engines' last counters
        after = stack.engine_counters()
    per_engine = {e: {"requests": placed[e], "long": kinds[(e, "long")], "short": kinds[(e, "short")],
                      **{k: after[e][k] - before.get(e, {}).get(k, 0) for k in after[e]}} for e in sorted(after)}
    return {"requests": len(mix), "long": sum(mix), "elapsed_s": round(elapsed, 2), "per_engine": per_engine}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the tiny test model)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--api-workers", type=int, default=2)
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    p.add_argument("--num-skewed", type=int, default=256)
    p.add_argument("--long-fraction", type=float, default=0.2)
    p.add_argument("--long-input", type=int, default=512)
    p.add_argument("--long-output", type=int, default=128)
    p.add_argument("--short-input", type=int, default=16)
    p.add_argument("--short-output", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="throughput runs per DP size (median reported)")
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args()
    report: dict = {"cpu_count": os.cpu_count()}
    if not args.skip_throughput:
        runs: dict[int, list[dict]] = {1: [], 2: []}
        for _ in range(args.repeats):  # alternate, so load from elsewhere on the machine hits both alike
            for dp in (1, 2):
                runs[dp].append(throughput(args, dp))
                print(f"DP={dp}: {json.dumps(runs[dp][-1])}", flush=True)
        for dp, results in runs.items():
            rates = sorted(r["output_tok_per_s"] for r in results)
            report[f"dp{dp}"] = {"output_tok_per_s_runs": [round(x, 1) for x in rates],
                                 "output_tok_per_s_median": round(statistics.median(rates), 1),
                                 "last_run": results[-1]}
        report["dp2_over_dp1"] = round(report["dp2"]["output_tok_per_s_median"]
                                       / report["dp1"]["output_tok_per_s_median"], 3)
    report["skewed"] = skewed_balance(args)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
