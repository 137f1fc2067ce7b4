"""The fault matrix of `redserve serve`: break one part at a time and record what clients saw.

Starts `redserve serve` (the tiny model unless --model; 2 API workers; a batch worker), runs every fault
once against it, in order, and prints a markdown table: fault | what was done | what clients saw |
time to recover (s) | un-started requests lost. Loopback only; every wait is bounded; the stack and
everything under it are killed at the end whatever happens.

    python benchmarks/fault_matrix.py [--model DIR] [--streams 150]
    python benchmarks/fault_matrix.py --redis-replicas 2 [--failover-streams 32]   # the Sentinel rows only
    python benchmarks/fault_matrix.py --redis-cluster 3                            # the Cluster rows only
    python benchmarks/fault_matrix.py --redis-cluster 3 --redis-replicas 1         # Cluster rows with failover
    python benchmarks/fault_matrix.py --redis-cluster 3 --redis-replicas 1 --data-parallel-size 2

The Cluster rows live in `benchmarks/fault_rows_cluster.py`.

Rules:
- "time to recover" runs from the fault to the first completion that succeeds again (or, for a request
  that must be refused, to its answer).
- Requests are "un-started" when they sit in an engine's request stream that the (SIGSTOPped) engine has
  not read yet; "lost" counts those that did not end with 200.
- With ``--redis-replicas N`` the stack runs a primary, N replicas and three sentinels, and the matrix has the
  Redis rows of that mode: the primary, a replica and a sentinel killed under streams in flight. "exact"
  counts streams that ended with [DONE], no error event and all their tokens (the usage chunk);
  "longest pause" is the longest wait between two events of any stream.
- With ``--redis-cluster N`` the stack runs an N-primary Redis Cluster, and the matrix first moves every engine's
  slot and the control slot to other primaries (CLUSTER MIGRATESLOTS) under streams, then kills each primary in turn
  (the supervisor restarts it with its slots, empty) under streams in flight and 3 un-started requests; each
  row says which of redserve's keys and channels that node held. With ``--redis-replicas R`` too, each primary has
  R replicas and the cluster fails a killed primary over by itself; each row also says when a replica was promoted
  (INFO replication), and the next row waits until the killed node is back as a replica, linked.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from api.batch.store import BatchStore  # noqa: E402
from broker.connection import connect, replication_topology  # noqa: E402
from broker.keys import RedisKeys  # noqa: E402
from redserve.proc_tree import alive, children, descendants, socket_owner, title  # noqa: E402
from redserve.redis_server import pdeathsig_preexec, redis_cli_invocation  # noqa: E402

KEYS = RedisKeys()
MODEL_NAME = "tiny-llama"
Row = tuple[str, str, str, str, str]


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "redserve.cli", *argv]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")












def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class ServeStack:
    """One `redserve serve` in a temp dir, with helpers to find and break its parts."""

    def __init__(self, model: str, workdir: Path, api_workers: int, redis_replicas: int = 0,
                 redis_cluster: int = 0, engines: int = 1) -> None:
        self.engines = engines
        self.state_dir = workdir / "state"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "REDSERVE_STATE_DIR": str(self.state_dir), "REDSERVE_BATCH_VISIBILITY_TIMEOUT": "8"}
        self.log_path = workdir / "serve.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            cli("serve", "--model", model, "--dtype", "float32", "--port", str(self.port), "--api-workers",
                str(api_workers), "--redis-replicas", str(redis_replicas), "--redis-cluster", str(redis_cluster),
                "--data-parallel-size", str(engines)), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
            start_new_session=True, preexec_fn=pdeathsig_preexec())

    def state(self) -> dict:
        return json.loads((self.state_dir / "stack.json").read_text())

    def redis(self) -> redis.Redis:
        return connect(self.state()["redis_url"], socket_timeout=5)

    def redis_node(self, role: str) -> int:
        """The pid of a data node in `role` (primary or replica) as the sentinels see it now, or of a sentinel."""
        client = self.redis()
        try:
            topology = replication_topology(client)
        finally:
            client.close()
        address = topology["primary"] if role == "primary" else topology["replicas"][0] if role == "replica" else None
        for node in self.state()["redis_nodes"]:
            if (address is None and node["role"] == "sentinel") or node["address"] == address:
                return node["pid"]
        raise LookupError(f"no Redis node in role {role}: {topology}")

    def child(self, name: str, but: int | None = None) -> int:
        def find() -> int | None:
            return next((p for p in children(self.proc.pid) if title(p).split(" ")[0] == f"redserve-{name}"
                         and p != but and alive(p)), None)
        return wait_for(find, 60, f"child {name}")

    def complete(self, timeout: float = 60, **body) -> requests.Response:
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, **body}
        return requests.post(f"{self.base_url}/v1/completions", json=body, timeout=timeout)

    def served(self) -> bool:
        try:
            return self.complete(timeout=10).status_code == 200
        except requests.RequestException:
            return False

    def wait_served(self, since: float, timeout: float = 120) -> float:
        wait_for(self.served, timeout, "a completion to succeed", interval=0.2)
        return time.monotonic() - since

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()


class Stream:
    """A streamed completion read to its end by a thread: outcome "completed", "cut" or "open"."""

    def __init__(self, stack: ServeStack, max_tokens: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=120)
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        self.max_tokens, self.tokens, self.longest_gap, self.finish = max_tokens, None, 0.0, None
        self.conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        self.client_port = self.conn.sock.getsockname()[1]
        self.response = self.conn.getresponse()
        self.outcome = "open" if self.response.status == 200 else f"HTTP {self.response.status}"
        if self.outcome == "open":
            self.response.readline()  # the first event: mid-stream from here on
            threading.Thread(target=self._read, daemon=True).start()

    @property
    def exact(self) -> bool:
        return self.outcome == "completed" and self.tokens == self.max_tokens

    def _read(self) -> None:
        try:
            errors, last = 0, time.monotonic()
            while line := self.response.readline():
                now = time.monotonic()
                self.longest_gap, last = max(self.longest_gap, now - last), now
                errors += line.startswith(b'data: {"error"')
                if line.startswith(b"data: {") and (b'"usage"' in line or b'"finish_reason":"' in line):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or {}
                    self.tokens = usage.get("completion_tokens", self.tokens)
                    self.finish = next((c["finish_reason"] for c in chunk.get("choices", []) if c.get("finish_reason")),
                                       self.finish)
                if line.strip() == b"data: [DONE]":
                    self.outcome = "error event" if errors else "completed"
                    return
            self.outcome = "cut"
        except (http.client.HTTPException, OSError):
            self.outcome = "cut"


def queue_unstarted(stack: ServeStack, engine: int | list[int], n: int = 3) -> tuple[list[threading.Thread], list]:
    """Freeze the engine (every engine of a list), send `n` completions that sit un-started in the request streams;
    (threads, results)."""
    engines = engine if isinstance(engine, list) else [engine]
    streams = [KEYS.request_stream(str(i)) for i in range(len(engines))]
    r = stack.redis()
    before = sum(r.xlen(s) for s in streams)
    for pid in engines:
        os.kill(pid, signal.SIGSTOP)
    results: list = []

    def send() -> None:
        try:
            results.append(stack.complete(timeout=120).status_code)
        except requests.RequestException as e:
            results.append(type(e).__name__)

    threads = [threading.Thread(target=send) for _ in range(n)]
    for t in threads:
        t.start()
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: sum(r.xlen(s) for s in streams) >= before + n, 20, "requests queued")
    r.close()
    return threads, results


def joined(threads: list[threading.Thread], results: list) -> tuple[str, int]:
    for t in threads:
        t.join(timeout=120)
    counts = Counter(map(str, results))
    return ", ".join(f"{v}x {k}" for k, v in sorted(counts.items())), sum(1 for r in results if r != 200)


def engine_kill(stack: ServeStack) -> Row:
    engine = stack.child("engine-0")
    streams = [Stream(stack, 1900) for _ in range(2)]
    threads, results = queue_unstarted(stack, engine)
    mid_stream = sum(s.outcome == "open" for s in streams)
    os.kill(engine, signal.SIGKILL)
    killed = time.monotonic()
    recovered = stack.wait_served(killed)
    queued, lost = joined(threads, results)
    wait_for(lambda: all(s.outcome != "open" for s in streams), 60, "the live streams to end")
    live = Counter(s.outcome for s in streams)
    return ("engine kill -9", f"2 live streams ({mid_stream} mid-stream at the kill) + 3 queued (engine SIGSTOPped), "
            "then SIGKILL", f"live streams: {dict(live)}; queued: {queued}", f"{recovered:.1f}", f"{lost} of 3")


def coordinator_kill(stack: ServeStack) -> Row:
    old = stack.child("coordinator")
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()
    saw = "200" if stack.served() else "an error"
    new = stack.child("coordinator", but=old)
    r = stack.redis()
    wait_for(lambda: r.hget(KEYS.coordinator(), "pid") == str(new).encode(), 60, "the new coordinator active")
    r.close()
    return ("coordinator kill -9", "SIGKILL", f"completion during the gap: {saw}",
            f"{time.monotonic() - killed:.1f} (new coordinator active)", "0 (not on the request path)")


def api_master_kill(stack: ServeStack) -> Row:
    old = stack.child("api")
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()
    saw = "200" if stack.served() else "connection refused"
    stack.child("api", but=old)
    return ("API master kill -9", "SIGKILL (workers die with its group)", f"during the gap: {saw}",
            f"{stack.wait_served(killed):.1f}", "0 (in-flight HTTP cut)")


def api_worker_kill(stack: ServeStack) -> Row:
    master = stack.child("api")
    workers = wait_for(lambda: (w := [p for p in children(master) if alive(p)]) and len(w) >= 2 and w, 60, "workers")
    engine = stack.child("engine-0")
    by_worker: dict[int, list[Stream]] = {pid: [] for pid in workers[:2]}
    while not all(by_worker.values()) and sum(map(len, by_worker.values())) < 16:  # until both serve some
        stream = Stream(stack, 1000)
        owner = wait_for(lambda s=stream: socket_owner(workers, stack.port, s.client_port), 10, "the stream's worker")
        by_worker[owner].append(stream)
    victim, survivor = sorted(by_worker, key=lambda pid: -len(by_worker[pid]))
    os.kill(engine, signal.SIGSTOP)  # keeps every stream mid-stream while the worker dies
    try:
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: all(s.outcome != "open" for s in by_worker[victim]), 15, "the victim's streams to break")
    finally:
        os.kill(engine, signal.SIGCONT)
    wait_for(lambda: len([p for p in children(master) if alive(p) and p != victim]) >= 2, 60, "the respawn")
    recovered = stack.wait_served(killed)
    wait_for(lambda: all(s.outcome != "open" for ss in by_worker.values() for s in ss), 120, "every stream to end")
    cut, kept = (dict(Counter(s.outcome for s in by_worker[pid])) for pid in (victim, survivor))
    return ("API worker kill -9 mid-stream", f"{len(by_worker[victim])} + {len(by_worker[survivor])} streams on the "
            "2 workers, engine paused, SIGKILL the busier worker", f"killed worker's streams: {cut}; "
            f"other worker's: {kept}", f"{recovered:.1f} (worker respawned)", "0 (its in-flight streams cut)")


def batch_worker_kill(stack: ServeStack, workdir: Path) -> Row:
    n = 40
    src = workdir / "batch.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"k{i}", "method": "POST", "url": "/v1/completions",
                                       "body": {"model": MODEL_NAME, "prompt": f"Story {i}:", "max_tokens": 96,
                                                "temperature": 0, "ignore_eos": True}}) + "\n" for i in range(n)))
    done = subprocess.run(cli("batch", "submit", str(src), "--chunk-size", "5"), capture_output=True, text=True,
                          timeout=60, env=stack.env)
    if done.returncode != 0:
        return ("batch worker kill -9", "submit failed", done.stderr.strip()[-200:], "-", "-")
    batch_id = done.stdout.split()[0]
    store = BatchStore(connect(stack.state()["redis_url"]), KEYS)
    try:
        wait_for(lambda: store.info(batch_id).done >= 5, 120, "the first results", interval=0.05)
        old = stack.child("batch")
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
        at_kill = store.info(batch_id).done
        wait_for(lambda: store.info(batch_id).status == "completed", 180, "the batch to complete")
        recovered = time.monotonic() - killed
        info = store.info(batch_id)
        ids = [r["custom_id"] for r in store.results(batch_id, n)]
    finally:
        store.redis.close()
    once = "every item exactly once" if ids == [f"k{i}" for i in range(n)] else f"items: {Counter(ids).most_common(3)}"
    return ("batch worker kill -9", f"batch of {n} in flight ({at_kill} done), SIGKILL the Celery worker",
            f"batch completed: {info.completed} ok, {info.failed} failed; {once}", f"{recovered:.1f} (batch done)",
            f"{n - info.completed}")


def redis_kill(stack: ServeStack) -> Row:
    engine = stack.child("engine-0")
    threads, results = queue_unstarted(stack, engine)
    old = stack.child("redis")
    try:
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
    finally:
        os.kill(engine, signal.SIGCONT)
    recovered = stack.wait_served(killed)
    queued, lost = joined(threads, results)
    return ("Redis kill -9", "3 queued (engine SIGSTOPped), SIGKILL the embedded Valkey",
            f"queued: {queued}", f"{recovered:.1f}", f"{lost} of 3 (no persistence)")


def _stream_summary(streams: list[Stream]) -> str:
    exact = sum(s.exact for s in streams)
    outcomes = Counter(s.outcome if s.outcome != "completed" else f"completed ({s.tokens} tokens, {s.finish})"
                       for s in streams if not s.exact)
    other = "".join(f", {v}x {k}" for k, v in sorted(outcomes.items()))
    return f"{exact}/{len(streams)} streams exact{other}; longest pause {max(s.longest_gap for s in streams):.2f} s"


def _finished(streams: list[Stream], timeout: float = 180) -> None:
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: all(s.outcome != "open" for s in streams), timeout, "streams to end")


def redis_primary_kill(stack: ServeStack, streams: int) -> Row:
    engine = stack.child("engine-0")
    running = [Stream(stack, 300) for _ in range(streams)]
    threads, results = queue_unstarted(stack, engine)
    primary = stack.redis_node("primary")
    try:
        os.kill(primary, signal.SIGKILL)
        killed = time.monotonic()
    finally:
        os.kill(engine, signal.SIGCONT)
    recovered = stack.wait_served(killed)
    _finished(running)
    queued, lost = joined(threads, results)
    return ("Redis primary kill -9 (Sentinel)", f"{streams} streams mid-way, 3 queued (engine SIGSTOPped), "
            "SIGKILL the primary", f"{_stream_summary(running)}; queued: {queued}", f"{recovered:.1f}", f"{lost} of 3")


def redis_node_kill(stack: ServeStack, role: str, streams: int = 8) -> Row:
    running = [Stream(stack, 300) for _ in range(streams)]
    os.kill(stack.redis_node(role), signal.SIGKILL)
    killed = time.monotonic()
    recovered = stack.wait_served(killed)
    _finished(running)
    return (f"Redis {role} kill -9 (Sentinel)", f"{streams} streams mid-way, SIGKILL one {role}",
            _stream_summary(running), f"{recovered:.1f}", "-")


def garbage_control_state(stack: ServeStack) -> Row:
    argv, extra_env = redis_cli_invocation(stack.state()["admin_redis_url"])
    env = {**os.environ, **extra_env}
    for command in (["SADD", KEYS.engines(), "a:b"], ["HSET", KEYS.lb(), "a:b", "{not json"],
                    ["HSET", KEYS.lb(), "0", "[1, 2"]):
        subprocess.run(argv + command, env=env, capture_output=True, timeout=10, check=True)
    started = time.monotonic()
    codes = []
    for _ in range(5):
        try:
            codes.append(stack.complete(timeout=30).status_code)
        except requests.RequestException as e:
            codes.append(type(e).__name__)
    health = requests.get(f"{stack.base_url}/health", timeout=10).status_code
    elapsed = time.monotonic() - started
    subprocess.run(argv + ["SREM", KEYS.engines(), "a:b"], env=env, capture_output=True, timeout=10)
    subprocess.run(argv + ["HDEL", KEYS.lb(), "a:b"], env=env, capture_output=True, timeout=10)
    return ("garbage control state", f"redis-cli SADD {KEYS.engines()} 'a:b'; garbage JSON in {KEYS.lb()}",
            f"5 completions: {dict(Counter(map(str, codes)))}; /health {health}", f"{elapsed:.1f} (5 requests)", "0")


def refused(stack: ServeStack, fault: str, done: str, path: str, body: dict) -> Row:
    started = time.monotonic()
    try:
        resp = requests.post(f"{stack.base_url}{path}", json={"model": MODEL_NAME, **body}, timeout=120)
        saw = f"{resp.status_code} {resp.json().get('error', {}).get('message', '')[:70]}"
    except (requests.RequestException, ValueError) as e:
        saw = type(e).__name__
    return (fault, done, saw, f"{time.monotonic() - started:.2f} (to the answer)", "-")


def load(stack: ServeStack, n: int) -> Row:
    health: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            with contextlib.suppress(requests.RequestException):
                requests.get(f"{stack.base_url}/health", timeout=30)
            health.append(time.monotonic() - t0)
            stop.wait(0.1)

    def one(_: int) -> tuple[int | str, float | None]:
        t0 = time.monotonic()
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                "stream": True}
        try:
            with requests.post(f"{stack.base_url}/v1/completions", json=body, stream=True, timeout=180) as resp:
                if resp.status_code != 200:
                    return resp.status_code, None
                ttfb = None
                for line in resp.iter_lines():
                    if ttfb is None and line.startswith(b"data: "):
                        ttfb = time.monotonic() - t0
                return 200, ttfb
        except requests.RequestException as e:
            return type(e).__name__, None

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    with ThreadPoolExecutor(max_workers=n) as pool:
        outcomes = list(pool.map(one, range(n)))
    stop.set()
    prober.join(timeout=30)
    codes = Counter(str(code) for code, _ in outcomes)
    ttfb = [t for code, t in outcomes if code == 200 and t is not None]
    return (f"{n} concurrent streams", f"{n} streams of 64 tokens at once, 2 API workers; /health polled",
            f"codes {dict(codes)}; admitted TTFB p50 {percentile(ttfb, 0.5):.2f} s p99 {percentile(ttfb, 0.99):.2f} s;"
            f" /health p50 {statistics.median(health) * 1000:.0f} ms max {max(health) * 1000:.0f} ms", "-",
            f"{codes.get('429', 0)} refused with 429 (none dropped)")


def ctrl_c(stack: ServeStack) -> Row:
    tree = descendants(stack.proc.pid)
    os.kill(stack.proc.pid, signal.SIGINT)
    started = time.monotonic()
    try:
        code = stack.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        code = "still running after 90 s"
    stopped = time.monotonic() - started
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not any(alive(p) for p in tree), 10, "descendants gone")
    lingering = [p for p in tree if alive(p)]
    return ("Ctrl-C", "SIGINT to redserve serve", f"exit code {code}", f"{stopped:.1f} (to exit)",
            f"lingering pids: {lingering or 'none'}")


def sentinel_steps(stack: ServeStack, streams: int) -> list[Callable[[], Row]]:
    """The rows of ``--redis-replicas``: a replica and a sentinel (nothing visible), then the primary."""
    def settled() -> bool:
        nodes = stack.state()["redis_nodes"]
        return all(alive(n["pid"]) for n in nodes)
    return [lambda: redis_node_kill(stack, "replica"),
            lambda: (wait_for(settled, 60, "the replica back"), redis_node_kill(stack, "sentinel"))[1],
            lambda: (wait_for(settled, 60, "the sentinel back"), redis_primary_kill(stack, streams))[1]]


def run(model: str, streams: int, redis_replicas: int = 0, failover_streams: int = 32,
        redis_cluster: int = 0, engines: int = 1) -> list[Row]:
    workdir = Path(tempfile.mkdtemp(prefix="redserve-faults-"))
    stack = ServeStack(model, workdir, api_workers=2, redis_replicas=redis_replicas, redis_cluster=redis_cluster,
                       engines=engines)
    rows: list[Row] = []
    try:
        wait_for(stack.served, 180, "the stack to serve", interval=0.5)
        ctx = 2048 + 10
        from fault_rows_cluster import cluster_steps  # here: that module imports this one
        steps: list[Callable[[], Row]] = cluster_steps(stack, redis_cluster, 8, redis_replicas) if redis_cluster \
            else sentinel_steps(stack, failover_streams) if redis_replicas else [
            lambda: engine_kill(stack), lambda: coordinator_kill(stack), lambda: api_master_kill(stack),
            lambda: api_worker_kill(stack), lambda: redis_kill(stack), lambda: batch_worker_kill(stack, workdir),
            lambda: garbage_control_state(stack),
            lambda: refused(stack, "min_tokens > context (completions)", f"min_tokens={ctx}, no max_tokens",
                            "/v1/completions", {"prompt": "Hi", "min_tokens": ctx}),
            lambda: refused(stack, "min_tokens > context (chat)", f"min_tokens={ctx}, no max_tokens",
                            "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                     "min_tokens": ctx}),
            lambda: refused(stack, "10 MB prompt", "a 10 MB prompt string", "/v1/completions",
                            {"prompt": "ab " * (10 * 1024 * 1024 // 3), "max_tokens": 1}),
            lambda: refused(stack, "16 stop strings of 100 kB", "stop: 16 x 100 kB", "/v1/completions",
                            {"prompt": "Hi", "max_tokens": 1, "stop": ["x" * 100_000] * 16}),
            lambda: load(stack, streams),
            lambda: ctrl_c(stack),
        ]
        for step in steps:
            try:
                rows.append(step())
            except Exception as e:  # noqa: BLE001 - one broken row must not hide the others
                rows.append((getattr(step, "__name__", "step"), "-", f"ERROR {type(e).__name__}: {e}"[:150], "-", "-"))
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    finally:
        stack.kill()
    print(f"(serve log: {stack.log_path})", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: the tiny test model)")
    parser.add_argument("--streams", type=int, default=150, help="concurrent streams in the load row")
    parser.add_argument("--redis-replicas", type=int, default=0,
                        help="N >= 1: run the Sentinel rows (primary, replica, sentinel killed) on N replicas instead "
                             "(with --redis-cluster: N replicas of each cluster primary)")
    parser.add_argument("--failover-streams", type=int, default=32, help="streams in flight when the primary dies")
    parser.add_argument("--redis-cluster", type=int, default=0,
                        help="N >= 1: run the Cluster rows (each of N primaries killed in turn) instead; with "
                             "--redis-replicas R each primary has R replicas (the cluster fails over)")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="engines (with --redis-cluster: each row freezes all of them to queue requests)")
    args = parser.parse_args()
    if args.data_parallel_size > 1 and not args.redis_cluster:
        parser.error("--data-parallel-size > 1 is for the --redis-cluster rows")
    model = args.model
    if model is None:
        from worker.models.tiny_model import make_tiny_model
        model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="redserve-tiny-")) / "tiny-llama", arch="llama",
                                    seed=0, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                    intermediate_size=256, vocab_size=1024))
    rows = run(model, args.streams, args.redis_replicas, args.failover_streams, args.redis_cluster,
               args.data_parallel_size)
    print("| fault | what was done | what clients saw | time to recover (s) | un-started requests lost |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")


if __name__ == "__main__":
    main()
