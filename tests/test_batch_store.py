"""Batch formats, the Redis batch store and chunk runs (real Redis, a fake item runner: no engine)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from api.batch.chunk import run_chunk
from api.batch.records import (
    BatchRequest,
    InvalidLine,
    error_line,
    is_failure,
    parse_request_line,
    response_line,
)
from api.batch.store import BatchStore, Claim
from api.batch.sweeper import BatchSweeper


def request_line(i: int, url: str = "/v1/completions", **body) -> str:
    return json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url,
                       "body": {"prompt": f"p{i}", "max_tokens": 4, **body}})


class FakeRunner:
    """Answers 200 with the prompt echoed; counts calls per custom_id."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls: dict[str, int] = {}
        self.delay = delay
        self._lock = threading.Lock()

    def run(self, request: BatchRequest) -> tuple[int, dict]:
        with self._lock:
            self.calls[request.custom_id] = self.calls.get(request.custom_id, 0) + 1
        time.sleep(self.delay)
        if request.body.get("prompt") == "bad":
            return 400, {"error": {"message": "bad prompt", "type": "invalid_request_error"}}
        return 200, {"object": "text_completion", "choices": [{"text": request.body["prompt"]}]}


@pytest.fixture
def store(redis_client, redis_keys) -> BatchStore:
    return BatchStore(redis_client, redis_keys)


def alive(redis_client, redis_keys, owner: str) -> None:
    redis_client.set(redis_keys.client_alive(owner), "test", ex=30)


# ------------------------------------------------------------------------------------------ formats

def test_parse_request_line_accepts_every_endpoint() -> None:
    r = parse_request_line(request_line(1))
    assert (r.custom_id, r.url, r.body["prompt"]) == ("req-1", "/v1/completions", "p1")
    for url in ("/v1/chat/completions", "/v1/responses"):
        other = parse_request_line(json.dumps({"custom_id": "c", "method": "post", "url": url, "body": {}}))
        assert other.url == url


@pytest.mark.parametrize(("line", "custom_id", "words"), [
    ("{not json", None, "not valid JSON"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"temperature": NaN}}', None,
     "NaN is not valid JSON"),
    ("[1, 2]", None, "JSON object"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), None, "custom_id"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}), "a", "method"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}), "a", "url"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": "x"}), "a", "body"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"stream": True}}),
     "a", "stream"),
])
def test_parse_request_line_rejects_with_reason(line: str, custom_id: str | None, words: str) -> None:
    with pytest.raises(InvalidLine, match=words) as e:
        parse_request_line(line)
    assert e.value.custom_id == custom_id


def test_output_lines_follow_openai_batch_output() -> None:
    ok = response_line("a", 200, {"id": "cmpl-1"})
    assert set(ok) == {"id", "custom_id", "response", "error"} and ok["error"] is None
    assert ok["id"].startswith("batch_req_") and set(ok["response"]) == {"status_code", "request_id", "body"}
    assert not is_failure(ok)
    assert is_failure(response_line("a", 400, {"error": {}}))
    bad = error_line(None, "invalid_request", "nope")
    assert bad["response"] is None and bad["error"] == {"code": "invalid_request", "message": "nope"}
    assert is_failure(bad)


# ------------------------------------------------------------------------------------------ store

