"""One API request's generation: submit its prompts to the broker, turn engine outputs into text deltas.

Rules:
- One `AddRequest` per prompt (ids ``{request_id}`` for one prompt, ``{request_id}-{p}`` for several);
  the engine expands n > 1. Its params are the prompt's `SamplingParams` as built here (typed, never a dict);
  their stop strings stay here (they never go on the wire). Choice index = prompt index * n + sequence index
  (OpenAI's order).
- Iterating yields the `ChoiceOutput` deltas of the output processor (`protocol.output_processor`, shared with
  the offline `LLM`: incremental detokenizer, stop strings, finish reasons, which tokens are shown and
  counted). Each choice ends with exactly one delta carrying its finish_reason (stop, length, or abort if
  the engine cut it). A stop string finishes its choice at once; the engine is told to stop that sequence
  alone while other choices of the request still run (an ABORT with its index), and to ABORT the request
  once every choice has finished.
- A failed request (`RequestOutput.error_code`) raises `GenerationError` (its `ErrorCode` and message);
  `is_disconnected()` (checked every `poll_interval` s) returning True raises `ClientDisconnected`.
  Both abort everything; the metrics' failure label is the `ErrorCode` (client_disconnected for the latter).
- `close()` aborts whatever still runs and records the request's metrics; call it in a `finally`
  (or use `with`). completion_tokens counts the tokens consumed, up to a stop string's last token.
- cached_tokens counts the prompt tokens the engine read from its prefix cache instead of computing them
  (`RequestOutput.num_cached_tokens`), each prompt once as prompt_tokens does (the processor's rule). A
  resumed sequence's engine counts from a prompt that holds the tokens already delivered: its first output's
  count stands.
- A request whose engine dies is resumed on another one by the broker client (`broker.client.migration`)
  behind the same handle: its outputs just go on (no token twice, same index), so the detokenizer, the stop
  strings and the counts here carry on across the move with nothing to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol

from broker.client.request_handle import RequestHandle
from protocol.detokenizer import Decoder
from protocol.messages import AddRequest, ErrorCode, FinishReason, RequestOutput, make_error
from protocol.output_processor import ChoiceOutput, PromptOutputs
from protocol.request_ids import prompt_request_id
from protocol.sampling_params import SamplingParams


class GenerationError(Exception):
    """The request failed in the engine or the broker: `code` says why, `message` is for humans."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(make_error(code, message))
        self.code = code
        self.message = message


class ClientDisconnected(Exception):
    """The HTTP client went away; the request was aborted."""


class Submitter(Protocol):
    def submit(self, add: AddRequest) -> RequestHandle: ...


class Recorder(Protocol):
    def on_tokens(self, choice: int, count: int) -> None: ...
    def on_finish(self, prompt_tokens: int, completion_tokens: int, reasons: list[str], error: str | None) -> None: ...


class Generation:
    """Runs one API request's prompts; see the module rules."""

    def __init__(self, submitter: Submitter, tokenizer: Decoder, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams], request_id: str, *,
                 deadline: float | None = None, recorder: Recorder | None = None,
                 is_disconnected: Callable[[], bool] = lambda: False, poll_interval: float = 0.25) -> None:
        self.request_id = request_id
        self.prompts = prompts
        self.params = params if isinstance(params, list) else [params] * len(prompts)
        if len(self.params) != len(prompts) or len({p.n for p in self.params}) > 1:
            raise ValueError("give one SamplingParams, or one per prompt, all with the same n")
        self._submitter = submitter
        self._deadline = deadline
        self._recorder = recorder
        self._is_disconnected = is_disconnected
        self._poll_interval = poll_interval
        self._outputs = [PromptOutputs(p * sp.n, tokenizer, ids, sp)
                         for p, (ids, sp) in enumerate(zip(prompts, self.params, strict=True))]
        self._handles: list[RequestHandle] = []
        self._error: ErrorCode | None = None
        self._closed = False

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(outputs.completion_tokens for outputs in self._outputs)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens read from the engines' prefix cache, each prompt counted once (see the rules)."""
        return sum(outputs.cached_tokens for outputs in self._outputs)

    def start(self) -> Generation:
        """Submit every prompt (broker errors propagate; what was submitted is aborted)."""
        try:
            for p, (ids, params) in enumerate(zip(self.prompts, self.params, strict=True)):
                rid = prompt_request_id(self.request_id, p, len(self.prompts))
                add = AddRequest(rid, "", ids, params, time.time(), self._deadline)
                self._handles.append(self._submitter.submit(add))
        except BaseException:
            self.close()
            raise
        return self

    def __iter__(self) -> Iterator[ChoiceOutput]:
        active = dict(enumerate(self._handles))
        next_check = time.monotonic() + self._poll_interval
        while active:
            got = self._next_output(active)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self._poll_interval
                if self._is_disconnected():
                    self._error = ErrorCode.CLIENT_DISCONNECTED
                    self.close()
                    raise ClientDisconnected(self.request_id)
            if got is None:
                continue
            p, out = got
            if out.error_code is not None:
                self._error = out.error_code
                self.close()
                raise GenerationError(out.error_code, out.error_message or "")
            yield from self._apply(p, out, active)

    def _apply(self, p: int, out: RequestOutput, active: dict[int, RequestHandle]) -> Iterator[ChoiceOutput]:
        outputs, handle = self._outputs[p], active[p]
        processed = outputs.apply(out)
        if processed.delta is not None:
            if processed.delta.token_ids and self._recorder is not None:
                self._recorder.on_tokens(processed.delta.index, len(processed.delta.token_ids))
            yield processed.delta
        if processed.abort_sequence is not None:
            handle.abort_sequence(processed.abort_sequence)
        if outputs.finished:
            if processed.abort_request:
                handle.abort()
            del active[p]
        elif handle.finished:
            yield from outputs.cut(FinishReason.ABORT)
            del active[p]

    def _next_output(self, active: dict[int, RequestHandle]) -> tuple[int, RequestOutput] | None:
        if len(active) == 1:
            (p, handle), = active.items()
            out = handle.get(timeout=self._poll_interval)
            return None if out is None else (p, out)
        end = time.monotonic() + self._poll_interval
        nap = 0.0005
        while True:
            for p, handle in active.items():
                out = handle.get(timeout=0)
                if out is not None:
                    return p, out
            if time.monotonic() >= end:
                return None
            time.sleep(nap)
            nap = min(nap * 2, 0.01)

    def close(self) -> None:
        """Abort what still runs and record the metrics; idempotent."""
        if self._closed:
            return
        self._closed = True
        for handle in self._handles:
            handle.close()
        if self._recorder is not None:
            error: str | None = self._error
            if error is None and not all(outputs.finished for outputs in self._outputs):
                error = FinishReason.ABORT
            reasons = [reason for outputs in self._outputs for reason in outputs.finish_reasons]
            self._recorder.on_finish(self.prompt_tokens, self.completion_tokens, reasons, error)

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
