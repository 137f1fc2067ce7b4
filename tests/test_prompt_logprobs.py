"""Prompt logprobs: computed by the engine only for requests that ask, equal to transformers' log-softmax.

Offline through `LLM` (plain, chunked prefill forced, with a prefix-cache hit present, n > 1) and through
the real stack (`echo` + `logprobs` with max_tokens 0 and > 0; vLLM's `prompt_logprobs` via extra_body).
The reference is `log_softmax(hf_model(prompt).logits)` gathered at the next prompt tokens (fp32).
"""

from __future__ import annotations

import json

import msgpack
import pytest
import requests
import torch
from engine_helpers import hf_model, make_llm, random_prompt

from engine import SamplingParams
from protocol.messages import EngineOutputs, RequestOutput, decode, encode
from protocol.step_types import (
    ModelRunnerOutput,
    SampledToken,
    runner_output_from_wire,
    runner_output_to_wire,
)

TOL = 1e-4
PROMPT = random_prompt(40, seed=7)
KEY = "test-key"


def hf_prompt_logprobs(model_dir: str, prompt: list[int], top_n: int = 0) -> tuple[list[float], list[list[int]]]:
    """The logprob of each prompt token after the first, and the top-N token ids at each position."""
    with torch.no_grad():
        logits = hf_model(model_dir)(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[:-1]
    chosen = logprobs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    top = logprobs.topk(top_n, dim=-1).indices.tolist() if top_n else []
    return chosen.tolist(), top


def assert_close(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want)
    diff = max(abs(g - w) for g, w in zip(got, want, strict=True))
    assert diff < TOL, f"max |engine - hf| = {diff}"
    return diff


def engine_values(entries: list) -> list[float]:
    assert entries[0] is None
    return [entry[0] for entry in entries[1:]]


@pytest.mark.parametrize("engine_kwargs", [
    {},
    {"max_num_batched_tokens": 16},  # the 40-token prompt in three chunks
], ids=["one-chunk", "chunked-prefill"])
def test_offline_prompt_logprobs_match_hf(llama_dir, engine_kwargs) -> None:
    llm = make_llm(llama_dir, **engine_kwargs)
    try:
        want, top = hf_prompt_logprobs(llama_dir, PROMPT, top_n=3)
        out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3))[0]
        assert len(out.prompt_logprobs) == len(PROMPT)
        assert_close(engine_values(out.prompt_logprobs), want)
        assert [entry[2] for entry in out.prompt_logprobs[1:]] == top
        plain = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=2))[0]
        assert plain.prompt_logprobs is None
        assert plain.outputs[0].token_ids == out.outputs[0].token_ids
    finally:
        llm.shutdown()


def test_prefix_cache_hit_does_not_skip_prompt_positions(llama_dir) -> None:
    llm = make_llm(llama_dir, max_num_batched_tokens=16)
    try:
        llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1))  # fills the prefix cache
        warm = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1))[0]
        assert warm.num_cached_tokens > 0
        out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, n=2))[0]
        assert out.num_cached_tokens == 0
        assert_close(engine_values(out.prompt_logprobs), hf_prompt_logprobs(llama_dir, PROMPT)[0])
    finally:
        llm.shutdown()


# --- through the real stack -------------------------------------------------------------------------------

