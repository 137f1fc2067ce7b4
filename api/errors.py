"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Rules:
- Handlers raise `ApiError`; the app turns it into that JSON with `status` (and `headers`, e.g.
  Retry-After). Before a stream has started this is the whole response; after, it is one SSE event
  (`sse_error`) followed by ``data: [DONE]``; in a Responses stream (/v1/responses) it is an ``error``
  event (`error_event`, numbered by the stream) and nothing follows.
- `type` follows the status unless given: 400/404/405/413 invalid_request_error, 401
  authentication_error, 429 rate_limit_error, 503 service_unavailable_error, 504 timeout_error,
  else server_error. `code` is a short machine-readable string (or None).
- `engine_error(code, message)` maps a failed request's `ErrorCode` to a status: the engine rejected
  the request -> 400, deadline -> 504, engine failure -> 500, engine or broker gone -> 503 (with
  Retry-After); the body's `code` is the ErrorCode's value.
"""

from __future__ import annotations

import json
from typing import Any

from protocol.messages import ErrorCode

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable_error", 504: "timeout_error"}

_ENGINE_STATUS = {ErrorCode.INVALID_REQUEST: 400, ErrorCode.DEADLINE_EXCEEDED: 504, ErrorCode.ENGINE_ERROR: 500,
                  ErrorCode.ENGINE_FAILED: 500}


class ApiError(Exception):
    """An error answer: HTTP `status` plus OpenAI's error body; see the module rules."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str, retry_after: int = 1, code: str = "no_engine_available") -> ApiError:
    return ApiError(503, message, code=code, headers={"Retry-After": str(retry_after)})


def engine_error(code: ErrorCode, message: str) -> ApiError:
    """The ApiError for a request that failed in the engine or the broker (see the module rules)."""
    status = _ENGINE_STATUS.get(code, 503)
    headers = {"Retry-After": "1"} if status == 503 else None
    return ApiError(status, message, code=code.value, headers=headers)


def sse_error(error: ApiError, named: bool = False) -> str:
    """The SSE event carrying `error` after a stream has started (`named`: an ``error`` event of a
    Responses stream; its handler sends its own, numbered, so this is only a fallback)."""
    if named:
        return f"event: error\ndata: {json.dumps(error_event(error))}\n\n"
    return f"data: {json.dumps(error.body())}\n\n"


def error_event(error: ApiError) -> dict[str, Any]:
    """`error` as a Responses stream's ``error`` event (OpenAI's ResponseErrorEvent, less the
    `sequence_number` its stream adds)."""
    return {"type": "error", "code": error.code or error.type, "message": error.message, "param": error.param}
