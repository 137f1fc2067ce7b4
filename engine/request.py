"""A request as the scheduler sees it: tokens, progress through them, its KV blocks, its status."""

from __future__ import annotations

import enum
import time

from protocol.messages import FinishReason
from protocol.sampling_params import SamplingParams


class RequestStatus(enum.StrEnum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # its prefix is being loaded from the KV tier (engine.kv_tier)
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_HANDOFF = "finished_handoff"  # its first token sampled, it goes on on another engine (no finish reason)

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
             RequestStatus.FINISHED_HANDOFF}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """One sequence being generated (a child of an n > 1 request is its own ``Request``).

    ``num_computed_tokens`` counts tokens whose KV is in the cache; the next step computes from there.
    All tokens (prompt + output) are in ``token_ids``; the last output token's KV is computed next step.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, parent_id: str | None = None, index: int = 0):
        self.request_id = request_id
        self.parent_id = parent_id or request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []
        self.num_cached_blocks = 0
        self.num_blocks_sent = 0
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.grammar = None  # llguidance LLMatcher of a structured-output sequence (engine.structured_output)
        self.num_in_flight_steps = 0  # submitted steps that hold this request and whose output is not back yet
        self.num_in_flight_tokens = 0  # the tokens those steps compute
        self.handoff = False  # prefill only: ends after its first token, continued elsewhere (engine.core)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
