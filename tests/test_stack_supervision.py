"""`redserve serve` survives its parts: children killed with -9 come back, a crash loop stops the stack,
Ctrl-C stops everything within a bound and a second Ctrl-C forces it. All through real processes.

Run with ``-s`` to see the fault matrix (fault, what clients saw, time to recover, un-started requests lost).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import stat
import subprocess
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

from api.batch.store import BatchStore
from broker.connection import connect
from broker.keys import RedisKeys
from redserve.proc_tree import alive, children, descendants, socket_owner

API_KEY = "sk-supervision-test-key"
API_NICENESS = 3  # serve --api-nice for this module's stack (the default is 0)
KEYS = RedisKeys()
STOP_BOUND_S = 60  # every deadline of a graceful stop together, with slack for a slow machine
MATRIX: list[tuple[str, str, str, str]] = []










def serve_argv(model: str, port: int, *extra: str, api_workers: int = 1, batch: bool = False) -> list[str]:
    return cli("--log-level", "INFO", "serve", "--model", model, "--dtype", "float32", "--port", str(port),
               "--api-workers", str(api_workers), *([] if batch else ["--no-batch-worker"]), *extra)


@dataclass
class Stack:
    proc: object
    procs: Procs
    base_url: str
    state_dir: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1])

    def child(self, name: str) -> int:
        """Pid of the direct child titled ``redserve-<name>`` (waits for it)."""
        def find() -> int | None:
            for pid in children(self.pid):
                try:
                    if title(pid).split(" ")[0] == f"redserve-{name}":
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


def start_stack(model: str, tmp: Path, *extra: str, api_workers: int = 1, batch: bool = False) -> Stack:
    state_dir = tmp / "state" / "redserve"
    # a short visibility timeout: the chunks of a killed batch worker come back within the test
    procs = Procs(tmp, env={"REDSERVE_STATE_DIR": str(state_dir), "REDSERVE_BATCH_VISIBILITY_TIMEOUT": "8"})
    port = free_port()
    proc = procs.start("serve", serve_argv(model, port, *extra, api_workers=api_workers, batch=batch))
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
    s = start_stack(tiny_llama_dir, tmp_path_factory.mktemp("supervised"), "--api-key", API_KEY,
                    "--api-nice", str(API_NICENESS), api_workers=2, batch=True)
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


def test_api_processes_run_at_the_niceness_asked_and_the_engine_does_not(stack: Stack) -> None:
    api = stack.child("api")
    workers = descendants(api)
    assert workers, "the API master has no workers"
    for pid in (api, *workers):
        assert os.getpriority(os.PRIO_PROCESS, pid) == API_NICENESS, f"API process {pid} is not at {API_NICENESS}"
    assert os.getpriority(os.PRIO_PROCESS, stack.child("engine-0")) == 0


def test_serve_refuses_an_api_niceness_out_of_range(tiny_llama_dir: str) -> None:
    import sys

    out = subprocess.run([sys.executable, "-m", "redserve.cli", "serve", "--model", tiny_llama_dir, "--api-nice", "20",
                          "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--api-nice must be 0 to 19, got 20" in out.stderr


def queue_unstarted(stack: Stack, r: redis.Redis, engine: int, n: int = 3) -> tuple[list[threading.Thread], list]:
    """Freeze the engine and send `n` completions: they sit un-started in its stream. Returns the threads and
    the list their results (status code or exception name) land in."""
    os.kill(engine, signal.SIGSTOP)
    results: list[int | str] = []

    def send() -> None:
        try:
            results.append(complete(stack, timeout=90).status_code)
        except requests.RequestException as e:
            results.append(type(e).__name__)

    threads = [threading.Thread(target=send) for _ in range(n)]
    for t in threads:
        t.start()
    wait_for(lambda: r.xlen(KEYS.request_stream("0")) >= n, 20, f"{n} requests queued on the frozen engine")
    return threads, results


def test_killed_engine_comes_back_and_unstarted_requests_survive(stack: Stack) -> None:
    r = stack.redis()
    engine = stack.child("engine-0")
    old_incarnation = r.hget(KEYS.engine("0"), "incarnation")
    live = open_stream(stack, max_tokens=1500)  # mid-stream when the engine dies: resumes on its restart
    threads, results = queue_unstarted(stack, r, engine)
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
    wait_for(lambda: live.outcome != "open", 90, "the live stream to end")
    MATRIX.append(("engine-0 kill -9", f"live stream: {live.outcome}; un-started requests: {sorted(map(str, results))}",
                   f"{recovered:.1f} s", f"{lost} of 3"))
    assert results == [200, 200, 200], f"un-started requests did not survive the engine restart: {results}"
    assert live.outcome == "completed", f"the live stream did not resume on the restarted engine: {live.outcome}"
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


@dataclass
class LiveStream:
    """One streamed completion, read to its end by a thread: outcome "completed", "broken: ..." or "open"."""

    response: http.client.HTTPResponse
    client_port: int
    outcome: str = "open"

    def read_to_end(self) -> None:
        try:
            errors = 0
            while line := self.response.readline():
                errors += line.startswith(b'data: {"error"')
                if line.strip() == b"data: [DONE]":
                    self.outcome = "error event" if errors else "completed"
                    return
            self.outcome = "broken: EOF"
        except (http.client.HTTPException, OSError) as e:
            self.outcome = f"broken: {type(e).__name__}"


def two_workers(master: int, but: int | None = None) -> list[int] | None:
    """The two live workers of the API master, if it has two and `but` is not one of them."""
    workers = [pid for pid in children(master) if alive(pid)]
    return workers if len(workers) == 2 and but not in workers else None


def open_stream(stack: Stack, max_tokens: int) -> LiveStream:
    """Start a streamed completion, wait for its first event (it is mid-stream then), read the rest in a thread."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=120)
    body = {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    client_port = conn.sock.getsockname()[1]
    response = conn.getresponse()
    assert response.status == 200, response.read()[:500]
    assert response.readline().startswith(b"data: ")
    stream = LiveStream(response, client_port)
    threading.Thread(target=stream.read_to_end, daemon=True).start()
    return stream


def test_killed_api_worker_cuts_only_its_streams(stack: Stack) -> None:
    master = stack.child("api")
    workers = wait_for(lambda: two_workers(master), 60, "two API workers")
    engine = stack.child("engine-0")
    streams: dict[int, list[LiveStream]] = {pid: [] for pid in workers}
    try:
        for target, other in (workers, workers[::-1]) * 2:  # two streams on each worker
            # The workers share one listening socket and the kernel hands a connection to whichever accepts
            # first (one took 16 in a row once): the other one is stopped while this one accepts.
            os.kill(other, signal.SIGSTOP)
            try:
                stream = open_stream(stack, max_tokens=1000)
            finally:
                os.kill(other, signal.SIGCONT)
            owner = wait_for(lambda s=stream: socket_owner(workers, stack.port, s.client_port), 10,
                             "the worker serving a stream", interval=0.02)
            assert owner == target
            streams[owner].append(stream)
        os.kill(engine, signal.SIGSTOP)  # every stream is now mid-stream and stays so until SIGCONT
        assert all(s.outcome == "open" for ss in streams.values() for s in ss), "a stream ended too early"
        victim, survivor = workers
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: all(s.outcome != "open" for s in streams[victim]), 30, "the victim's streams to break")
    finally:
        os.kill(engine, signal.SIGCONT)
    respawned = wait_for(lambda: two_workers(master, but=victim), 60, "gunicorn to respawn the worker")
    wait_for(lambda: served(stack), 60, "a completion after the respawn")
    recovered = time.monotonic() - killed
    wait_for(lambda: all(s.outcome != "open" for s in streams[survivor]), 120, "the other worker's streams to end")
    cut = sorted({s.outcome for s in streams[victim]})
    MATRIX.append(("api worker kill -9 mid-stream",
                   f"{len(streams[victim])} streams on it cut ({', '.join(cut)}); "
                   f"{len(streams[survivor])} on the other worker completed",
                   f"{recovered:.1f} s (worker respawned)", "its in-flight streams; none queued"))
    assert all(s.outcome.startswith("broken") for s in streams[victim])
    assert all(s.outcome == "completed" for s in streams[survivor])
    assert stack.child("api") == master and survivor in respawned


