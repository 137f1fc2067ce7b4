"""`redserve serve` survives its parts: children killed with -9 come back, a crash loop stops the stack,
Ctrl-C stops everything within a bound and a second Ctrl-C forces it. All through real processes.

Run with ``-s`` to see the fault matrix (fault, what clients saw, time to recover, un-started requests lost).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import requests
from redis.connection import parse_url
from stack_procs import Procs, cli, free_port, title, wait_for

from broker.keys import RedisKeys
from redserve.cli import build_parser
from redserve.stack import Stack as SupervisedStack
from redserve.supervisor import ChildSpec, RestartPolicy, Supervisor, has_exited

API_KEY = "sk-supervision-test-key"
KEYS = RedisKeys()
STOP_BOUND_S = 60  # every deadline of a graceful stop together, with slack for a slow machine
MATRIX: list[tuple[str, str, str, str]] = []


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren, ...)."""
    return [p for child in children(pid) for p in (child, *descendants(child))]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def serve_argv(model: str, port: int, *extra: str) -> list[str]:
    return cli("--log-level", "INFO", "serve", "--model", model, "--dtype", "float32", "--port", str(port),
               "--api-workers", "1", "--no-batch-worker", *extra)


@dataclass
class Stack:
    proc: object
    procs: Procs
    base_url: str
    state_dir: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def child(self, name: str) -> int:
        """Pid of the direct child titled ``redserve-<name>`` (waits for it)."""
        def find() -> int | None:
            for pid in children(self.pid):
                try:
                    if title(pid) == f"redserve-{name}":
                        return pid
                except OSError:
                    continue
            return None
        return wait_for(find, 60, f"child {name}", watch=(self.proc,))

    def redis(self) -> redis.Redis:
        url = json.loads((self.state_dir / "stack.json").read_text())["redis_url"]
        return redis.Redis.from_url(url)

    def log(self) -> str:
        return self.procs.log("serve")


def start_stack(model: str, tmp: Path, *extra: str) -> Stack:
    state_dir = tmp / "state" / "redserve"
    procs = Procs(tmp, env={"REDSERVE_STATE_DIR": str(state_dir)})
    port = free_port()
    proc = procs.start("serve", serve_argv(model, port, *extra))
    return Stack(proc, procs, f"http://127.0.0.1:{port}", state_dir)


