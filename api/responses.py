"""POST /v1/responses: OpenAI's Responses API, served by the chat path.

Rules:
- The body (`api.responses_protocol`) runs as a chat request: the same chat template, admission,
  sampling, structured output and tool calls (`api.chat.start_chat_run`); only the answer differs.
- The answer is a `response` object (id ``resp_<hex>``) echoing the request's settings (instructions,
  max_output_tokens, the temperature and top_p in force, text, tools, tool_choice, parallel_tool_calls,
  user, metadata) with `store` false and `previous_response_id` null (the server stores nothing).
- Its `output`: a `message` item (``msg_<hex>``, role assistant, one `output_text` part) holding the text,
  and one `function_call` item (``fc_<hex>``, call_id ``call_<hex>``, arguments the JSON the model wrote)
  per call found as the chat endpoint finds them (a forced tool_choice's grammar, or the server's parser
  for "auto"). Text before the calls comes first; no message item when there is no text besides calls;
  an empty message when there is neither.
- `status` "completed", or "incomplete" with ``incomplete_details: {"reason": "max_output_tokens"}`` when
  max_output_tokens (or the context) cut the output; the item that was cut is "incomplete" too.
- `usage`: input_tokens, output_tokens, total_tokens; input_tokens_details.cached_tokens the prompt tokens
  the engine read from its prefix cache (`api.serving.usage`); cache_write_tokens and reasoning_tokens are
  0 (not counted; no reasoning models).
- Streaming: named events (`api.answer`), numbered by `sequence_number` from 0: response.created and
  response.in_progress (the response so far), then per output item response.output_item.added, for a
  message response.content_part.added, response.output_text.delta as text comes,
  response.output_text.done and response.content_part.done, for a call
  response.function_call_arguments.delta as the arguments are written and .done, then
  response.output_item.done; last response.completed (or response.incomplete) with the whole response.
  One item is open at a time. As chat's streamed tool calls: text before any call marker goes out as it
  comes, calls as they are written, and a streamed call is never taken back (cut short, it ends
  "incomplete" as far as it went, where the non-streamed answer shows the text as the message).
  An error after the stream began is one ``error`` event, and the stream ends.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable, Generator
from typing import Any

from api.answer import Answer, Chunk
from api.chat import start_chat_run
from api.errors import ApiError, error_event
from api.responses_protocol import ResponsesRequest, parse_responses_request, responses_field_names
from api.serving import Run, chunk_stream, collect, prefetched, usage
from api.state import ApiState
from api.tool_parsers import ExtractedToolCalls, PartialCall
from protocol.output_processor import ChoiceOutput


def create_response(state: ApiState, data: Any, is_disconnected: Callable[[], bool]) -> Answer:
    """The answer to one /v1/responses body: a response object or its stream's events (ApiError for bad
    input; see the module rules)."""
    request = parse_responses_request(data)
    response_id = f"resp_{uuid.uuid4().hex}"
    with responses_field_names():
        run, _ = start_chat_run(state, request.chat, response_id, is_disconnected)
    view = _ResponseView(state, request, run, response_id)
    if request.chat.stream:
        events = chunk_stream(run, view.opening_events(), prefetched(run), view.delta_events, view.closing_events)
        return Answer(chunks=view.numbered_errors(events), named_events=True)
    [result] = collect(run)
    return Answer(body=view.response(result))


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_output_text(text)]
    return {"type": "message", "id": _item_id("msg"), "status": status, "role": "assistant", "content": content}


def _call_item(name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": _item_id("fc"), "call_id": f"call_{uuid.uuid4().hex[:24]}",
            "name": name, "arguments": arguments, "status": status}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class _ResponseView:
    """Renders one Responses request's answer: the response object, or its stream's events."""

    def __init__(self, state: ApiState, request: ResponsesRequest, run: Run, response_id: str) -> None:
        self.state = state
        self.request = request
        self.run = run
        self.id = response_id
        self.created_at = int(time.time())
        self._parser = state.config.tool_call_parser
        self._sequence = 0
        self._text = ""  # the whole output so far
        self._sent = 0  # characters of it sent as message text
        self._finish_reason: str | None = None
        self._output: list[dict[str, Any]] = []  # the items so far, the open one last
        self._open: dict[str, Any] | None = None
        self._calls: list[dict[str, Any]] = []  # the function_call items streamed

    # ------------------------------------------------------------------ the response object

    def _response(self, status: str, output: list[dict[str, Any]],
                  token_usage: dict[str, Any] | None) -> dict[str, Any]:
        request, params = self.request, self.request.chat.params
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
                "model": self.state.config.model_name, "output": output,
                "parallel_tool_calls": request.chat.tools.parallel, "previous_response_id": None, "reasoning": None,
                "store": False, "temperature": params.temperature, "text": request.text,
                "tool_choice": request.tool_choice, "tools": request.tools, "top_p": params.top_p,
                "truncation": "disabled", "usage": token_usage, "user": request.chat.user, "metadata": request.metadata}

    def _usage(self) -> dict[str, Any]:
        counts = usage(self.run)
        return {"input_tokens": counts["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": 0},
                "output_tokens": counts["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": counts["total_tokens"]}

    def _found(self, text: str) -> ExtractedToolCalls:
        """The calls and the text of an output (all text with tool_choice "none")."""
        return self.request.chat.tools.extract(text, self._parser)

    def response(self, result: ChoiceOutput) -> dict[str, Any]:
        """The non-streamed answer (see the rules)."""
        status = _status(result.finish_reason)
        found = self._found(result.text)
        text = found.content if found.calls else result.text
        output = [_message_item(text or "", status)] if text or not found.calls else []
        output += [_call_item(call.name, call.arguments, "completed") for call in found.calls]
        return self._response(status, output, self._usage())

    # ------------------------------------------------------------------ stream events

    def _event(self, kind: str, **fields: Any) -> Chunk:
        event = {"type": kind, **fields, "sequence_number": self._sequence}
        self._sequence += 1
        return event

    def numbered_errors(self, chunks: Generator[Chunk | ApiError, None, None]) -> Generator[Chunk, None, None]:
        """The stream's events, a late ApiError as the stream's numbered ``error`` event; closing this closes
        `chunks` (which aborts the request)."""
        try:
            for chunk in chunks:
                yield self._event("error", **error_event(chunk)) if isinstance(chunk, ApiError) else chunk
        finally:
            chunks.close()

    def opening_events(self) -> list[Chunk]:
        return [self._event(kind, response=self._response("in_progress", [], None))
                for kind in ("response.created", "response.in_progress")]

    def delta_events(self, delta: ChoiceOutput) -> list[Chunk]:
        """Text up to any call marker as it comes, then the calls as they are written (the end: `closing_events`)."""
        self._text += delta.text
        if delta.finish_reason is not None:
            self._finish_reason = delta.finish_reason
            return []
        if not delta.text:
            return []
        tools, events = self.request.chat.tools, []
        if not self._calls:
            ready = tools.content_prefix(self._text, self._parser)
            if ready > self._sent:
                events += self._text_events(self._text[self._sent:ready])
                self._sent = ready
        return events + self._call_events(tools.partial_calls(self._text, self._parser))

    def closing_events(self) -> list[Chunk]:
        """What the whole output adds to what was streamed, the last item closed, then the whole response."""
        text, sent, streamed = self._text, self._sent, bool(self._calls)
        found = self._found(text)
        if not found.calls:
            content = None if streamed else text[sent:]  # a call cut short stays as far as it was streamed
            calls = self.request.chat.tools.partial_calls(text, self._parser) if streamed else []
        else:
            calls = [PartialCall(call.name, call.arguments) for call in found.calls]
            if found.content and found.content.startswith(text[:sent]):
                content = found.content[sent:]
            else:
                content = None if sent else found.content
        events = [] if streamed or not content else self._text_events(content)
        events += self._call_events(calls)
        if streamed and content:
            events += self._text_events(content)
        status = _status(self._finish_reason)
        events += self._close_open_item(status)
        if not self._output:  # neither text nor a call: an empty message, as the non-streamed answer
            events += self._text_events("") + self._close_open_item(status)
        response = self._response(status, copy.deepcopy(self._output), self._usage())
        return [*events, self._event(f"response.{status}", response=response)]

    def _output_index(self) -> int:
        return len(self._output) - 1

    def _open_item(self, item: dict[str, Any]) -> list[Chunk]:
        events = self._close_open_item("completed")
        self._output.append(item)
        self._open = item
        return [*events, self._event("response.output_item.added", output_index=self._output_index(),
                                     item=copy.deepcopy(item))]

    def _text_events(self, piece: str) -> list[Chunk]:
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self._open_item(_message_item(None, "in_progress"))
            self._open["content"].append(_output_text(""))
            events.append(self._event("response.content_part.added", item_id=self._open["id"],
                                      output_index=self._output_index(), content_index=0,
                                      part=_output_text("")))
        part = self._open["content"][0]
        part["text"] += piece
        if piece:
            events.append(self._event("response.output_text.delta", item_id=self._open["id"],
                                      output_index=self._output_index(), content_index=0, delta=piece, logprobs=[]))
        return events

    def _call_events(self, calls: list[PartialCall]) -> list[Chunk]:
        """The events for what `calls` add to the calls streamed: a new call's item once its name is
        known, then its arguments in pieces (only the open call grows)."""
        events: list[Chunk] = []
        for i, call in enumerate(calls):
            if i == len(self._calls):
                if call.name is None:
                    break
                item = _call_item(call.name, "", "in_progress")
                events += self._open_item(item)
                self._calls.append(item)
            item, arguments = self._calls[i], call.arguments or ""
            if item is self._open and len(arguments) > len(item["arguments"]) \
                    and arguments.startswith(item["arguments"]):
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self._output_index(),
                                          delta=arguments[len(item["arguments"]):]))
                item["arguments"] = arguments
        return events

    def _close_open_item(self, status: str) -> list[Chunk]:
        item, self._open = self._open, None
        if item is None:
            return []
        index, events = self._output.index(item), []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=copy.deepcopy(part)))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"]))
        item["status"] = status
        return [*events, self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]
