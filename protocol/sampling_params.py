"""Sampling parameters of one request, shared by the API (validation) and the engine (sampling).

Pure Python with no torch so API processes and Celery workers can validate requests cheaply.
Invalid values raise ``ValueError`` with a message fit to show a user, starting with the field's
name (the API turns it into a 400 naming that field).

Rules:
- Bounded cost: at most `MAX_STOP_STRINGS` stop strings of `MAX_STOP_BYTES` UTF-8 bytes in all, at
  most `MAX_STOP_TOKEN_IDS` stop token ids, n <= `MAX_N`.
- Built and checked once, where the request is made (the API handler, `LLM.generate`), then carried
  as a typed field (`AddRequest.params`, `NewRequestData.sampling`) down to the sampler: never as a dict.
- On the wire it is a `by_name` record (`protocol.wire_schema`): a map of the fields that differ from
  their defaults, e.g. `{"temperature": 0.7, "max_tokens": 100}`; a missing field is its default. The
  API-only fields (`stop`, `include_stop_str_in_output`, `skip_special_tokens`, declared `off_wire`)
  are applied where text exists (the API process) and never travel: a decoded one has their defaults.
- Decoding checks each field's type, not its range: a receiver of untrusted bytes (the engine) calls
  `validate()`, which raises the same ValueError as construction. Unknown keys are ignored (the wire's
  rule), so a new field that changes what is generated must come with a version bump of `AddRequest`:
  an engine that predates it then refuses the request rather than ignoring the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from protocol.wire_schema import off_wire, wire

_GREEDY_EPSILON = 1e-5
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 4096
MAX_STOP_TOKEN_IDS = 1024
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")  # engine.structured_output


@wire(by_name=True)
@dataclass
class SamplingParams:
    """vLLM-compatible sampling parameters.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters. The ranges are
    vLLM's (`_verify_args`): top_k -1, 0 or >= 1; top_p in (0, 1]; min_p in [0, 1]; temperature >= 0;
    presence/frequency penalties in [-2, 2]; repetition_penalty > 0; seed in int64.
    ``prompt_logprobs`` (k) asks for the logprob of every prompt token after the first and the top-k
    at each prompt position; the engine computes them only for requests that ask.
    ``stop`` strings are applied where text exists (the API process, the offline ``LLM``);
    ``stop_token_ids`` and EOS are applied by the engine.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = off_wire(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = off_wire(default=False)
    skip_special_tokens: bool = off_wire(default=True)
    structured_output: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> SamplingParams:
        """Check every range (ValueError naming the field; see the class docstring) and normalize top_k -1 to 0.
        Construction calls it; a receiver calls it on a decoded one (decoding checks types only)."""
        self._check()
        if self.top_k == -1:
            self.top_k = 0
        return self

    def _check(self) -> None:
        _require(isinstance(self.n, int) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {self.n}")
        _require(0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _require(isinstance(self.top_k, int) and self.top_k >= -1,
                 f"top_k must be -1 or 0 (disable) or at least 1, got {self.top_k}")
        _require(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _require(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _require(-2.0 <= self.frequency_penalty <= 2.0,
                 f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _require(self.repetition_penalty > 0.0,
                 f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        _require(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                 f"max_tokens must be at least 1, got {self.max_tokens}")
        _require(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
                 f"min_tokens must be >= 0, got {self.min_tokens}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens,
                 f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _require(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
                 f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        _require(self.prompt_logprobs is None
                 or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
                 f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        _require(self.seed is None or (isinstance(self.seed, int) and _INT64_MIN <= self.seed <= _INT64_MAX),
                 f"seed must be an integer in the signed 64-bit range, got {self.seed!r}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        _require(len(self.stop) <= MAX_STOP_STRINGS, f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed")
        _require(sum(len(s.encode("utf-8", "surrogatepass")) for s in self.stop) <= MAX_STOP_BYTES,
                 f"stop: the stop strings may hold at most {MAX_STOP_BYTES} bytes (UTF-8) in all")
        _require(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
                 f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                 "stop_token_ids must be non-negative integers")
        _require(self.structured_output is None
                 or (isinstance(self.structured_output, dict) and self.structured_output.get("kind") in GRAMMAR_KINDS),
                 f"structured_output must be a dict whose kind is one of {list(GRAMMAR_KINDS)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def for_child(self, index: int) -> SamplingParams:
        """Parameters of the index-th of n parallel samples: n=1, and a distinct seed when seeded."""
        seed = None if self.seed is None else (self.seed + index - _INT64_MIN) % 2**64 + _INT64_MIN
        return dataclasses.replace(self, n=1, seed=seed)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
