"""``redserve serve``: a whole single-node stack from one command.

Starts an embedded Redis when no ``--redis-url`` is given, then the engines (one process per DP rank)
and the API (gunicorn), each as a child process that dies with this launcher (PR_SET_PDEATHSIG).
Ctrl-C / SIGTERM stops the API first, then drains the engines, then Redis; no orphan is left.
If a child dies on its own, the whole stack stops and the exit code says so.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time
import urllib.request

from broker.redis_server import EmbeddedRedis, pdeathsig_preexec
from redserve.cli import resolve_model
from redserve.proctitle import set_title

logger = logging.getLogger("redserve.stack")

_ENGINE_FLAGS = ["dtype", "device", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "kv_cache_memory", "gpu_memory_utilization", "tensor_parallel_size", "seed"]
_ENGINE_SWITCHES = ["no_prefix_caching", "no_chunked_prefill"]


def _flags(args: argparse.Namespace, names: list[str], switches: list[str]) -> list[str]:
    out = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    out += [f"--{name.replace('_', '-')}" for name in switches if getattr(args, name)]
    return out


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "redserve.cli", *argv]


class Stack:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.redis: EmbeddedRedis | None = None
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.stopping = False

    def start(self) -> None:
        args = self.args
        resolve_model(args)
        if not args.redis_url:
            self.redis = EmbeddedRedis().start()
            args.redis_url = self.redis.url
            logger.info("started embedded Redis at %s (redis-cli -p %s)", args.redis_url, self.redis.port)
        common = ["--redis-url", args.redis_url, "--key-prefix", args.key_prefix, "--log-level", args.log_level]
        for rank in range(args.data_parallel_size):
            self._spawn(f"engine-{rank}", _cli("--log-level", args.log_level, "engine", "--model", args.model,
                                              "--dp-rank", str(rank), "--redis-url", args.redis_url,
                                              "--key-prefix", args.key_prefix,
                                              *_flags(args, _ENGINE_FLAGS, _ENGINE_SWITCHES)))
        api = ["api", "--model", args.model, "--host", args.host, "--port", str(args.port),
               "--workers", str(args.api_workers), "--max-queued-requests", str(args.max_queued_requests)]
        if args.api_key:
            api += ["--api-key", args.api_key]
        if args.served_model_name:
            api += ["--served-model-name", args.served_model_name]
        self._spawn("api", _cli("--log-level", args.log_level, *api, *common[:4]))

    def _spawn(self, name: str, argv: list[str]) -> None:
        proc = subprocess.Popen(argv, preexec_fn=pdeathsig_preexec(), stdin=subprocess.DEVNULL)
        self.children.append((name, proc))

    def wait_ready(self, timeout: float = 600.0) -> bool:
        url = f"http://{self.args.host}:{self.args.port}/health"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stopping:
            if self._dead_child():
                return False
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.5)
        return False

    def _dead_child(self) -> str | None:
        for name, proc in self.children:
            if proc.poll() is not None:
                return f"{name} exited with code {proc.returncode}"
        return None

    def supervise(self) -> int:
        while not self.stopping:
            dead = self._dead_child()
            if dead:
                logger.error("%s; stopping the stack", dead)
                return 1
            time.sleep(0.5)
        return 0

    def stop(self) -> None:
        self.stopping = True
        for group in (["api"], [n for n, _ in self.children if n != "api"]):
            procs = [p for n, p in self.children if n in group and p.poll() is None]
            for p in procs:
                p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 40
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.redis is not None:
            self.redis.stop()


def run_stack(args: argparse.Namespace) -> int:
    set_title("redserve-serve")
    stack = Stack(args)

    def on_signal(*_: object) -> None:
        stack.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 1
    try:
        stack.start()
        if stack.wait_ready():
            print(f"redserve is serving {args.model} at http://{args.host}:{args.port}/v1 "
                  f"(Redis {args.redis_url}); Ctrl-C stops it", flush=True)
            code = stack.supervise()
        elif not stack.stopping:
            logger.error("the stack did not become ready: %s", stack._dead_child() or "timed out")
        else:
            code = 0
    finally:
        stack.stop()
    return code
