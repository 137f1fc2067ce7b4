"""EngineCore / LLM limits and request validation on the tiny llama model: max_model_len, bad prompts,
duplicate ids, and requests that once made the engine hang."""

from __future__ import annotations

import pytest
from engine_helpers import (
    GREEDY,
    PROMPTS,
    VOCAB,
    assert_all_blocks_free,
    drive,
    greedy,
    hf_greedy,
    make_llm,
    random_prompt,
)

from engine import SamplingParams


def test_max_model_len(llama_dir: str) -> None:
    llm = make_llm(llama_dir, max_model_len=64)
    assert llm.engine.max_model_len == 64
    out = llm.generate([random_prompt(50, seed=107)], greedy(100))[0].outputs[0]
    assert len(out.token_ids) == 14 and out.finish_reason == "length"
    out = llm.generate([random_prompt(63, seed=108)], greedy(100))[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="64"):
        llm.generate([random_prompt(64, seed=109)], greedy())
    assert not llm.engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


def test_invalid_prompts_are_rejected(llama_dir: str) -> None:
    llm = make_llm(llama_dir)
    core = llm.engine
    for bad in ([5, VOCAB], [5, -1], [VOCAB + 100]):
        with pytest.raises(ValueError, match="out of range"):
            core.add_request("bad", bad, GREEDY)
    with pytest.raises(ValueError):
        core.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, VOCAB]], GREEDY)
    assert not core.has_unfinished_requests() and core.scheduler.num_waiting == 0
    core.add_request("dup", PROMPTS[1], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        core.add_request("dup", PROMPTS[1], GREEDY)
    tokens, _ = drive(core, {})
    assert tokens["dup"] == hf_greedy(llama_dir, PROMPTS[1])


# --- limits that once made requests hang ---------------------------------------------------------------------


def _finishes_or_is_rejected(make, prompt: list[int], params: SamplingParams) -> None:
    """The engine must either refuse (ValueError, at construction or add_request) or finish the request;
    looping forever with the request stuck in the waiting queue is the bug."""
    try:
        llm = make()
        drive(llm.engine, {0: [("r", prompt, params)]}, max_steps=300)
    except ValueError:
        return


def test_request_larger_than_kv_pool_does_not_hang(llama_dir: str) -> None:
    _finishes_or_is_rejected(lambda: make_llm(llama_dir, num_kv_blocks=2), PROMPTS[3], greedy(30))


def test_prompt_over_budget_without_chunked_prefill_does_not_hang(llama_dir: str) -> None:
    _finishes_or_is_rejected(
        lambda: make_llm(llama_dir, max_num_batched_tokens=32, enable_chunked_prefill=False), PROMPTS[4], GREEDY)


def test_out_of_vocab_stop_token_is_rejected(llama_dir: str) -> None:
    llm = make_llm(llama_dir)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.engine.add_request("bad", [5, 6], SamplingParams(min_tokens=2, stop_token_ids=[10**6]))
    assert not llm.engine.has_unfinished_requests()


def test_abort_one_sequence_of_n(llama_dir: str) -> None:
    llm = make_llm(llama_dir)
    core = llm.engine
    core.add_request("r", PROMPTS[2], greedy(12, n=2))
    core.step()
    core.step()
    outs = core.abort_sequence("r", 0)
    assert [(o.request_id, o.index, o.finish_reason) for o in outs] == [("r", 0, "abort")]
    assert core.abort_sequence("r", 0) == []
    tokens = []
    while core.has_unfinished_requests():
        for out in core.step():
            assert out.index == 1
            tokens += out.new_token_ids
    assert len(tokens) >= 10
    assert_all_blocks_free(llm)