def test_create_stores_items_in_chunks_and_skips_blank_lines(store: BatchStore, redis_client, redis_keys) -> None:
    lines = [request_line(i) + "\n" for i in range(7)]
    info = store.create([*lines[:3], "\n", "   \n", *lines[3:]], chunk_size=3, input_file="in.jsonl")
    assert (info.total, info.num_chunks, info.status, info.done) == (7, 3, "in_progress", 0)
    assert store.info(info.id) == info
    assert [list(info.chunk_items(c)) for c in range(3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert store.item_lines(info.id, info.chunk_items(2)) == [lines[6].rstrip("\n")]
    assert 0 < redis_client.ttl(redis_keys.batch_items(info.id)) <= 7 * 24 * 3600
    with pytest.raises(ValueError):
        info.chunk_items(3)
    with pytest.raises(ValueError, match="no requests"):
        store.create(["\n"], chunk_size=3)


def test_claims_give_each_item_to_one_live_worker(store: BatchStore, redis_client, redis_keys) -> None:
    info = store.create([request_line(0), request_line(1)], chunk_size=2)
    alive(redis_client, redis_keys, "w1")
    alive(redis_client, redis_keys, "w2")
    assert store.claim(info.id, 0, "w1") is Claim.CLAIMED
    assert store.claim(info.id, 0, "w2") is Claim.HELD
    assert store.claim(info.id, 0, "w1") is Claim.CLAIMED  # the holder itself may take it again
    redis_client.delete(redis_keys.client_alive("w1"))  # w1 died: its heartbeat expired
    assert store.claim(info.id, 0, "w2") is Claim.CLAIMED
    assert store.claim(info.id, 0, "w1") is Claim.HELD
    assert store.claim("batch_unknown", 0, "w1") is Claim.GONE


def test_record_writes_once_counts_and_completes(store: BatchStore, redis_client, redis_keys) -> None:
    info = store.create([request_line(0), request_line(1)], chunk_size=1)
    alive(redis_client, redis_keys, "w1")
    assert store.claim(info.id, 1, "w1") is Claim.CLAIMED
    first = response_line("req-1", 200, {"n": 1})
    assert store.record(info.id, 1, first)
    assert not store.record(info.id, 1, response_line("req-1", 200, {"n": 2}))
    assert store.claim(info.id, 1, "w1") is Claim.DONE
    assert redis_client.hlen(redis_keys.batch_claims(info.id)) == 0
    assert (store.info(info.id).completed, store.info(info.id).status) == (1, "in_progress")
    assert store.record(info.id, 0, error_line(None, "invalid_request", "bad"))
    done = store.info(info.id)
    assert (done.completed, done.failed, done.status) == (1, 1, "completed") and done.completed_at
    results = list(store.results(info.id, done.total))
    assert [r["custom_id"] for r in results] == [None, "req-1"] and results[1] == first
    assert done.to_dict()["request_counts"] == {"total": 2, "completed": 1, "failed": 1}


# ------------------------------------------------------------------------------------------ chunks

def test_run_chunk_records_every_item_and_reports_malformed_lines(store: BatchStore, redis_client,
                                                                  redis_keys) -> None:
    lines = [request_line(0), "{oops", request_line(2, prompt="bad"), request_line(3), request_line(4)]
    info = store.create(lines, chunk_size=4)
    alive(redis_client, redis_keys, "w1")
    runner = FakeRunner()
    summary = run_chunk(store, runner, "w1", info.id, 0)
    assert (summary.recorded, summary.skipped, summary.gone) == (4, 0, False)
    assert store.info(info.id).status == "in_progress"
    assert run_chunk(store, runner, "w1", info.id, 1).recorded == 1
    results = list(store.results(info.id, 5))
    assert [r["custom_id"] for r in results] == ["req-0", None, "req-2", "req-3", "req-4"]
    assert results[1]["error"]["code"] == "invalid_request" and results[2]["response"]["status_code"] == 400
    assert (store.info(info.id).completed, store.info(info.id).failed) == (3, 2)


def test_rerun_chunk_generates_nothing_twice(store: BatchStore, redis_client, redis_keys) -> None:
    info = store.create([request_line(i) for i in range(6)], chunk_size=6)
    alive(redis_client, redis_keys, "w1")
    runner = FakeRunner()
    for i in (0, 1, 2):  # an earlier run finished three items, then died
        assert store.claim(info.id, i, "dead") is Claim.CLAIMED
        store.record(info.id, i, response_line(f"req-{i}", 200, {}))
    assert store.claim(info.id, 3, "dead") is Claim.CLAIMED  # ... while generating item 3
    summary = run_chunk(store, runner, "w1", info.id, 0)
    assert (summary.recorded, summary.skipped) == (3, 3)
    assert runner.calls == {"req-3": 1, "req-4": 1, "req-5": 1}
    assert run_chunk(store, runner, "w1", info.id, 0).skipped == 6
    assert sum(runner.calls.values()) == 3


def test_run_chunk_waits_for_items_a_live_worker_holds(store: BatchStore, redis_client, redis_keys) -> None:
    info = store.create([request_line(0), request_line(1)], chunk_size=2)
    alive(redis_client, redis_keys, "w1")
    alive(redis_client, redis_keys, "w2")
    assert store.claim(info.id, 0, "w2") is Claim.CLAIMED

    def finish_later() -> None:
        time.sleep(0.3)
        store.record(info.id, 0, response_line("req-0", 200, {"by": "w2"}))

    threading.Thread(target=finish_later).start()
    runner = FakeRunner()
    summary = run_chunk(store, runner, "w1", info.id, 0, poll_interval=0.05)
    assert (summary.recorded, summary.skipped) == (1, 1) and runner.calls == {"req-1": 1}
    assert next(store.results(info.id, 2))["response"]["body"] == {"by": "w2"}


def test_run_chunk_of_a_gone_batch(store: BatchStore) -> None:
    assert run_chunk(store, FakeRunner(), "w1", "batch_nothing", 0).gone


# ------------------------------------------------------------------------------------------ sweeper

def test_sweeper_requeues_only_stalled_unattended_batches(store: BatchStore, redis_client, redis_keys) -> None:
    stalled = store.create([request_line(i) for i in range(5)], chunk_size=2)
    held = store.create([request_line(i) for i in range(2)], chunk_size=2)
    done = store.create([request_line(0)], chunk_size=1)
    alive(redis_client, redis_keys, "w1")
    store.claim(stalled.id, 2, "w1")
    store.record(stalled.id, 2, response_line("req-2", 200, {}))  # chunk 1 half done
    store.claim(stalled.id, 3, "dead")  # claimed by a worker that is gone
    store.record(done.id, 0, response_line("req-0", 200, {}))
    assert store.claim(held.id, 0, "w1") is Claim.CLAIMED  # a live worker is on it
    assert set(store.active_batches()) == {stalled.id, held.id}

    queued: list[tuple[str, list[int]]] = []
    sweeper = BatchSweeper(store, lambda b, chunks: queued.append((b, list(chunks))), "q", "w1",
                           interval=60, stall_after=30)

    def sweep(now: float) -> dict[str, list[int]]:
        redis_client.delete(redis_keys.batch_sweeper_lock())
        return sweeper.sweep_once(now)

    now = time.time()
    assert sweep(now) == {}  # progress is recent
    redis_client.rpush("q", "a message")
    assert sweep(now + 60) == {}  # the queue has work: chunks may be waiting
    redis_client.delete("q")
    assert sweep(now + 60) == {stalled.id: [0, 1, 2]}
    assert queued == [(stalled.id, [0, 1, 2])]
    assert sweep(now + 60) == {}  # its progress_at was reset: the next try comes stall_after later
    assert sweeper.sweep_once(now + 200) == {}  # the lock spaces sweeps out
    assert sweep(now + 200) == {stalled.id: [0, 1, 2]}


def test_sweeper_forgets_expired_batches(store: BatchStore, redis_client, redis_keys) -> None:
    info = store.create([request_line(0)], chunk_size=1)
    redis_client.delete(redis_keys.batch(info.id))
    sweeper = BatchSweeper(store, lambda b, c: None, "q", "w1", interval=60, stall_after=1)
    assert sweeper.sweep_once(time.time() + 10) == {}
    assert store.active_batches() == []
    store.mark_progress(info.id, time.time())
    assert not redis_client.exists(redis_keys.batch(info.id))  # never recreated
