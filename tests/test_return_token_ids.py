"""vLLM's `return_token_ids` on /v1/completions and /v1/chat/completions, end to end (real Redis, engine and
API processes: the session's `api_stack`): the prompt's ids and each choice's generated ids, whole and
streamed, checked against /tokenize and against the ids the logprobs name (`return_tokens_as_token_ids`)."""

from __future__ import annotations

import json

import pytest
import requests

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Count with me: one, two,"}]


@pytest.fixture(scope="module")
def base(api_stack) -> str:
    return api_stack.base_url


@pytest.fixture(scope="module")
def model(base) -> str:
    return requests.get(f"{base}/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]


def post(base: str, path: str, body: dict) -> requests.Response:
    return requests.post(f"{base}{path}", json=body, headers=AUTH, timeout=120)


def events(base: str, path: str, body: dict) -> list[dict]:
    with requests.post(f"{base}{path}", json={**body, "stream": True}, headers=AUTH, timeout=120, stream=True) as r:
        assert r.status_code == 200, r.text
        lines = [line for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def tokenized(base: str, model: str, **body) -> list[int]:
    return post(base, "/tokenize", {"model": model, **body}).json()["tokens"]


def logprob_ids(entries: list[str]) -> list[int]:
    return [int(t.split(":", 1)[1]) for t in entries]


def test_completions_give_each_choice_its_prompt_and_generated_ids(base, model) -> None:
    prompts = ["def hello(", "The quick brown fox"]
    body = {"model": model, "prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True}
    answer = post(base, "/v1/completions", body).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    for choice in answer["choices"]:
        assert choice["prompt_token_ids"] == tokenized(base, model, prompt=prompts[choice["index"] // 2])
        assert choice["token_ids"] == logprob_ids(choice["logprobs"]["tokens"])
        assert len(choice["token_ids"]) == 6
    assert sum(len(c["token_ids"]) for c in answer["choices"]) == answer["usage"]["completion_tokens"]


def test_completions_stream_the_ids_each_chunk_adds(base, model) -> None:
    body = {"model": model, "prompt": ["def hello(", "import os\n"], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    whole = post(base, "/v1/completions", body).json()["choices"]
    per_choice: dict[int, list[dict]] = {0: [], 1: []}
    for chunk in events(base, "/v1/completions", body):
        for choice in chunk["choices"]:
            per_choice[choice["index"]].append(choice)
    for i, choices in per_choice.items():
        assert [t for c in choices for t in c["token_ids"]] == whole[i]["token_ids"]
        assert len(whole[i]["token_ids"]) == 8
        assert choices[0]["prompt_token_ids"] == whole[i]["prompt_token_ids"]  # on the choice's first chunk only
        assert all("prompt_token_ids" not in c for c in choices[1:])


def test_echo_stream_carries_the_prompt_ids_in_its_echo_chunk(base, model) -> None:
    body = {"model": model, "prompt": "def hello(", "max_tokens": 3, "temperature": 0, "echo": True,
            "return_token_ids": True}
    chunks = events(base, "/v1/completions", body)
    first = chunks[0]["choices"][0]
    assert first["text"] == "def hello(" and first["token_ids"] == []
    assert first["prompt_token_ids"] == tokenized(base, model, prompt="def hello(")
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])


def test_chat_gives_the_rendered_prompt_ids_and_each_choice_ids(base, model) -> None:
    body = {"model": model, "messages": MESSAGES, "n": 2, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "return_tokens_as_token_ids": True, "return_token_ids": True}
    answer = post(base, "/v1/chat/completions", body).json()
    assert answer["prompt_token_ids"] == tokenized(base, model, messages=MESSAGES)
    for choice in answer["choices"]:
        assert choice["token_ids"] == logprob_ids([e["token"] for e in choice["logprobs"]["content"]])
        assert len(choice["token_ids"]) == 5


def test_chat_stream_gives_prompt_ids_first_then_each_chunk_ids(base, model) -> None:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 7, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    whole = post(base, "/v1/chat/completions", body).json()
    chunks = events(base, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    streamed = [t for c in chunks[1:] for choice in c["choices"] for t in choice["token_ids"]]
    assert streamed == whole["choices"][0]["token_ids"] and len(streamed) == 7


def test_without_the_flag_no_id_fields_appear(base, model) -> None:
    completion = post(base, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2}).json()
    chat = post(base, "/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 2}).json()
    assert "prompt_token_ids" not in chat and "token_ids" not in chat["choices"][0]
    assert not {"prompt_token_ids", "token_ids"} & set(completion["choices"][0])
    chunks = events(base, "/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 2})
    assert not any("prompt_token_ids" in c or any("token_ids" in ch for ch in c["choices"]) for c in chunks)


def test_a_non_boolean_flag_is_a_400_naming_it(base, model) -> None:
    r = post(base, "/v1/completions", {"model": model, "prompt": "hi", "return_token_ids": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_ids"


def test_a_streamed_tool_call_carries_every_generated_id(base, model) -> None:
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    body = {"model": model, "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "add"}}, "return_token_ids": True}
    whole = post(base, "/v1/chat/completions", body).json()
    chunks = events(base, "/v1/chat/completions", body)[1:]  # after the role chunk
    streamed = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
    assert streamed == whole["choices"][0]["token_ids"] and streamed
