"""protocol/request_ids.py: each form of a request id, and that they nest without ambiguity."""

from __future__ import annotations

import pytest

from protocol.request_ids import continuation_id, new_request_id, prompt_request_id, sequence_id


def test_api_ids_are_fresh_and_prefixed() -> None:
    chat, other = new_request_id("chatcmpl"), new_request_id("chatcmpl")
    assert chat.startswith("chatcmpl-") and chat != other and len(chat) == len("chatcmpl-") + 32
    assert new_request_id("cmpl").startswith("cmpl-")
    with pytest.raises(ValueError, match="kind"):
        new_request_id("resp")


def test_one_prompt_one_sequence_keep_the_id() -> None:
    assert prompt_request_id("cmpl-ab", 0, 1) == "cmpl-ab"
    assert sequence_id("cmpl-ab", 0, 1) == "cmpl-ab"
    assert continuation_id("cmpl-ab", 2, 0, 1) == "cmpl-ab~m2"


def test_the_forms_nest_in_order() -> None:
    prompt = prompt_request_id("cmpl-ab", 1, 3)
    assert prompt == "cmpl-ab-1"
    assert sequence_id(prompt, 2, 4) == "cmpl-ab-1#2"
    assert continuation_id(prompt, 2, 0, 4) == "cmpl-ab-1~m2.0"
    ids = {continuation_id(prompt_request_id("cmpl-ab", p, 2), k, i, 2) for p in range(2) for k in range(3) for i in range(2)}
    assert len(ids) == 12  # distinct for every (prompt, continuation, sequence)
