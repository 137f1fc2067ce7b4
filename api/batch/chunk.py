"""Runs one chunk of a batch: every item of it ends with exactly one recorded result.

Rules:
- All the chunk's items run at once, one thread each (the engines batch them); each item is claimed
  first (`BatchStore.claim`) and generated only by its claim holder, so a chunk that runs again
  (a retry, a redelivery after a worker died or after the visibility timeout) skips the items that
  have a result and generates only the others: no item is generated twice while its worker lives.
- An item another live worker holds is waited for (polled every `poll_interval` s) until it has a
  result or its holder dies (then this run claims and generates it). So when `run_chunk` returns,
  every item of the chunk has a result, unless the batch is gone (expired or deleted).
- A malformed line is recorded as a failed item (`invalid_request`); it never stops the chunk.
- The claim holder is identified by its broker client id, whose heartbeat key says it is alive:
  `owner` must be the id of a started `BrokerClient` of this process with a live heartbeat.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from api.batch.records import BatchRequest, InvalidLine, error_line, parse_request_line, response_line
from api.batch.store import BatchStore, Claim


class Answerer(Protocol):
    def run(self, request: BatchRequest) -> tuple[int, dict[str, Any]]: ...


class Outcome(StrEnum):
    RECORDED = "recorded"
    SKIPPED = "skipped"
    GONE = "gone"


@dataclass
class ChunkSummary:
    """What one run of a chunk did: results it wrote, items already done by others, batch gone."""

    batch_id: str
    chunk: int
    recorded: int = 0
    skipped: int = 0
    gone: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"batch_id": self.batch_id, "chunk": self.chunk, "recorded": self.recorded,
                "skipped": self.skipped, "gone": self.gone}


def answer_line(runner: Answerer, line: str) -> dict[str, Any]:
    """The output line for one input line (a malformed line gives an error line)."""
    try:
        request = parse_request_line(line)
    except InvalidLine as e:
        return error_line(e.custom_id, "invalid_request", str(e))
    status, body = runner.run(request)
    return response_line(request.custom_id, status, body)


def run_chunk(store: BatchStore, runner: Answerer, owner: str, batch_id: str, chunk: int,
              poll_interval: float = 0.5) -> ChunkSummary:
    """Settle every item of chunk `chunk` of `batch_id`; see the module rules."""
    summary = ChunkSummary(batch_id, chunk)
    info = store.info(batch_id)
    if info is None:
        summary.gone = True
        return summary
    items = info.chunk_items(chunk)
    lines = store.item_lines(batch_id, items)

    def settle(index: int, line: str) -> Outcome:
        while True:
            claim = store.claim(batch_id, index, owner)
            if claim is Claim.CLAIMED:
                recorded = store.record(batch_id, index, answer_line(runner, line))
                return Outcome.RECORDED if recorded else Outcome.SKIPPED
            if claim is Claim.DONE:
                return Outcome.SKIPPED
            if claim is Claim.GONE:
                return Outcome.GONE
            time.sleep(poll_interval)

    with ThreadPoolExecutor(max_workers=max(1, len(lines)), thread_name_prefix=f"batch-chunk-{chunk}") as pool:
        outcomes = list(pool.map(settle, items, lines))
    summary.recorded = outcomes.count(Outcome.RECORDED)
    summary.skipped = outcomes.count(Outcome.SKIPPED)
    summary.gone = Outcome.GONE in outcomes
    return summary
