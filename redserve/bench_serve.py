"""``redserve bench serve``: a serving benchmark in the manner of vLLM's ``benchmark_serving``.

Sends random token-id prompts of ``--input-len`` tokens to ``/v1/completions`` (streaming, ignore_eos,
``--output-len`` tokens each) with at most ``--concurrency`` in flight and, optionally, Poisson arrivals
at ``--request-rate``. Reports TTFT, TPOT, ITL and E2E latency (p50/p99) and output tokens/s. Uses the
standard library's HTTP client only, so the load generator itself stays light.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import select
import statistics
import threading
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field


def sse_chunks(resp) -> Iterator[dict]:
    """The JSON chunks of a streamed (SSE) response, up to ``data: [DONE]``."""
    for raw in resp:
        line = raw.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[6:])

def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--vocab-low", type=int, default=10)
    p.add_argument("--vocab-high", type=int, default=1000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


class Client:
    def __init__(self, base_url: str, api_key: str | None):
        parsed = urllib.parse.urlsplit(base_url)
        self.host, self.port = parsed.hostname, parsed.port or 80
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self.local, "conn", None)
        if conn is not None and conn.sock is not None and select.select([conn.sock], [], [], 0)[0]:
            conn.close()  # an idle kept-alive socket that reads as ready: the server closed it (urllib3's check)
            conn = None
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        return conn

    def get_json(self, path: str) -> dict:
        conn = self._conn()
        conn.request("GET", path, headers=self.headers)
        return json.loads(conn.getresponse().read())

    def _post(self, path: str, body: str) -> http.client.HTTPResponse:
        """POST on this thread's kept-alive connection. One the server closed since its last answer
        (llama-server closes after each streamed answer) is replaced once, as urllib3 retries a stale pooled
        connection; a fresh connection's failure is the request's."""
        reused = getattr(self.local, "conn", None) is not None
        try:
            conn = self._conn()
            conn.request("POST", path, body=body, headers=self.headers)
            return conn.getresponse()
        except (http.client.RemoteDisconnected, http.client.ImproperConnectionState, ConnectionResetError,
                BrokenPipeError):
            if not reused:
                raise
            self.local.conn = None
            conn = self._conn()
            conn.request("POST", path, body=body, headers=self.headers)
            return conn.getresponse()

    def stream_completion(self, body: dict) -> RequestResult:
        start = time.perf_counter()
        result = RequestResult(ok=False)
        try:
            resp = self._post("/v1/completions", json.dumps(body))
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
                return result
            last = start
            for chunk in sse_chunks(resp):
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                now = time.perf_counter()
                usage = chunk.get("usage")
                if usage:
                    result.output_tokens = usage["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
            result.e2e = time.perf_counter() - start
            result.ok = True
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.local.conn = None
            result.error = f"{type(exc).__name__}: {exc}"
        return result


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between ranks (numpy's default, as vLLM's
    benchmark reports it); nan for no values."""
    if not values:
        return float("nan")
    values = sorted(values)
    rank = q / 100 * (len(values) - 1)
    low = int(rank)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (rank - low)


def run_bench(args: argparse.Namespace) -> int:
    report = measure(args)
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:32s} {value:.4g}" if isinstance(value, float) else f"{key:32s} {value}")
    return 0 if report["failed"] == 0 else 1


def bench_args(**overrides) -> argparse.Namespace:
    """The ``redserve bench serve`` defaults with ``overrides`` (for callers that run it in-process)."""
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args([])
    unknown = set(overrides) - set(vars(args))
    if unknown:
        raise ValueError(f"unknown bench option(s): {sorted(unknown)}")
    return argparse.Namespace(**{**vars(args), **overrides})


def measure(args: argparse.Namespace) -> dict:
    """Run the benchmark once and return the report (see `summarize`)."""
    client = Client(args.base_url, args.api_key)
    model = args.model or client.get_json("/v1/models")["data"][0]["id"]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(args.vocab_low, args.vocab_high) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]

    def one(prompt: list[int]) -> RequestResult:
        return client.stream_completion({
            "model": model, "prompt": prompt, "max_tokens": args.output_len, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})

    start = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=args.concurrency)
    try:
        futures = []
        for prompt in prompts:
            futures.append(pool.submit(one, prompt))
            if args.request_rate != float("inf"):
                time.sleep(rng.expovariate(args.request_rate))
        results = [f.result() for f in futures]
    finally:  # on Ctrl-C, return at once: threads blocked on a stream end when its server goes
        pool.shutdown(wait=False, cancel_futures=True)
    duration = time.perf_counter() - start
    return summarize(results, duration, args)


def summarize(results: list[RequestResult], duration: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.ok]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itls]
    out_tokens = sum(r.output_tokens for r in ok)
    ms = 1e3
    errors = [r.error for r in results if not r.ok]
    return {
        "concurrency": args.concurrency, "request_rate": args.request_rate,
        "completed": len(ok), "failed": len(errors), "first_error": errors[0] if errors else "",
        "duration_s": duration, "output_tokens": out_tokens, "output_tok_per_s": out_tokens / duration,
        "request_per_s": len(ok) / duration,
        "ttft_ms_p50": percentile([r.ttft for r in ok], 50) * ms, "ttft_ms_p99": percentile([r.ttft for r in ok], 99) * ms,
        "tpot_ms_p50": percentile(tpots, 50) * ms, "tpot_ms_p99": percentile(tpots, 99) * ms,
        "itl_ms_p50": percentile(itls, 50) * ms, "itl_ms_p99": percentile(itls, 99) * ms,
        "e2e_ms_p50": percentile([r.e2e for r in ok], 50) * ms, "e2e_ms_p99": percentile([r.e2e for r in ok], 99) * ms,
        "ttft_ms_mean": statistics.fmean([r.ttft for r in ok]) * ms if ok else float("nan"),
    }
