"""The data that crosses from the scheduler to the workers each step, and back.

A new request travels in full once (``NewRequestData``); after that a step carries only small diffs
(``CachedRequestData``: new block ids, computed-token count). Each type is declared once as a wire
record (``protocol.wire_schema``): the multiproc executor ships it over the shm queue as a msgpack array
in field order, trailing defaults left out. The peers are the engine and its own TP workers, so
decoding unpacks by position without type checks (``trusted=True``), as fast as the hand-written code was.
``NewRequestData.sampling`` is the request's ``SamplingParams`` itself (a nested ``by_name`` record: the engine
fields that differ from their defaults), built once by the API and checked once by the engine: never a dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.sampling_params import SamplingParams
from protocol.wire_schema import wire

_record = wire(array=True, trusted=True)


@_record
@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@_record
@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed_from_preemption: bool = False


@_record
@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: list[str] = field(default_factory=list)
    grammar_bitmasks: dict[str, bytes] = field(default_factory=dict)  # req_id -> token mask (structured output)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@_record
@dataclass
class SampledToken:
    """One sampled token; ``logprobs`` is ``[sampled_logprob, rank, top_ids, top_logprobs]`` when asked.

    ``prompt_logprobs`` (only on the first token of a request that asked for them) has one entry of
    that shape per prompt token after the first: the logprob of prompt token i+1 given tokens 0..i.
    """

    token_id: int
    logprobs: list | None = None
    prompt_logprobs: list | None = None


@_record
@dataclass
class ModelRunnerOutput:
    """Tokens sampled this step, only for requests whose scheduled chunk reached their last token."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)


def scheduler_output_to_wire(sched: SchedulerOutput) -> list[Any]:
    """What the shm queue carries for a step (msgpack-able lists, ints, strs, bytes)."""
    return sched.to_wire()


def scheduler_output_from_wire(data: Any) -> SchedulerOutput:
    """Raises protocol.errors.MessageError if ``data`` is not a scheduler output."""
    return SchedulerOutput.from_wire(data)


def runner_output_to_wire(out: ModelRunnerOutput) -> list[Any]:
    return out.to_wire()


def runner_output_from_wire(data: Any) -> ModelRunnerOutput:
    """Raises protocol.errors.MessageError if ``data`` is not a model runner output."""
    return ModelRunnerOutput.from_wire(data)
