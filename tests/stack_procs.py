"""Helpers for tests that run redserve processes (batch and compose tests): spawn, wait, stop.

Every child runs ``python -m redserve.cli ...`` (or a given argv) in its own session, so its whole
process group (Celery pool processes, gunicorn workers) can be signalled, and dies with the test
process (PR_SET_PDEATHSIG). Logs go to one file per process in `logs`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from broker.keys import RedisKeys
from redserve.redis_server import pdeathsig_preexec


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "redserve.cli", *argv]


def quiet_cli(*argv: str) -> list[str]:
    """`cli` logging at WARNING only."""
    return cli("--log-level", "WARNING", *argv)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.2,
             watch: tuple[subprocess.Popen, ...] = ()) -> Any:
    """Poll `predicate` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p.args for p in watch if p.poll() is not None]
        if dead:
            raise AssertionError(f"a process exited while waiting for {what}: {dead}")
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def poll(predicate: Callable[[], object], timeout: float, what: str) -> Any:
    """`wait_for` polling every 50 ms: returns the predicate's first truthy value."""
    return wait_for(predicate, timeout, what, interval=0.05)


def engine_ready(redis_url: str, keys: RedisKeys, engine_id: str = "0") -> bool:
    r = redis.Redis.from_url(redis_url)
    try:
        return r.hget(keys.engine(engine_id), "state") == b"ready"
    finally:
        r.close()


def process_tree(pid: int) -> list[int]:
    """`pid` and its children (one level: a Celery main process and its pool)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [pid, *map(int, f.read().split())]
    except OSError:
        return [pid]


def title(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode().strip()


def maps_torch(pid: int) -> bool:
    """True if the process has any torch library or module file mapped."""
    with open(f"/proc/{pid}/maps") as f:
        return "torch" in f.read()


class Procs:
    """The child processes of one test module; `close()` stops them all."""

    def __init__(self, logs: Path, env: dict[str, str] | None = None) -> None:
        self.logs = logs
        self.env = {**os.environ, **(env or {})}
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**self.env, **(env or {})}, start_new_session=True,
                                preexec_fn=pdeathsig_preexec())
        proc.log_file = log
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """SIGKILL the process's whole group (no cleanup of any kind runs) and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    @staticmethod
    def stop(proc: subprocess.Popen, timeout: float = 20.0) -> None:
        """SIGTERM the group; SIGKILL it after `timeout`."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                Procs.kill(proc)
        proc.log_file.close()

    def close(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)