def complete(stack: Stack, timeout: float = 60) -> requests.Response:
    return requests.post(f"{stack.base_url}/v1/completions", timeout=timeout,
                         headers={"Authorization": f"Bearer {API_KEY}"},
                         json={"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})


def served(stack: Stack) -> bool:
    try:
        return complete(stack, timeout=10).status_code == 200
    except requests.RequestException:
        return False


def restarts(stack: Stack) -> str:
    return requests.get(f"{stack.base_url}/metrics", timeout=10, headers={"Authorization": f"Bearer {API_KEY}"}).text


@pytest.fixture(scope="module", autouse=True)
def fault_matrix() -> Iterator[None]:
    yield
    if MATRIX:
        rows = [("fault", "what clients saw", "recovered in", "un-started lost"), *MATRIX]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        print("\n\nfault matrix (redserve serve, DP=1):")
        for row in rows:
            print("  " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tiny_llama_dir, tmp_path_factory.mktemp("supervised"), "--api-key", API_KEY)
    try:
        wait_for(lambda: served(s), 120, "the stack to serve", interval=0.5, watch=(s.proc,))
        yield s
    finally:
        s.procs.close()


def test_secrets_stay_off_command_lines_and_the_state_file_is_private(stack: Stack) -> None:
    url = json.loads((stack.state_dir / "stack.json").read_text())["redis_url"]
    password = parse_url(url).get("password")
    for pid in descendants(stack.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace")
        assert API_KEY not in argv and url not in argv, f"a secret is on the command line of {pid}: {argv}"
        assert not password or password not in argv, f"the Redis password is on the command line of {pid}"
    assert API_KEY not in stack.log() and (not password or password not in stack.log())
    assert stat.S_IMODE((stack.state_dir / "stack.json").stat().st_mode) == 0o600
    assert stat.S_IMODE(stack.state_dir.stat().st_mode) == 0o700


def test_backoff_doubles_to_its_cap_and_starts_over_after_a_stable_run() -> None:
    now = [0.0]
    policy = RestartPolicy(initial_backoff=0.5, max_backoff=2.0, stable_after=30, max_restarts=100)
    supervisor = Supervisor(policy, clock=lambda: now[0])
    child = supervisor.start(ChildSpec("crasher", [sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), 5))
    backoffs = []
    try:
        for uptime in (0, 0, 0, 0, 31, 0):
            wait_for(lambda: has_exited(child.proc), 30, "the crasher to exit", interval=0.02)
            now[0] += uptime
            supervisor.check()
            backoffs.append(child.restart_at - now[0])
            now[0] = child.restart_at
            supervisor.check()
            assert child.running
    finally:
        supervisor.stop([])
    assert backoffs == [0.5, 1.0, 2.0, 2.0, 0.5, 1.0]


def test_children_get_the_redis_url_and_api_key_through_the_environment(tmp_path: Path, monkeypatch) -> None:
    # The real children retitle themselves (setproctitle hides argv once they run), so check what is spawned.
    monkeypatch.setenv("REDSERVE_STATE_DIR", str(tmp_path))
    url = "redis://:redis-secret@127.0.0.1:1/0"
    args = build_parser().parse_args(["serve", "--redis-url", url, "--api-key", API_KEY, "--model", str(tmp_path)])
    stack = SupervisedStack(args)
    specs: list[ChildSpec] = []
    stack.supervisor.start = specs.append
    stack.start()
    assert {s.name for s in specs} == {"coordinator", "engine-0", "api", "batch"}
    for spec in specs:
        argv = " ".join(spec.argv)
        assert "redis-secret" not in argv and API_KEY not in argv and "--redis-url" not in argv, argv
        assert spec.env["REDSERVE_REDIS_URL"] == url
        assert (spec.env.get("REDSERVE_API_KEY") == API_KEY) == (spec.name == "api")


def test_killed_engine_comes_back_and_unstarted_requests_survive(stack: Stack) -> None:
    r = stack.redis()
    engine = stack.child("engine-0")
    old_incarnation = r.hget(KEYS.engine("0"), "incarnation")
    # Requests that cannot start: the engine is frozen, so they sit un-started in its stream.
    os.kill(engine, signal.SIGSTOP)
    results: list[int | str] = []

    def send() -> None:
        try:
            results.append(complete(stack, timeout=90).status_code)
        except requests.RequestException as e:
            results.append(type(e).__name__)

    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: r.xlen(KEYS.request_stream("0")) >= 3, 20, "3 requests queued on the frozen engine")
    os.kill(engine, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: r.hget(KEYS.engine("0"), "state") == b"ready"
             and r.hget(KEYS.engine("0"), "incarnation") != old_incarnation, 90,
             "engine 0 back READY as a new incarnation", watch=(stack.proc,))
    wait_for(lambda: served(stack), 60, "a completion after the engine restart")
    recovered = time.monotonic() - killed
    for t in threads:
        t.join(timeout=90)
    lost = sum(1 for code in results if code != 200)
    MATRIX.append(("engine-0 kill -9", f"un-started requests: {sorted(map(str, results))}", f"{recovered:.1f} s",
                   f"{lost} of 3"))
    assert results == [200, 200, 200], f"un-started requests did not survive the engine restart: {results}"
    assert stack.proc.poll() is None
    assert 'redserve_child_restarts_total{child="engine-0"} 1.0' in restarts(stack)
    assert "engine-0 was killed by SIGKILL" in stack.log()


def test_killed_coordinator_is_restarted(stack: Stack) -> None:
    r = stack.redis()
    old = stack.child("coordinator")
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()
    saw = "200" if served(stack) else "an error"  # the coordinator is not on the request path
    new = wait_for(lambda: (pid := stack.child("coordinator")) != old and pid, 30, "a new coordinator")
    wait_for(lambda: r.hget(KEYS.coordinator(), "pid") == str(new).encode(), 30, "the new coordinator active")
    MATRIX.append(("coordinator kill -9", f"completions during the gap: {saw}",
                   f"{time.monotonic() - killed:.1f} s (lock TTL)", "0 (not on the request path)"))
    assert served(stack)
    assert 'redserve_child_restarts_total{child="coordinator"} 1.0' in restarts(stack)


def test_killed_api_master_is_restarted_and_serves(stack: Stack) -> None:
    old = stack.child("api")
    workers = descendants(old)
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()
    saw = "200" if served(stack) else "connection refused"
    wait_for(lambda: stack.child("api") != old, 30, "a new API master")
    # its process group was killed before the restart: no orphaned worker holds the port
    assert not any(alive(pid) for pid in workers), "the dead master's workers were left running"
    wait_for(lambda: served(stack), 60, "the restarted API to serve", watch=(stack.proc,))
    MATRIX.append(("api master kill -9", f"during the gap: {saw}", f"{time.monotonic() - killed:.1f} s",
                   "in-flight HTTP requests cut; none queued"))
    assert 'redserve_child_restarts_total{child="api"} 1.0' in restarts(stack)


def test_sigint_stops_every_process_within_a_bound(stack: Stack) -> None:
    tree = descendants(stack.pid)
    assert len(tree) >= 4  # redis, coordinator, engine, api master + its worker
    os.kill(stack.pid, signal.SIGINT)
    started = time.monotonic()
    code = stack.proc.wait(timeout=STOP_BOUND_S)
    wait_for(lambda: not any(alive(pid) for pid in tree), 10, "every descendant gone")
    log = stack.log()
    assert code == 0, log[-3000:]
    assert log.index("api stopped") < log.index("engine-0 stopped") < log.index("coordinator stopped")
    assert "stack stopped" in log and "killing it" not in log
    MATRIX.append(("SIGINT", "graceful stop", f"all gone in {time.monotonic() - started:.1f} s", "-"))


def test_second_sigint_forces_the_stop(tiny_llama_dir: str, tmp_path: Path) -> None:
    s = start_stack(tiny_llama_dir, tmp_path)
    try:
        engine = s.child("engine-0")
        s.child("api")
        os.kill(engine, signal.SIGSTOP)  # an engine that cannot drain: the stop would wait out its deadline
        tree = descendants(s.pid)
        os.kill(s.pid, signal.SIGINT)
        wait_for(lambda: "api stopped" in s.log(), 30, "the API stopped first", watch=(s.proc,))
        os.kill(s.pid, signal.SIGINT)
        forced = time.monotonic()
        code = s.proc.wait(timeout=15)
        wait_for(lambda: not any(alive(pid) for pid in tree), 10, "every descendant gone")
        assert code == 0
        assert "forced stop: killing engine-0" in s.log()
        MATRIX.append(("second SIGINT (engine hung)", "-", f"all gone {time.monotonic() - forced:.1f} s after it",
                       "-"))
    finally:
        s.procs.close()


def test_crash_loop_stops_the_stack(tiny_llama_dir: str, tmp_path: Path) -> None:
    # --max-queued-requests 0 makes `redserve api` exit 2 at every start: a child that always crashes.
    s = start_stack(tiny_llama_dir, tmp_path, "--max-queued-requests", "0", "--max-restarts", "2")
    try:
        tree: set[int] = set()

        def exited() -> bool:
            tree.update(descendants(s.pid))
            return s.proc.poll() is not None

        wait_for(exited, 60, "the stack to give up on the crashing API", interval=0.1)
        log = s.log()
        assert s.proc.returncode == 1, log[-3000:]
        assert "api exited with code 2" in log
        assert "it was restarted 2 times within 60 s: it is in a crash loop" in log
        wait_for(lambda: not any(alive(pid) for pid in tree), 10, "every descendant gone")
        MATRIX.append(("api crash loop", "-", "stack exits 1 after 2 restarts", "-"))
    finally:
        s.procs.close()
