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
    grammar_bitmasks: dict[str, bytes] = field(default_factory=dict)  # req_id -> token mask (structured output)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class SampledToken:
    """One sampled token; ``logprobs`` is ``[sampled_logprob, rank, top_ids, top_logprobs]`` when asked.

    ``prompt_logprobs`` (only on the first token of a request that asked for them) has one entry of
    that shape per prompt token after the first: the logprob of prompt token i+1 given tokens 0..i.
    """

    token_id: int
    logprobs: list | None = None
    prompt_logprobs: list | None = None


@dataclass
class ModelRunnerOutput:
    """Tokens sampled this step, only for requests whose scheduled chunk reached their last token."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)


def scheduler_output_to_wire(sched: SchedulerOutput) -> dict[str, Any]:
    """Plain dict of ints, strs and lists for the shm queue (msgpack)."""
    return {
        "new": [[n.req_id, n.prompt_token_ids, n.output_token_ids, n.sampling, n.block_ids, n.num_computed_tokens]
                for n in sched.new_requests],
        "cached": [[c.req_id, c.new_block_ids, c.num_computed_tokens, c.resumed_from_preemption]
                   for c in sched.cached_requests],
        "scheduled": sched.num_scheduled_tokens,
        "finished": sched.finished_req_ids,
        "grammar": sched.grammar_bitmasks,
    }


def scheduler_output_from_wire(data: dict[str, Any]) -> SchedulerOutput:
    return SchedulerOutput(
        new_requests=[NewRequestData(*n) for n in data["new"]],
        cached_requests=[CachedRequestData(*c) for c in data["cached"]],
        num_scheduled_tokens=dict(data["scheduled"]),
        finished_req_ids=list(data["finished"]),
        grammar_bitmasks=dict(data.get("grammar") or {}),
    )


def runner_output_to_wire(out: ModelRunnerOutput) -> dict[str, Any]:
    return {req_id: [t.token_id, t.logprobs] + ([] if t.prompt_logprobs is None else [t.prompt_logprobs])
            for req_id, t in out.sampled.items()}


def runner_output_from_wire(data: dict[str, Any]) -> ModelRunnerOutput:
    return ModelRunnerOutput({req_id: SampledToken(*t[:3]) for req_id, t in data.items()})
