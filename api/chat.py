"""POST /v1/chat/completions.

Rules:
- `messages` are rendered with the model's chat template (``add_generation_prompt`` true unless
  the body says otherwise; ``chat_template_kwargs`` are passed to the template), then tokenized
  without adding special tokens (the template writes them).
- `logprobs: true` (+ `top_logprobs` N) gives OpenAI's chat logprobs (`logprobs.content`).
- vLLM's `prompt_logprobs` K (non-streamed only) adds one top-level `prompt_logprobs` list for the
  rendered prompt, as vLLM: ``[None, {token_id: {logprob, rank, decoded_token}}, ...]``.
- Streaming: first a chunk per choice with ``delta: {"role": "assistant", "content": ""}``, then
  content deltas, each choice's last chunk carrying its finish_reason; `stream_options.include_usage`
  adds a last chunk with empty choices and the usage.
- Tools (`api.tools`): with tool_choice other than "none", each choice's text is read for tool calls
  (the server's parser for "auto", the constrained JSON for "required" / a named function). Found
  calls become the message's `tool_calls` (ids ``call_<hex>``, arguments a JSON string as the model
  wrote it), the rest of the text its `content` (null when empty), and finish_reason "tool_calls".
  Streamed, content before any call marker is sent as it comes; from a marker (or a forced choice's
  first token) on, the calls go out as they are written, in OpenAI's delta format: per call one delta
  with index, id, type and function.name (arguments "") once the name is written, then its arguments
  in pieces as they come (`api.tools.ToolRequest.partial_calls`); at the end, any other content and
  the finish_reason. Streamed calls cannot be taken back: a call cut short (max_tokens) ends as far as
  it went, with that finish_reason, where the non-streamed answer shows the text as content.
- vLLM's `return_token_ids` adds the rendered prompt's ids at the top (`prompt_token_ids`) and each
  choice's generated ids (`token_ids`, an EOS or stop token included). Streamed, the first chunk carries
  `prompt_token_ids` and each chunk's choice the ids it adds (on the last chunk of a delta's several, as
  logprobs); no delta is skipped then, even one that adds no text.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from api.answer import Answer
from api.errors import bad_request
from api.logprobs import chat_logprobs, vllm_prompt_logprobs
from api.protocol import ChatRequest, fit_params, parse_chat_request
from api.serving import (
    Run,
    admit,
    check_model,
    chunk_stream,
    collect,
    context_length,
    prefetched,
    prompt_token_ids,
    start_run,
    token_namer,
    usage,
)
from api.state import ApiState
from api.tool_parsers import ExtractedToolCalls, PartialCall, ToolCall
from api.tools import check_auto_allowed, tool_call_dicts
from protocol.output_processor import ChoiceOutput
from protocol.request_ids import new_request_id


def create_chat_completion(state: ApiState, data: Any, is_disconnected: Callable[[], bool]) -> Answer:
    """The answer to one /v1/chat/completions body: a JSON body or stream chunks (ApiError for bad input; see
    the module rules)."""
    request = parse_chat_request(data)
    request_id = new_request_id("chatcmpl")
    run, prompt = start_chat_run(state, request, request_id, is_disconnected)
    view = _ChatView(state, request, run, request_id, prompt)
    if request.stream:
        return Answer(chunks=chunk_stream(run, view.role_chunks(), prefetched(run), view.chunk, view.usage_chunks))
    return Answer(body=view.response(collect(run)))


def start_chat_run(state: ApiState, request: ChatRequest, request_id: str,
                   is_disconnected: Callable[[], bool]) -> tuple[Run, list[int]]:
    """Check the model and the tool choice, take the slots, render the prompt and submit it: the run and
    its prompt token ids (ApiError for what is refused; /v1/responses starts its runs here too)."""
    check_model(state, request.model)
    check_auto_allowed(request.tools, state.config.tool_call_parser, state.config.enable_auto_tool_choice)
    with admit(state, 1, request.params.n) as slots:
        max_model_len = context_length(state)
        prompt = render_prompt(state, request, max_model_len)
        params = fit_params(request.params, [len(prompt)], max_model_len, state.tokenizer.vocab_size)
        run = start_run(state, [prompt], params, request_id, is_disconnected, slots)
    return run, prompt


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

    def __init__(self, state: ApiState, request: ChatRequest, run: Run, request_id: str, prompt: list[int]) -> None:
        self.state = state
        self.request = request
        self.run = run
        self.prompt = prompt
        self.id = request_id
        self.created = int(time.time())
        self._token_name = token_namer(state, request.return_tokens_as_token_ids)
        self._parses_tools = request.tools.choice != "none"
        self._held_text: dict[int, str] = {}
        self._sent_chars: dict[int, int] = {}
        self._streamed_calls: dict[int, list[str]] = {}

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

    def response(self, results: list[ChoiceOutput]) -> dict[str, Any]:
        choices = []
        for r in results:
            found = self._tool_calls(r.text)
            message: dict[str, Any] = {"role": "assistant", "content": found.content if found.calls else r.text}
            if found.calls:
                message["tool_calls"] = tool_call_dicts(found.calls)
            choices.append(self._with_token_ids({
                "index": r.index, "message": message, "logprobs": self._logprobs(r.token_ids, r.logprobs),
                "finish_reason": "tool_calls" if found.calls else r.finish_reason, "stop_reason": r.stop_reason},
                r.token_ids))
        answer = {**self._envelope("chat.completion", choices), "usage": usage(self.run)}
        if self.request.return_token_ids:
            answer["prompt_token_ids"] = self.prompt
        if self.request.show_prompt_logprobs:  # one prompt for all the choices: the first entries that came
            entries = next((r.prompt_logprobs for r in results if r.prompt_logprobs is not None), None)
            answer["prompt_logprobs"] = vllm_prompt_logprobs(self._token_name, self.prompt, entries)
        return answer

    def _with_token_ids(self, choice: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
        if self.request.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def role_chunks(self) -> list[dict[str, Any]]:
        chunks = [self._envelope("chat.completion.chunk", [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            for i in range(self.request.params.n)]
        if self.request.return_token_ids:
            chunks[0]["prompt_token_ids"] = self.prompt
        return chunks

    def chunk(self, delta: ChoiceOutput) -> list[dict[str, Any]]:
        if self._parses_tools:
            return self._tool_chunks(delta)
        if not delta.text and delta.finish_reason is None and not self.request.logprobs \
                and not self.request.return_token_ids:
            return []
        choice = {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                  "logprobs": self._logprobs(delta.token_ids, delta.logprobs) if delta.token_ids else None,
                  "finish_reason": delta.finish_reason}
        if delta.finish_reason is not None:
            choice["stop_reason"] = delta.stop_reason
        return [self._envelope("chat.completion.chunk", [self._with_token_ids(choice, delta.token_ids)])]

    def _tool_chunks(self, delta: ChoiceOutput) -> list[dict[str, Any]]:
        """Content up to any call marker as it comes, then the calls as they are written (see the rules)."""
        text = self._held_text.get(delta.index, "") + delta.text
        self._held_text[delta.index] = text
        sent = self._sent_chars.get(delta.index, 0)
        logprobs = self._logprobs(delta.token_ids, delta.logprobs) if delta.token_ids else None
        parser = self.state.config.tool_call_parser
        if delta.finish_reason is None:
            ready = max(sent, self.request.tools.content_prefix(text, parser))
            self._sent_chars[delta.index] = ready
            deltas = [{"content": text[sent:ready]}] if ready > sent else []
            deltas += self._call_deltas(delta.index, self.request.tools.partial_calls(text, parser))
            if not deltas and not self.request.logprobs and not self.request.return_token_ids:
                return []
            return self._chunks(delta.index, deltas or [{}], logprobs, None, delta.token_ids)
        found = self._tool_calls(text)
        streamed = self._streamed_calls.get(delta.index)
        if not found.calls:
            content = None if streamed else text[sent:]  # a call cut short stays as far as it was streamed
            partial = self.request.tools.partial_calls(text, parser) if streamed else []
        elif found.content and found.content.startswith(text[:sent]):
            content, partial = found.content[sent:], [PartialCall(c.name, c.arguments) for c in found.calls]
        else:
            content = None if sent else found.content
            partial = [PartialCall(c.name, c.arguments) for c in found.calls]
        deltas = [{"content": content}] if content else []
        deltas += self._call_deltas(delta.index, partial)
        last = {"index": delta.index, "delta": {}, "logprobs": logprobs,
                "finish_reason": "tool_calls" if found.calls else delta.finish_reason, "stop_reason": delta.stop_reason}
        return [*self._chunks(delta.index, deltas, None, None, []),
                self._envelope("chat.completion.chunk", [self._with_token_ids(last, delta.token_ids)])]

    def _call_deltas(self, index: int, calls: list[PartialCall]) -> list[dict[str, Any]]:
        """OpenAI's tool-call deltas for what `calls` add to what this choice has sent: a call's index, id,
        type and name once its name is known, then its arguments in pieces."""
        streamed = self._streamed_calls.setdefault(index, [])  # [arguments sent] per call
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(calls):
            if i == len(streamed):
                if call.name is None:
                    break
                [header] = tool_call_dicts([ToolCall(call.name, "")])
                deltas.append({"tool_calls": [{"index": i, **header}]})
                streamed.append("")
            arguments = call.arguments or ""
            if len(arguments) > len(streamed[i]) and arguments.startswith(streamed[i]):
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": arguments[len(streamed[i]):]}}]})
                streamed[i] = arguments
        return deltas

    def _chunks(self, index: int, deltas: list[dict[str, Any]], logprobs: dict | None,
                finish_reason: str | None, token_ids: list[int]) -> list[dict[str, Any]]:
        """One chunk per delta; the last carries the logprobs and token ids of what they add."""
        last = len(deltas) - 1
        return [self._envelope("chat.completion.chunk", [self._with_token_ids(
            {"index": index, "delta": d, "logprobs": logprobs if k == last else None, "finish_reason": finish_reason},
            token_ids if k == last else [])]) for k, d in enumerate(deltas)]

    def usage_chunks(self) -> list[dict[str, Any]]:
        if not self.request.include_usage:
            return []
        return [{**self._envelope("chat.completion.chunk", []), "usage": usage(self.run)}]
