"""The stack of the multihost tests: hosts as network namespaces, the processes each test starts in them,
and HTTP clients on host A.

Hosts are network namespaces on a private bridge (`tests/netns.py`, 198.18.0.0/24); every process runs in
its host through ``ip netns exec``. The ``stack`` fixture gives host A Redis and the API; tests start
coordinators, engines and workers where they need them. Used by tests/test_multihost.py (engines across
hosts) and tests/test_multihost_pp.py (one engine's pipeline across hosts).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
import requests
from stack_procs import wait_for

from broker.keys import RedisKeys
from redserve.redis_conf import ServerConfig, render
from redserve.redis_server import redis_server_path
from tests import netns

REDIS_PORT, API_PORT, API_KEY = 6379, 8000, "multihost-key"
HEARTBEAT_TTL = 2.0
KEYS = RedisKeys("rs")
# Still streaming when the test acts on it: the tiny model decodes ~2,000 tokens a second on one core, so 1000
# tokens had ended before two more requests reached B on a loaded CI host. Needs the 8192-position tiny llama.
LIVE_TOKENS = 6000


@dataclass
class Stack:
    """The processes of one test, by name, with their hosts; `close()` stops them all."""

    net: netns.Network
    model: str
    logs: Path
    redis_url: str = ""
    admin_url: str = ""
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def a(self) -> netns.Host:
        return self.net.hosts["a"]

    @property
    def b(self) -> netns.Host:
        return self.net.hosts["b"]

    @property
    def base_url(self) -> str:
        return f"http://{self.a.address}:{API_PORT}"

    def start(self, name: str, host: netns.Host, argv: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        proc = host.popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        proc.log_file = log
        self.procs[name] = proc
        return proc

    def start_redis(self) -> None:
        passwords = {"app": secrets.token_urlsafe(24), "admin": secrets.token_urlsafe(24)}
        workdir = self.logs / "redis"
        workdir.mkdir(mode=0o700)
        config = render(ServerConfig(port=REDIS_PORT, directory=str(workdir), logfile=str(workdir / "redis.log"),
                                     app_password=passwords["app"], admin_password=passwords["admin"]))
        conf = workdir / "redis.conf"
        conf.write_text(config.replace("bind 127.0.0.1", f"bind {self.a.address} 127.0.0.1"))
        conf.chmod(0o600)
        self.start("redis", self.a, [redis_server_path(), str(conf)])
        self.redis_url = f"redis://redserve:{passwords['app']}@{self.a.address}:{REDIS_PORT}/0"
        self.admin_url = f"redis://admin:{passwords['admin']}@127.0.0.1:{REDIS_PORT}/0"
        wait_for(self.redis_up, 10, "Redis on host A", watch=(self.procs["redis"],))

    def redis_up(self) -> bool:
        with self.a.entered():
            client = redis.Redis.from_url(self.admin_url, socket_timeout=1, socket_connect_timeout=1)
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False
            finally:
                client.close()

    def cli(self, name: str, host: netns.Host, *argv: str) -> subprocess.Popen:
        return self.start(name, host, [sys.executable, "-m", "redserve.cli", "--log-level", "INFO", *argv])

    def start_engine(self, engine_id: str, host: netns.Host, *extra: str) -> subprocess.Popen:
        return self.cli(f"engine-{engine_id}", host, "engine", "--headless", "--model", self.model, "--redis-url",
                        self.redis_url, "--engine-id", engine_id, "--dtype", "float32", "--device", "cpu",
                        "--heartbeat-ttl", str(HEARTBEAT_TTL), *extra)

    def start_api(self) -> None:
        self.cli("coordinator", self.a, "coordinator", "--redis-url", self.redis_url)
        self.cli("api", self.a, "api", "--model", self.model, "--redis-url", self.redis_url, "--host", self.a.address,
                 "--port", str(API_PORT), "--workers", "1", "--api-key", API_KEY)

    def engine_info(self, engine_id: str) -> dict | None:
        """The engine's registration hash (str fields), read from host A; None if absent or Redis is not up."""
        with self.a.entered():
            client = redis.Redis.from_url(self.admin_url, socket_timeout=2, socket_connect_timeout=2)
            try:
                raw = client.hgetall(KEYS.engine(engine_id))
            except redis.RedisError:
                return None
            finally:
                client.close()
        return {k.decode(): v.decode() for k, v in raw.items()} if raw else None

    def wait_ready(self, engine_id: str, timeout: float = 120.0, not_incarnation: str | None = None) -> dict:
        def ready() -> dict | None:
            info = self.engine_info(engine_id)
            ok = info and info.get("state") == "ready" and info.get("incarnation") != not_incarnation
            return info if ok else None
        return wait_for(ready, timeout, f"engine {engine_id} READY; logs in {self.logs}",
                        watch=tuple(p for n, p in self.procs.items() if n != f"engine-{engine_id}"))

    def wait_api(self, timeout: float = 60.0) -> None:
        def healthy() -> bool:
            with self.a.entered():
                try:
                    return requests.get(f"{self.base_url}/health", timeout=2).status_code == 200
                except requests.RequestException:
                    return False
        wait_for(healthy, timeout, f"the API on host A; logs in {self.logs}", watch=(self.procs["api"],))

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        proc = self.procs.pop(name)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        proc.log_file.close()

    def close(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name, timeout=10)


