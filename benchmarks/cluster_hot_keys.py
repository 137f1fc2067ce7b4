"""Hot keys of a clustered stack: which keys and channels each primary serves, counted with MONITOR.

Starts `redserve serve --redis-cluster 3 --data-parallel-size 2` (the tiny model unless --model), opens MONITOR
on every primary as the admin, sends ``--requests`` completions ``--concurrency`` at a time whose prompts share a
few long prefixes (so the prefix-cache index and cache-aware routing work), and prints per node the commands it
ran per second, then the hottest keys (and sharded channels) over the cluster with their node and ops/s. MONITOR
itself slows the servers; the figures are for comparing keys with each other, not absolute capacity.

    python benchmarks/cluster_hot_keys.py [--requests 96] [--concurrency 16] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broker.connection import parse_cluster_url  # noqa: E402
from redserve.redis_server import pdeathsig_preexec  # noqa: E402

PREFIXES = [" ".join(f"{topic} fact {i}." for i in range(60)) for topic in ("Rivers", "Stars", "Trains", "Bread")]
_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')  # MONITOR quotes each argument, escaping quotes and bytes
_SKIP = {"monitor", "ping", "cluster", "info", "client", "hello", "auth", "select", "readonly", "command"}


def key_of(argv: list[str]) -> str | None:
    """The key (or channel) a monitored command names, None for key-less commands."""
    name = argv[0].lower()
    if name in _SKIP or len(argv) < 2:
        return None
    if name in ("evalsha", "eval"):
        return argv[3] if len(argv) > 3 and argv[2] != "0" else None
    if name == "xreadgroup":
        return argv[argv.index("STREAMS") + 1] if "STREAMS" in argv else None
    if name == "exec" or name == "multi":
        return None
    return argv[1]


def watch(address: tuple[str, int], user: str, password: str, stop: threading.Event, counts: Counter,
          per_node: Counter, name: str) -> None:
    client = redis.Redis(host=address[0], port=address[1], username=user, password=password, protocol=2)
    with client.monitor() as monitor:
        for event in monitor.listen():
            if stop.is_set():
                break
            argv = _ARG.findall(event["command"] or "") or (event["command"] or "").split()[:2]
            if not argv:
                continue
            per_node[name] += 1
            key = key_of(argv)
            if key is not None:
                counts[(key, name, argv[0].upper())] += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from engine.tiny_model import make_tiny_model
        model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="redserve-tiny-")) / "tiny-llama", seed=0,
                                    hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                    intermediate_size=256, vocab_size=1024))
    work = Path(tempfile.mkdtemp(prefix="redserve-hotkeys-"))
    env = {**os.environ, "REDSERVE_STATE_DIR": str(work / "state")}
    port = free_port()
    log = open(work / "serve.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "redserve.cli", "serve", "--model", model, "--dtype", "float32",
                             "--port", str(port), "--redis-cluster", "3", "--data-parallel-size", "2",
                             "--no-batch-worker"], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, preexec_fn=pdeathsig_preexec())
    base = f"http://127.0.0.1:{port}/v1/completions"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if requests.post(base, json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 1}, timeout=5).ok:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the stack did not serve; see {work / 'serve.log'}")
            time.sleep(0.5)
        state = json.loads((work / "state" / "stack.json").read_text())
        admin = parse_cluster_url(state["admin_redis_url"])
        counts: Counter = Counter()
        per_node: Counter = Counter()
        stop = threading.Event()
        watchers = [threading.Thread(target=watch, daemon=True, args=(
            address(n["address"]), admin.username, admin.password, stop, counts, per_node, n["name"]))
            for n in state["redis_nodes"]]
        for t in watchers:
            t.start()
        time.sleep(0.5)

        def one(i: int) -> None:
            prompt = f"{PREFIXES[i % len(PREFIXES)]} Question {i}:"
            requests.post(base, json={"model": "tiny-llama", "prompt": prompt, "max_tokens": args.max_tokens,
                                      "temperature": 0, "ignore_eos": True}, timeout=120).raise_for_status()

        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(one, range(args.requests)))
        elapsed = time.monotonic() - started
        stop.set()
        time.sleep(0.3)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    tokens = args.requests * args.max_tokens
    print(f"{args.requests} requests x {args.max_tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:,.0f} tok/s), "
          "MONITOR on every primary")
    for node in sorted(per_node):
        print(f"  {node}: {per_node[node] / elapsed:8,.0f} commands/s")
    print("hottest keys and channels (key, node, command: ops/s, per request):")
    for (key, node, command), n in counts.most_common(20):
        print(f"  {key:42s} {node:8s} {command:12s} {n / elapsed:8,.1f}/s  {n / args.requests:6.2f}/request")
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


if __name__ == "__main__":
    sys.exit(main())
