"""Batch jobs through real processes: redis-server, `redserve engine`, `redserve batch worker` (Celery).

Results are compared with the offline `engine.LLM` on the same model (float32, greedy). A worker is
killed with SIGKILL mid-batch and another one started: the batch still completes, every item once.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest
import redis
from stack_procs import Procs, cli, engine_ready, maps_torch, process_tree, title, wait_for

from api.batch.store import BatchStore
from broker.connection import connect
from broker.keys import RedisKeys
from redserve.redis_server import EmbeddedRedis

VISIBILITY_TIMEOUT = 8  # short, so that a killed worker's chunks come back within the test


class BatchStack:
    def __init__(self, model_dir: str, redis_url: str, keys: RedisKeys, procs: Procs) -> None:
        self.model_dir = model_dir
        self.redis_url = redis_url
        self.keys = keys
        self.procs = procs
        self.worker: subprocess.Popen | None = None
        self.store = BatchStore(connect(redis_url), keys)
        self.common = ["--redis-url", redis_url, "--key-prefix", keys.prefix]

    def start_worker(self, name: str) -> subprocess.Popen:
        self.worker = self.procs.start(name, cli("batch", "worker", "--model", self.model_dir, *self.common,
                                                 "--concurrency", "2",
                                                 "--visibility-timeout", str(VISIBILITY_TIMEOUT)))
        return self.worker

    def batch_cli(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(cli("batch", *argv, *self.common), capture_output=True, text=True, timeout=timeout)

    def submit(self, path: Path, *extra: str, timeout: float = 120) -> tuple[str, subprocess.CompletedProcess]:
        done = self.batch_cli("submit", str(path), *extra, timeout=timeout)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().splitlines()[0], done


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory):
    server = EmbeddedRedis().start()
    keys = RedisKeys(f"b{uuid.uuid4().hex[:8]}")
    procs = Procs(tmp_path_factory.mktemp("batch-logs"))
    stack = BatchStack(tiny_llama_dir, server.url, keys, procs)
    try:
        engine = procs.start("engine", cli("engine", "--model", tiny_llama_dir, *stack.common,
                                           "--dtype", "float32"))
        worker = stack.start_worker("worker-1")
        wait_for(lambda: engine_ready(server.url, keys), 120, "the engine", watch=(engine, worker))
        yield stack
    finally:
        procs.close()
        stack.store.redis.close()
        server.stop()


@pytest.fixture(scope="module")
def offline(stack: BatchStack):
    from engine import LLM

    llm = LLM(model=stack.model_dir, dtype="float32")
    yield llm
    llm.shutdown()


def offline_texts(llm, prompts: list[str], max_tokens: list[int], **params) -> list[str]:
    from engine import SamplingParams

    outputs = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0, **params) for m in max_tokens])
    return [o.outputs[0].text for o in outputs]


def completion_line(custom_id: str, prompt: str, max_tokens: int, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0, **body}})


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_batch_of_50_matches_offline_llm(stack: BatchStack, offline, tmp_path: Path) -> None:
    prompts = [f"Item {i}: {['def f(', 'The quick brown fox', 'import os', 'Once upon'][i % 4]} {i * 7}"
               for i in range(50)]
    max_tokens = [8 + i % 5 * 4 for i in range(50)]
    src = tmp_path / "in.jsonl"
    pairs = enumerate(zip(prompts, max_tokens, strict=True))
    src.write_text("".join(completion_line(f"c{i}", p, m) + "\n" for i, (p, m) in pairs))
    out = tmp_path / "out.jsonl"
    batch_id, done = stack.submit(src, "--output", str(out), "--chunk-size", "8", "--poll-interval", "0.2")
    assert "50/50 done, 0 failed" in done.stderr
    lines = read_jsonl(out)
    assert [line["custom_id"] for line in lines] == [f"c{i}" for i in range(50)]
    expected = offline_texts(offline, prompts, max_tokens)
    for line, text, m in zip(lines, expected, max_tokens, strict=True):
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "text_completion" and body["model"] == "tiny-llama"
        assert body["choices"][0]["text"] == text
        assert body["usage"]["completion_tokens"] <= m
    status = json.loads(stack.batch_cli("status", batch_id, "--json").stdout)
    assert status["status"] == "completed"
    assert status["request_counts"] == {"total": 50, "completed": 50, "failed": 0}
    assert status["num_chunks"] == 7


def test_worker_never_loads_torch_and_is_titled(stack: BatchStack) -> None:
    pids = process_tree(stack.worker.pid)
    assert len(pids) == 3  # the Celery main process and its two pool processes
    for pid in pids:
        assert title(pid).startswith("redserve-batch")
        assert not maps_torch(pid)


def test_malformed_lines_are_reported_not_fatal(stack: BatchStack, tmp_path: Path) -> None:
    lines = [
        completion_line("ok-1", "Hello there", 6),
        "{this is not json",
        json.dumps({"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings", "body": {}}),
        completion_line("unknown-model", "Hello", 4, model="no-such-model"),
        completion_line("bad-param", "Hello", -1),
        json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}}),
        "",
        completion_line("ok-2", "Bye now", 6),
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    batch_id, _ = stack.submit(src, "--output", str(tmp_path / "out.jsonl"), "--chunk-size", "3",
                               "--poll-interval", "0.2")
    results = stack.batch_cli("results", batch_id)
    assert results.returncode == 0, results.stderr
    by_id = {}
    for line in map(json.loads, results.stdout.splitlines()):
        by_id[line["custom_id"]] = line
    assert len(by_id) == 7  # 7 items: the blank line is not one
    assert by_id[None]["error"]["code"] == "invalid_request" and "JSON" in by_id[None]["error"]["message"]
    assert by_id["wrong-url"]["response"] is None and "url" in by_id["wrong-url"]["error"]["message"]
    assert by_id["unknown-model"]["response"]["status_code"] == 404
    assert by_id["unknown-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert by_id["bad-param"]["response"]["status_code"] == 400
    assert by_id["chat"]["response"]["body"]["object"] == "chat.completion"
    for ok in ("ok-1", "ok-2", "chat"):
        assert by_id[ok]["response"]["status_code"] == 200 and by_id[ok]["error"] is None
    status = stack.batch_cli("status", batch_id)
    assert status.stdout.strip() == f"{batch_id}: completed, 7/7 done (4 failed)"


def test_killed_worker_is_replaced_without_duplicates(stack: BatchStack, offline, tmp_path: Path) -> None:
    n = 80  # 40 once finished between the first results and the kill under CI load (6 Dec 2026)
    prompts = [f"Story {i}:" for i in range(n)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(completion_line(f"k{i}", p, 96, ignore_eos=True) + "\n" for i, p in enumerate(prompts)))
    batch_id, _ = stack.submit(src, "--chunk-size", "5")
    wait_for(lambda: stack.store.info(batch_id).done >= 5, 120, "the first results", interval=0.05)
    Procs.kill(stack.worker)
    before = {r["custom_id"]: r for r in stack.store.results(batch_id, n)}
    assert len(before) < n, "the batch finished before the worker was killed: make the items longer"

    stack.start_worker("worker-2")
    wait_for(lambda: stack.store.info(batch_id).status == "completed", 120, "the batch to complete",
             watch=(stack.worker,))
    info = stack.store.info(batch_id)
    assert (info.total, info.completed, info.failed) == (n, n, 0)
    results = list(stack.store.results(batch_id, n))
    assert [r["custom_id"] for r in results] == [f"k{i}" for i in range(n)]
    for r in results:  # results recorded before the kill were kept, not generated again
        if r["custom_id"] in before:
            assert r == before[r["custom_id"]]
    expected = offline_texts(offline, prompts, [96] * n, ignore_eos=True)
    assert [r["response"]["body"]["choices"][0]["text"] for r in results] == expected
    r = redis.Redis.from_url(stack.redis_url)
    try:
        assert not r.exists(stack.keys.batch_claims(batch_id))
    finally:
        r.close()


def test_lost_messages_are_recovered_by_the_sweeper(stack: BatchStack) -> None:
    lines = [completion_line(f"s{i}", f"Lost {i}", 4) for i in range(6)]
    info = stack.store.create(lines, chunk_size=3)  # stored but never queued: as if Celery lost its messages
    wait_for(lambda: stack.store.info(info.id).status == "completed", 90, "the sweeper to queue the batch again",
             watch=(stack.worker,))
    results = list(stack.store.results(info.id, 6))
    assert [r["custom_id"] for r in results] == [f"s{i}" for i in range(6)]
    assert all(r["response"]["status_code"] == 200 for r in results)
