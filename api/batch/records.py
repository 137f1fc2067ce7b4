"""OpenAI batch file formats: one JSON object per line, in and out.

Rules:
- An input line is ``{"custom_id": str, "method": "POST", "url": ENDPOINT, "body": {...}}`` with
  ENDPOINT one of `ENDPOINTS`; the body is what that endpoint takes over HTTP. Streaming is not
  available in a batch (``"stream": true`` is rejected). Blank lines are not items (the submitter
  skips them); every other line is one item, valid or not.
- Lines are strict JSON, as HTTP bodies are (NaN and Infinity are rejected).
- `parse_request_line` raises `InvalidLine` (with the custom_id when one could be read): the item
  is then reported as failed with error code ``invalid_request``, and the batch goes on.
- An output line is ``{"id", "custom_id", "response", "error"}``: `response_line` for an answer from
  the endpoint (``response = {"status_code", "request_id", "body"}``, ``error`` null, whatever the
  status), `error_line` for an item that never reached the endpoint (``response`` null).
- An item has failed when it has an ``error`` or its status code is not 200 (`is_failure`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


class InvalidLine(ValueError):
    """An input line that is not a valid batch request; `custom_id` if one could be read."""

    def __init__(self, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.custom_id = custom_id


@dataclass(frozen=True)
class BatchRequest:
    """One valid input line."""

    custom_id: str
    url: str
    body: dict[str, Any]


def parse_request_line(line: str) -> BatchRequest:
    """The request on one input line; InvalidLine says what is wrong with it."""
    try:
        obj = json.loads(line, parse_constant=_reject_constant)
    except ValueError as e:
        raise InvalidLine(f"the line is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise InvalidLine("the line must be a JSON object with custom_id, method, url and body")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidLine("'custom_id' must be a non-empty string")
    if str(obj.get("method", "")).upper() != "POST":
        raise InvalidLine(f"'method' must be \"POST\", got {obj.get('method')!r}", custom_id)
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise InvalidLine(f"'url' must be one of {', '.join(ENDPOINTS)}, got {url!r}", custom_id)
    body = obj.get("body")
    if not isinstance(body, dict):
        raise InvalidLine("'body' must be a JSON object (the request body of the endpoint)", custom_id)
    if body.get("stream"):
        raise InvalidLine("'stream' is not available in a batch: remove it or set it to false", custom_id)
    return BatchRequest(custom_id, url, body)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")  # as the HTTP API: NaN and Infinity are rejected


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def response_line(custom_id: str, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    """The output line of an item the endpoint answered (successfully or not)."""
    return {"id": _line_id(), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": f"req_{uuid.uuid4().hex}", "body": body},
            "error": None}


def error_line(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """The output line of an item that never reached the endpoint."""
    return {"id": _line_id(), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def is_failure(line: dict[str, Any]) -> bool:
    response = line.get("response")
    return line.get("error") is not None or not response or response.get("status_code") != 200
