"""Sampling-parameter ranges as vLLM's `SamplingParams._verify_args`: a 400 naming the field, through the
Flask app over the scripted broker client; in-range values (the edges included) are accepted."""

from __future__ import annotations

import pytest
from fake_broker import FakeClient, make_app, token_script

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

REJECTED = [
    ("top_k", -5), ("top_k", -2), ("min_p", -0.1), ("min_p", 1.5), ("top_p", 0.0), ("top_p", 1.01),
    ("temperature", -0.5), ("presence_penalty", -2.5), ("presence_penalty", 2.1),
    ("frequency_penalty", 3), ("frequency_penalty", -2.01), ("repetition_penalty", 0),
    ("repetition_penalty", -1.0), ("seed", 2**63), ("seed", -(2**63) - 1), ("n", 0), ("n", -1),
    ("logprobs", -1), ("logprobs", 21), ("prompt_logprobs", -1), ("prompt_logprobs", 21),
    ("min_tokens", -1), ("max_tokens", 0),
]
ACCEPTED = [
    ("top_k", -1), ("top_k", 0), ("top_k", 1), ("top_k", 50), ("min_p", 0), ("min_p", 1), ("top_p", 1),
    ("top_p", 1e-9), ("temperature", 0), ("presence_penalty", -2), ("presence_penalty", 2),
    ("frequency_penalty", 2), ("repetition_penalty", 0.01), ("repetition_penalty", 2.5),
    ("seed", 2**63 - 1), ("seed", -(2**63)), ("n", 1), ("logprobs", 0), ("logprobs", 20),
    ("prompt_logprobs", 0),
]


@pytest.fixture
def http(tiny_llama_dir, tokenizer):
    return make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(tokenizer.encode("a b c d"))))


@pytest.mark.parametrize("name,value", REJECTED)
def test_out_of_range_is_a_400_naming_the_field(http, name, value) -> None:
    r = http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2, name: value})
    assert r.status_code == 400, r.get_json()
    assert r.get_json()["error"]["param"] == name, r.get_json()


@pytest.mark.parametrize("name,value", [(n, v) for n, v in REJECTED if n not in ("logprobs", "prompt_logprobs")])
def test_chat_out_of_range_is_a_400_naming_the_field(http, name, value) -> None:
    r = http.post(CHAT, json={"messages": USER, "max_tokens": 2, name: value})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == name, r.get_json()


@pytest.mark.parametrize("name,value", ACCEPTED)
def test_in_range_is_accepted(http, name, value) -> None:
    r = http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2, name: value})
    assert r.status_code == 200, r.get_json()


@pytest.mark.parametrize("top_logprobs,status", [(-1, 400), (21, 400), (0, 200), (20, 200)])
def test_chat_top_logprobs_range(http, top_logprobs, status) -> None:
    r = http.post(CHAT, json={"messages": USER, "max_tokens": 2, "logprobs": True, "top_logprobs": top_logprobs})
    assert r.status_code == status, r.get_json()
    if status == 400:
        assert r.get_json()["error"]["param"] == "top_logprobs"


def test_echo_with_max_tokens_zero_is_allowed_and_shows_only_the_prompt(http) -> None:
    r = http.post(COMPLETIONS, json={"prompt": "x y", "max_tokens": 0, "echo": True})
    assert r.status_code == 200, r.get_json()
    assert r.get_json()["choices"][0]["text"] == "x y"
    assert http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 0}).status_code == 400


@pytest.mark.parametrize("body, status", [({"prompt_logprobs": -1}, 400), ({"prompt_logprobs": 21}, 400),
                                          ({"prompt_logprobs": 1, "stream": True}, 400),  # as vLLM
                                          ({"prompt_logprobs": 0}, 200), ({"prompt_logprobs": 20}, 200)])
def test_chat_prompt_logprobs_range_and_no_streaming(http, body, status) -> None:
    r = http.post(CHAT, json={"messages": USER, "max_tokens": 2, **body})
    assert r.status_code == status, r.get_data(as_text=True)
    if status == 400:
        assert r.get_json()["error"]["param"] == "prompt_logprobs"
