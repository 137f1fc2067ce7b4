"""What an endpoint handler answers, as plain data: no Flask, no JSON text.

Rules:
- A handler (`api.completions.create_completion`, `api.chat.create_chat_completion`) returns an
  `Answer`: an HTTP status with a JSON-able `body`, or (streaming) the `chunks` of an SSE stream; it
  raises `ApiError` for an error it finds before answering (`Answer.error` is that error as data).
- Stream chunks are the JSON objects of the events, in order; an error after the stream has begun is
  yielded as an `ApiError` and ends the stream. The ``[DONE]`` marker is framing, not a chunk.
- `named_events` (/v1/responses): each chunk is an event named by its ``type`` (sent with an
  ``event:`` line), and the stream ends without ``[DONE]``, as OpenAI's Responses streams.
- `api.app` is the only place that turns an Answer into an HTTP response (JSON or SSE); the batch
  worker (`api.batch.runner`) calls the same handlers and keeps the status and body as they are.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from api.errors import ApiError

Chunk = dict[str, Any]


@dataclass(frozen=True)
class Answer:
    """An endpoint's answer: `status` and `headers` with either a JSON `body` or stream `chunks` (events
    named by their type when `named_events`)."""

    status: int = 200
    body: dict[str, Any] | None = None
    chunks: Generator[Chunk | ApiError, None, None] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    named_events: bool = False

    @classmethod
    def error(cls, error: ApiError) -> Answer:
        """The answer an `ApiError` stands for: its status, OpenAI's error body and its headers."""
        return cls(error.status, error.body(), headers=dict(error.headers))
