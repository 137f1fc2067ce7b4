"""Unit tests for engine.scheduler's stop rules with a fake model: EOS, stop tokens, min/max tokens,
max_model_len, grammars."""

from __future__ import annotations

import pytest

from engine.request import Request, RequestStatus
from tests.scheduler_helpers import EOS, make_request, make_scheduler, run_to_completion, step


def _finish_with(tokens: list[int], **params) -> Request:
    s = make_scheduler()
    req = make_request("r", 5, **params)
    s.add_request(req)
    feed = iter(tokens)
    while s.has_unfinished():
        step(s, lambda r: next(feed))
    assert s.block_manager.num_free_blocks == 64
    return req


def test_stop_on_eos() -> None:
    req = _finish_with([9, EOS, 9])
    assert req.status == RequestStatus.FINISHED_STOPPED and req.status.finish_reason == "stop"
    assert req.output_token_ids == [9, EOS] and req.stop_reason is None


def test_ignore_eos() -> None:
    req = _finish_with([EOS] * 5, ignore_eos=True, max_tokens=5)
    assert req.status == RequestStatus.FINISHED_LENGTH and req.output_token_ids == [EOS] * 5


def test_stop_token_ids() -> None:
    req = _finish_with([9, 9, 42, 9], stop_token_ids=[42])
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == [9, 9, 42] and req.stop_reason == 42


def test_min_tokens_suppresses_stops() -> None:
    req = _finish_with([EOS, 42, 9, 42], stop_token_ids=[42], min_tokens=3)
    assert req.output_token_ids == [EOS, 42, 9, 42]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 42


def test_max_tokens() -> None:
    req = _finish_with([9] * 3, max_tokens=3)
    assert req.status == RequestStatus.FINISHED_LENGTH and req.status.finish_reason == "length"
    assert req.num_output_tokens == 3


def test_max_model_len() -> None:
    s = make_scheduler(max_model_len=12)
    with pytest.raises(ValueError):
        s.add_request(make_request("too_long", 12))
    req = make_request("r", 9, max_tokens=100)
    s.add_request(req)
    run_to_completion(s)
    assert req.num_tokens == 12 and req.num_output_tokens == 3
    assert req.status == RequestStatus.FINISHED_LENGTH


class _FailingMatcher:
    """A structured-output matcher that rejects every token (llguidance's LLMatcher interface)."""

    def consume_token(self, token_id: int) -> bool:
        return False

    def is_error(self) -> bool:
        return True

    def get_error(self) -> str:
        return "rejected"


def test_a_failed_grammar_stops_the_request() -> None:
    s = make_scheduler()
    req = make_request("g", 4)
    req.grammar = _FailingMatcher()
    s.add_request(req)
    _, updates = step(s)
    assert updates[0].finished and req.status == RequestStatus.FINISHED_STOPPED


class _CompleteMatcher:
    """A matcher whose grammar is complete: it takes every token and only EOS may follow."""

    def __init__(self) -> None:
        self.consumed: list[int] = []

    def consume_token(self, token_id: int) -> bool:
        self.consumed.append(token_id)
        return True

    def is_error(self) -> bool:
        return False

    def is_stopped(self) -> bool:
        return True


def test_eos_ends_a_complete_grammar_even_with_ignore_eos() -> None:
    s = make_scheduler()
    req = make_request("g", 4, ignore_eos=True)
    req.grammar = _CompleteMatcher()
    s.add_request(req)
    feed = iter([9, EOS, 9])
    while s.has_unfinished():
        step(s, lambda r: next(feed))
    assert req.output_token_ids == [9, EOS] and req.grammar.consumed == [9, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_a_stop_token_at_exactly_min_tokens_stops() -> None:
    req = _finish_with([EOS, 42, 9], stop_token_ids=[42], min_tokens=2)
    assert req.output_token_ids == [EOS, 42] and req.stop_reason == 42
