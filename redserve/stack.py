"""``redserve serve``: a whole single-node stack from one command.

Starts an embedded Redis when no ``--redis-url`` is given, then the DP coordinator, the engines (one
process per DP rank), the API (gunicorn) and a batch worker (Celery; not with ``--no-batch-worker``), each
as a child process that dies with this launcher (PR_SET_PDEATHSIG). Ctrl-C / SIGTERM stops the API and
the batch worker first, then drains the engines, then stops the coordinator and Redis; no orphan is left.
While it runs, `redserve.stack_state` records its Redis URL so ``redserve batch`` commands find it.
If a child dies on its own, the whole stack stops and the exit code says so.
DP engines on this one node share its cores: each gets ``OMP_NUM_THREADS`` = cores / DP size (unless
the variable is set already), so N engines do not run N x cores torch threads on the same cores.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request

from broker.redis_server import EmbeddedRedis, pdeathsig_preexec
from redserve.cli import resolve_model
from redserve.proctitle import set_title
from redserve.stack_state import StackState, remove_stack_state, write_stack_state

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
        self._spawn("coordinator", _cli("--log-level", args.log_level, "coordinator", *common[:4],
                                        *(["--dp-lockstep"] if args.dp_lockstep else [])))
        for rank in range(args.data_parallel_size):
            self._spawn(f"engine-{rank}", _cli("--log-level", args.log_level, "engine", "--model", args.model,
                                              "--dp-rank", str(rank), "--redis-url", args.redis_url,
                                              "--key-prefix", args.key_prefix,
                                              *_flags(args, _ENGINE_FLAGS, _ENGINE_SWITCHES)),
                        env=self._engine_env())
        api = ["api", "--model", args.model, "--host", args.host, "--port", str(args.port),
               "--workers", str(args.api_workers), "--max-queued-requests", str(args.max_queued_requests)]
        if args.api_key:
            api += ["--api-key", args.api_key]
        if args.served_model_name:
            api += ["--served-model-name", args.served_model_name]
        self._spawn("api", _cli("--log-level", args.log_level, *api, *common[:4]))
        names = [args.served_model_name] if args.served_model_name else []
        if not args.no_batch_worker:
            self._spawn("batch", _cli("--log-level", args.log_level, "batch", "worker", "--model", args.model,
                                      *common[:4], *(["--served-model-name", *names] if names else [])))
        write_stack_state(StackState(args.redis_url, args.key_prefix, args.model, names))

    def _engine_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.args.data_parallel_size)))
        return env

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        proc = subprocess.Popen(argv, preexec_fn=pdeathsig_preexec(), stdin=subprocess.DEVNULL, env=env)
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
        engines = [n for n, _ in self.children if n.startswith("engine-")]
        for group in (["api", "batch"], engines, ["coordinator"]):
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
        remove_stack_state()
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
