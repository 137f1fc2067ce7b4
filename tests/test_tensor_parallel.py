"""Tensor parallelism on CPU (gloo): TP=2 equals TP=1 and transformers; worker and engine deaths."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from engine_helpers import requires_devices
from parallel_helpers import child_pids, cmdline, shm_segments, submit, wait_engine_ready, wait_gone

from broker.client import BrokerClient
from engine import LLM
from protocol.sampling_params import SamplingParams
from worker.multiproc_executor import WorkerDied

pytestmark = requires_devices(2)

PROMPTS = [[5, 17, 99, 4, 250, 31], list(range(40, 140)), [7], list(range(300, 333))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tp1_tokens(tiny_llama_dir: str) -> list[list[int]]:
    llm = LLM(tiny_llama_dir, dtype="float32")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_tp2_offline_matches_tp1_and_transformers(tiny_llama_dir, tiny_qwen2_dir, tp1_tokens):
    from transformers import AutoModelForCausalLM
    llm = LLM(tiny_llama_dir, dtype="float32", tensor_parallel_size=2)
    try:
        tp2 = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()
    assert tp2 == tp1_tokens
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    for prompt, tokens in zip(PROMPTS, tp2, strict=True):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == ref

    qwen = LLM(tiny_qwen2_dir, dtype="float32", tensor_parallel_size=2)
    try:
        qwen_tp2 = [o.outputs[0].token_ids for o in qwen.generate(PROMPTS, GREEDY)]
    finally:
        qwen.shutdown()
    qwen_tp1 = [o.outputs[0].token_ids for o in LLM(tiny_qwen2_dir, dtype="float32").generate(PROMPTS, GREEDY)]
    assert qwen_tp2 == qwen_tp1


def test_killed_worker_fails_the_step_fast_and_leaves_nothing(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", tensor_parallel_size=2)
    executor = llm.engine.executor
    worker_pids = [p.pid for p in executor.procs]
    llm.engine.add_request("r", PROMPTS[1], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    llm.engine.step()
    os.kill(worker_pids[1], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(WorkerDied):
        for _ in range(1000):
            llm.engine.step()
    assert time.monotonic() - started < 10
    llm.shutdown()
    assert wait_gone(worker_pids, 10) == []
    assert shm_segments(os.getpid()) == []


def _start_engine(model: str, redis_url: str, prefix: str, tp: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "redserve.cli", "engine", "--model", model, "--redis-url", redis_url,
         "--key-prefix", prefix, "--dtype", "float32", "--tensor-parallel-size", str(tp)],
        stdin=subprocess.DEVNULL)


def test_served_tp2_matches_and_worker_death_ends_requests(tiny_llama_dir, redis_url, redis_keys, tp1_tokens):
    proc = _start_engine(tiny_llama_dir, redis_url, redis_keys.prefix, tp=2)
    # The error path is under test: no migration (tests/test_stream_resume.py resumes such requests), and a
    # request that had no output yet waits only briefly for another engine to be re-placed on (there is none).
    client = BrokerClient(redis_url, keys=redis_keys, max_migrations=0, replace_wait=3).start()
    try:
        wait_engine_ready(client, proc)
        for i, (prompt, expected) in enumerate(zip(PROMPTS, tp1_tokens, strict=True)):
            tokens = []
            with submit(client, f"g{i}", prompt, GREEDY) as handle:
                for out in handle:
                    assert out.error_code is None
                    tokens += out.new_token_ids
            assert tokens == expected

        workers = child_pids(proc.pid)
        long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
        handles = [submit(client, f"long{i}", PROMPTS[i], long) for i in range(2)]
        assert handles[0].get(timeout=60) is not None
        spawned = [p for p in workers if "redserve-worker" in cmdline(p) or "spawn" in cmdline(p)]
        assert spawned, f"no worker among children {workers}"
        os.kill(spawned[-1], signal.SIGKILL)
        started = time.monotonic()
        for handle in handles:
            last = None
            for out in handle:
                last = out
            assert last is not None and last.finish_reason == "error"
        assert time.monotonic() - started < 30
        assert proc.wait(timeout=30) != 0
        assert wait_gone(workers, 15) == []
        assert shm_segments(proc.pid) == []
    finally:
        client.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_killed_engine_takes_its_workers_and_segments(tiny_llama_dir, redis_url, redis_keys):
    proc = _start_engine(tiny_llama_dir, redis_url, redis_keys.prefix, tp=2)
    client = BrokerClient(redis_url, keys=redis_keys).start()
    try:
        wait_engine_ready(client, proc)
        children = child_pids(proc.pid)
        assert children
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_gone(children, 15) == []
        deadline = time.monotonic() + 10
        while shm_segments(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert shm_segments(proc.pid) == []
    finally:
        client.stop()
