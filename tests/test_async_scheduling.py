"""Async scheduling (engine.scheduler, worker.model_runner submit/collect): step N + 1 is scheduled and launched
before step N's tokens are back, requests running ahead with a placeholder token fed on the device.

The scheduler's rules with a fake model, then whole engines on the CPU (``async_scheduling=True`` runs the same
code there, without overlap): every request's tokens, logprobs and finish reasons equal a synchronous engine's
(greedy, seeded sampling, logprobs, prompt logprobs, penalties, min_tokens, n > 1, stop tokens hit while the
next step is in flight, aborts, preemption), and nothing leaks: no request left in flight, every KV block free.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.block_manager import BlockManager
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerConfig
from protocol.sampling_params import SamplingParams
from protocol.step_types import ModelRunnerOutput, SampledToken
from worker.config import EngineConfig
from worker.models.tiny_model import ensure_default_model

BS = 4
EOS = 1
FILLER = 7


def make_scheduler(num_blocks: int = 64, max_model_len: int = 256) -> Scheduler:
    return Scheduler(SchedulerConfig(8, 64, max_model_len, True, async_scheduling=True),
                     BlockManager(num_blocks, BS, True), [EOS])


def make_request(rid: str, n: int, start: int = 100, **params) -> Request:
    params.setdefault("max_tokens", 16)
    return Request(rid, list(range(start, start + n)), SamplingParams(**params))


def sampled(s: Scheduler, out, token: int = FILLER) -> ModelRunnerOutput:
    """The fake model's output of step ``out``: a token for each of its requests still running (the tests
    schedule only chunks that end their known tokens)."""
    result = {}
    for rid in out.num_scheduled_tokens:
        request = s._in_flight.get(rid)
        if request is not None and not request.status.finished:
            result[rid] = SampledToken(token)
    return ModelRunnerOutput(result)


# -- the scheduler's rules -------------------------------------------------------------------------------------

def test_a_decoding_request_runs_ahead_with_one_placeholder_token() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 6))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 6}
    second = s.schedule()  # step 1 is in flight: a runs ahead, computing the token step 1 samples (position 6)
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.cached_requests[0].num_computed_tokens == 6
    assert s.schedule().is_empty  # at most one step ahead
    s.update_from_output(first, sampled(s, first))
    request = s.requests["a"]
    assert request.num_tokens == 7 and request.num_computed_tokens == 6
    assert len(request.block_ids) == 2  # 8 slots: positions 0..6 (7 tokens computed once step 2 ends)
    third = s.schedule()
    assert third.num_scheduled_tokens == {"a": 1} and third.cached_requests[0].num_computed_tokens == 7
    s.update_from_output(second, sampled(s, second))
    assert request.num_computed_tokens == 7 and request.num_tokens == 8
    s.update_from_output(third, sampled(s, third))
    assert request.num_computed_tokens == 8 and request.num_in_flight_steps == 0 and not s._in_flight


@pytest.mark.parametrize("why,params,max_model_len", [
    ("penalties need the token on the host", {"repetition_penalty": 1.2}, 256),
    ("its in-flight token is its last by max_tokens", {"max_tokens": 1}, 256),
    ("its in-flight token fills the context", {}, 7),
])
def test_no_run_ahead(why, params, max_model_len) -> None:
    s = make_scheduler(max_model_len=max_model_len)
    s.add_request(make_request("a", 6, **params))
    s.schedule()
    assert s.schedule().is_empty, why


def test_a_structured_output_request_waits_for_its_token() -> None:
    s = make_scheduler()
    request = make_request("a", 6)
    request.grammar = object()  # the matcher must accept the token on the host before the next mask
    s.add_request(request)
    s.schedule()
    assert s.schedule().is_empty


def test_a_prefill_chunk_that_samples_nothing_does_not_run_ahead() -> None:
    s = Scheduler(SchedulerConfig(8, 4, 256, True, async_scheduling=True), BlockManager(64, BS, True), [EOS])
    s.add_request(make_request("a", 10))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 4}
    assert s.schedule().is_empty  # its next chunk's tokens are known, but they follow an unfinished one


def test_a_stop_token_in_flight_finishes_the_request_and_its_ahead_step_is_dropped() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 6))
    first, second = s.schedule(), s.schedule()
    updates = s.update_from_output(first, sampled(s, first, token=EOS))
    assert [u.finished for u in updates] == [True]
    assert "a" not in s.requests
    assert s.block_manager.num_free_blocks == 64  # freed now: step 2 writes into them, but before any later step
    third = s.schedule()
    assert third.finished_req_ids == ["a"] and third.is_empty
    assert s.update_from_output(second, ModelRunnerOutput({"a": SampledToken(FILLER)})) == []
    assert not s._in_flight and s.block_manager.num_free_blocks == 64


def test_run_ahead_never_preempts_and_waits_when_every_other_request_is_in_flight() -> None:
    s = make_scheduler(num_blocks=3)  # 12 slots
    s.add_request(make_request("a", 4))
    s.add_request(make_request("b", 4, start=200))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 4, "b": 4}  # 2 blocks, 1 left
    second = s.schedule()  # a takes the last block for position 4; b finds none and no victim: it waits
    assert second.num_scheduled_tokens == {"a": 1}
    assert all(r.status.value == "running" for r in s.requests.values())
    s.update_from_output(first, sampled(s, first))
    s.update_from_output(second, sampled(s, second))
    assert not s._in_flight


# -- whole engines on the CPU: async equals sync -------------------------------------------------------------

def _engine(async_on: bool, **kwargs) -> LLM:
    """On the CPU whatever the machine has: these tests are about the engine's logic (the CUDA one is below)."""
    return LLM(str(ensure_default_model()), dtype="float32", device="cpu", async_scheduling=async_on, **kwargs)


