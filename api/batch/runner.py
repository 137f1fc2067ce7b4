"""Answers one batch request exactly as the HTTP API answers it, non-streaming.

Rules:
- The request goes through the API's own handlers (`api.completions.create_completion`,
  `api.chat.create_chat_completion`, `api.responses.create_response`) with this process's `ApiState` (its `BrokerClient`, tokenizer
  and in-flight limiter), called directly: no Flask, no HTTP request, no JSON round trip. Their
  `api.answer.Answer` holds the status code and body the endpoint would send.
- `ApiError` becomes its status and OpenAI error body (`Answer.error`), as the app's error handler
  does; any other exception a 500 with the same message the app gives (and a log line with the
  traceback).
- Transient answers (429 in-flight limit, 503 no engine ready / broker unavailable / engine gone)
  are retried with backoff (0.5 s doubling to 10 s) for up to `retry_for` seconds, then returned:
  a batch outlives short outages instead of failing every item at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from api.answer import Answer
from api.batch.records import BatchRequest
from api.chat import create_chat_completion
from api.completions import create_completion
from api.errors import ApiError
from api.generation_defaults import apply_generation_defaults
from api.log_safety import printable
from api.responses import create_response
from api.state import ApiState

logger = logging.getLogger(__name__)

TRANSIENT = frozenset({429, 503})

Handler = Callable[[ApiState, Any, Callable[[], bool]], Answer]
_HANDLERS: dict[str, Handler] = {"/v1/completions": create_completion,
                                 "/v1/chat/completions": create_chat_completion,
                                 "/v1/responses": create_response}


def _still_connected() -> bool:
    return False


class ItemRunner:
    """Runs batch requests through the API handlers; see the module rules. Thread-safe."""

    def __init__(self, state: ApiState, retry_for: float = 300.0) -> None:
        self.state = state
        self.retry_for = retry_for

    def run(self, request: BatchRequest) -> tuple[int, dict[str, Any]]:
        """The endpoint's (status code, JSON body) for `request`, after retrying transient answers."""
        give_up = time.monotonic() + self.retry_for
        delay = 0.5
        while True:
            status, body = self.answer(request)
            if status not in TRANSIENT or time.monotonic() + delay > give_up:
                return status, body
            logger.info("batch item %s: %d (%s); retrying in %.1fs", printable(request.custom_id), status,
                        printable(body.get("error", {}).get("message"), limit=500), delay)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)

    def answer(self, request: BatchRequest) -> tuple[int, dict[str, Any]]:
        """One try: the endpoint's (status code, JSON body)."""
        handler = _HANDLERS[request.url]
        try:
            defaults = self.state.generation_defaults if self.state is not None else {}
            answer = handler(self.state, apply_generation_defaults(request.body, defaults), _still_connected)
        except ApiError as e:
            answer = Answer.error(e)
        except Exception as e:
            logger.exception("batch item %s failed on %s", printable(request.custom_id), printable(request.url))
            answer = Answer.error(ApiError(500, f"internal server error ({type(e).__name__}); see the server log"))
        return answer.status, answer.body
