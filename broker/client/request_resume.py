"""Resuming a started request on another engine: which requests may move, and the ADDs that continue them.

When the engine of a request that already produced tokens is declared gone, the client sends each
sequence that is still running to a live engine as a new request whose prompt is the original prompt
plus the tokens already delivered for that sequence. The new engine continues the sequence; the caller
sees one stream (the in-flight table, `broker.client.in_flight`, routes the new outputs into the same mailbox).

Rules:
- One continuation per running sequence, always n=1: sequence i of an n > 1 request continues as its
  own request, id ``{original}~m{k}.{i}`` (``{original}~m{k}`` when n = 1; `protocol.request_ids`), k = the migration number.
- Remaining budget: `max_tokens` - delivered (the sequence has not finished, so at least 1 is left);
  `min_tokens` - delivered (not below 0). Every other engine parameter is kept, so stop token ids,
  ignore_eos, logprobs and the sampling filters act as before; `prompt_logprobs` is dropped (they
  were sent with the first token and the new prompt is not the caller's).
- Seeds: greedy sequences need none (they resume token for token). A seeded sequence continues with
  `continuation_seed(child_seed, delivered)` where child_seed is the seed the engine used for that
  sequence (`SamplingParams.for_child`: seed + index) and delivered the number of tokens it had
  produced: child_seed + delivered * 0x9E3779B97F4A7C15 (the 64-bit golden ratio), wrapped into the
  signed 64-bit range. The same request killed at the same point resumes the same way, and the
  continuation's random stream does not repeat the first engine's. Unseeded sequences stay unseeded.
- Not resumable (the request fails with engine_gone, as before): requests with a grammar
  (`structured_output`: the new engine would restart the grammar at the continuation's first token)
  and with presence or frequency penalties (they count generated tokens, and the delivered ones would
  become prompt). `repetition_penalty` counts prompt and output alike, so it resumes exactly.
- Everything here reads and builds typed `SamplingParams` (the request's own, as the API built it): no dicts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from protocol.messages import AddRequest
from protocol.request_ids import continuation_id
from protocol.sampling_params import SamplingParams

_GOLDEN_64 = 0x9E3779B97F4A7C15
_INT64_MIN = -(2**63)


def continuation_seed(child_seed: int, delivered: int) -> int:
    """The seed a seeded sequence continues with after `delivered` tokens (see the module rules)."""
    return (child_seed + delivered * _GOLDEN_64 - _INT64_MIN) % 2**64 + _INT64_MIN


def resume_blocker(params: SamplingParams) -> str | None:
    """Why a request with these params cannot be resumed elsewhere, or None if it can."""
    if params.structured_output:
        return "it is constrained by a grammar"
    if params.presence_penalty or params.frequency_penalty:
        return "presence/frequency penalties count the tokens it generated"
    return None


def handoff_blocker(params: SamplingParams) -> str | None:
    """Why a new request with these params is not split between a prefill and a decode engine, or None."""
    if params.n > 1:
        return "n > 1"
    if params.max_tokens == 1:
        return "one token: its prefill engine finishes it"
    return resume_blocker(params)


def continuation_params(params: SamplingParams, index: int, delivered: int) -> SamplingParams:
    """Params of sequence `index` continuing after `delivered` tokens (n = 1)."""
    sp = params.for_child(index)
    max_tokens = None if sp.max_tokens is None else sp.max_tokens - delivered
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"sequence {index} already delivered {delivered} of its {sp.max_tokens} tokens")
    seed = None if sp.seed is None else continuation_seed(sp.seed, delivered)
    resumed = dataclasses.replace(sp, max_tokens=max_tokens, min_tokens=max(0, sp.min_tokens - delivered),
                                  seed=seed, prompt_logprobs=None)
    return resumed


def continuation_adds(add: AddRequest, delivered: Mapping[int, list[int]], running: list[int],
                      migration: int) -> dict[str, tuple[int, AddRequest]]:
    """The ADDs that continue the `running` sequences of `add`: continuation id -> (index, AddRequest).

    `delivered` holds each sequence's tokens so far (by index); `migration` numbers this move (1, 2, ...).
    """
    n = add.params.n
    adds = {}
    for index in running:
        tokens = delivered.get(index, [])
        rid = continuation_id(add.request_id, migration, index, n)
        adds[rid] = (index, AddRequest(rid, add.client_id, [*add.prompt_token_ids, *tokens],
                                       continuation_params(add.params, index, len(tokens)),
                                       add.arrival_time, add.deadline))
    return adds
