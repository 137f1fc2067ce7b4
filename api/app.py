"""The Flask app: routes, API-key check, body parsing and error mapping.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET /v1/models, GET /health,
GET /readyz, GET /livez, GET /version, POST /tokenize, POST /detokenize, GET /metrics.

Rules:
- The generation handlers (`api.completions`, `api.chat`, `api.responses`) return an `api.answer.Answer`;
  this module alone turns it into HTTP (`_respond`): its body as JSON, or its chunks as server-sent events
  (`sse_body`: one compact ``data:`` line per chunk, a mid-stream error as OpenAI's error event, then
  ``data: [DONE]``; for /v1/responses each event named by an ``event:`` line and no ``[DONE]``).
- Every error is OpenAI's error JSON (`api.errors`), including unknown routes (404), wrong methods
  (405), oversized bodies (413) and anything unexpected (500, logged); no input takes a process down.
- With an API key configured, every route needs ``Authorization: Bearer <key>`` (401 otherwise, unknown
  paths included) except /health, /readyz and /livez, and /metrics when ``--public-metrics`` says so.
- Request paths in log lines are escaped (`api.log_safety.printable`): one line per event.
- Bodies are JSON objects; invalid JSON (NaN and Infinity included) is a 400.
- Readiness: /health (as vLLM's) and its alias /readyz are 200 when at least one READY engine has a live
  heartbeat, else 503 with the reason in `status` (never 500: garbage in Redis is skipped by the readers,
  anything else is "control state unreadable").
- Liveness: /livez is 200 whenever this API process serves requests: it reads neither Redis nor the
  engines, so a model still loading (or an engine down) never makes an orchestrator restart the API
  (docker-compose's API healthcheck uses it; readiness shows through the engines' healthchecks).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Generator, Iterator
from importlib import metadata
from typing import Any

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from api.answer import Answer, Chunk
from api.chat import create_chat_completion
from api.completions import create_completion
from api.config import ApiConfig
from api.errors import ApiError, bad_request, sse_error
from api.generation import ClientDisconnected
from api.generation_defaults import apply_generation_defaults
from api.log_safety import printable
from api.metrics import EngineStatsCollector, render_metrics, start_at_zero
from api.protocol import Body, parse_messages
from api.responses import create_response
from api.serving import check_model, check_prompt_chars, prompt_token_ids
from api.state import ApiState, disconnect_probe
from broker.errors import BrokerError
from broker.log_limits import warn_every

logger = logging.getLogger(__name__)

STATE_KEY = "redserve"

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(config: ApiConfig, state: ApiState | None = None) -> Flask:
    """The API as a Flask app; its `ApiState` is ``app.extensions["redserve"]``."""
    app = Flask("redserve.api")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.json.sort_keys = False
    state = state or ApiState(config)
    app.extensions[STATE_KEY] = state
    collector = EngineStatsCollector(config.model_name, state.live_engines, state.child_restarts,
                                     state.routing_counts)
    created = int(time.time())
    start_at_zero(config.model_name)

    open_paths = {"/health", "/readyz", "/livez", *(["/metrics"] if config.public_metrics else [])}

    @app.before_request
    def check_api_key() -> None:
        if config.api_key and request.path not in open_paths and request.method != "OPTIONS":
            header = request.headers.get("Authorization", "")
            given = header[7:].strip() if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), config.api_key.encode()):
                raise ApiError(401, "invalid or missing API key: send `Authorization: Bearer <key>`",
                               code="invalid_api_key")

    @app.post("/v1/completions")
    def completions() -> Response:
        body = apply_generation_defaults(_json_body(), state.generation_defaults)
        return _respond(create_completion(state, body, _probe()))

    @app.post("/v1/chat/completions")
    def chat_completions() -> Response:
        body = apply_generation_defaults(_json_body(), state.generation_defaults)
        return _respond(create_chat_completion(state, body, _probe()))

    @app.post("/v1/responses")
    def responses() -> Response:
        body = apply_generation_defaults(_json_body(), state.generation_defaults)
        return _respond(create_response(state, body, _probe()))

    @app.get("/v1/models")
    def models() -> Response:
        max_model_len = _max_model_len(state)
        data = [{"id": name, "object": "model", "created": created, "owned_by": "redserve", "root": config.model,
                 "parent": None, "max_model_len": max_model_len, "permission": []}
                for name in config.served_model_names]
        return jsonify({"object": "list", "data": data})

    @app.get("/health")
    @app.get("/readyz")
    def health() -> Response:
        try:
            engines = state.ready_engines()
        except BrokerError as e:
            return _status(503, f"the broker is unavailable: {e}", 0)
        except Exception as e:  # noqa: BLE001 - /health says 503 with a reason, never 500
            warn_every(logger, f"health:{type(e).__name__}", 60.0, "/health: control state unreadable", exc_info=e)
            return _status(503, f"control state unreadable: {type(e).__name__}: {e}", 0)
        if not engines:
            return _status(503, f"no engine is ready; registered: {_engine_summary(state)}", 0)
        return _status(200, "ok", len(engines))

    @app.get("/livez")
    def livez() -> Response:
        return jsonify({"status": "ok"})

    @app.get("/version")
    def version() -> Response:
        return jsonify({"version": _version()})

    @app.post("/tokenize")
    def tokenize() -> Response:
        body = Body(_json_body())
        check_model(state, body.get("model", "str"))
        max_model_len = _max_model_len(state)
        if body.has("messages"):
            text, special = _render_chat(state, body), body.get("add_special_tokens", "bool", False)
        else:
            text, special = body.get("prompt", "str"), body.get("add_special_tokens", "bool", True)
            if text is None:
                raise bad_request("give 'prompt' (a string) or 'messages'", param="prompt")
        if max_model_len is not None:
            check_prompt_chars(state, text, max_model_len)  # a 10 MB text is refused, not tokenized
        ids = state.tokenizer.encode(text, add_special_tokens=special)
        strs = state.tokenizer.token_strings(ids) if body.get("return_token_strs", "bool", False) else None
        return jsonify({"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                        "token_strs": strs})

    @app.post("/detokenize")
    def detokenize() -> Response:
        body = Body(_json_body())
        check_model(state, body.get("model", "str"))
        tokens = body.get("tokens", "int_list")
        if tokens is None:
            raise bad_request("'tokens' (an array of token ids) is required", param="tokens")
        prompt = prompt_token_ids(state, tokens) if tokens else []
        return jsonify({"prompt": state.tokenizer.decode(prompt, skip_special_tokens=False)})

    @app.get("/metrics")
    def metrics() -> Response:
        payload, content_type = render_metrics(collector)
        return Response(payload, content_type=content_type)

    _register_error_handlers(app)
    return app


def _json_body() -> Any:
    raw = request.get_data(cache=False)
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {e}") from e


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _probe():
    return disconnect_probe(request.environ.get("gunicorn.socket"))


def _render_chat(state: ApiState, body: Body) -> str:
    kwargs = dict(body.get("chat_template_kwargs", "dict", {}))
    if body.has("chat_template"):
        kwargs["chat_template"] = body.get("chat_template", "str")
    try:
        return state.tokenizer.render_chat(parse_messages(body), body.get("add_generation_prompt", "bool", True),
                                           **kwargs)
    except ValueError as e:
        raise bad_request(str(e), param="messages") from e


def _max_model_len(state: ApiState) -> int | None:
    try:
        return state.max_model_len()
    except BrokerError:
        return state.tokenizer.max_position_embeddings


def _engine_summary(state: ApiState) -> str:
    """Every registered engine's state and liveness, to explain a 503."""
    try:
        engines = state.registry.all_engines()
    except Exception as e:  # noqa: BLE001 - only an explanation
        return f"unknown ({type(e).__name__})"
    return ", ".join(f"{e['engine_id']}={e.get('state')}{'' if e['alive'] else ' (no heartbeat)'}"
                     for e in engines) or "none"


