"""Pipeline parallelism on CPU (gloo): PP=2 and PP=2 x TP=2 give the tokens of PP=1, each stage holds and
loads only its own modules, the engine keeps one batch per stage in flight, and a killed stage worker
ends the served requests with an error and leaves no process or segment behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from engine_helpers import requires_devices
from parallel_helpers import shm_segments, submit, wait_engine_ready, wait_gone
from stack_procs import process_tree, title, wait_for

from broker.client import BrokerClient
from engine import LLM
from protocol.sampling_params import SamplingParams
from worker import parallel_state
from worker.model_loader import build_model, load_config
from worker.parallel_state import PPGroup
from worker.pipeline import MissingLayer, stage_layers

PROMPTS = [[5, 17, 99, 4, 250, 31], list(range(40, 140)), [7], list(range(300, 333))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def pp1_tokens(tiny_llama_dir: str) -> list[list[int]]:
    return _tokens(LLM(tiny_llama_dir, dtype="float32"))


def test_stage_layers_split_contiguously_first_stages_take_the_rest() -> None:
    assert [list(stage_layers(2, s, 2)) for s in range(2)] == [[0], [1]]
    assert [list(stage_layers(7, s, 3)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(stage_layers(32, s, 4)) for s in range(4)] == [8] * 4
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        stage_layers(2, 0, 3)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_stage_builds_and_loads_only_its_modules(tiny_qwen2_dir, monkeypatch, stage) -> None:
    """The tiny qwen2 ties its LM head to the embedding: the last stage, which has no embedding, reads the
    embedding rows into its own head."""
    monkeypatch.setattr(parallel_state, "_PP", PPGroup(stage, 2, 1))
    config = load_config(tiny_qwen2_dir)
    model = build_model(tiny_qwen2_dir, config, torch.float32, torch.device("cpu"), 64)
    names = {n.split(".")[0] if not n.startswith("layers.") else ".".join(n.split(".")[:2])
             for n, _ in model.named_parameters()}
    if stage == 0:
        assert names == {"embed_tokens", "layers.0"}
        assert isinstance(model.lm_head, MissingLayer) and isinstance(model.norm, MissingLayer)
    else:
        assert names == {"layers.1", "norm", "lm_head"}
        assert isinstance(model.embed_tokens, MissingLayer)
        monkeypatch.setattr(parallel_state, "_PP", PPGroup())
        whole = build_model(tiny_qwen2_dir, config, torch.float32, torch.device("cpu"), 64)
        assert torch.equal(model.lm_head.weight, whole.embed_tokens.weight)
        assert torch.equal(model.layers[1].mlp.down_proj.weight, whole.layers[1].mlp.down_proj.weight)


@requires_devices(4)
def test_pp2_and_pp2_tp2_offline_match_pp1(tiny_llama_dir, tiny_qwen2_dir, pp1_tokens) -> None:
    for tp in (1, 2):
        llm = LLM(tiny_llama_dir, dtype="float32", pipeline_parallel_size=2, tensor_parallel_size=tp)
        try:
            assert _tokens(llm) == pp1_tokens, f"PP=2 x TP={tp}"
        finally:
            llm.shutdown()
    qwen = LLM(tiny_qwen2_dir, dtype="float32", pipeline_parallel_size=2)
    try:
        qwen_pp2 = _tokens(qwen)
    finally:
        qwen.shutdown()
    assert qwen_pp2 == _tokens(LLM(tiny_qwen2_dir, dtype="float32"))


@requires_devices(2)
def test_pp2_keeps_two_batches_in_flight_and_matches_pp1_at_concurrency(tiny_llama_dir) -> None:
    prompts = [list(range(10 + i, 30 + 3 * i)) for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = _tokens(LLM(tiny_llama_dir, dtype="float32", max_num_seqs=6), prompts, params)
    llm = LLM(tiny_llama_dir, dtype="float32", pipeline_parallel_size=2, max_num_seqs=6)
    depth, submit_step = [], llm.engine.executor.submit_step

    def recording_submit(sched):
        submit_step(sched)
        depth.append(len(llm.engine.in_flight) + 1)
        assert not set(sched.num_scheduled_tokens) & {r for s in llm.engine.in_flight for r in s.num_scheduled_tokens}

    llm.engine.executor.submit_step = recording_submit
    try:
        assert _tokens(llm, prompts, params) == expected
    finally:
        llm.shutdown()
    assert max(depth) == 2
    assert depth.count(2) > len(depth) / 2, depth


def _start_engine(model: str, redis_url: str, prefix: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "redserve.cli", "engine", "--model", model, "--redis-url", redis_url,
         "--key-prefix", prefix, "--dtype", "float32", "--pipeline-parallel-size", "2"],
        stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "2"})


@requires_devices(2)
def test_served_pp2_matches_and_stage_death_ends_requests(tiny_llama_dir, redis_url, redis_keys, pp1_tokens):
    proc = _start_engine(tiny_llama_dir, redis_url, redis_keys.prefix)
    client = BrokerClient(redis_url, keys=redis_keys, max_migrations=0, replace_wait=3).start()
    try:
        wait_engine_ready(client, proc)
        workers = {title(pid): pid for pid in process_tree(proc.pid)[1:] if title(pid).startswith("redserve-worker")}
        assert sorted(workers) == ["redserve-worker-0-0-0", "redserve-worker-0-1-0"]
        handles = [submit(client, f"g{i}", prompt, GREEDY) for i, prompt in enumerate(PROMPTS)]
        for handle, expected in zip(handles, pp1_tokens, strict=True):
            tokens = []
            with handle:
                for out in handle:
                    assert out.error_code is None
                    tokens += out.new_token_ids
            assert tokens == expected

        long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
        handles = [submit(client, f"long{i}", PROMPTS[i], long) for i in range(2)]
        assert handles[0].get(timeout=60) is not None
        os.kill(workers["redserve-worker-0-0-0"], signal.SIGKILL)  # the first stage: the engine reads the last
        started = time.monotonic()
        for handle in handles:
            last = None
            for out in handle:
                last = out
            assert last is not None and last.finish_reason == "error"
        assert time.monotonic() - started < 30
        assert proc.wait(timeout=30) != 0
        assert wait_gone(list(workers.values()), 15) == []
        wait_for(lambda: not shm_segments(proc.pid), 10, "the engine's segments to go")
    finally:
        client.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
