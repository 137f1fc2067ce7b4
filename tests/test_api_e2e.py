"""End to end through real processes: redis-server, `redserve engine`, `redserve api` (gunicorn, 2 workers).

Uses the official `openai` client and plain HTTP. Outputs are compared with the offline
`engine.LLM` on the same model (float32, greedy), so they must match token for token.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from typing import Any

import pytest
import redis
import requests
from openai import OpenAI

from broker.keys import RedisKeys

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["def hello(", "import os\nimport sys\n", "The quick brown fox"]


@pytest.fixture(scope="module")
def stack(api_stack):
    return api_stack


@pytest.fixture(scope="module")
def client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(stack) -> str:
    return requests.get(f"{stack.base_url}/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def offline(stack):
    from engine import LLM

    llm = LLM(model=stack.model_dir, dtype="float32")
    yield llm
    llm.shutdown()


def offline_generate(llm, prompt, **params):
    from engine import SamplingParams

    return llm.generate(prompt, SamplingParams(**params))[0].outputs[0]


def token_ids(logprobs_tokens: list[str]) -> list[int]:
    return [int(t.split(":", 1)[1]) for t in logprobs_tokens]


def engine_counters(stack) -> dict[str, Any]:
    r = redis.Redis.from_url(stack.redis_url)
    try:
        keys = RedisKeys()
        fields = r.hgetall(keys.engine("0"))
        pending = r.xpending(keys.request_stream("0"), RedisKeys.consumer_group)["pending"]
    finally:
        r.close()
    return {"running": int(fields.get(b"running", b"0")), "waiting": int(fields.get(b"waiting", b"0")),
            "generated": int(fields.get(b"generated_tokens", b"0")), "pending": pending}


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def engine_idle(stack) -> bool:
    c = engine_counters(stack)
    return c["running"] == 0 and c["waiting"] == 0 and c["pending"] == 0


# ---------------------------------------------------------------------------------------------- basics

def test_models_health_version(stack, model) -> None:
    models = requests.get(f"{stack.base_url}/v1/models", headers=AUTH, timeout=10).json()
    assert models["object"] == "list"
    entry = models["data"][0]
    assert entry["id"] == model == "tiny-llama" and entry["object"] == "model"
    assert entry["max_model_len"] == 2048 and entry["root"] == stack.model_dir and entry["owned_by"]
    health = requests.get(f"{stack.base_url}/health", timeout=10)
    assert health.status_code == 200, health.text
    assert requests.get(f"{stack.base_url}/version", headers=AUTH, timeout=10).json()["version"]


def test_processes_are_titled(stack) -> None:
    def title(pid: int) -> str:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode().strip()

    assert title(stack.api.pid).startswith("redserve-api")
    with open(f"/proc/{stack.api.pid}/task/{stack.api.pid}/children") as f:
        children = f.read().split()
    assert len(children) == 2 and all(title(int(pid)).startswith("redserve-api") for pid in children)


# ---------------------------------------------------------------------------------------------- outputs

@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_matches_offline_llm(client, model, offline, prompt) -> None:
    expected = offline_generate(offline, prompt, max_tokens=24, temperature=0, logprobs=0)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, logprobs=0,
                                  extra_body={"return_tokens_as_token_ids": True})
    choice = r.choices[0]
    assert choice.text == expected.text
    assert token_ids(choice.logprobs.tokens) == expected.token_ids
    assert choice.finish_reason == expected.finish_reason
    assert choice.logprobs.token_logprobs == pytest.approx([e[0] for e in expected.logprobs], abs=1e-4)
    assert r.usage.prompt_tokens == len(offline.get_tokenizer().encode(prompt))
    assert r.usage.completion_tokens == len(expected.token_ids)


def test_streamed_completion_equals_non_streamed(client, model) -> None:
    for prompt in PROMPTS:
        whole = client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0)
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
        pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].finish_reason is None]
        assert not any(p.endswith("\ufffd") for p in pieces), "a chunk ended inside a character"


def test_chat_matches_offline_llm_and_streams_the_same(client, model, offline) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]
    prompt_text = offline.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = offline.get_tokenizer().encode(prompt_text, add_special_tokens=False)
    expected = offline_generate(offline, [prompt_ids], max_tokens=20, temperature=0)
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.text
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == len(expected.token_ids)
    stream = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=20,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_n2_and_several_prompts_usage(client, model, offline) -> None:
    r = client.completions.create(model=model, prompt=PROMPTS[:2], max_tokens=6, n=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(PROMPTS[:2]):
        expected = offline_generate(offline, prompt, max_tokens=6, temperature=0, ignore_eos=True)
        assert r.choices[2 * p].text == r.choices[2 * p + 1].text == expected.text
    prompt_tokens = sum(len(offline.get_tokenizer().encode(p)) for p in PROMPTS[:2])
    assert r.usage.prompt_tokens == prompt_tokens and r.usage.completion_tokens == 4 * 6
    sampled = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, n=2, temperature=1.0,
                                        seed=7, extra_body={"ignore_eos": True})
    again = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, n=2, temperature=1.0,
                                      seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]
    assert sampled.usage.completion_tokens == 16


def test_logprobs_shapes(client, model) -> None:
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3,
                                  echo=True)
    lp = r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt + 5
    assert lp.token_logprobs[0] is None  # prompt logprobs: the first is null, as OpenAI
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:n_prompt])
    assert all(len(top) >= 3 for top in lp.top_logprobs[n_prompt:])
    assert r.choices[0].text.startswith(PROMPTS[0])
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob, abs=1e-5)


def test_stop_strings(client, model, offline) -> None:
    expected = offline_generate(offline, PROMPTS[0], max_tokens=40, temperature=0, ignore_eos=True)
    words = re.findall(r"[A-Za-z]{3,}", expected.text[5:])
    assert words, expected.text
    stop = words[0]
    cut = expected.text.index(stop)
    for stream in (False, True):
        kwargs = dict(model=model, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop],
                      extra_body={"ignore_eos": True})
        if stream:
            chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            last = [c for c in chunks if c.choices][-1].choices[0]
            finish, stop_reason, used = last.finish_reason, last.model_extra.get("stop_reason"), chunks[-1].usage
        else:
            r = client.completions.create(**kwargs)
            text, finish = r.choices[0].text, r.choices[0].finish_reason
            stop_reason, used = r.choices[0].model_extra.get("stop_reason"), r.usage
        assert text == expected.text[:cut]
        assert finish == "stop" and stop_reason == stop
        assert used.completion_tokens < 40
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert r.choices[0].text == expected.text[:cut + len(stop)]


def test_64_concurrent_streams(client, model) -> None:
    results: dict[int, tuple[str, int]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            stream = client.completions.create(model=model, prompt=PROMPTS[i % 3], max_tokens=8, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
            chunks = list(stream)
            results[i] = ("".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:3]
    assert len(results) == 64 and all(n == 8 for _, n in results.values())
    for i, (text, _) in results.items():
        assert text == results[i % 3][0]


# ---------------------------------------------------------------------------------------------- disconnects

LONG = 2000  # tokens: the tiny model makes them in about a second, so "cut short" is judged by count, not time


def test_stream_disconnect_frees_the_engine(stack, model) -> None:
    wait_for(lambda: engine_idle(stack), 20, "an idle engine before the test")
    before = engine_counters(stack)["generated"]
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": LONG, "ignore_eos": True, "stream": True}
    response = requests.post(f"{stack.base_url}/v1/completions", json=body, headers=AUTH, stream=True, timeout=60)
    assert response.status_code == 200
    lines = response.iter_lines()
    assert any(next(lines).startswith(b"data: {") for _ in range(4))
    response.close()
    wait_for(lambda: engine_idle(stack) and engine_counters(stack)["generated"] > before, 15,
             "the engine to free the aborted stream (running 0, XPENDING 0)")
    generated = engine_counters(stack)["generated"] - before
    assert 0 < generated < LONG, "the request ran to the end: the disconnect did not abort it"


def test_non_streaming_disconnect_frees_the_engine(stack, model) -> None:
    wait_for(lambda: engine_idle(stack), 20, "an idle engine before the test")
    before = engine_counters(stack)["generated"]
    host, port = stack.base_url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "prompt": PROMPTS[1], "max_tokens": LONG, "ignore_eos": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    wait_for(lambda: engine_counters(stack)["generated"] > before, 10, "the request to start generating")
    sock.close()
    wait_for(lambda: engine_idle(stack) and engine_counters(stack)["generated"] > before, 15,
             "the engine to free the abandoned request (running 0, XPENDING 0)")
    generated = engine_counters(stack)["generated"] - before
    assert 0 < generated < LONG, "the request ran to the end: the disconnect did not abort it"


# ---------------------------------------------------------------------------------------------- bad input

BAD_REQUESTS = [
    ("post", "/v1/completions", b"{not json", 400),
    ("post", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400),
    ("post", "/v1/completions", {"prompt": "x", "temperature": -3}, 400),
    ("post", "/v1/completions", {"prompt": "x", "n": 0}, 400),
    ("post", "/v1/completions", {"prompt": [[1, 2], 3]}, 400),
    ("post", "/v1/completions", {"prompt": [4096]}, 400),
    ("post", "/v1/completions", {"prompt": list(range(5, 2053))}, 400),
    ("post", "/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400),
    ("post", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400),
    ("post", "/v1/chat/completions", {"messages": "hi"}, 400),
    ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
    ("post", "/v1/completions", {"model": "gpt-17", "prompt": "x"}, 404),
    ("post", "/v1/nowhere", {}, 404),
    ("get", "/v1/chat/completions", None, 405),
    ("post", "/v1/completions", b"{" + b" " * (2 << 20) + b"}", 413),
]


@pytest.mark.parametrize("method,path,body,status", BAD_REQUESTS)
def test_bad_input_gets_its_status_and_the_server_keeps_serving(stack, client, model, method, path, body,
                                                                status) -> None:
    kwargs: dict[str, Any] = {"headers": {**AUTH, "Content-Type": "application/json"}, "timeout": 30}
    if isinstance(body, bytes):
        kwargs["data"] = body
    elif body is not None:
        kwargs["data"] = json.dumps(body)
    r = requests.request(method, stack.base_url + path, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert client.completions.create(model=model, prompt="ok", max_tokens=2).usage.completion_tokens == 2


def test_api_key_required_everywhere_but_health(stack) -> None:
    url = f"{stack.base_url}/v1/completions"
    assert requests.post(url, json={"prompt": "x"}, timeout=10).status_code == 401
    wrong = requests.post(url, json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(f"{stack.base_url}/health", timeout=10).status_code == 200
    assert requests.get(f"{stack.base_url}/metrics", timeout=10).status_code == 401
    assert requests.get(f"{stack.base_url}/metrics", headers=AUTH, timeout=10).status_code == 200


def test_429_when_one_process_is_full_then_clean_sigterm(stack, model) -> None:
    proc, base_url = stack.spawn_api("api-small", "--max-queued-requests", "2", workers=1)
    url = f"{base_url}/v1/completions"
    try:
        stack.wait_healthy(base_url, timeout=60, watch=(proc,))
        r = requests.post(url, json={"model": model, "prompt": ["a", "b", "c"]}, timeout=30)  # could never fit
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        refused = 0
        for _ in range(3):  # two long streams hold both slots while a third request arrives
            body = {"model": model, "prompt": PROMPTS[0], "max_tokens": LONG, "ignore_eos": True, "stream": True}
            holders = [requests.post(url, json=body, stream=True, timeout=60) for _ in range(2)]
            r = requests.post(url, json={"model": model, "prompt": "x"}, timeout=30)
            if r.status_code == 429:
                assert r.headers["Retry-After"] and r.json()["error"]["type"] == "rate_limit_error"
                refused += 1
            for holder in holders:
                holder.close()
            if refused:
                break
        assert refused
        wait_for(lambda: requests.post(url, json={"model": model, "prompt": "x", "max_tokens": 2},
                                       timeout=30).status_code == 200, 15, "the slots to be freed")
    finally:
        code = stack.stop_process(proc)
    assert code == 0


# ---------------------------------------------------------------------------------------------- metrics

def metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_consistent_across_workers(stack, client, model) -> None:
    url = f"{stack.base_url}/metrics"
    before = requests.get(url, headers=AUTH, timeout=10).text
    for _ in range(10):
        client.completions.create(model=model, prompt="hello", max_tokens=3, extra_body={"ignore_eos": True})
    scrapes = [requests.get(url, headers=AUTH, timeout=10).text for _ in range(8)]
    success = [metric_sum(s, "redserve:request_success_total", finished_reason="length") for s in scrapes]
    generated = [metric_sum(s, "redserve:generation_tokens_total") for s in scrapes]
    assert len(set(success)) == 1 and len(set(generated)) == 1, "scrapes of different workers disagree"
    assert success[0] - metric_sum(before, "redserve:request_success_total", finished_reason="length") == 10
    assert generated[0] - metric_sum(before, "redserve:generation_tokens_total") == 30
    text = scrapes[0]
    for name in ("redserve:time_to_first_token_seconds_count", "redserve:inter_token_latency_seconds_count",
                 "redserve:e2e_request_latency_seconds_count", "redserve:prompt_tokens_total",
                 'redserve:num_requests_running{', 'redserve:num_requests_waiting{', "redserve:engines_ready{"):
        assert name in text, name
    assert metric_sum(text, "redserve:engines_ready") == 1


# ---------------------------------------------------------------------------------------------- engine gone

def test_health_503_when_the_engine_stops(stack, client, model) -> None:
    assert stack.stop_engine() == 0
    stack.wait_healthy(stack.base_url, timeout=20, want=503)
    r = requests.post(f"{stack.base_url}/v1/completions", json={"model": model, "prompt": "x"}, headers=AUTH,
                      timeout=30)
    assert r.status_code == 503 and r.headers["Retry-After"]
    stack.start_engine()
    stack.wait_healthy(stack.base_url, timeout=90)
    assert client.completions.create(model=model, prompt="back", max_tokens=2).usage.completion_tokens == 2