def running_stack(tiny_llama_dir: str, tmp_path: Path) -> Iterator[Stack]:
    """The body of each test module's ``stack`` fixture: hosts a (198.18.0.1) and b (198.18.0.2); Redis and the
    API on a. Everything is torn down."""
    with netns.network("a", "b") as net:
        s = Stack(net, tiny_llama_dir, tmp_path)
        try:
            s.start_redis()
            s.start_api()
            yield s
        finally:
            s.close()


# --- HTTP clients on host A -----------------------------------------------------------------------------------


def complete(stack: Stack, max_tokens: int = 8, timeout: float = 60.0, prompt: str = "hello across hosts") -> dict:
    with stack.a.entered():
        r = requests.post(f"{stack.base_url}/v1/completions", timeout=timeout,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": stack.model, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


@dataclass
class StreamRecord:
    """What one streaming client saw: (monotonic time, SSE event) pairs, and how the stream ended."""

    events: list[tuple[float, dict]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    failure: str | None = None

    def chunks_after(self, t: float) -> list[tuple[float, dict]]:
        return [(ts, e) for ts, e in self.events if ts > t]

    @property
    def text(self) -> str:
        return "".join(e["choices"][0]["text"] for _, e in self.events if e.get("choices"))

    @property
    def finish_reason(self) -> str | None:
        reasons = [c.get("finish_reason") for _, e in self.events for c in e.get("choices", ())]
        return next((r for r in reversed(reasons) if r), None)

    @property
    def error(self) -> dict | None:
        return next((e["error"] for _, e in self.events if "error" in e), None)


def stream_in_background(stack: Stack, prompt: str, max_tokens: int) -> StreamRecord:
    record = StreamRecord()

    def run() -> None:
        try:
            with stack.a.entered():
                r = requests.post(f"{stack.base_url}/v1/completions", stream=True, timeout=120,
                                  headers={"Authorization": f"Bearer {API_KEY}"},
                                  json={"model": stack.model, "prompt": prompt, "max_tokens": max_tokens,
                                        "temperature": 0, "ignore_eos": True, "stream": True})
                for line in r.iter_lines():
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        record.events.append((time.monotonic(), json.loads(line[6:])))
        except Exception as e:  # noqa: BLE001 - the test reads it from the record
            record.failure = f"{type(e).__name__}: {e}"
        finally:
            record.done.set()

    threading.Thread(target=run, daemon=True).start()
    return record


def in_background(fn, *args) -> dict:
    """Run fn(*args) in a thread; the returned dict gets "result" or "error", and "done" (an Event)."""
    out: dict = {"done": threading.Event()}

    def run() -> None:
        try:
            out["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out["error"] = e
        finally:
            out["done"].set()

    threading.Thread(target=run, daemon=True).start()
    return out


def stream_tpot(stack: Stack, max_tokens: int) -> float:
    """Seconds per output token of one stream at concurrency 1, seen by a client on host A."""
    record = stream_in_background(stack, "measure the hop", max_tokens)
    assert record.done.wait(120) and record.failure is None, record.failure
    times = [ts for ts, e in record.events if e.get("choices") and e["choices"][0].get("text")]
    assert len(times) >= max_tokens // 2, f"only {len(times)} chunks"
    return (times[-1] - times[0]) / (len(times) - 1)
