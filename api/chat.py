"""POST /v1/chat/completions.

Rules:
- `messages` are rendered with the model's chat template (``add_generation_prompt`` true unless
  the body says otherwise; ``chat_template_kwargs`` are passed to the template), then tokenized
  without adding special tokens (the template writes them).
- `logprobs: true` (+ `top_logprobs` N) gives OpenAI's chat logprobs (`logprobs.content`).
- Streaming: first a chunk per choice with ``delta: {"role": "assistant", "content": ""}``, then
  content deltas, each choice's last chunk carrying its finish_reason; `stream_options.include_usage`
  adds a last chunk with empty choices and the usage.
- Tools (`api.tools`): with tool_choice other than "none", each choice's text is read for tool calls
  (the server's parser for "auto", the constrained JSON for "required" / a named function). Found
  calls become the message's `tool_calls` (ids ``call_<hex>``, arguments a JSON string), the rest of
  the text its `content` (null when empty), and finish_reason "tool_calls". Streamed, content
  before any call marker is sent as it comes; from a marker (or a forced choice's first token) on,
  the text is held back until the choice finishes (calls are only known whole), then sent in
  OpenAI's delta format: the rest of the content, then per call one delta with index, id, type and
  function.name (arguments ""), one with its arguments, and the finish_reason.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from flask import Response, jsonify

from api.errors import bad_request
from api.generation import SequenceDelta
from api.logprobs import chat_logprobs
from api.protocol import ChatRequest, parse_chat_request
from api.serving import (
    ChoiceResult,
    Run,
    admit,
    check_model,
    collect,
    context_length,
    fit_params,
    prefetched,
    prompt_token_ids,
    sse_response,
    sse_stream,
    start_run,
    token_namer,
    usage,
)
from api.state import ApiState
from api.tool_parsers import ExtractedToolCalls
from api.tools import check_auto_allowed, tool_call_dicts


def create_chat_completion(state: ApiState, data: Any, is_disconnected: Callable[[], bool]) -> Response:
    """Answer one /v1/chat/completions body (ApiError for bad input; see the module rules)."""
    request = parse_chat_request(data)
    check_model(state, request.model)
    check_auto_allowed(request.tools, state.config.tool_call_parser, state.config.enable_auto_tool_choice)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    with admit(state, 1, request.params.n) as slots:
        max_model_len = context_length(state)
        prompt = render_prompt(state, request, max_model_len)
        params = fit_params(state, [prompt], request.params, max_model_len)
        run = start_run(state, [prompt], params, request_id, is_disconnected, slots)
    view = _ChatView(state, request, run, request_id)
    if request.stream:
        return sse_response(sse_stream(run, view.role_chunks(), prefetched(run), view.chunk, view.usage_chunks))
    return jsonify(view.response(collect(run)))


def render_prompt(state: ApiState, request: ChatRequest, max_model_len: int | None = None) -> list[int]:
    """The prompt token ids of a chat request (ApiError 400 if the template cannot render it, or if the
    text cannot fit `max_model_len`: see `prompt_token_ids`)."""
    try:
        text = state.tokenizer.render_chat(request.messages, request.add_generation_prompt, request.tools.tools,
                                           **request.chat_template_kwargs)
    except ValueError as e:
        raise bad_request(str(e), param="messages") from e
    return prompt_token_ids(state, text, add_special_tokens=False, max_model_len=max_model_len)


class _ChatView:
    """Renders one chat request's choices, chunks and usage."""

    def __init__(self, state: ApiState, request: ChatRequest, run: Run, request_id: str) -> None:
        self.state = state
        self.request = request
        self.run = run
        self.id = request_id
        self.created = int(time.time())
        self._token_name = token_namer(state, request.return_tokens_as_token_ids)
        self._parses_tools = request.tools.choice != "none"
        self._held_text: dict[int, str] = {}
        self._sent_chars: dict[int, int] = {}

    def _logprobs(self, token_ids: list[int], entries: list | None) -> dict[str, Any] | None:
        if not self.request.logprobs:
            return None
        content = chat_logprobs(self._token_name, token_ids, entries, self.request.top_logprobs)
        return {"content": content}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.state.config.model_name,
                "choices": choices}

    def _tool_calls(self, text: str) -> ExtractedToolCalls:
        if not self._parses_tools:
            return ExtractedToolCalls(text)
        return self.request.tools.extract(text, self.state.config.tool_call_parser)

    def response(self, results: list[ChoiceResult]) -> dict[str, Any]:
        choices = []
        for r in results:
            found = self._tool_calls(r.text)
            message: dict[str, Any] = {"role": "assistant", "content": found.content if found.calls else r.text}
            if found.calls:
                message["tool_calls"] = tool_call_dicts(found.calls)
            choices.append({"index": r.index, "message": message, "logprobs": self._logprobs(r.token_ids, r.logprobs),
                            "finish_reason": "tool_calls" if found.calls else r.finish_reason,
                            "stop_reason": r.stop_reason})
        return {**self._envelope("chat.completion", choices), "usage": usage(self.run)}

    def role_chunks(self) -> list[dict[str, Any]]:
        return [self._envelope("chat.completion.chunk", [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            for i in range(self.request.params.n)]

    def chunk(self, delta: SequenceDelta) -> list[dict[str, Any]]:
        if self._parses_tools:
            return self._tool_chunks(delta)
        if not delta.text and delta.finish_reason is None and not self.request.logprobs:
            return []
        choice = {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                  "logprobs": self._logprobs(delta.token_ids, delta.logprobs) if delta.token_ids else None,
                  "finish_reason": delta.finish_reason}
        if delta.finish_reason is not None:
            choice["stop_reason"] = delta.stop_reason
        return [self._envelope("chat.completion.chunk", [choice])]

    def _tool_chunks(self, delta: SequenceDelta) -> list[dict[str, Any]]:
        """Hold the text back until the choice finishes; then its content and tool-call deltas."""
        text = self._held_text.get(delta.index, "") + delta.text
        self._held_text[delta.index] = text
        sent = self._sent_chars.get(delta.index, 0)
        logprobs = self._logprobs(delta.token_ids, delta.logprobs) if delta.token_ids else None
        if delta.finish_reason is None:
            ready = max(sent, self.request.tools.content_prefix(text, self.state.config.tool_call_parser))
            self._sent_chars[delta.index] = ready
            if ready == sent and not self.request.logprobs:
                return []
            return [self._envelope("chat.completion.chunk", [
                {"index": delta.index, "delta": {"content": text[sent:ready]} if ready > sent else {},
                 "logprobs": logprobs, "finish_reason": None}])]
        found = self._tool_calls(text)
        if not found.calls:
            content = text[sent:]
        elif found.content and found.content.startswith(text[:sent]):
            content = found.content[sent:]
        else:
            content = None if sent else found.content
        deltas: list[dict[str, Any]] = [{"content": content}] if content else []
        for i, call in enumerate(tool_call_dicts(found.calls)):
            name = {"name": call["function"]["name"], "arguments": ""}
            deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function", "function": name}]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]})
        chunks = [self._envelope("chat.completion.chunk", [
            {"index": delta.index, "delta": d, "logprobs": None, "finish_reason": None}]) for d in deltas]
        last = {"index": delta.index, "delta": {}, "logprobs": logprobs,
                "finish_reason": "tool_calls" if found.calls else delta.finish_reason, "stop_reason": delta.stop_reason}
        return [*chunks, self._envelope("chat.completion.chunk", [last])]

    def usage_chunks(self) -> list[dict[str, Any]]:
        if not self.request.include_usage:
            return []
        return [{**self._envelope("chat.completion.chunk", []), "usage": usage(self.run)}]