def _completion(api_stack, **body) -> dict:
    r = requests.post(f"{api_stack.base_url}/v1/completions", json={"model": api_stack.model_dir, **body},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_with_logprobs_returns_the_prompt_logprobs(api_stack, max_tokens) -> None:
    want, _ = hf_prompt_logprobs(api_stack.model_dir, PROMPT)
    choice = _completion(api_stack, prompt=PROMPT, echo=True, logprobs=2, max_tokens=max_tokens,
                         temperature=0.0, return_tokens_as_token_ids=True)["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT) + max_tokens
    assert [int(t.split(":")[1]) for t in logprobs["tokens"][:len(PROMPT)]] == PROMPT
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert_close(logprobs["token_logprobs"][1:len(PROMPT)], want)
    assert all(len(top) >= 2 for top in logprobs["top_logprobs"][1:])
    assert all(v is not None for v in logprobs["token_logprobs"][len(PROMPT):])
    if max_tokens == 0:
        assert choice["finish_reason"] == "length"


def test_prompt_logprobs_in_extra_body(api_stack, client) -> None:
    want, top = hf_prompt_logprobs(api_stack.model_dir, PROMPT, top_n=2)
    completion = client.completions.create(model=api_stack.model_dir, prompt=PROMPT, max_tokens=2,
                                           temperature=0.0, extra_body={"prompt_logprobs": 2})
    entries = completion.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT)
    got = [entries[i][str(PROMPT[i])]["logprob"] for i in range(1, len(PROMPT))]
    assert_close(got, want)
    for i in range(1, len(PROMPT)):
        ranked = sorted((v["rank"], int(k)) for k, v in entries[i].items())
        assert [k for rank, k in ranked if rank <= 2][:2] == top[i - 1]


def test_stream_echo_with_logprobs_carries_the_prompt_logprobs(api_stack) -> None:
    want, _ = hf_prompt_logprobs(api_stack.model_dir, PROMPT)
    r = requests.post(f"{api_stack.base_url}/v1/completions", stream=True, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": api_stack.model_dir, "prompt": PROMPT, "echo": True, "logprobs": 1,
                            "max_tokens": 2, "temperature": 0.0, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
              if line.startswith("data: ") and line != "data: [DONE]"]
    token_logprobs = [v for c in chunks for choice in c["choices"] if choice["logprobs"]
                      for v in choice["logprobs"]["token_logprobs"]]
    assert len(token_logprobs) == len(PROMPT) + 2 and token_logprobs[0] is None
    assert_close(token_logprobs[1:len(PROMPT)], want)


# --- the wire ------------------------------------------------------------------------------------------

def test_request_output_wire_carries_prompt_logprobs_and_reads_old_arrays() -> None:
    entries = [[-1.5, 3, [7, 8], [-0.2, -1.1]], [-0.25, 1, [], []]]
    msg = EngineOutputs("e0", [RequestOutput("r1", 0, [5], None, None, 3, 0, None, None, entries),
                               RequestOutput("r2", 0, [6], None, None, 3, 0, None, None)], 1.0, seq=1)
    assert decode(encode(msg)) == msg
    assert len(msg.outputs[1].to_wire()) == 6  # no cost for requests that did not ask: trailing defaults left out
    runner = ModelRunnerOutput({"a": SampledToken(5, None, entries), "b": SampledToken(6)})
    assert runner_output_from_wire(msgpack.unpackb(msgpack.packb(runner_output_to_wire(runner)))) == runner


def test_chat_prompt_logprobs_cover_the_rendered_prompt(api_stack, client) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "def add(a, b):"}]
    tokenizer = AutoTokenizer.from_pretrained(api_stack.model_dir)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    want, top = hf_prompt_logprobs(api_stack.model_dir, prompt, top_n=2)
    reply = client.chat.completions.create(model=api_stack.model_dir, messages=messages, max_tokens=2, n=2,
                                           temperature=0.0, extra_body={"prompt_logprobs": 2})
    assert reply.usage.prompt_tokens == len(prompt)
    entries = reply.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    assert_close([entries[i][str(prompt[i])]["logprob"] for i in range(1, len(prompt))], want)
    for i in range(1, len(prompt)):
        assert [int(k) for k, v in sorted(entries[i].items(), key=lambda kv: kv[1]["rank"])][:2] == top[i - 1]
    plain = client.chat.completions.create(model=api_stack.model_dir, messages=messages, max_tokens=2)
    assert "prompt_logprobs" not in plain.model_extra


def test_chat_prompt_logprobs_when_streaming_is_a_400(api_stack, client) -> None:
    import openai

    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.chat.completions.create(model=api_stack.model_dir, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1})
