"""Prefill/decode disaggregation (issue 30, part 2): a prefill engine computes the prompt and the first token, the
KV tier carries the prompt's blocks, a decode engine continues; the caller sees one stream with exact usage.

The engine side in process (two `EngineCore`s over a real Valkey tier), then the whole stack:
`redserve serve --prefill-engines 1 --decode-engines 1` (real processes, HTTP), with each kind of engine killed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from engine_helpers import greedy, make_llm, random_prompt
from stack_procs import Procs, cli, free_port, title, wait_for

from engine.core import EngineCore
from redserve.proc_tree import children
from redserve.redis_server import EmbeddedRedis
from worker.config import EngineConfig

PROMPT = random_prompt(300, seed=40)
LONG_PROMPT = random_prompt(1800, seed=41)  # a prefill long enough to kill its engine in the middle of it
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tier_url() -> Iterator[str]:
    with EmbeddedRedis(maxmemory="128mb", maxmemory_policy="allkeys-lru", title="redserve-kv-tier") as server:
        yield server.url


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: str) -> dict[int, list[int]]:
    """Greedy tokens of a colocated engine, by max_tokens."""
    llm = make_llm(tiny_llama_dir)
    try:
        out = {n: llm.generate([PROMPT], greedy(n), use_tqdm=False)[0].outputs[0].token_ids for n in (MAX_TOKENS, 120)}
        out["long"] = llm.generate([LONG_PROMPT], greedy(MAX_TOKENS), use_tqdm=False)[0].outputs[0].token_ids
        return out
    finally:
        llm.engine.shutdown()


def run_until_done(core: EngineCore, timeout: float = 60) -> list:
    outputs, deadline = [], time.monotonic() + timeout
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine never finished"
        outputs += core.step()
    return outputs


def test_a_prefill_engine_hands_over_after_the_first_token_and_a_decode_engine_continues(
        tiny_llama_dir: str, tier_url: str, reference: dict[int, list[int]]) -> None:
    config = dict(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, kv_tier_url=tier_url)
    prefill, decode = EngineCore(EngineConfig(**config)), EngineCore(EngineConfig(**config))
    try:
        prefill.add_request("r", PROMPT, greedy(MAX_TOKENS), handoff=True)
        (first,) = run_until_done(prefill)
        assert first.handoff and first.finish_reason is None and first.num_prompt_tokens == len(PROMPT)
        assert prefill.scheduler.requests == {}  # dropped there, blocks cached
        # The client's continuation: the prompt plus the delivered token, the remaining budget.
        decode.add_request("r~m1", PROMPT + first.new_token_ids, greedy(MAX_TOKENS - 1))
        rest = run_until_done(decode)
        tokens = first.new_token_ids + [t for out in rest for t in out.new_token_ids]
        assert tokens == reference[MAX_TOKENS]
        assert decode.kv_tier.stats()["hit_blocks"] == len(PROMPT) // 16  # every full prompt block from the tier
        assert not any(out.handoff for out in rest)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_handoff_is_ignored_without_a_tier_and_for_n_above_one(tiny_llama_dir: str, reference) -> None:
    core = EngineCore(EngineConfig(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256))
    try:
        core.add_request("r", PROMPT, greedy(MAX_TOKENS), handoff=True)
        outputs = run_until_done(core)
        assert [t for out in outputs for t in out.new_token_ids] == reference[MAX_TOKENS]
        assert not any(out.handoff for out in outputs)
    finally:
        core.shutdown()


# --- the whole stack -----------------------------------------------------------------------------------------


class DisaggStack:
    def __init__(self, model: str, tmp: Path) -> None:
        self.state = tmp / "state"
        self.procs = Procs(tmp, env={"REDSERVE_STATE_DIR": str(self.state)})
        self.port = free_port()
        self.model = Path(model).name
        self.serve = self.procs.start("serve", cli(
            "serve", "--model", model, "--dtype", "float32", "--port", str(self.port), "--api-workers", "1",
            "--no-batch-worker", "--prefill-engines", "1", "--decode-engines", "1", "--kv-tier-memory", "128mb"))
        self.base = f"http://127.0.0.1:{self.port}"
        wait_for(lambda: self.ready_engines() == 2, 180, "both engines READY", watch=(self.serve,))
        time.sleep(1.0)  # the API reads the engine list every 0.5 s: until it sees both pools it splits nothing

    def ready_engines(self) -> int:
        try:
            return json.loads(self.status()).get("engines_ready", 0)
        except (ValueError, OSError):
            return 0

    def status(self) -> str:
        import subprocess
        out = subprocess.run(cli("status", "--json"), capture_output=True, text=True, timeout=60,
                             env={**os.environ, "REDSERVE_STATE_DIR": str(self.state)})
        data = json.loads(out.stdout)
        data["engines_ready"] = sum(1 for e in data["engines"] if e.get("state") == "ready" and e.get("alive"))
        return json.dumps(data)

    def engine_pid(self, rank: int) -> int:
        return next(p for p in children(self.serve.pid) if title(p).startswith(f"redserve-engine-{rank}"))

    def restarted(self, rank: int, old_pid: int) -> bool:
        """Engine `rank` runs as a new process, READY in the registry."""
        engine = next((e for e in json.loads(self.status())["engines"] if e["engine_id"] == str(rank)), {})
        return engine.get("pid") not in (None, old_pid) and engine.get("state") == "ready" and engine.get("alive")

    def stream(self, max_tokens: int, on_chunk=None, prompt: list[int] = PROMPT) -> tuple[list[int], dict, list]:
        """Token ids, usage and per-token logprobs of one streamed greedy completion."""
        tokens, usage, logprobs = [], None, []
        with requests.post(f"{self.base}/v1/completions", stream=True, timeout=120, json={
                "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "logprobs": 1, "return_token_ids": True,
                "stream_options": {"include_usage": True}}) as resp:
            assert resp.status_code == 200, resp.text
            for line in resp.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    tokens += choice.get("token_ids") or []
                    logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
                    if on_chunk is not None and choice.get("token_ids"):
                        on_chunk(len(tokens))
        return tokens, usage, logprobs

    def metric(self, line_start: str) -> float:
        text = requests.get(f"{self.base}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))

    def close(self) -> None:
        self.procs.close()


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DisaggStack]:
    s = DisaggStack(tiny_llama_dir, tmp_path_factory.mktemp("disagg"))
    yield s
    s.close()


def test_a_split_stream_has_the_colocated_tokens_exact_usage_and_no_seam(stack: DisaggStack, reference) -> None:
    handoffs = stack.metric('redserve:request_migrations_total{model_name="tiny-llama",reason="handoff"}')
    tokens, usage, logprobs = stack.stream(MAX_TOKENS)
    assert tokens == reference[MAX_TOKENS]  # one of each: no token lost or repeated at the handover
    assert usage["prompt_tokens"] == len(PROMPT) and usage["completion_tokens"] == MAX_TOKENS
    assert len(logprobs) == MAX_TOKENS and all(isinstance(x, float) for x in logprobs)
    assert stack.metric('redserve:request_migrations_total{model_name="tiny-llama",reason="handoff"}') == handoffs + 1
    status = json.loads(stack.status())
    roles = {e["engine_id"]: e.get("role") for e in status["engines"]}
    assert roles == {"0": "prefill", "1": "decode"}
    by_id = {e["engine_id"]: e for e in status["engines"]}
    assert by_id["0"]["generated_tokens"] >= 1 and by_id["1"]["generated_tokens"] >= MAX_TOKENS - 1


def test_killing_the_prefill_engine_before_it_hands_over_re_prefills_the_request(stack: DisaggStack,
                                                                                 reference) -> None:
    prefill = stack.engine_pid(0)
    moves_before = len(handoff_log_lines(stack))
    os.kill(prefill, signal.SIGSTOP)  # frozen with the request in its stream: still READY to the API
    killed = threading.Timer(0.5, lambda: os.kill(prefill, signal.SIGKILL))
    killed.start()
    tokens, usage, _ = stack.stream(MAX_TOKENS, prompt=LONG_PROMPT)
    killed.join()
    assert tokens == reference["long"] and usage["completion_tokens"] == MAX_TOKENS
    assert usage["prompt_tokens"] == len(LONG_PROMPT)
    moves = handoff_log_lines(stack)[moves_before:]
    assert any("engine 0 is gone; re-placed" in line for line in moves), moves
    wait_for(lambda: stack.restarted(0, prefill), 120, "the prefill engine back")


def test_killing_the_decode_engine_mid_stream_resumes_it(stack: DisaggStack, reference) -> None:
    decode = stack.engine_pid(1)

    def kill_after_some(count: int) -> None:
        if count == 20 and decode in children(stack.serve.pid):
            os.kill(decode, signal.SIGKILL)

    tokens, usage, _ = stack.stream(120, on_chunk=kill_after_some)
    assert tokens == reference[120] and usage["completion_tokens"] == 120 and usage["prompt_tokens"] == len(PROMPT)
    assert decode not in children(stack.serve.pid)  # it was killed mid-stream, not after
    assert "engine_exited: resumed request" in stack.procs.log("serve")
    wait_for(lambda: stack.restarted(1, decode), 120, "the decode engine back")


def handoff_log_lines(stack: DisaggStack) -> list[str]:
    return [line for line in stack.procs.log("serve").splitlines() if "re-placed" in line or "resumed request" in line]
