"""Unit tests for engine.scheduler with a fake model: budget, max_num_seqs, chunked prefill, FCFS,
preemption by recompute, aborts (the stop rules: tests/test_scheduler_stops.py)."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerConfig
from protocol.step_types import CachedRequestData, ModelRunnerOutput, SampledToken
from tests.scheduler_helpers import BS, EOS, FILLER, make_request, make_scheduler, run_to_completion, step


def test_token_budget_and_chunking_of_the_last_admitted() -> None:
    s = make_scheduler(budget=16)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 10, start=100 * (i + 1)))
    out, updates = step(s)
    assert out.num_scheduled_tokens == {"r0": 10, "r1": 6}
    assert [u.request.request_id for u in updates] == ["r0"]
    assert [r.request_id for r in s.running] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]
    out, updates = step(s)
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 4, "r2": 10}
    assert out.total_num_scheduled_tokens == 15
    assert {u.request.request_id for u in updates} == {"r0", "r1", "r2"}
    for _ in range(5):
        out, _ = step(s)
        assert out.total_num_scheduled_tokens <= 16


def test_max_num_seqs() -> None:
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 5, start=100 * (i + 1), max_tokens=3))
    out, _ = step(s)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert s.num_running == 2 and s.num_waiting == 1
    step(s)
    out, updates = step(s)  # r0 and r1 reach max_tokens=3
    assert all(u.finished for u in updates) and len(updates) == 2
    assert "r2" not in out.num_scheduled_tokens
    out, _ = step(s)
    assert set(out.num_scheduled_tokens) == {"r2"}
    assert out.finished_req_ids == ["r0", "r1"]


def test_chunked_prefill_chunks() -> None:
    s = make_scheduler(budget=8)
    req = make_request("a", 20)
    s.add_request(req)
    chunks = []
    while not req.output_token_ids:
        out, updates = step(s)
        chunks.append(out.num_scheduled_tokens["a"])
        if req.num_computed_tokens < 20:
            assert updates == []
    assert chunks == [8, 8, 4]
    assert req.num_computed_tokens == 20 and req.output_token_ids == [FILLER]
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1}


def test_new_then_cached_request_data() -> None:
    s = make_scheduler(budget=8)
    req = make_request("a", 10)
    s.add_request(req)
    out, _ = step(s)
    assert [n.req_id for n in out.new_requests] == ["a"] and out.cached_requests == []
    new = out.new_requests[0]
    assert new.prompt_token_ids == req.prompt_token_ids and new.num_computed_tokens == 0
    assert new.block_ids == req.block_ids[:2] and len(new.block_ids) == 2
    assert new.sampling is req.params and new.sampling.max_tokens == 16
    out, _ = step(s)
    assert out.new_requests == []
    assert out.cached_requests == [CachedRequestData("a", [req.block_ids[2]], 8, False)]
    out, _ = step(s)  # decode at position 10 stays in block 3: no new blocks
    assert out.cached_requests == [CachedRequestData("a", [], 10, False)]


def test_chunked_prefill_disabled_schedules_whole_prompts() -> None:
    s = make_scheduler(budget=16, chunked=False)
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 10, start=300))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 10}  # b does not fit the rest of the budget, and is not split
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 10}


def test_fcfs_by_budget_and_by_kv_blocks() -> None:
    s = make_scheduler(budget=10)
    s.add_request(make_request("r0", 8))
    s.add_request(make_request("r1", 8, start=200))
    s.add_request(make_request("r2", 2, start=300))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens.items()) == [("r0", 8), ("r1", 2)]  # r2 would fit, but waits

    s = make_scheduler(num_blocks=4, budget=64)
    s.add_request(make_request("big0", 9))  # 3 blocks
    s.add_request(make_request("big1", 9, start=200))  # 3 blocks: does not fit
    s.add_request(make_request("small", 2, start=300))  # 1 block would fit, but must not jump the queue
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["big0"]
    assert [r.request_id for r in s.waiting] == ["big1", "small"]


def _preemption_setup() -> tuple[Scheduler, Request, Request]:
    s = make_scheduler(num_blocks=4, budget=64, max_model_len=64)
    a = make_request("a", 7, max_tokens=4)
    b = make_request("b", 7, start=200, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    step(s)  # both prefilled: 2 blocks each, the pool is full
    step(s)  # decode position 7: still block 2
    assert s.block_manager.num_free_blocks == 0 and a.num_tokens == 9
    return s, a, b


def test_preemption_lifo_front_of_queue_and_recompute() -> None:
    s, a, b = _preemption_setup()
    late = make_request("late", 2, start=500, max_tokens=2)
    s.add_request(late)
    b_tokens = list(b.token_ids)
    out, _ = step(s)  # a needs a 3rd block: b (latest admitted) is preempted
    assert s.num_preemptions == 1 and b.num_preemptions == 1 and a.num_preemptions == 0
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.block_ids == []
    assert list(out.num_scheduled_tokens) == ["a"]  # nothing admitted in a step that preempted
    assert [r.request_id for r in s.waiting] == ["b", "late"]
    assert b.token_ids == b_tokens and b.output_token_ids == [FILLER, FILLER]

    outs = run_to_completion(s)
    resumed = [c for o in outs for c in o.cached_requests if c.req_id == "b" and c.resumed_from_preemption]
    assert len(resumed) == 1
    resume_step = next(o for o in outs if any(c is resumed[0] for c in o.cached_requests))
    # Recompute from its cached prefix: every token after it, outputs included.
    assert resumed[0].num_computed_tokens % BS == 0
    assert resume_step.num_scheduled_tokens["b"] == len(b_tokens) - resumed[0].num_computed_tokens
    assert len(resumed[0].new_block_ids) == -(-len(b_tokens) // BS)  # the whole new block table
    assert all(n.req_id != "b" for o in outs for n in o.new_requests)  # the runner still knows b
    first_late = next(i for i, o in enumerate(outs) if "late" in o.num_scheduled_tokens)
    first_b = next(i for i, o in enumerate(outs) if "b" in o.num_scheduled_tokens)
    assert first_b <= first_late  # the preempted request goes before later arrivals
    assert b.status == RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 4
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 4
    assert s.block_manager.num_free_blocks == 4


def test_request_that_cannot_grow_preempts_itself_when_it_is_the_latest() -> None:
    s = make_scheduler(num_blocks=5, budget=64, max_model_len=64)
    a = make_request("a", 7, max_tokens=4)
    b = make_request("b", 7, start=200, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    step(s)
    step(s)
    assert s.block_manager.num_free_blocks == 1
    out, _ = step(s)  # a takes the last block; b, the latest admitted, is its own victim
    assert out.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.block_ids == []
    assert a.status == RequestStatus.RUNNING and len(a.block_ids) == 3
    assert s.num_preemptions == 1 and [r.request_id for r in s.waiting] == ["b"]
    run_to_completion(s)
    assert a.num_output_tokens == b.num_output_tokens == 4
    assert s.block_manager.num_free_blocks == 5


def test_abort_waiting_running_and_mid_chunk() -> None:
    s = make_scheduler(budget=8)
    mid = make_request("mid", 20)
    s.add_request(mid)
    s.add_request(make_request("w", 5, start=300))
    step(s)
    assert mid.num_computed_tokens == 8 and mid.block_ids
    aborted = s.abort_requests(["mid", "w", "unknown"])
    assert [r.request_id for r in aborted] == ["mid", "w"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    assert aborted[0].status.finish_reason == "abort"
    assert s.block_manager.num_free_blocks == 64
    assert not s.has_unfinished() and s.requests == {}
    out = s.schedule()
    assert out.finished_req_ids == ["mid"]  # w never reached the runner
    assert out.is_empty
    assert s.abort_requests(["mid"]) == []  # already finished

    s = make_scheduler()
    r = make_request("r", 6)
    s.add_request(r)
    step(s)
    step(s)
    assert r.status == RequestStatus.RUNNING and r.num_output_tokens == 2
    s.abort_requests(["r"])
    assert s.block_manager.num_free_blocks == 64 and s.running == []
    assert s.schedule().finished_req_ids == ["r"]


def test_abort_preempted_request() -> None:
    s, a, b = _preemption_setup()
    step(s)
    assert b.status == RequestStatus.PREEMPTED
    s.abort_requests(["b"])
    assert b.status == RequestStatus.FINISHED_ABORTED and list(s.waiting) == []
    run_to_completion(s)
    assert s.block_manager.num_free_blocks == 4


def test_prefix_hit_sets_computed_and_cached_tokens() -> None:
    s = make_scheduler()
    a = make_request("a", 10, max_tokens=2)
    s.add_request(a)
    run_to_completion(s)
    b = make_request("b", 11, max_tokens=2)  # same first 10 tokens
    s.add_request(b)
    out, _ = step(s)
    assert b.num_cached_tokens == 8
    assert out.new_requests[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"b": 3}
    assert s.block_manager.prefix_hits == 8


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_blocks_completed_in_a_requests_last_step_stay_cached(max_tokens: int) -> None:
    """A request that finishes in the step that completed its blocks (one output token: the prefill step) still
    leaves them in the prefix cache; they were freed before being cached once (0 hits for max_tokens=1)."""
    s = make_scheduler()
    s.add_request(make_request("a", 10, max_tokens=max_tokens))
    run_to_completion(s)
    assert len(s.block_manager.hash_to_block) == 2
    b = make_request("b", 10, max_tokens=1)
    s.add_request(b)
    step(s)
    assert b.num_cached_tokens == 8 and s.block_manager.prefix_hits == 8


def test_in_flight_requests_are_neither_rescheduled_nor_preempted() -> None:
    s = make_scheduler()
    a, b = make_request("a", 6), make_request("b", 6, start=200)
    s.add_request(a)
    s.add_request(b)
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 6, "b": 6}
    assert s.schedule().is_empty  # both in flight: their next tokens depend on that step's output
    s.update_from_output(first, ModelRunnerOutput({"a": SampledToken(FILLER), "b": SampledToken(FILLER)}))
    assert s.schedule().num_scheduled_tokens == {"a": 1, "b": 1}

    s, a, b = _preemption_setup()
    s._in_flight["b"] = b  # b's step is running (its blocks are being written): a, short of a block, gives way
    b.num_in_flight_steps, b.num_in_flight_tokens = 1, 1
    assert s.schedule().is_empty
    assert a.status == RequestStatus.PREEMPTED and b.status == RequestStatus.RUNNING and b.block_ids


def test_batches_in_flight_split_the_requests_between_them() -> None:
    s = Scheduler(SchedulerConfig(8, 64, 256, True, max_batches_in_flight=2), BlockManager(64, BS, True), [EOS])
    for i in range(5):
        s.add_request(make_request(f"r{i}", 4, start=100 + 10 * i))
    first, second = s.schedule(), s.schedule()
    assert list(first.num_scheduled_tokens) == ["r0", "r1", "r2"]
    assert list(second.num_scheduled_tokens) == ["r3", "r4"]
    assert s.schedule().is_empty
    s.update_from_output(first, ModelRunnerOutput({r: SampledToken(FILLER) for r in first.num_scheduled_tokens}))
    assert list(s.schedule().num_scheduled_tokens) == ["r0", "r1", "r2"]


def test_first_schedule_has_an_empty_finished_list() -> None:
    out = make_scheduler().schedule()
    assert out.is_empty and out.finished_req_ids == []


def test_a_request_id_reused_after_it_finished_is_sent_as_new() -> None:
    s = make_scheduler()
    s.add_request(make_request("r", 5, max_tokens=1))
    run_to_completion(s)
    s.add_request(make_request("r", 6, start=300, max_tokens=1))
    out, _ = step(s)
    assert [n.req_id for n in out.new_requests] == ["r"] and out.cached_requests == []
    assert out.new_requests[0].prompt_token_ids == list(range(300, 306))


def test_preemption_counters_count_every_preemption() -> None:
    s = make_scheduler(num_blocks=4, budget=64, max_model_len=64)
    reqs = [make_request(f"r{i}", 2, start=100 * (i + 1), max_tokens=8) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    run_to_completion(s)
    # LIFO victims: the latest admitted, r3, is preempted twice (a request's counter keeps counting).
    assert [r.num_preemptions for r in reqs] == [0, 1, 1, 2]
    assert s.num_preemptions == 4
    assert all(r.num_output_tokens == 8 for r in reqs)


def test_running_requests_share_the_budget_to_the_last_token() -> None:
    s = make_scheduler(budget=2)
    s.add_request(make_request("a", 1, max_tokens=4))
    s.add_request(make_request("b", 1, start=300, max_tokens=4))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    out, _ = step(s)  # two decodes fill the budget of 2 exactly: neither waits
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}

    s = make_scheduler(budget=8)
    s.add_request(make_request("a", 6))
    s.add_request(make_request("b", 20, start=300))
    assert step(s)[0].num_scheduled_tokens == {"a": 6, "b": 2}
    out, _ = step(s)  # a's decode leaves 7 of the 8 for b's next chunk
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}


def test_pipeline_batches_alternate_and_keep_their_size() -> None:
    s = Scheduler(SchedulerConfig(8, 64, 256, True, max_batches_in_flight=2), BlockManager(64, BS, True), [EOS])
    for i in range(2):
        s.add_request(make_request(f"r{i}", 4, start=100 + 10 * i))
    first, second = s.schedule(), s.schedule()
    assert (list(first.num_scheduled_tokens), list(second.num_scheduled_tokens)) == (["r0"], ["r1"])
    s.update_from_output(first, ModelRunnerOutput({"r0": SampledToken(FILLER)}))
    third = s.schedule()
    assert list(third.num_scheduled_tokens) == ["r0"]
    s.update_from_output(second, ModelRunnerOutput({"r1": SampledToken(FILLER)}))
    assert list(s.schedule().num_scheduled_tokens) == ["r1"]  # r0 (in flight) comes first in running

    s = Scheduler(SchedulerConfig(8, 64, 256, True, max_batches_in_flight=2), BlockManager(64, BS, True), [EOS])
    for i in range(4):
        s.add_request(make_request(f"r{i}", 4, start=100 + 10 * i))
    first, second = s.schedule(), s.schedule()
    for out in (first, second):
        s.update_from_output(out, ModelRunnerOutput({r: SampledToken(FILLER) for r in out.num_scheduled_tokens}))
    assert list(s.schedule().num_scheduled_tokens) == ["r0", "r1"]  # ceil(4 / 2), not one more


def test_too_long_prompt_error_says_what_and_how_long() -> None:
    s = make_scheduler(max_model_len=12)
    with pytest.raises(ValueError, match="prompt has 12 tokens; the model's context is 12 tokens"):
        s.add_request(make_request("too_long", 12))


def test_waiting_requests_use_the_budget_to_the_last_token() -> None:
    s = make_scheduler(budget=8)
    s.add_request(make_request("a", 7))
    s.add_request(make_request("b", 5, start=300))
    assert step(s)[0].num_scheduled_tokens == {"a": 7, "b": 1}  # chunked: b starts with the one token left

    s = make_scheduler(budget=16, chunked=False)
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 6, start=300))
    assert step(s)[0].num_scheduled_tokens == {"a": 10, "b": 6}  # b's whole prompt fits the rest exactly


def test_batches_in_flight_never_exceed_max_num_seqs() -> None:
    s = Scheduler(SchedulerConfig(2, 64, 256, True, max_batches_in_flight=2), BlockManager(64, BS, True), [EOS])
    for i in range(3):
        s.add_request(make_request(f"r{i}", 4, start=100 + 10 * i))
    batches = [s.schedule() for _ in range(3)]
    assert [list(b.num_scheduled_tokens) for b in batches] == [["r0"], ["r1"], []]
    assert s.num_running == 2 and s.num_waiting == 1


def test_cached_tokens_are_those_of_the_first_admission() -> None:
    s, a, b = _preemption_setup()
    assert b.num_cached_tokens == 0
    run_to_completion(s)  # b is preempted, then readmitted on its own cached blocks
    assert b.num_preemptions == 1 and b.num_cached_tokens == 0


def test_prompt_logprobs_request_computes_its_whole_prompt() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 10, max_tokens=2))  # its prompt blocks are cached after its first step
    run_to_completion(s)
    assert len(s.block_manager.hash_to_block) == 2
    b = make_request("b", 10, max_tokens=1, prompt_logprobs=1)
    s.add_request(b)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"b": 10} and b.num_cached_tokens == 0
    assert out.new_requests[0].num_computed_tokens == 0 and out.new_requests[0].output_token_ids == []


def test_tokens_of_requests_aborted_in_flight_are_dropped() -> None:
    s = make_scheduler()
    a, b = make_request("a", 4), make_request("b", 4, start=200)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.abort_requests(["a"])
    updates = s.update_from_output(out, ModelRunnerOutput({"a": SampledToken(FILLER), "b": SampledToken(FILLER)}))
    assert [(u.request.request_id, u.token) for u in updates] == [("b", SampledToken(FILLER))]
    assert a.output_token_ids == [] and b.output_token_ids == [FILLER]