def completion_line(custom_id: str, max_tokens: int) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"model": "tiny-llama", "prompt": f"Story {custom_id}:", "max_tokens": max_tokens,
                                "temperature": 0, "ignore_eos": True}})


def test_killed_batch_worker_is_restarted_and_its_batch_completes_once(stack: Stack, tmp_path: Path) -> None:
    n = 40
    src = tmp_path / "in.jsonl"
    # Lengths staggered (24 to 492 tokens): items of one length all end on the same engine step, and on a fast
    # machine every chunk was in flight at once, so the whole batch finished within the poll below.
    src.write_text("".join(completion_line(f"k{i}", 24 + 12 * i) + "\n" for i in range(n)))
    submit = subprocess.run(cli("batch", "submit", str(src), "--chunk-size", "5"), capture_output=True, text=True,
                            timeout=60, env={**os.environ, "REDSERVE_STATE_DIR": str(stack.state_dir)})
    assert submit.returncode == 0, submit.stderr
    batch_id = submit.stdout.split()[0]
    store = BatchStore(connect(json.loads((stack.state_dir / "stack.json").read_text())["redis_url"]), KEYS)
    try:
        wait_for(lambda: store.info(batch_id).done >= 5, 120, "the first results", interval=0.05)
        old = stack.child("batch")
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
        before = {r["custom_id"]: r for r in store.results(batch_id, n)}
        assert len(before) < n, "the batch finished before the worker was killed: make the items longer"
        wait_for(lambda: stack.child("batch") != old, 30, "a new batch worker")
        wait_for(lambda: store.info(batch_id).status == "completed", 120, "the batch to complete",
                 watch=(stack.proc,))
        recovered = time.monotonic() - killed
        info = store.info(batch_id)
        results = list(store.results(batch_id, n))
    finally:
        store.redis.close()
    MATRIX.append(("batch worker kill -9 (batch in flight)", f"{len(before)}/{n} items done at the kill; "
                   f"then {info.completed} completed, {info.failed} failed", f"{recovered:.1f} s to batch completed",
                   "0 (every item exactly once)"))
    assert (info.total, info.completed, info.failed) == (n, n, 0)
    assert [r["custom_id"] for r in results] == [f"k{i}" for i in range(n)]
    assert all(r == before[r["custom_id"]] for r in results if r["custom_id"] in before)  # kept, not redone
    assert 'redserve_child_restarts_total{child="batch"} 1.0' in restarts(stack)


