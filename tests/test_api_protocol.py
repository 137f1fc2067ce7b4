"""Request parsing and validation (api.protocol): types, defaults, vLLM extras, context checks."""

from __future__ import annotations

from typing import Any

import pytest

from api.errors import ApiError, engine_error
from api.protocol import fit_params, fit_to_context, parse_chat_request, parse_completion_request
from protocol.messages import ErrorCode
from protocol.sampling_params import SamplingParams

CHAT = [{"role": "user", "content": "hi"}]


def bad(parse, body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


def test_completion_defaults() -> None:
    r = parse_completion_request({"model": "m", "prompt": "hello"})
    assert r.prompts == ["hello"]
    assert r.params.max_tokens == 16 and r.params.n == 1 and r.params.temperature == 1.0
    assert not r.stream and not r.echo and r.params.logprobs is None


def test_completion_prompt_forms() -> None:
    assert parse_completion_request({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert parse_completion_request({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert parse_completion_request({"prompt": [[1, 2], [3]]}).prompts == [[1, 2], [3]]
    for prompt in (None, [], [[]], [1, "a"], [[1], "a"], 5, {"a": 1}, [True]):
        assert bad(parse_completion_request, {"prompt": prompt}).param == "prompt"


def test_vllm_extra_sampling_fields() -> None:
    body = {"prompt": "x", "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True,
            "min_tokens": 2, "stop_token_ids": [7, 9], "seed": 42, "include_stop_str_in_output": True,
            "skip_special_tokens": False, "stop": "END", "n": 3, "temperature": 0}
    p = parse_completion_request(body).params
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos, p.min_tokens) == (5, 0.1, 1.2, True, 2)
    assert p.stop_token_ids == [7, 9] and p.seed == 42 and p.stop == ["END"] and p.n == 3
    assert p.include_stop_str_in_output and not p.skip_special_tokens and p.greedy


def test_unknown_fields_are_ignored() -> None:
    r = parse_completion_request({"prompt": "x", "frobnicate": {"a": 1}, "extra_body": 3})
    assert r.prompts == ["x"]


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "10"), ("max_tokens", 1.5), ("max_tokens", True), ("n", "2"), ("temperature", "hot"),
    ("top_p", [1]), ("stop", 5), ("stop", ["a", 1]), ("stop_token_ids", [1, "2"]), ("seed", 1.0),
    ("stream", "yes"), ("echo", 1), ("logprobs", True), ("ignore_eos", "false"), ("model", 3),
])
def test_wrong_types_are_400_naming_the_field(field: str, value: Any) -> None:
    error = bad(parse_completion_request, {"prompt": "x", field: value})
    assert error.param == field
    assert error.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("n", 0), ("max_tokens", 0), ("min_p", 2),
    ("presence_penalty", 3), ("repetition_penalty", 0), ("logprobs", 21), ("seed", 2**64),
    ("min_tokens", -1), ("best_of", 3), ("stop_token_ids", [-1]),
])
def test_out_of_range_values_are_400(field: str, value: Any) -> None:
    bad(parse_completion_request, {"prompt": "x", field: value})


def test_min_tokens_above_max_tokens() -> None:
    bad(parse_completion_request, {"prompt": "x", "max_tokens": 2, "min_tokens": 5})


def test_null_means_default() -> None:
    p = parse_completion_request({"prompt": "x", "temperature": None, "n": None, "stop": None}).params
    assert p.temperature == 1.0 and p.n == 1 and p.stop == []
    assert parse_completion_request({"prompt": "x", "max_tokens": None}).params.max_tokens is None


