"""Helpers of the TP and PP tests: engine processes, their children and their shared-memory segments."""

from __future__ import annotations

import os
import subprocess
import time

from broker.client import BrokerClient
from protocol.messages import AddRequest
from protocol.sampling_params import SamplingParams


def shm_segments(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if f"_{pid}_" in name]


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive (zombies count as gone) after waiting up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if is_alive(p)]
        time.sleep(0.1)
    return alive


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        return f.read()


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def wait_engine_ready(client: BrokerClient, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not client.ready_engines():
        assert proc.poll() is None, f"engine exited with {proc.returncode}"
        assert time.monotonic() < deadline, "engine not ready in time"
        time.sleep(0.2)


def submit(client: BrokerClient, request_id: str, prompt: list[int], params: SamplingParams):
    return client.submit(AddRequest(request_id, "", prompt, params, time.time(), time.time() + 120))