def test_killed_embedded_redis_is_restarted_and_the_stack_serves_again(stack: Stack) -> None:
    r = stack.redis()
    counts = {k.decode(): int(v) for k, v in r.hgetall(KEYS.stack_restarts()).items()}
    engine = stack.child("engine-0")
    threads, results = queue_unstarted(stack, r, engine)
    r.close()
    old = stack.child("redis")
    try:
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
    finally:
        os.kill(engine, signal.SIGCONT)
    saw = "200" if served(stack) else "errors"
    new = wait_for(lambda: (pid := stack.child("redis")) != old and pid, 30, "a new Redis")
    wait_for(lambda: served(stack), 90, "a completion after the Redis restart", interval=0.5, watch=(stack.proc,))
    recovered = time.monotonic() - killed
    for t in threads:
        t.join(timeout=90)
    assert len(results) == 3, "a request queued before the Redis kill never got an answer"
    lost = sum(1 for code in results if code != 200)
    MATRIX.append(("embedded Redis kill -9", f"queued requests: {sorted(map(str, results))}; completions during "
                   f"the gap: {saw}", f"{recovered:.1f} s", f"{lost} of 3 (sent again by their API process)"))
    assert lost == 0, f"requests not started when Redis died must be sent again, not failed: {results}"
    metrics = restarts(stack)
    assert 'redserve_child_restarts_total{child="redis"} 1.0' in metrics
    for name, count in counts.items():  # written back: counters never go down
        assert f'redserve_child_restarts_total{{child="{name}"}} {float(count)}' in metrics
    assert f"the embedded Redis (pid {old}) was killed by SIGKILL" in stack.log()
    assert f"restarted the embedded Redis (pid {new}" in stack.log()


def test_sigint_stops_every_process_within_a_bound(stack: Stack) -> None:
    tree = descendants(stack.pid)
    assert len(tree) >= 4  # redis, coordinator, engine, api master + its worker
    before = len(stack.log())
    os.kill(stack.pid, signal.SIGINT)
    started = time.monotonic()
    code = stack.proc.wait(timeout=STOP_BOUND_S)
    wait_for(lambda: not any(alive(pid) for pid in tree), 10, "every descendant gone")
    log = stack.log()
    assert code == 0, log[-3000:]
    assert log.index("api stopped") < log.index("engine-0 stopped") < log.index("coordinator stopped")
    assert "stack stopped" in log and "killing it" not in log
    assert "consumer group missing" not in log[before:], "an engine re-created its stream while stopping"
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