def test_stream_options() -> None:
    r = parse_completion_request({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert r.stream and r.include_usage
    assert bad(parse_completion_request, {"prompt": "x", "stream_options": {"include_usage": True}}).param == \
        "stream_options"
    bad(parse_completion_request, {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}})


def test_unsupported_features_are_rejected() -> None:
    bad(parse_completion_request, {"prompt": "x", "suffix": "y"})
    bad(parse_completion_request, {"prompt": "x", "logit_bias": {"5": 10}})
    bad(parse_chat_request, {"messages": CHAT, "response_format": {"type": "xml"}})
    bad(parse_chat_request, {"messages": CHAT, "tools": [{"type": "function"}]})
    assert parse_chat_request({"messages": CHAT, "tools": [], "response_format": {"type": "text"},
                               "logit_bias": {}}).messages


def test_chat_max_tokens() -> None:
    assert parse_chat_request({"messages": CHAT}).params.max_tokens is None
    assert parse_chat_request({"messages": CHAT, "max_tokens": 7}).params.max_tokens == 7
    r = parse_chat_request({"messages": CHAT, "max_tokens": 7, "max_completion_tokens": 3})
    assert r.params.max_tokens == 3


def test_chat_logprobs() -> None:
    r = parse_chat_request({"messages": CHAT, "logprobs": True, "top_logprobs": 3})
    assert r.logprobs and r.top_logprobs == 3 and r.params.logprobs == 3
    assert parse_chat_request({"messages": CHAT, "logprobs": True}).params.logprobs == 0
    assert parse_chat_request({"messages": CHAT}).params.logprobs is None
    assert bad(parse_chat_request, {"messages": CHAT, "top_logprobs": 2}).param == "top_logprobs"
    bad(parse_chat_request, {"messages": CHAT, "logprobs": 2})


def test_chat_messages() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    r = parse_chat_request({"messages": [{"role": "system", "content": None, "name": "x"},
                                         {"role": "user", "content": parts}]})
    assert r.messages == [{"role": "system", "content": None, "name": "x"}, {"role": "user", "content": "a\nb"}]
    for messages in (None, [], "hi", [{"content": "x"}], [{"role": 1, "content": "x"}],
                     [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "text"}]}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]):
        bad(parse_chat_request, {"messages": messages})


def test_body_must_be_an_object() -> None:
    for body in ([], "x", 3, None):
        bad(parse_completion_request, body)


def test_fit_to_context() -> None:
    p = SamplingParams(max_tokens=10)
    assert fit_to_context(p, 5, 100) is p
    assert fit_to_context(SamplingParams(max_tokens=None), 30, 100).max_tokens == 70
    with pytest.raises(ApiError) as info:
        fit_to_context(p, 95, 100)
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    assert "maximum context length is 100" in info.value.message
    with pytest.raises(ApiError):
        fit_to_context(SamplingParams(max_tokens=None), 100, 100)
    assert fit_to_context(p, 90, 100).max_tokens == 10


def test_fit_params_checks_the_vocabulary_then_each_prompt() -> None:
    p = SamplingParams(max_tokens=None, stop_token_ids=[7])
    assert [q.max_tokens for q in fit_params(p, [30, 60], 100, vocab_size=8)] == [70, 40]
    with pytest.raises(ApiError) as info:
        fit_params(p, [100], 100, vocab_size=7)
    assert (info.value.status, info.value.param) == (400, "stop_token_ids")
    with pytest.raises(ApiError) as info:
        fit_params(SamplingParams(max_tokens=50), [10, 60], 100, vocab_size=8)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"


ENGINE_STATUSES = {ErrorCode.INVALID_REQUEST: 400, ErrorCode.DEADLINE_EXCEEDED: 504, ErrorCode.ENGINE_ERROR: 500,
                   ErrorCode.ENGINE_FAILED: 500, ErrorCode.ENGINE_GONE: 503, ErrorCode.BROKER_DISCONNECTED: 503,
                   ErrorCode.OUTPUT_LOST: 503, ErrorCode.NO_ENGINE: 503, ErrorCode.CLIENT_DISCONNECTED: 503}


def test_engine_errors_map_to_statuses() -> None:
    assert set(ENGINE_STATUSES) == set(ErrorCode)  # a new code must choose its status here
    for code, status in ENGINE_STATUSES.items():
        error = engine_error(code, "detail")
        assert (error.status, error.code, error.message) == (status, code.value, "detail"), code
        assert error.headers == ({"Retry-After": "1"} if status == 503 else {}), code
    assert engine_error(ErrorCode.INVALID_REQUEST, "bad ids").body()["error"] == {
        "message": "bad ids", "type": "invalid_request_error", "param": None, "code": "invalid_request"}
