"""The output processor: one engine request's token outputs turned into each choice's text, the same for the
API (`api/generation.py`) and the offline `LLM` (`engine/llm.py`), as vLLM's one `OutputProcessor`.

Rules:
- `PromptOutputs` holds the n sequences of one prompt (one engine request; choice index = first index +
  sequence index) and `apply(out)` takes each engine output of it in order. Each `SequenceOutput` runs its own
  incremental detokenizer (`protocol.detokenizer`, with the prompt's tail as context) and stop strings
  (`protocol.stop_strings`, searched over the new text and the held-back tail only, never the whole text).
- `apply` returns a `Processed`: the `ChoiceOutput` delta (text made final, the tokens and logprob entries that
  produced it; None when an output adds nothing), and what the caller must tell the engine: `abort_sequence`,
  a sequence a stop string ended while other choices still run; `abort_request`, once every choice has
  finished and the engine still runs some. Outputs of a finished sequence (or an unknown index) are ignored.
- Each choice ends with exactly one delta carrying its finish_reason: the engine's (stop, length, abort), or
  "stop" with stop_reason = the string when a stop string matched; `cut` finishes the others when the request
  ended under them.
- The token that made the engine stop (EOS or one of stop_token_ids) counts as a completion token but is not
  detokenized, unless include_stop_str_in_output (vLLM's rule). completion_tokens counts the tokens consumed,
  up to a stop string's last token.
- cached_tokens counts the prompt tokens read from the prefix cache once: the lowest count of the sequences
  (the first one computes the prompt, the others are admitted onto its cached blocks), each sequence's count
  the one on its first output.
- Finish reasons are the engine's `FinishReason`; engine outputs are the wire's `RequestOutput`
  (`protocol.messages`).
- Pure Python, no torch: anything with ``decode(ids, skip_special_tokens=bool) -> str`` is a tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from protocol.detokenizer import Decoder, IncrementalDetokenizer
from protocol.messages import FinishReason
from protocol.messages import RequestOutput as EngineOutput
from protocol.sampling_params import SamplingParams
from protocol.stop_strings import StopStringMatcher

STOP = FinishReason.STOP  # the engine's stop (EOS, stop token, grammar) and a matched stop string


@dataclass
class ChoiceOutput:
    """One choice's output: what one engine output added to it (a delta, as `PromptOutputs.apply` gives), or
    the deltas joined by `add` (a whole choice)."""

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


@dataclass
class Processed:
    """What one engine output did; see the module rules."""

    delta: ChoiceOutput | None = None
    abort_sequence: int | None = None
    abort_request: bool = False


class SequenceOutput:
    """Detokenizer + stop strings of one choice."""

    def __init__(self, index: int, tokenizer: Decoder, prompt_ids: Sequence[int], params: SamplingParams) -> None:
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

    def apply(self, out: EngineOutput) -> ChoiceOutput | None:
        if self.num_cached_tokens is None:
            self.num_cached_tokens = out.num_cached_tokens
        delta = ChoiceOutput(self.index, logprobs=[] if out.logprobs else None, prompt_logprobs=out.prompt_logprobs)
        tokens = out.new_token_ids
        hide_stop_token = out.finish_reason == STOP and not self.show_stop_token
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
                return self._finish(delta, STOP, stop)
        if out.finish_reason is not None:
            self.engine_done = True
            piece, stop = self.stops.feed(self.detok.flush())
            delta.text += piece
            if stop is not None:
                return self._finish(delta, STOP, stop)
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


class PromptOutputs:
    """The n choices of one prompt (one engine request); see the module rules."""

    def __init__(self, first_index: int, tokenizer: Decoder, prompt_ids: Sequence[int],
                 params: SamplingParams) -> None:
        self.prompt_len = len(prompt_ids)
        self.sequences = [SequenceOutput(first_index + i, tokenizer, prompt_ids, params) for i in range(params.n)]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    @property
    def completion_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    @property
    def cached_tokens(self) -> int:
        counts = [s.num_cached_tokens for s in self.sequences if s.num_cached_tokens is not None]
        return min(max(min(counts), 0), self.prompt_len) if counts else 0

    @property
    def finish_reasons(self) -> list[str]:
        return [s.finish_reason for s in self.sequences if s.finish_reason is not None]

    def apply(self, out: EngineOutput) -> Processed:
        if not 0 <= out.index < len(self.sequences):
            return Processed()
        seq = self.sequences[out.index]
        if seq.finished:
            return Processed()
        processed = Processed(seq.apply(out))
        if seq.finished and not seq.engine_done and not seq.abort_sent:
            seq.abort_sent = True
            if not self.finished:
                processed.abort_sequence = out.index  # a stop string ended it; the other choices go on
        processed.abort_request = self.finished and not all(s.engine_done for s in self.sequences)
        return processed

    def cut(self, reason: str) -> list[ChoiceOutput]:
        """Finish every choice still running with `reason` (the request ended under them)."""
        return [s.cut(reason) for s in self.sequences if not s.finished]
