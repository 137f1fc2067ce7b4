"""The continuation of a started request (`broker.client.request_resume`) and the migration limit
(`broker.client.migration.migration_blocker`): pure functions, no Redis."""

from __future__ import annotations

import pytest

from broker.client.mailbox import Mailbox
from broker.client.migration import migration_blocker
from broker.client.request_resume import (
    continuation_adds,
    continuation_params,
    continuation_seed,
    handoff_blocker,
    resume_blocker,
)
from protocol.messages import AddRequest
from protocol.sampling_params import SamplingParams


def _add(**params) -> AddRequest:
    return AddRequest("cmpl-1", "client-a", [1, 2, 3], SamplingParams(**params), 100.0, 200.0)


def test_a_greedy_sequence_continues_with_its_tokens_as_prompt_and_the_remaining_budget() -> None:
    add = _add(temperature=0, max_tokens=10, min_tokens=4, stop_token_ids=[7], ignore_eos=True, logprobs=2,
               prompt_logprobs=1, repetition_penalty=1.3)
    adds = continuation_adds(add, {0: [11, 12, 13]}, [0], migration=1)
    ((rid, (index, cont)),) = adds.items()
    assert (rid, index) == ("cmpl-1~m1", 0)
    assert cont.prompt_token_ids == [1, 2, 3, 11, 12, 13]
    assert (cont.client_id, cont.arrival_time, cont.deadline) == ("client-a", 100.0, 200.0)
    params = cont.params
    assert type(params) is SamplingParams
    assert (params.max_tokens, params.min_tokens, params.n) == (7, 1, 1)
    assert (params.stop_token_ids, params.ignore_eos, params.logprobs) == ([7], True, 2)
    assert params.prompt_logprobs is None and params.seed is None and params.repetition_penalty == 1.3


def test_min_tokens_never_goes_below_zero_and_no_max_tokens_stays_unbounded() -> None:
    params = continuation_params(SamplingParams(max_tokens=None, min_tokens=2), 0, 5)
    assert (params.max_tokens, params.min_tokens) == (None, 0)


def test_a_sequence_without_budget_left_cannot_continue() -> None:
    with pytest.raises(ValueError, match="already delivered 4 of its 4"):
        continuation_params(SamplingParams(max_tokens=4), 0, 4)


def test_each_running_sequence_of_n_continues_on_its_own_with_its_own_tokens() -> None:
    add = _add(n=3, max_tokens=8, seed=42, temperature=0.8)
    adds = continuation_adds(add, {0: [5, 6], 2: [9]}, [0, 2], migration=2)
    assert list(adds) == ["cmpl-1~m2.0", "cmpl-1~m2.2"]
    first, third = adds["cmpl-1~m2.0"], adds["cmpl-1~m2.2"]
    assert (first[0], first[1].prompt_token_ids, first[1].params.max_tokens) == (0, [1, 2, 3, 5, 6], 6)
    assert (third[0], third[1].prompt_token_ids, third[1].params.max_tokens) == (2, [1, 2, 3, 9], 7)
    # the engine seeded child i with seed + i; the continuation derives from that and the tokens delivered
    assert first[1].params.seed == continuation_seed(42, 2)
    assert third[1].params.seed == continuation_seed(44, 1)
    assert all(a.params.n == 1 for _, a in adds.values())


def test_the_continuation_seed_is_deterministic_distinct_and_a_signed_64_bit_int() -> None:
    assert continuation_seed(7, 3) == continuation_seed(7, 3)
    seeds = {continuation_seed(s, d) for s in range(4) for d in range(1, 50)}
    assert len(seeds) == 4 * 49
    assert continuation_seed(7, 0) == 7
    for seed in (2**63 - 1, -(2**63), 0):
        assert -(2**63) <= continuation_seed(seed, 123_456) < 2**63
    assert continuation_seed(1, 1) == 1 + 0x9E3779B97F4A7C15 - 2**64


def test_requests_whose_state_a_prompt_cannot_carry_are_not_resumed() -> None:
    assert resume_blocker(SamplingParams(temperature=0)) is None
    assert resume_blocker(SamplingParams(repetition_penalty=1.5)) is None
    assert "grammar" in resume_blocker(SamplingParams(structured_output={"kind": "regex", "value": "a+"}))
    assert "penalties" in resume_blocker(SamplingParams(presence_penalty=0.5))
    assert "penalties" in resume_blocker(SamplingParams(frequency_penalty=-0.5))


def test_only_a_single_multi_token_resumable_request_is_split_between_prefill_and_decode() -> None:
    assert handoff_blocker(SamplingParams(max_tokens=8)) is None
    assert handoff_blocker(SamplingParams(n=2)) == "n > 1"
    assert "one token" in handoff_blocker(SamplingParams(max_tokens=1))
    assert "grammar" in handoff_blocker(SamplingParams(structured_output={"kind": "json_object"}))
    assert "penalties" in handoff_blocker(SamplingParams(presence_penalty=0.5))


def test_a_request_moves_at_most_max_migrations_times() -> None:
    mb = Mailbox(add=_add(temperature=0), engine_id="0", incarnation="x", n=1)
    assert migration_blocker(mb, max_migrations=2) is None
    mb.migrations = 2
    assert "moved 2 time(s)" in migration_blocker(mb, max_migrations=2)
    off = migration_blocker(Mailbox(add=_add(), engine_id="0", incarnation="x", n=1), max_migrations=0)
    assert off == "resuming is off (--max-migrations 0)"


def test_a_mailbox_routes_its_own_id_until_it_moves() -> None:
    mb = Mailbox(add=_add(n=2), engine_id="0", incarnation="x", n=2)
    assert mb.routes == {"cmpl-1": None} and mb.wire_id(1) == ("cmpl-1", 1)
    mb.routes = {"cmpl-1~m1.0": 0, "cmpl-1~m1.1": 1}
    assert mb.wire_id(1) == ("cmpl-1~m1.1", 0)
    mb.finished_indices.add(0)
    mb.abandoned.add(1)
    assert mb.running == []
