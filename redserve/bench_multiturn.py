"""``redserve bench multiturn``: multi-turn chat load, where every turn resends the whole conversation.

C conversations (``--conversations``) run at once, each of T turns (``--turns``): a turn sends the history
(an optional system prompt of S tokens shared by every conversation, ``--system-len``, then all earlier
user messages and replies) plus a new user message of ``--user-len`` random tokens to ``/v1/completions``
(streamed, ignore_eos, ``--output-len`` tokens); the reply's token ids (``logprobs: 0`` with
``return_tokens_as_token_ids``) join the history. Reported: TTFT p50/p99 (all turns, and turns after the
first), output tokens/s, and from ``/metrics`` before and after (needs ``--public-metrics`` or
``--api-key``): the engines' prefix-cache hit rate (prompt tokens found / looked up), each engine's share
of prompt tokens and requests (load spread = busiest / mean) and the routing decisions by reason.

``--launch-model MODEL`` starts ``redserve serve`` (``--dp`` engines, embedded Redis) once per policy in
``--policies`` (cache, load), runs the benchmark against each and prints one report per policy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from redserve.bench_serve import Client, percentile, sse_chunks

_SAMPLE = re.compile(r'^(redserve:[a-z_]+)\{([^}]*)\} ([0-9.eE+-]+)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def add_multiturn_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--conversations", type=int, default=8, help="conversations run at once (C)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (T)")
    p.add_argument("--system-len", type=int, default=0, help="tokens of a system prompt shared by all (S)")
    p.add_argument("--user-len", type=int, default=64, help="tokens of each new user message")
    p.add_argument("--output-len", type=int, default=32, help="tokens of each reply")
    p.add_argument("--vocab-low", type=int, default=10)
    p.add_argument("--vocab-high", type=int, default=1000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print each report as one JSON line")
    p.add_argument("--launch-model", default=None, help="start `redserve serve` with this model per policy")
    p.add_argument("--policies", default="load,cache", help="with --launch-model: routing policies to compare")
    p.add_argument("--dp", type=int, default=2, help="with --launch-model: data-parallel engines")
    p.add_argument("--serve-args", default="", help="with --launch-model: more `redserve serve` flags")


def run_multiturn(args: argparse.Namespace) -> int:
    reports = launch_and_measure(args) if args.launch_model else [measure(args)]
    for report in reports:
        if args.json:
            print(json.dumps(report), flush=True)
        else:
            print(f"--- routing policy: {report.get('policy', '?')}")
            for key, value in report.items():
                print(f"{key:32s} {value:.4g}" if isinstance(value, float) else f"{key:32s} {value}")
    return 0 if all(r["failed"] == 0 for r in reports) else 1


def scrape(base_url: str, api_key: str | None) -> dict[tuple[str, tuple], float]:
    """redserve:* samples of /metrics as {(name, sorted labels): value}."""
    import urllib.request  # here: `redserve` builds its parser, with this module's flags, on every command

    request = urllib.request.Request(base_url.rstrip("/") + "/metrics")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=30) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = tuple(sorted((k, v) for k, v in _LABEL.findall(m.group(2)) if k != "model_name"))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def _per_engine(before: dict, after: dict, name: str) -> dict[str, float]:
    got: dict[str, float] = defaultdict(float)
    for (n, labels), value in after.items():
        if n == name:
            engine = dict(labels).get("engine", "?")
            got[engine] += value - before.get((n, labels), 0.0)
    return dict(got)


def measure(args: argparse.Namespace) -> dict:
    client = Client(args.base_url, args.api_key)
    model = args.model or client.get_json("/v1/models")["data"][0]["id"]
    rng = random.Random(args.seed)
    system = [rng.randrange(args.vocab_low, args.vocab_high) for _ in range(args.system_len)]
    before = scrape(args.base_url, args.api_key)

    def conversation(seed: int) -> list[tuple[int, bool, float, int]]:
        crng = random.Random(seed)
        history, results = list(system), []
        for turn in range(args.turns):
            history += [crng.randrange(args.vocab_low, args.vocab_high) for _ in range(args.user_len)]
            ok, ttft, tokens = _turn(client, model, history, args.output_len)
            results.append((turn, ok, ttft, len(tokens)))
            if not ok:
                break
            history += tokens
        return results

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.conversations) as pool:
        turns = [r for f in [pool.submit(conversation, args.seed * 1000 + i) for i in range(args.conversations)]
                 for r in f.result()]
    duration = time.perf_counter() - start
    after = scrape(args.base_url, args.api_key)
    return summarize(turns, duration, before, after)


def _turn(client: Client, model: str, prompt: list[int], max_tokens: int) -> tuple[bool, float, list[int]]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    start = time.perf_counter()
    ttft, tokens = 0.0, []
    try:
        conn = client._conn()
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers=client.headers)
        resp = conn.getresponse()
        if resp.status != 200:
            resp.read()
            return False, 0.0, []
        for chunk in sse_chunks(resp):
            if "error" in chunk:
                return False, 0.0, []
            for choice in chunk.get("choices") or []:
                if ttft == 0.0:
                    ttft = time.perf_counter() - start
                for tok in (choice.get("logprobs") or {}).get("tokens") or []:
                    tokens.append(int(tok.split(":", 1)[1]))
    except (OSError, ValueError) as exc:
        client.local.conn = None
        print(f"turn failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return False, 0.0, []
    return True, ttft, tokens


def summarize(turns: list[tuple[int, bool, float, int]], duration: float, before: dict, after: dict) -> dict:
    ok = [t for t in turns if t[1]]
    ttfts = [t[2] for t in ok]
    later = [t[2] for t in ok if t[0] > 0]
    queries = _per_engine(before, after, "redserve:prefix_cache_queries_total")
    hits = _per_engine(before, after, "redserve:prefix_cache_hits_total")
    routed: dict[str, float] = defaultdict(float)
    reasons: dict[str, float] = defaultdict(float)
    for (n, labels), value in after.items():
        if n == "redserve:routing_decisions_total":
            d = dict(labels)
            delta = value - before.get((n, labels), 0.0)
            routed[d.get("engine", "?")] += delta
            reasons[d.get("reason", "?")] += delta
    engines = sorted(set(queries) | set(routed))

    def spread(values: dict[str, float]) -> float:
        vals = [values.get(e, 0.0) for e in engines]
        return max(vals) / (sum(vals) / len(vals)) if vals and sum(vals) > 0 else float("nan")

    return {
        "requests": len(turns), "failed": len(turns) - len(ok), "duration_s": duration,
        "output_tokens_per_s": sum(t[3] for t in ok) / duration if duration > 0 else 0.0,
        "ttft_p50_ms": percentile(ttfts, 50) * 1000, "ttft_p99_ms": percentile(ttfts, 99) * 1000,
        "ttft_later_turns_p50_ms": percentile(later, 50) * 1000,
        "prefix_hit_rate": sum(hits.values()) / sum(queries.values()) if sum(queries.values()) else float("nan"),
        "hit_rate_by_engine": {e: round(hits.get(e, 0.0) / queries[e], 4) if queries.get(e) else None
                               for e in engines},
        "prompt_tokens_by_engine": {e: int(queries.get(e, 0.0)) for e in engines},
        "requests_by_engine": {e: int(routed.get(e, 0.0)) for e in engines},
        "load_spread_prompt_tokens": spread(queries), "load_spread_requests": spread(routed),
        "routing_decisions": {k: int(v) for k, v in sorted(reasons.items())},
    }


def launch_and_measure(args: argparse.Namespace) -> list[dict]:
    reports = []
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        port = _free_port()
        argv = [sys.executable, "-m", "redserve.cli", "--log-level", "WARNING", "serve", "--model", args.launch_model,
                "-dp", str(args.dp), "--port", str(port), "--public-metrics", "--routing", policy,
                "--no-batch-worker", *args.serve_args.split()]
        proc = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_engines(base, args.dp, proc)
            report = measure(argparse.Namespace(**{**vars(args), "base_url": base}))
            reports.append({"policy": policy, "dp": args.dp, **report})
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return reports


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_engines(base: str, dp: int, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redserve serve exited with {proc.returncode}")
        with contextlib.suppress(OSError, ValueError):
            ready = scrape(base, None).get(("redserve:engines_ready", ()), 0)
            if ready >= dp:
                return
        time.sleep(1.0)
    raise RuntimeError(f"{dp} engines were not ready within {timeout}s")
