"""EngineCore / LLM against transformers on tiny real models (CPU, float32).

Greedy tokens must equal ``AutoModelForCausalLM.generate(do_sample=False)`` token for token, and every
sampled step's logits must equal the HF forward pass on the same tokens, whatever the batching: all at
once, one by one, added mid-flight, chunked prefill, prefix-cache hits, preemption, n > 1.
Limits and validation are in test_engine_limits.py, checkpoint loading and model variants in
test_engine_models.py; the shared helpers in engine_helpers.py.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from engine_helpers import (
    GREEDY,
    MAX_TOKENS,
    PROMPTS,
    LogitsRecorder,
    ScheduleRecorder,
    assert_all_blocks_free,
    drive,
    greedy,
    hf_greedy,
    hf_logits,
    make_llm,
    random_prompt,
)

from engine import SamplingParams

# --- greedy equals transformers ---------------------------------------------------------------------


def test_greedy_all_at_once_matches_hf(model_dir: str) -> None:
    llm = make_llm(model_dir)
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt)
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert_all_blocks_free(llm)


def test_greedy_one_by_one_matches_hf(model_dir: str) -> None:
    llm = make_llm(model_dir, enable_prefix_caching=False)
    for prompt in PROMPTS:
        assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_greedy(model_dir, prompt)


def test_greedy_added_mid_flight_matches_hf(model_dir: str) -> None:
    llm = make_llm(model_dir)
    recorder = LogitsRecorder(llm)
    arrivals = {0: [("p5", PROMPTS[5], GREEDY)],
                2: [("p0", PROMPTS[0], GREEDY), ("p3", PROMPTS[3], GREEDY)],
                5: [("p1", PROMPTS[1], GREEDY)],
                6: [("p4", PROMPTS[4], greedy(20))],
                9: [("p2", PROMPTS[2], GREEDY)]}
    tokens, finish = drive(llm.engine, arrivals)
    assert set(finish.values()) == {"length"}
    for rid in ("p0", "p1", "p2", "p3", "p5"):
        assert tokens[rid] == hf_greedy(model_dir, PROMPTS[int(rid[1])]), rid
    assert tokens["p4"] == hf_greedy(model_dir, PROMPTS[4], 20)
    # Decode steps ran batched with prefills of late arrivals.
    assert len(recorder.rows) == 5 * MAX_TOKENS + 20
    assert_all_blocks_free(llm)


def test_per_step_logits_match_hf(model_dir: str) -> None:
    llm = make_llm(model_dir, max_num_batched_tokens=48)
    recorder = LogitsRecorder(llm)
    arrivals = {0: [(f"p{i}", PROMPTS[i], greedy(logprobs=3)) for i in (5, 1)],
                3: [(f"p{i}", PROMPTS[i], greedy(logprobs=3)) for i in (0, 2, 3, 4)]}
    tokens, _ = drive(llm.engine, arrivals)
    assert len(recorder.rows) == 6 * MAX_TOKENS
    by_request: dict[str, list] = defaultdict(list)
    for rid, ctx, row in recorder.rows:
        by_request[rid].append((ctx, row))
    worst = 0.0
    for rid, rows in by_request.items():
        full = PROMPTS[int(rid[1])] + tokens[rid]
        reference = hf_logits(model_dir, full)
        for ctx, row in rows:
            assert ctx == full[:len(ctx)]
            expected = reference[len(ctx) - 1]
            torch.testing.assert_close(row, expected, atol=1e-4, rtol=1e-4)
            worst = max(worst, float((row - expected).abs().max()))
            assert int(row.argmax()) == full[len(ctx)]
    assert worst < 1e-4


def test_logprobs_match_hf(llama_dir: str) -> None:
    llm = make_llm(llama_dir)
    prompt = PROMPTS[3]
    out = llm.generate([prompt], greedy(6, logprobs=4))[0].outputs[0]
    reference = torch.log_softmax(hf_logits(llama_dir, prompt + out.token_ids), dim=-1)
    assert len(out.logprobs) == 6
    for i, (token, (lp, rank, top_ids, top_lps)) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = reference[len(prompt) + i - 1]
        assert lp == pytest.approx(float(row[token]), abs=1e-4)
        assert rank == 1
        assert top_ids == row.topk(4).indices.tolist()
        assert top_lps == pytest.approx(row.topk(4).values.tolist(), abs=1e-4)
    plain = llm.generate([prompt, PROMPTS[4]], [greedy(3), greedy(3, logprobs=1)])
    assert plain[0].outputs[0].logprobs is None
    assert len(plain[1].outputs[0].logprobs) == 3


# --- batching features give exactly the plain-path tokens ------------------------------------------------


@pytest.mark.parametrize("budget", [16, 32])
def test_chunked_prefill_matches_hf(model_dir: str, budget: int) -> None:
    llm = make_llm(model_dir, max_num_batched_tokens=budget)
    schedule = ScheduleRecorder(llm)
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt)
    assert max(sum(s.values()) for s in schedule.steps) <= budget
    # The 130-token prompt was split into budget-sized chunks.
    long_id = outputs[5].request_id
    chunks = [s[long_id] for s in schedule.steps if s.get(long_id, 1) > 1]
    assert len(chunks) >= 130 // budget and sum(chunks) <= 130 + budget


def test_prefix_cache_hits_match_hf(model_dir: str) -> None:
    llm = make_llm(model_dir)
    shared = random_prompt(70, seed=100)
    first_prompt, second_prompt = shared + random_prompt(9, seed=101), shared + random_prompt(3, seed=102)
    first = llm.generate([first_prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0
    hits_before = llm.engine.block_manager.prefix_hits
    second = llm.generate([second_prompt], GREEDY)[0]
    assert second.num_cached_tokens == 64  # the 4 full blocks of the shared prefix
    assert llm.engine.block_manager.prefix_hits - hits_before == 64
    assert second.outputs[0].token_ids == hf_greedy(model_dir, second_prompt)
    again = llm.generate([first_prompt], GREEDY)[0]  # its prompt and generated blocks are cached
    assert again.num_cached_tokens == 64
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(model_dir, first_prompt)
    assert llm.engine.stats().prefix_cache_hit_rate > 0
    assert_all_blocks_free(llm)
    assert llm.engine.reset_prefix_cache()
    assert llm.generate([first_prompt], GREEDY)[0].num_cached_tokens == 0


def test_prefix_cache_hit_on_block_boundary_and_with_chunking(llama_dir: str) -> None:
    llm = make_llm(llama_dir, max_num_batched_tokens=16)
    prompt = random_prompt(48, seed=103)  # exactly 3 blocks: a full hit still computes the last token
    llm.generate([prompt], greedy(2))
    out = llm.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 32
    assert out.outputs[0].token_ids == hf_greedy(llama_dir, prompt)
    extended = prompt + out.outputs[0].token_ids[:5]
    out2 = llm.generate([extended], GREEDY)[0]
    assert out2.num_cached_tokens == 48
    assert out2.outputs[0].token_ids == hf_greedy(llama_dir, extended)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_matches_hf(model_dir: str, prefix_caching: bool) -> None:
    # 8 blocks of 16 = 128 slots; each request alone needs <= 4 blocks, together far more.
    llm = make_llm(model_dir, num_kv_blocks=8, enable_prefix_caching=prefix_caching)
    prompts = [PROMPTS[3], PROMPTS[4], random_prompt(30, seed=104), random_prompt(25, seed=105)]
    outputs = llm.generate(prompts, greedy(24))
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats().num_preemptions == llm.engine.scheduler.num_preemptions
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 24)
        assert out.outputs[0].finish_reason == "length"
    assert_all_blocks_free(llm)


def test_preemption_with_chunked_prefill_and_late_arrivals(llama_dir: str) -> None:
    llm = make_llm(llama_dir, num_kv_blocks=9, max_num_batched_tokens=32)
    arrivals = {0: [("a", PROMPTS[4], greedy(30)), ("b", PROMPTS[3], greedy(30))],
                4: [("c", random_prompt(50, seed=106), greedy(20))],
                7: [("d", PROMPTS[1], greedy(30))]}
    tokens, finish = drive(llm.engine, arrivals)
    assert llm.engine.scheduler.num_preemptions > 0
    for rid, prompt, params in (x for batch in arrivals.values() for x in batch):
        assert tokens[rid] == hf_greedy(llama_dir, prompt, params.max_tokens), rid
    assert_all_blocks_free(llm)


# --- aborts, n > 1, finish reasons, limits -------------------------------------------------------------------


def test_abort_frees_blocks(llama_dir: str) -> None:
    llm = make_llm(llama_dir, max_num_batched_tokens=32, max_num_seqs=2)
    core = llm.engine
    core.add_request("long", PROMPTS[5], greedy(20))
    core.add_request("run", PROMPTS[3], greedy(20))
    core.add_request("wait", PROMPTS[4], greedy(20))
    core.step()
    long_req = core.scheduler.requests["long"]
    assert 0 < long_req.num_computed_tokens < len(PROMPTS[5])  # mid-chunk
    assert core.scheduler.requests["wait"] in core.scheduler.waiting
    outs = core.abort_request(["wait", "long", "nope"])
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outs] == [
        ("wait", "abort", []), ("long", "abort", [])]
    for _ in range(3):
        core.step()
    assert core.scheduler.requests["run"].num_output_tokens >= 2
    outs = core.abort_request(["run"])
    assert [(o.request_id, o.finish_reason) for o in outs] == [("run", "abort")]
    assert not core.has_unfinished_requests()
    assert_all_blocks_free(llm)
    core.step()  # tells the runner to forget the aborted requests
    assert core.executor.runner.input_batch.requests == {}
    assert core.abort_request(["run"]) == []
    # The engine is still healthy; a reused id is fine once its request is gone.
    tokens, _ = drive(core, {0: [("run", PROMPTS[3], GREEDY)]})
    assert tokens["run"] == hf_greedy(llama_dir, PROMPTS[3])


def test_abort_n2_request(llama_dir: str) -> None:
    llm = make_llm(llama_dir)
    core = llm.engine
    core.add_request("r", PROMPTS[4], greedy(20, n=2))
    core.step()
    outs = core.abort_request(["r"])
    assert sorted((o.index, o.finish_reason) for o in outs) == [(0, "abort"), (1, "abort")]
    assert not core.has_unfinished_requests() and core.stats().load.waiting == 0
    assert_all_blocks_free(llm)


def test_n2_shares_prompt_blocks_and_matches(model_dir: str) -> None:
    llm = make_llm(model_dir)
    out = llm.generate([PROMPTS[4]], greedy(n=2))[0]
    assert len(out.outputs) == 2 and [o.index for o in out.outputs] == [0, 1]
    expected = hf_greedy(model_dir, PROMPTS[4])
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == expected
    assert all(o.finish_reason == "length" for o in out.outputs)
    assert llm.engine.block_manager.prefix_hits >= 32  # the 2nd sequence reused the 2 full prompt blocks
    assert_all_blocks_free(llm)


def test_stop_token_and_length(model_dir: str) -> None:
    llm = make_llm(model_dir)
    prompt = PROMPTS[3]
    reference = hf_greedy(model_dir, prompt)
    out = llm.generate([prompt], greedy(stop_token_ids=[reference[0]]))[0].outputs[0]
    assert out.token_ids == [reference[0]]
    assert (out.finish_reason, out.stop_reason) == ("stop", reference[0])
    stop_at = reference[4]
    out = llm.generate([prompt], greedy(stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == reference[:reference.index(stop_at) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)
    out = llm.generate([prompt], greedy(5))[0].outputs[0]
    assert out.token_ids == reference[:5]
    assert (out.finish_reason, out.stop_reason) == ("length", None)
    assert_all_blocks_free(llm)


def test_eos_stops_unless_ignored(llama_dir: str) -> None:
    llm = make_llm(llama_dir)
    assert set(llm.engine.scheduler.eos_token_ids) == {1, 3}  # generation_config.json: </s>, <|im_end|>
    reference = hf_greedy(llama_dir, PROMPTS[4])
    eos = reference[2]
    llm.engine.scheduler.eos_token_ids = frozenset({eos})  # make the model "emit" EOS at step 3
    llm.engine.executor.runner.input_batch.eos_token_ids = [eos]
    stopped = llm.generate([PROMPTS[4]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].outputs[0]
    assert stopped.token_ids == reference[:reference.index(eos) + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", None)
    ignored = llm.generate([PROMPTS[4]], GREEDY)[0].outputs[0]
    assert ignored.token_ids == reference and ignored.finish_reason == "length"
    # min_tokens masks EOS too: the first tokens avoid it, so they differ from the plain greedy ones.
    masked = llm.generate([PROMPTS[4]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                        min_tokens=MAX_TOKENS))[0].outputs[0]
    assert eos not in masked.token_ids and len(masked.token_ids) == MAX_TOKENS


def test_min_tokens_suppresses_stop_tokens(model_dir: str) -> None:
    llm = make_llm(model_dir)
    prompt = PROMPTS[4]
    stop = hf_greedy(model_dir, prompt)[0]
    out = llm.generate([prompt], greedy(8, stop_token_ids=[stop], min_tokens=3))[0].outputs[0]
    assert stop not in out.token_ids[:3]
    second_best = int(hf_logits(model_dir, prompt)[-1].topk(2).indices[1])
    assert out.token_ids[0] == second_best
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop and len(out.token_ids) > 3 and out.stop_reason == stop
    else:
        assert len(out.token_ids) == 8 and out.finish_reason == "length"
    assert_all_blocks_free(llm)
