"""POST /v1/completions (OpenAI's legacy completions, with vLLM's extra sampling fields).

Rules:
- `prompt`: a string, an array of strings, an array of token ids or an array of token-id arrays.
  Each prompt is its own engine request; choice index = prompt index * n + sample index.
- `echo` prepends the prompt text to each choice (streaming: in a first chunk per choice).
- `logprobs` N: OpenAI's completions logprobs (tokens, token_logprobs, top_logprobs, text_offset);
  with echo the prompt tokens come first with the engine's prompt logprobs (the first one null, as
  OpenAI). Streamed, the echo chunk then waits for the choice's first engine output.
- `echo` with `max_tokens` 0 answers the prompt alone: the one token generated is dropped (as vLLM).
- vLLM's `prompt_logprobs` K in the body adds `prompt_logprobs` to each (non-streamed) choice:
  ``[None, {token_id: {logprob, rank, decoded_token}}, ...]`` with the prompt token and the top-K.
- vLLM's `return_token_ids` adds to each choice `prompt_token_ids` (its prompt's ids) and `token_ids` (the
  ids it generated, an EOS or stop token included); streamed, each chunk's `token_ids` are the ids it adds
  (no delta is skipped then, even one that adds no text) and a choice's first chunk carries the prompt's.
- Streaming chunks are ``text_completion`` objects; `stream_options.include_usage` adds a last
  chunk with empty choices and the usage. Every choice ends with a chunk carrying finish_reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from api.answer import Answer
from api.logprobs import CompletionLogprobs, vllm_prompt_logprobs
from api.protocol import CompletionRequest, fit_params, parse_completion_request
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
from protocol.output_processor import ChoiceOutput
from protocol.request_ids import new_request_id


def create_completion(state: ApiState, data: Any, is_disconnected: Callable[[], bool]) -> Answer:
    """The answer to one /v1/completions body: a JSON body or stream chunks (ApiError for bad input; see the
    module rules)."""
    request = parse_completion_request(data)
    check_model(state, request.model)
    request_id = new_request_id("cmpl")
    with admit(state, len(request.prompts), request.params.n) as slots:
        max_model_len = context_length(state)
        prompts = [prompt_token_ids(state, p, max_model_len=max_model_len) for p in request.prompts]
        params = fit_params(request.params, [len(ids) for ids in prompts], max_model_len, state.tokenizer.vocab_size)
        run = start_run(state, prompts, params, request_id, is_disconnected, slots)
    view = _CompletionView(state, request, run, prompts, request_id)
    if request.stream:
        return Answer(chunks=chunk_stream(run, view.echo_chunks(), prefetched(run), view.chunk, view.usage_chunks))
    return Answer(body=view.response(collect(run)))


class _CompletionView:
    """Renders one completion request's choices, chunks and usage."""

    def __init__(self, state: ApiState, request: CompletionRequest, run: Run, prompts: list[list[int]],
                 request_id: str) -> None:
        self.state = state
        self.request = request
        self.run = run
        self.prompts = prompts
        self.id = request_id
        self.created = int(time.time())
        self.n = request.params.n
        self.want_logprobs = request.logprobs is not None
        self._logprobs: dict[int, CompletionLogprobs] = {}
        self._echoed: set[int] = set()
        self._prompt_ids_sent: set[int] = set()
        self._token_name = token_namer(state, request.return_tokens_as_token_ids)

    def _prompt_text(self, p: int) -> str:
        prompt = self.request.prompts[p]
        return prompt if isinstance(prompt, str) else self.state.tokenizer.decode(self.prompts[p])

    def _builder(self, index: int) -> CompletionLogprobs:
        if index not in self._logprobs:
            self._logprobs[index] = CompletionLogprobs(self._token_name)
        return self._logprobs[index]

    def _echo(self, index: int, prompt_logprobs: list | None = None) -> tuple[str, dict | None]:
        p = index // self.n
        self._echoed.add(index)
        text = self._prompt_text(p)
        logprobs = self._builder(index).add_prompt(self.prompts[p], prompt_logprobs) if self.want_logprobs else None
        return text, logprobs

    def _choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                stop_reason: int | str | None, token_ids: list[int] | None = None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
        if self.request.return_token_ids:
            if index not in self._prompt_ids_sent:  # the choice's first chunk (or its whole answer)
                self._prompt_ids_sent.add(index)
                choice["prompt_token_ids"] = self.prompts[index // self.n]
            choice["token_ids"] = token_ids or []
        return choice

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.state.config.model_name, "choices": choices}

    def response(self, results: list[ChoiceOutput]) -> dict[str, Any]:
        choices = []
        for result in results:
            text, logprobs = self._echo(result.index, result.prompt_logprobs) if self.request.echo else ("", None)
            if self.request.echo_only:
                result.text, result.token_ids, result.logprobs = "", [], None
            if self.want_logprobs:
                self._builder(result.index).add(result.token_ids, result.logprobs)
                logprobs = self._builder(result.index).total
            choice = self._choice(result.index, text + result.text, logprobs, result.finish_reason,
                                  result.stop_reason, result.token_ids)
            if self.request.show_prompt_logprobs:
                p = result.index // self.n
                choice["prompt_logprobs"] = vllm_prompt_logprobs(self._token_name, self.prompts[p],
                                                                 result.prompt_logprobs)
            choices.append(choice)
        return {**self._envelope(choices), "usage": usage(self.run)}

    def echo_chunks(self) -> list[dict[str, Any]]:
        if not self.request.echo or self.want_logprobs:
            return []  # with logprobs, the echo waits for the prompt logprobs (`chunk`)
        return [self._envelope([self._choice(i, *self._echo(i), None, None)])
                for i in range(self.n * len(self.prompts))]

    def chunk(self, delta: ChoiceOutput) -> list[dict[str, Any]]:
        head = []
        if self.request.echo and delta.index not in self._echoed:
            head = [self._envelope([self._choice(delta.index, *self._echo(delta.index, delta.prompt_logprobs),
                                                 None, None)])]
        if self.request.echo_only:
            delta.text, delta.token_ids, delta.logprobs = "", [], None
            if delta.finish_reason is None:
                return head
        if not delta.text and delta.finish_reason is None and not self.want_logprobs \
                and not self.request.return_token_ids:
            return head
        logprobs = self._builder(delta.index).add(delta.token_ids, delta.logprobs) if self.want_logprobs else None
        return head + [self._envelope([self._choice(delta.index, delta.text, logprobs, delta.finish_reason,
                                                    delta.stop_reason, delta.token_ids)])]

    def usage_chunks(self) -> list[dict[str, Any]]:
        if not self.request.include_usage:
            return []
        return [{**self._envelope([]), "usage": usage(self.run)}]
