"""A scheduler over a fake model for the scheduler tests (tests/test_scheduler.py, tests/test_scheduler_stops.py):
a block manager of BS-token blocks, EOS as the only EOS token, and a step that samples FILLER where a chunk ends."""

from __future__ import annotations

from collections.abc import Callable

from engine.block_manager import BlockManager
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerConfig, TokenUpdate
from protocol.sampling_params import SamplingParams
from protocol.step_types import ModelRunnerOutput, SampledToken, SchedulerOutput

BS = 4
EOS = 1
FILLER = 7  # the fake model's default token: neither EOS nor a stop token


def make_scheduler(num_blocks: int = 64, budget: int = 32, max_num_seqs: int = 8, max_model_len: int = 256,
                   chunked: bool = True, prefix: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, chunked),
                     BlockManager(num_blocks, BS, prefix), [EOS])


def make_request(rid: str, n: int, start: int = 100, **params) -> Request:
    params.setdefault("max_tokens", 16)
    return Request(rid, list(range(start, start + n)), SamplingParams(**params))


def step(s: Scheduler, token: Callable[[Request], int] = lambda r: FILLER
         ) -> tuple[SchedulerOutput, list[TokenUpdate]]:
    """One schedule + fake execute + update; a token is sampled where the chunk reaches the last token."""
    out = s.schedule()
    sampled = {}
    for rid, n in out.num_scheduled_tokens.items():
        r = s.requests[rid]
        assert 1 <= n <= r.num_tokens - r.num_computed_tokens
        if r.num_computed_tokens + n == r.num_tokens:
            sampled[rid] = SampledToken(token(r))
    return out, s.update_from_output(out, ModelRunnerOutput(sampled))


def run_to_completion(s: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return outs
        outs.append(step(s)[0])
    raise AssertionError("scheduler did not finish")
