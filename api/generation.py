"""One API request's generation: submit its prompts to the broker, turn engine outputs into text deltas.

Rules:
- One `AddRequest` per prompt (ids ``{request_id}`` for one prompt, ``{request_id}-{p}`` for several);
  the engine expands n > 1. Its params are `SamplingParams.to_engine_dict()`: stop strings stay here. Choice index = prompt index * n + sequence index (OpenAI's order).
- Iterating yields `ChoiceOutput` deltas: text made final by the incremental detokenizer, after stop
  strings, with the tokens (and logprob entries) that produced it. Each choice ends with exactly one
  delta carrying its finish_reason (a `FinishReason`: stop, length, or abort if the engine cut it).
- The token that made the engine stop (EOS or one of stop_token_ids) counts as a completion token
  but is not detokenized, unless include_stop_str_in_output (vLLM's rule).
- A stop string finishes its choice at once (finish_reason "stop", stop_reason = the string). The
  engine is told to stop that sequence alone while other choices of the request still run (an
  ABORT with its index), and to ABORT the request once every choice has finished.
- A failed request (`RequestOutput.error_code`) raises `GenerationError` (its `ErrorCode` and message);
  `is_disconnected()` (checked every `poll_interval` s) returning True raises `ClientDisconnected`.
  Both abort everything; the metrics' failure label is the `ErrorCode` (client_disconnected for the latter).
- `close()` aborts whatever still runs and records the request's metrics; call it in a `finally`
  (or use `with`). completion_tokens counts the tokens consumed, up to a stop string's last token.
- cached_tokens counts the prompt tokens the engine read from its prefix cache instead of computing them
  (`RequestOutput.num_cached_tokens`), each prompt once as prompt_tokens does: with n > 1 the lowest count
  of its sequences (the first one computes the prompt, the others are admitted onto its cached blocks). A
  sequence's count is the one on its first output (a resumed sequence's engine counts from a prompt that
  holds the tokens already delivered).
- A request whose engine dies is resumed on another one by the broker client (`broker.client.migration`)
  behind the same handle: its outputs just go on (no token twice, same index), so the detokenizer, the stop
  strings and the counts here carry on across the move with nothing to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from api.detokenizer import Decoder, IncrementalDetokenizer
from api.stop_strings import StopStringMatcher
from broker.client.request_handle import RequestHandle
from protocol.messages import AddRequest, ErrorCode, FinishReason, RequestOutput, make_error
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


@dataclass
class ChoiceOutput:
    """One choice's output: what one engine output added to it (a delta, as `Generation` yields), or
    the deltas joined by `add` (a non-streamed choice)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list | None = None  # the engine's entries for prompt tokens 1.. (first delta only)

    def add(self, delta: ChoiceOutput) -> None:
        """Append a later delta of the same choice."""
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


class _Sequence:
    """Detokenizer + stop strings of one choice."""

    def __init__(self, index: int, tokenizer: Decoder, prompt_ids: list[int], params: SamplingParams) -> None:
        self.index = index
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.show_stop_token = params.include_stop_str_in_output
        self.num_tokens = 0
        self.num_cached_tokens: int | None = None  # from the first engine output
        self.finish_reason: str | None = None
        self.engine_done = False
        self.abort_sent = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, out: RequestOutput) -> ChoiceOutput | None:
        if self.num_cached_tokens is None:
            self.num_cached_tokens = out.num_cached_tokens
        delta = ChoiceOutput(self.index, logprobs=[] if out.logprobs else None, prompt_logprobs=out.prompt_logprobs)
        tokens = out.new_token_ids
        hide_stop_token = out.finish_reason is FinishReason.STOP and not self.show_stop_token
        shown = len(tokens) - 1 if hide_stop_token else len(tokens)
        for k, token in enumerate(tokens):
            self.num_tokens += 1
            delta.token_ids.append(token)
            if out.logprobs:
                delta.logprobs.append(out.logprobs[k])
            if k >= shown:
                break  # the EOS / stop token that ended the sequence: counted, not shown (as vLLM)
            piece, stop = self.stops.feed(self.detok.add([token]))
            delta.text += piece
            if stop is not None:
                return self._finish(delta, FinishReason.STOP, stop)
        if out.finish_reason is not None:
            self.engine_done = True
            piece, stop = self.stops.feed(self.detok.flush())
            delta.text += piece
            if stop is not None:
                return self._finish(delta, FinishReason.STOP, stop)
            delta.text += self.stops.flush()
            return self._finish(delta, out.finish_reason, out.stop_reason)
        return delta if delta.text or delta.token_ids else None

    def cut(self, reason: str) -> ChoiceOutput:
        """Finish without an engine output (the request ended under us)."""
        return self._finish(ChoiceOutput(self.index), reason, None)

    def _finish(self, delta: ChoiceOutput, reason: str, stop_reason: int | str | None) -> ChoiceOutput:
        self.finish_reason = reason
        delta.finish_reason, delta.stop_reason = reason, stop_reason
        return delta


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
        self._seqs = [[_Sequence(p * sp.n + i, tokenizer, ids, sp) for i in range(sp.n)]
                      for p, (ids, sp) in enumerate(zip(prompts, self.params, strict=True))]
        self._handles: list[RequestHandle] = []
        self._error: ErrorCode | None = None
        self._closed = False

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(s.num_tokens for seqs in self._seqs for s in seqs)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens read from the engines' prefix cache, each prompt counted once (see the rules)."""
        total = 0
        for ids, seqs in zip(self.prompts, self._seqs, strict=True):
            counts = [s.num_cached_tokens for s in seqs if s.num_cached_tokens is not None]
            total += min(max(min(counts), 0), len(ids)) if counts else 0
        return total

    def start(self) -> Generation:
        """Submit every prompt (broker errors propagate; what was submitted is aborted)."""
        try:
            for p, (ids, params) in enumerate(zip(self.prompts, self.params, strict=True)):
                rid = prompt_request_id(self.request_id, p, len(self.prompts))
                add = AddRequest(rid, "", ids, params.to_engine_dict(), time.time(), self._deadline)
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
        seqs = self._seqs[p]
        if 0 <= out.index < len(seqs) and not seqs[out.index].finished:
            delta = seqs[out.index].apply(out)
            if delta is not None:
                if delta.token_ids and self._recorder is not None:
                    self._recorder.on_tokens(delta.index, len(delta.token_ids))
                yield delta
        handle = active[p]
        seq = seqs[out.index] if 0 <= out.index < len(seqs) else None
        if seq is not None and seq.finished and not seq.engine_done and not seq.abort_sent:
            seq.abort_sent = True
            if not all(s.finished for s in seqs):
                handle.abort_sequence(out.index)  # a stop string ended it; the other choices go on
        if all(s.finished for s in seqs):
            if not all(s.engine_done for s in seqs):
                handle.abort()
            del active[p]
        elif handle.finished:
            for s in seqs:
                if not s.finished:
                    yield s.cut(FinishReason.ABORT)
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
            seqs = [s for group in self._seqs for s in group]
            error: str | None = self._error
            if error is None and not all(s.finished for s in seqs):
                error = FinishReason.ABORT
            reasons = [s.finish_reason for s in seqs if s.finish_reason is not None]
            self._recorder.on_finish(self.prompt_tokens, self.completion_tokens, reasons, error)

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