def _status(code: int, status: str, engines: int) -> Response:
    headers = {"Retry-After": "1"} if code == 503 else {}
    return _respond(Answer(code, {"status": status, "ready_engines": engines}, headers=headers))


def _version() -> str:
    try:
        return metadata.version("redserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def _respond(answer: Answer) -> Response:
    """The HTTP response for a handler's `Answer`: its body as JSON, or its chunks as server-sent events."""
    if answer.chunks is not None:
        response = Response(sse_body(answer.chunks, answer.named_events), mimetype="text/event-stream",
                            headers=SSE_HEADERS)
    else:
        response = jsonify(answer.body)
    response.status_code = answer.status
    for name, value in answer.headers.items():
        response.headers[name] = value
    return response


def sse_body(chunks: Generator[Chunk | ApiError, None, None], named_events: bool = False) -> Iterator[str]:
    """One ``data:`` event per chunk (an ApiError as OpenAI's error event), then ``data: [DONE]``; nothing
    more once the client has gone. Closing this closes the chunks (which aborts the request).

    With `named_events` (/v1/responses) each chunk's event is named by its ``type`` and there is no
    ``[DONE]``."""
    try:
        for chunk in chunks:
            if isinstance(chunk, ApiError):
                yield sse_error(chunk, named_events)
            else:
                name = f"event: {chunk['type']}\n" if named_events else ""
                yield f"{name}data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"
        if not named_events:
            yield DONE
    except ClientDisconnected as e:
        logger.info("request %s: client disconnected; aborted", e)
    finally:
        chunks.close()


def _error_response(error: ApiError) -> Response:
    return _respond(Answer.error(error))


def _request_line() -> str:
    """The method and path of the current request, escaped for a log line."""
    return f"{printable(request.method, limit=20)} {printable(request.path)}"


def _register_error_handlers(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def api_error(e: ApiError) -> Response:
        logger.debug("%s -> %d %s", _request_line(), e.status, printable(e.message, limit=500))
        return _error_response(e)

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException) -> Response:
        message = f"{e.name}: {request.method} {request.path}" if e.code in (404, 405) else f"{e.name}: {e.description}"
        headers = {k: v for k, v in e.get_headers() if k.lower() == "allow"}
        return _error_response(ApiError(e.code or 500, message, headers=headers))

    @app.errorhandler(ClientDisconnected)
    def client_gone(e: ClientDisconnected) -> Response:
        logger.info("request %s: client disconnected; aborted", e)
        return Response(status=499)

    @app.errorhandler(Exception)
    def unexpected(e: Exception) -> Response:
        logger.exception("unhandled error on %s", _request_line())
        return _error_response(ApiError(500, f"internal server error ({type(e).__name__}); see the server log"))
