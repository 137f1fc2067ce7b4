"""The data that crosses from the scheduler to the workers each step, and back.

A new request travels in full once (``NewRequestData``); after that a step carries only small diffs
(``CachedRequestData``: new block ids, computed-token count). Plain dataclasses of ints, lists and
dicts so the multiproc executor can ship them over the shm queue with msgpack.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: dict[str, Any]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed_from_preemption: bool = False


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class SampledToken:
    """One sampled token; ``logprobs`` is ``[sampled_logprob, rank, top_ids, top_logprobs]`` when asked."""

    token_id: int
    logprobs: list | None = None


@dataclass
class ModelRunnerOutput:
    """Tokens sampled this step, only for requests whose scheduled chunk reached their last token."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)