def _prompts(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 500, (n,), generator=g).tolist() for n in lengths]


def _run(llm: LLM, prompts, params) -> tuple[list, list]:
    """Per request: (tokens, finish reason, stop reason) of each sequence; and the numbers of its logprobs and
    prompt logprobs apart, since those are compared to float32 rounding: steps batch the requests
    differently under async scheduling (a penalties request waits out every other step), and a matmul over
    another batch size may round the last bit otherwise."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]
    numbers = [[c.logprobs for c in o.outputs] + [o.prompt_logprobs] for o in outs]
    return tokens, numbers


def _assert_same(got: tuple[list, list], expected: tuple[list, list]) -> None:
    assert got[0] == expected[0]

    def flat(x):  # every number of a nested logprobs structure, in order; ids and ranks included
        if isinstance(x, dict):
            return [v for key in sorted(x) for v in [key, *flat(x[key])]]
        if isinstance(x, (list, tuple)):
            return [v for item in x for v in flat(item)]
        if hasattr(x, "__dict__"):
            return flat(vars(x))
        return [x]

    a, b = flat(got[1]), flat(expected[1])
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x == y if not isinstance(y, float) else x == pytest.approx(y, rel=1e-4, abs=1e-4)


def _assert_drained(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.in_flight and not engine.scheduler._in_flight
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def engines():
    sync, overlapped = _engine(False), _engine(True)
    assert not sync.engine.executor.overlaps_steps and overlapped.engine.executor.overlaps_steps
    assert overlapped.engine.executor.max_in_flight == 2
    yield sync, overlapped
    sync.shutdown()
    overlapped.shutdown()


def test_async_engine_matches_the_sync_engine(engines, monkeypatch) -> None:
    sync, overlapped = engines
    prompts = _prompts((5, 17, 40, 3, 33, 64, 9, 12))
    # A stop token the greedy request meets at its 4th output token, while its next step is in flight.
    probe = sync.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    stop = probe[3]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]),
              SamplingParams(temperature=1.0, seed=5, max_tokens=15, logprobs=3),
              SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=9, max_tokens=25, ignore_eos=True,
                             prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=1),
              SamplingParams(temperature=0, max_tokens=10, min_tokens=6, ignore_eos=False),
              SamplingParams(n=2, temperature=0.7, seed=3, max_tokens=9, ignore_eos=True)]
    expected = _run(sync, prompts, params)
    ahead = []
    runs_ahead = overlapped.engine.scheduler._runs_ahead
    monkeypatch.setattr(overlapped.engine.scheduler, "_runs_ahead",
                        lambda request: ahead.append(runs_ahead(request)) or ahead[-1])
    got = _run(overlapped, prompts, params)
    _assert_same(got, expected)
    assert expected[0][1][0][0] == probe[:4] and expected[0][1][0][2] == stop  # the stop token did end it
    assert sum(ahead) > 50  # requests did run ahead
    _assert_drained(overlapped)


def test_abort_while_steps_are_in_flight(engines) -> None:
    sync, overlapped = engines
    prompts = _prompts((20, 30), seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = sync.generate([prompts[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    engine = overlapped.engine
    engine.add_request("victim", prompts[0], params)
    engine.add_request("kept", prompts[1], params)
    tokens = []
    for i in range(200):
        if i == 6:
            assert engine.in_flight  # a step is on its way when the abort comes
            engine.abort_request(["victim"])
        for out in engine.step():
            if out.request_id == "kept":
                tokens += out.new_token_ids
        if not engine.has_unfinished_requests():
            break
    assert tokens == expected
    _assert_drained(overlapped)


def test_preemption_under_async_scheduling() -> None:
    prompts = _prompts((30, 31, 29, 33), seed=2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    results = []
    for async_on in (False, True):
        llm = _engine(async_on, num_kv_blocks=12, max_num_seqs=4)  # 192 slots for 4 x 70 tokens: preemptions
        try:
            results.append(_run(llm, prompts, params))
            assert llm.engine.scheduler.num_preemptions > 0
            _assert_drained(llm)
        finally:
            llm.shutdown()
    _assert_same(results[1], results[0])


def test_config_rules() -> None:
    model = str(ensure_default_model())
    assert not EngineConfig(model=model, device="cpu").use_async_scheduling  # auto: CUDA only
    assert EngineConfig(model=model, device="cpu", async_scheduling=True).use_async_scheduling
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model=model, device="cpu", async_scheduling=True, tensor_parallel_size=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_async_engine_on_cuda_with_graphs_matches_the_sync_engine() -> None:
    """On CUDA (auto: async on, decode graphs captured), the overlapped engine's greedy tokens and finish reasons
    equal an engine's with async scheduling off, for a batch that grows, shrinks and stops on a token."""
    prompts = _prompts((5, 17, 40, 3, 33, 64, 9, 12), seed=4)
    results = []
    for async_on in (None, False):
        llm = LLM(str(ensure_default_model()), dtype="float32", device="cuda", async_scheduling=async_on,
                  max_num_seqs=16, num_kv_blocks=256)  # a small cache: the other engine's memory may not be back yet
        try:
            assert llm.engine.executor.overlaps_steps == (async_on is None)
            assert llm.engine.executor.runner.graph_runner is not None
            probe = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].token_ids
            params = [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[probe[2]])]  # stops in flight
            params += [SamplingParams(temperature=0, max_tokens=10 + 5 * i, ignore_eos=True) for i in range(7)]
            tokens = _run(llm, prompts, params)[0]
            assert tokens[0][0][0] == probe[:probe.index(probe[2]) + 1] and tokens[0][0][2] == probe[2]
            results.append((probe, tokens))
            _assert_drained(llm)
        finally:
            llm.shutdown()
    assert results[0] == results[1]
