"""Streams outlive their engine: a `kill -9` of one of two DP engines in the middle of generation, and every
request (streamed or not) still completes, resumed on the other engine, equal to an uninterrupted run:
same text (half the streams end on a stop string found late in their text, so the API's detokenizer and
stop matcher carry on across the move), tokens, logprobs, usage, finish reason and one id.

Real processes over a real Redis and real HTTP: a coordinator, two tiny-model engines (TP=2 each),
`redserve api`. The victim is first frozen (SIGSTOP) once its requests are under way, so the kill lands
mid-stream for sure. First the engine holding a long non-streamed request is killed (its streams and that
request resume on the other engine: detected by its presence subscription vanishing, well before its 5 s
heartbeat TTL, `broker.engine_presence`; if the balancer put every stream on the other engine, that one is
killed instead and only its streams move); then a TP worker of the busier engine is killed (the engine fails
its requests with engine_failed and exits; they resume on the other).

Run with ``-s`` to see the pause the resumed streams saw (their longest silence after the kill).
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from itertools import pairwise

import pytest
import redis
import requests
from stack_procs import Procs, cli, free_port, poll, quiet_cli

from broker.keys import RedisKeys
from redserve.proc_tree import descendants, title

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", str(32 << 20), "--max-num-seqs", "8",
                "--tensor-parallel-size", "2"]
MAX_TOKENS = 128  # streams long enough to be under way when a test freezes an engine (48 ended first once)
LONG_TOKENS = 400  # the non-streamed request: still running when its engine is killed (200 was not, once, in CI)
PROMPTS = [f"Stream number {i} tells a long story about" for i in range(8)]


def token_counts(usage: dict | None) -> dict | None:
    """A usage without its prefix-cache hits: those depend on what each engine served before (the reference
    run warms the caches the resumed run then finds), not on the resume."""
    if usage is None:
        return None
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 <= cached <= usage["prompt_tokens"] and cached % 16 == 0, usage  # whole KV blocks (default size)
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


@dataclass
class StreamResult:
    """What one streaming client saw: every chunk with the time it arrived."""

    chunks: list[tuple[float, dict]] = field(default_factory=list)
    error: str | None = None
    started: float = 0.0

    @property
    def choice_chunks(self) -> list[tuple[float, dict]]:
        return [(t, c) for t, c in self.chunks if c.get("choices")]

    @property
    def text(self) -> str:
        return "".join(c["choices"][0]["text"] for _, c in self.choice_chunks)

    @property
    def tokens(self) -> list[str]:
        return [tok for _, c in self.choice_chunks for tok in (c["choices"][0].get("logprobs") or {}).get("tokens", [])]

    @property
    def logprobs(self) -> list[float]:
        return [lp for _, c in self.choice_chunks
                for lp in (c["choices"][0].get("logprobs") or {}).get("token_logprobs", [])]

    @property
    def finish_reason(self) -> str | None:
        reasons = [c["choices"][0].get("finish_reason") for _, c in self.choice_chunks]
        return next((r for r in reversed(reasons) if r), None)

    @property
    def usage(self) -> dict | None:
        return token_counts(next((c["usage"] for _, c in reversed(self.chunks) if c.get("usage")), None))

    @property
    def ids(self) -> set[str]:
        return {c["id"] for _, c in self.chunks}


class ResumeStack:
    def __init__(self, procs: Procs, url: str, model: str) -> None:
        self.procs, self.url, self.model = procs, url, model
        self.keys = RedisKeys(f"mig{uuid.uuid4().hex[:8]}")
        self.redis = redis.Redis.from_url(url)
        self.engines: dict[str, object] = {}
        self.procs.start("coordinator", quiet_cli("coordinator", "--redis-url", url, "--key-prefix", self.keys.prefix))
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.api = self.procs.start("api", cli("--log-level", "INFO", "api", "--model", model, "--redis-url", url,
                                               "--key-prefix", self.keys.prefix, "--port", str(port),
                                               "--workers", "1", "--public-metrics",
                                               *os.environ.get("RESUME_TEST_API_FLAGS", "").split()))
        self._generation = 0

    def start_engine(self, rank: str, *flags: str) -> None:
        self._generation += 1
        self.engines[rank] = self.procs.start(f"engine-{rank}-{self._generation}", quiet_cli(
            "engine", "--model", self.model, "--redis-url", self.url, "--key-prefix", self.keys.prefix,
            "--dp-rank", rank, *ENGINE_FLAGS, *flags))

    def wait_ready(self) -> None:
        def ready() -> bool:
            for rank, proc in self.engines.items():
                assert proc.poll() is None, f"engine {rank} exited"
            try:
                health = requests.get(f"{self.base_url}/health", timeout=2)
            except requests.RequestException:
                return False
            # pid too: a killed engine's hash says "ready" until the coordinator marks it dead
            hashes = [self.redis.hmget(self.keys.engine(r), "state", "pid") for r in self.engines]
            return health.status_code == 200 and all(
                state == b"ready" and int(pid) == self.engines[r].pid for r, (state, pid) in zip(self.engines, hashes,
                                                                                                  strict=True))
        poll(ready, 180, "both engines READY and the API healthy")
        # the API's engine list is cached up to 0.5 s: let it see both before traffic is spread
        time.sleep(1.0)

    def generated(self, rank: str) -> int:
        return int(self.redis.hget(self.keys.engine(rank), "generated_tokens") or 0)

    def running(self, rank: str) -> int:
        return int(self.redis.hget(self.keys.engine(rank), "running") or 0)

    def migrations(self) -> dict[str, float]:
        text = requests.get(f"{self.base_url}/metrics", timeout=10).text
        return {m[0]: float(m[1]) for m in
                re.findall(r'^redserve:request_migrations_total\{[^}]*reason="([a-z_]+)"[^}]*\} (\S+)$', text, re.M)}

    def kill(self, rank: str) -> float:
        """SIGKILL a (frozen) engine; the wall time of the kill."""
        proc = self.engines[rank]
        killed_at = time.time()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return killed_at


def _resume_logged_at(log: str) -> float:
    """Wall time of the last "resumed request" line of the API log (local time, ms)."""
    stamp = re.findall(r"^(\S+ \S+),(\d{3}) INFO broker.client.migration.*resumed request", log, re.M)[-1]
    return time.mktime(time.strptime(stamp[0], "%Y-%m-%d %H:%M:%S")) + int(stamp[1]) / 1000


def _body(prompt: str, stream: bool, stop: str | None = None) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream,
            "logprobs": 1, "return_tokens_as_token_ids": True, **({"stop": [stop]} if stop else {}),
            **({"stream_options": {"include_usage": True}} if stream else {})}


def _late_stop(text: str) -> str:
    """Three characters whose first occurrence lies in the last third of `text`."""
    for start in range(len(text) * 2 // 3, len(text) - 3):
        candidate = text[start:start + 3]
        if candidate.strip() and text.find(candidate) == start:
            return candidate
    raise AssertionError(f"no late stop string in {text!r}")


def _stream(base_url: str, prompt: str, result: StreamResult, stop: str | None) -> None:
    result.started = time.time()
    try:
        with requests.post(f"{base_url}/v1/completions", json=_body(prompt, True, stop), stream=True,
                           timeout=120) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {r.text}"
                return
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])
                result.chunks.append((time.time(), chunk))
    except requests.RequestException as e:
        result.error = repr(e)


def _run_streams(base_url: str, stops: list[str | None], staggered: bool = False,
                 ) -> tuple[list[StreamResult], list[threading.Thread]]:
    """Start a stream per prompt; `staggered`: the second half once the first half is decoding, so the engines
    also run steps that mix prefills and decodes (the first such step of an engine is slow: warm it up)."""
    results = [StreamResult() for _ in PROMPTS]
    threads = [threading.Thread(target=_stream, args=(base_url, p, r, stop), daemon=True)
               for p, r, stop in zip(PROMPTS, results, stops, strict=True)]
    half = len(threads) // 2
    for k, t in enumerate(threads):
        if staggered and k == half:
            poll(lambda: all(len(r.tokens) >= 2 for r in results[:half]), 60, "the first streams to decode")
        t.start()
    return results, threads


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a stream did not end"


@pytest.fixture(scope="module")
def stack(redis_server, tiny_llama_dir, tmp_path_factory):
    procs = Procs(tmp_path_factory.mktemp("resume-logs"))
    try:
        s = ResumeStack(procs, redis_server.url, tiny_llama_dir)
        s.start_engine("0")
        s.start_engine("1")
        s.wait_ready()
        yield s
    finally:
        procs.close()


@dataclass
class Reference:
    plain: list[StreamResult]  # no stop strings
    stops: list[str | None]  # a late stop string for the even streams
    stopped: list[StreamResult]  # with those stop strings
    long: dict  # the non-streamed answer for PROMPTS[1] with LONG_TOKENS


@pytest.fixture(scope="module")
def reference(stack) -> Reference:
    """Everything uninterrupted: the streams plain, then with stop strings taken from the plain texts (staggered,
    which also warms the engines up), and the long non-streamed request."""
    plain, threads = _run_streams(stack.base_url, [None] * len(PROMPTS))
    _join(threads)
    for r in plain:
        assert r.error is None and r.finish_reason == "length" and len(r.tokens) == MAX_TOKENS, r.error
    stops = [_late_stop(r.text) if i % 2 == 0 else None for i, r in enumerate(plain)]
    stopped, threads = _run_streams(stack.base_url, stops, staggered=True)
    _join(threads)
    for i, r in enumerate(stopped):
        assert r.error is None and r.finish_reason == ("stop" if stops[i] else "length"), r.error
    long = _complete(stack.base_url)
    assert long["status"] == 200, long
    return Reference(plain, stops, stopped, long["body"])


def _complete(base_url: str, answer: dict | None = None) -> dict:
    """The long non-streamed request; its status and body (also into `answer`)."""
    body = {**_body(PROMPTS[1], False), "max_tokens": LONG_TOKENS}
    r = requests.post(f"{base_url}/v1/completions", json=body, timeout=120)
    answer = {} if answer is None else answer
    answer.update(status=r.status_code, body=r.json())
    return answer


def _check_streams(results: list[StreamResult], reference: Reference) -> None:
    for i, (got, want) in enumerate(zip(results, reference.stopped, strict=True)):
        assert got.error is None, (i, got.error)
        assert (got.text, got.tokens, got.finish_reason) == (want.text, want.tokens, want.finish_reason), i
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-3), i
        assert got.usage == want.usage, i
        assert len(got.ids) == 1, i


def _resumed(stack: ResumeStack, results: list[StreamResult]) -> list[StreamResult]:
    """The streams the API log says it resumed."""
    moved = set(re.findall(r"resumed request (\S+) from engine", stack.procs.log("api")))
    return [r for r in results if r.ids <= moved]


def _report(what: str, stack: ResumeStack, reference: Reference, held: list[StreamResult], killed_at: float) -> None:
    # the longest silence after the kill (a frozen engine flushes what it had when it wakes, so not simply the
    # first chunk after the kill)
    pauses = sorted(max(b - a for a, b in pairwise([killed_at, *(t for t, _ in r.choice_chunks if t > killed_at)]))
                    for r in held)
    detected = _resume_logged_at(stack.procs.log("api")) - killed_at
    ttft = statistics.median(r.choice_chunks[0][0] - r.started for r in reference.plain)
    print(f"\n{what}: resumed {len(held)} stream(s); kill -> resumed (API log) {detected:.3f}s; pause after the kill: "
          f"p50 {statistics.median(pauses):.3f}s max {pauses[-1]:.3f}s; uninterrupted TTFT p50 {ttft:.3f}s")
    assert pauses[-1] < 4.0, "the resume should come well before the 5 s heartbeat TTL runs out"


def test_kill_9_of_an_engine_mid_generation_every_request_resumes_identical(stack, reference) -> None:
    before = stack.migrations()
    long: dict = {}
    poll(lambda: not any(stack.running(r) for r in stack.engines), 30, "the engines to be idle")
    base = {rank: stack.generated(rank) for rank in stack.engines}
    long_thread = threading.Thread(target=_complete, args=(stack.base_url, long), daemon=True)
    long_thread.start()
    long_engine = poll(lambda: next((r for r in stack.engines if stack.running(r) and stack.generated(r) > base[r] + 2),
                                    None), 60, "an engine to be generating the non-streamed request")
    results, threads = _run_streams(stack.base_url, reference.stops)
    poll(lambda: all(len(r.tokens) >= 3 for r in results), 60, "every stream to be under way")
    # The victim: the engine with the non-streamed request, once its stats show a stream there too. Under load the
    # balancer can place every stream on the other engine (its load snapshot lags); then the victim is the engine
    # with the streams, and only they move (the non-streamed move is still covered whenever placement spreads).
    deadline = time.monotonic() + 5.0
    while stack.running(long_engine) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    victim = long_engine if stack.running(long_engine) >= 2 else poll(
        lambda: next((r for r in stack.engines if r != long_engine and stack.running(r) >= 1), None), 30,
        "an engine with streams running")
    long_moves = int(victim == long_engine)
    os.kill(stack.engines[victim].pid, signal.SIGSTOP)
    assert not (long and long_moves), "the non-streamed request ended before its engine was stopped: raise LONG_TOKENS"
    frozen = time.time()
    time.sleep(1.0)  # outputs the victim had published reach the clients; the other engine's streams go on
    killed_at = stack.kill(victim)
    _join(threads)
    long_thread.join(timeout=120)

    _check_streams(results, reference)
    assert long["status"] == 200, long
    got, want = long["body"]["choices"][0], reference.long["choices"][0]
    assert (got["text"], got["logprobs"]["tokens"], got["finish_reason"]) == (want["text"], want["logprobs"]["tokens"],
                                                                              "length")
    assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-3)
    assert token_counts(long["body"]["usage"]) == token_counts(reference.long["usage"])
    held = _resumed(stack, results)
    moved = stack.migrations().get("engine_exited", 0) - before.get("engine_exited", 0)
    assert len(held) >= 1 and moved == len(held) + long_moves, (moved, len(held), long_moves)
    assert all(not any(frozen + 0.2 < t < killed_at for t, _ in r.choice_chunks) for r in held)
    _report(f"kill -9 engine {victim} ({'with' if long_moves else 'without'} the non-streamed request)", stack, reference, held, killed_at)
    other = "0" if victim == "1" else "1"
    assert re.search(rf"resumed request \S+ from engine {victim} on engine {other}", stack.procs.log("api"))

    stack.start_engine(victim)
    stack.wait_ready()


def test_a_dead_tp_worker_mid_generation_every_stream_resumes_identical(stack, reference) -> None:
    before = stack.migrations()
    results, threads = _run_streams(stack.base_url, reference.stops)
    poll(lambda: all(len(r.tokens) >= 3 for r in results), 60, "every stream to be under way")
    # The engine with the most streams running, read once its stats show any (a stale 0 on both would pick an
    # engine without streams, and nothing would be left to resume).
    victim = poll(lambda: max((r for r in stack.engines if stack.running(r)), key=stack.running, default=None), 30,
                  "an engine with streams running")
    engine = stack.engines[victim]
    os.kill(engine.pid, signal.SIGSTOP)
    frozen = time.time()
    time.sleep(1.0)
    worker = next(pid for pid in descendants(engine.pid) if title(pid).startswith(f"redserve-worker-{victim}-1"))
    os.kill(worker, signal.SIGKILL)
    killed_at = time.time()
    os.kill(engine.pid, signal.SIGCONT)
    _join(threads)

    _check_streams(results, reference)
    held = _resumed(stack, results)
    assert all(not any(frozen + 0.2 < t < killed_at for t, _ in r.choice_chunks) for r in held)
    after = stack.migrations()
    assert sum(after.values()) - sum(before.values()) == len(held) >= 1, (after, before, len(held))
    assert after.get("engine_failed", 0) > before.get("engine_failed", 0)  # it told its clients it failed
    assert engine.wait(timeout=60) == 1
    _report(f"kill -9 a TP worker of engine {victim}", stack, reference, held, killed_at)
