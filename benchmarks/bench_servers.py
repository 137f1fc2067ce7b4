"""Start and stop the servers the benchmarks measure: ``redserve serve``, ``vllm serve``, ``llama-server``.

Rules:
- Each server runs in its own session (process group), dies with this process (PR_SET_PDEATHSIG), and
  logs to ``<log_dir>/<name>.log``.
- `running_server` yields once ``GET /health`` answers 200; it raises, naming the log, if the server
  exits first or is not healthy within the timeout.
- Stopping is SIGINT to the server's pid (vLLM's API process stops its EngineCore child; ``redserve
  serve`` stops its stack), then SIGKILL to the whole process group after ``stop_timeout``. It runs on
  every exit from the block, errors and Ctrl-C included.
- Neither server asks for an API key: REDSERVE_API_KEY / VLLM_API_KEY and REDSERVE_REDIS_URL are
  dropped from the child's environment (so ``redserve serve`` starts its embedded Redis).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from redserve.redis_server import pdeathsig_preexec

DROPPED_ENV = ("REDSERVE_API_KEY", "VLLM_API_KEY", "REDSERVE_REDIS_URL", "OPENAI_API_KEY")


@dataclass
class ServerSpec:
    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = 600.0
    stop_timeout: float = 60.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redserve_spec(cmd: str, model_dir: str, dtype: str, port: int, served_name: str, max_model_len: int,
                  extra: str = "") -> ServerSpec:
    argv = [*shlex.split(cmd), "serve", "--model", model_dir, "--dtype", dtype, "--port", str(port),
            "--served-model-name", served_name, "--max-model-len", str(max_model_len), *shlex.split(extra)]
    return ServerSpec("redserve", argv, port, startup_timeout=300.0)


def vllm_spec(venv: Path, model_dir: str, dtype: str, port: int, served_name: str, max_model_len: int,
              extra: str = "", kv_cache_gib: int = 2) -> ServerSpec:
    argv = [str(venv / "bin" / "vllm"), "serve", model_dir, "--served-model-name", served_name,
            "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len), *shlex.split(extra)]
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1"}
    return ServerSpec("vllm", argv, port, env=env, startup_timeout=600.0)


def llamacpp_spec(bin_dir: Path, gguf_file: str, port: int, served_name: str, slots: int, per_slot: int,
                  threads: int, extra: str = "") -> ServerSpec:
    """``llama-server`` on a GGUF file: ``slots`` parallel sequences of ``per_slot`` tokens each."""
    argv = [str(bin_dir / "llama-server"), "-m", gguf_file, "--host", "127.0.0.1", "--port", str(port),
            "-c", str(slots * per_slot), "-np", str(slots), "-t", str(threads), "-a", served_name,
            *shlex.split(extra)]
    return ServerSpec("llamacpp", argv, port, startup_timeout=300.0)


def healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def running_server(spec: ServerSpec, log_dir: Path) -> Iterator[subprocess.Popen]:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}.log"
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV} | spec.env
    with open(log_path, "ab") as log:
        print(f"[bench] starting {spec.name}: {shlex.join(spec.argv)} (log: {log_path})", flush=True)
        proc = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, preexec_fn=pdeathsig_preexec())
        try:
            started = time.monotonic()
            wait_healthy(proc, spec, log_path)
            print(f"[bench] {spec.name} healthy after {time.monotonic() - started:.0f} s", flush=True)
            yield proc
        finally:
            stop(proc, spec.stop_timeout)


def wait_healthy(proc: subprocess.Popen, spec: ServerSpec, log_path: Path) -> None:
    deadline = time.monotonic() + spec.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{spec.name} exited with code {proc.returncode} before /health answered; "
                               f"see {log_path}")
        if healthy(spec.base_url):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{spec.name} not healthy after {spec.startup_timeout:.0f} s; see {log_path}")


def stop(proc: subprocess.Popen, timeout: float) -> None:
    """SIGINT to the pid; once it has exited (or after `timeout`), SIGKILL to what is left of its process
    group. The leader is reaped only after that, so its pid (the group id) cannot have been reused."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout
        while not _exited(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not _exited(proc.pid):
            print(f"[bench] pid {proc.pid} ignored SIGINT for {timeout:.0f} s: SIGKILL to its group", flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a stuck child goes too
    proc.wait()


def _exited(pid: int) -> bool:
    """True once `pid` (our child) has exited; leaves it unreaped."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True
