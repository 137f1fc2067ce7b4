"""Valid JSON never gets a 500: fuzzed and tabled bodies of /v1/completions and /v1/chat/completions.

Every answer must be 2xx, or 4xx/503 with OpenAI's error body ``{"error": {"message", "type",
"param", "code"}}``; a stream that started must not end in an internal-error event. The fuzz runs
against the Flask app over the scripted broker of tests/test_api_fake_broker.py (fast, bounded by
hypothesis' max_examples); a short table of the worst cases also goes through the real stack
(redis-server + engine + gunicorn API, the session's `api_stack`).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests
from fake_broker import FakeClient, make_app, sse_events
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from protocol.messages import AddRequest, RequestOutput

HUGE = [2**63, 2**63 - 1, -(2**63) - 1, 2**64, 10**30, -1, 0, 1, 128, 129, 2048, 4096]
SURROGATES = st.sampled_from(["\ud800", "a\udfff b", "\udbff\udc00"])  # JSON escapes: lone ones (400), a pair
JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.sampled_from(HUGE) | st.floats(
    allow_nan=False, allow_infinity=False) | st.text(max_size=8) | SURROGATES
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)

INTS = st.sampled_from(HUGE) | st.integers(min_value=-3, max_value=40)
NUMBERS = INTS | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([1e308, -1e308, 0.5, 5e-324])
TOKEN_IDS = st.lists(st.sampled_from([0, 1, 2, 10, 500, 1023, 1024, 2**63, -1]), max_size=4)
TEXTS = st.text(max_size=30)
STOPS = st.text(max_size=6) | st.lists(st.text(max_size=6), max_size=20)
PROMPTS = (TEXTS | SURROGATES | st.lists(st.text(max_size=10), max_size=5) | TOKEN_IDS | st.lists(TOKEN_IDS, max_size=3)
           | st.lists(st.lists(st.text(max_size=3), max_size=2), max_size=2))
ROLES = st.sampled_from(["user", "system", "assistant"])
PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=5)}),
                 max_size=2)
MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLES | JSON_VALUES},
                                          optional={"content": TEXTS | st.none() | PARTS | JSON_VALUES,
                                                    "name": JSON_VALUES}), max_size=3)


def unit(low: float = 0.0, high: float = 1.0) -> st.SearchStrategy[float]:
    return st.floats(min_value=low, max_value=high)


# name -> (values a client would send, edge values: out of range, huge, empty, odd types of the right kind)
SAMPLING: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "n": (st.integers(1, 3), INTS), "temperature": (unit(0, 2), NUMBERS), "top_p": (unit(0.01, 1), NUMBERS),
    "top_k": (st.integers(-1, 50), INTS), "min_p": (unit(), NUMBERS), "seed": (st.integers(-(2**63), 2**63 - 1), INTS),
    "presence_penalty": (unit(-2, 2), NUMBERS), "frequency_penalty": (unit(-2, 2), NUMBERS),
    "repetition_penalty": (unit(0.1, 2), NUMBERS), "max_tokens": (st.integers(1, 100) | st.none(), INTS),
    "min_tokens": (st.integers(0, 5), INTS), "stop": (st.lists(st.text(min_size=1, max_size=4), max_size=3), STOPS),
    "stop_token_ids": (st.lists(st.integers(0, 1023), max_size=3), TOKEN_IDS),
    "ignore_eos": (st.booleans(), JSON_VALUES), "include_stop_str_in_output": (st.booleans(), JSON_VALUES),
    "skip_special_tokens": (st.booleans(), JSON_VALUES), "best_of": (st.just(1), INTS),
    "stream": (st.booleans(), JSON_VALUES),
    "stream_options": (st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}), JSON_VALUES),
    "user": (st.text(max_size=5), JSON_VALUES), "model": (st.just("tiny-llama"), st.sampled_from(["nope", ""])),
    "return_tokens_as_token_ids": (st.booleans(), JSON_VALUES),
    "logit_bias": (st.just({}), st.dictionaries(st.text(max_size=3), INTS, max_size=2)),
    "response_format": (st.just({"type": "text"}), st.sampled_from([
        {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, {"type": "xml"}])),
    "guided_regex": (st.just("[a-z]{1,5}"), st.text(max_size=6)),
    "guided_choice": (st.just(["yes", "no"]), st.lists(st.text(max_size=3), max_size=2)),
    "guided_json": (st.just({"type": "object"}), JSON_VALUES),
}
COMPLETION = {**SAMPLING, "prompt": (TEXTS.filter(bool) | st.lists(st.text(min_size=1, max_size=10), min_size=1,
                                                                   max_size=3), PROMPTS),
              "echo": (st.booleans(), JSON_VALUES), "logprobs": (st.integers(0, 5), INTS),
              "suffix": (st.none(), st.text(max_size=3))}
CHAT = {**SAMPLING, "messages": (st.lists(st.fixed_dictionaries({"role": ROLES, "content": TEXTS}), min_size=1,
                                          max_size=3), MESSAGES),
        "logprobs": (st.booleans(), JSON_VALUES), "top_logprobs": (st.integers(0, 5), INTS),
        "max_completion_tokens": (st.integers(1, 100), INTS), "add_generation_prompt": (st.booleans(), JSON_VALUES),
        "chat_template_kwargs": (st.just({}), st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=2)),
        "tools": (st.just([]), st.lists(JSON_VALUES, max_size=1))}


@st.composite
def bodies(draw: st.DrawFn, fields: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]],
           required: tuple[str, ...]) -> dict[str, Any]:
    """The required fields and a few others: mostly values a client would send, some edge values, some any JSON."""
    names = [*required, *draw(st.lists(st.sampled_from(sorted(fields)), max_size=8, unique=True))]
    body = {}
    for name in names:
        valid, edge = fields[name]
        body[name] = draw(st.sampled_from([valid] * 7 + [edge] * 2 + [JSON_VALUES]))
    return {name: draw(strategy) for name, strategy in body.items()}


def echo_script(add: AddRequest) -> list[RequestOutput | None]:
    """Each sequence: up to 3 tokens (fewer if max_tokens is smaller), logprobs when asked."""
    n, limit = add.params.n, add.params.max_tokens
    top = add.params.logprobs
    outs: list[RequestOutput | None] = []
    tokens = [10, 11, 12][:limit]
    for k, token in enumerate(tokens):
        entry = [[-0.5, 1, [token] * (top or 0), [-0.5] * (top or 0)]] if top is not None else None
        for i in range(n):
            outs.append(RequestOutput(add.request_id, i, [token], "length" if k == len(tokens) - 1 else None,
                                      num_prompt_tokens=len(add.prompt_token_ids), logprobs=entry))
    return outs


def check_answer(response, body: Any) -> int:
    """2xx, or an error status with OpenAI's error body; never a 500 (nor an internal-error SSE event)."""
    status = response.status_code
    assert status != 500 and status < 600, f"{status} for {body!r}: {response.get_data(as_text=True)[:500]}"
    if status >= 400:
        error = response.get_json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        return status
    if response.mimetype == "text/event-stream":
        events = sse_events(response)
        assert events[-1] == "[DONE]"
        errors = [e["error"] for e in events[:-1] if "error" in e]
        assert not errors, f"stream error for {body!r}: {errors}"
    return status


@pytest.fixture(scope="module")
def fuzz_http(tiny_llama_dir, tokenizer):  # noqa: F811 - the fixture imported above
    return make_app(tiny_llama_dir, tokenizer, FakeClient(echo_script, max_model_len=64))


FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(body=bodies(COMPLETION, ("prompt",)))
def test_fuzz_completions(fuzz_http, body) -> None:
    status = check_answer(fuzz_http.post("/v1/completions", data=json.dumps(body), content_type="application/json"),
                          body)
    event(f"status {status}")  # --hypothesis-show-statistics: how many bodies got how far


@FUZZ
@given(body=bodies(CHAT, ("messages",)))
def test_fuzz_chat(fuzz_http, body) -> None:
    status = check_answer(fuzz_http.post("/v1/chat/completions", data=json.dumps(body),
                                         content_type="application/json"), body)
    event(f"status {status}")


@FUZZ
@given(body=JSON_VALUES)
def test_fuzz_any_json_body(fuzz_http, body) -> None:
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        check_answer(fuzz_http.post(route, data=json.dumps(body), content_type="application/json"), body)


USER = [{"role": "user", "content": "hi"}]
# (route, body, expected status): the worst cases found by the fuzz and by hand.
EDGE_CASES = [
    ("/v1/completions", {"prompt": "x", "min_tokens": 5000, "max_tokens": None}, 400),
    ("/v1/chat/completions", {"messages": USER, "min_tokens": 5000}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2**63}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400),
    ("/v1/completions", {"prompt": "x", "n": 2**63}, 400),
    ("/v1/completions", {"prompt": "x", "top_k": -(2**63) - 1, "max_tokens": 2}, 400),
    ("/v1/completions", {"prompt": "x", "top_k": 2**63, "max_tokens": 2}, 200),
    ("/v1/completions", {"prompt": "x", "seed": 2**63 - 1, "n": 3, "max_tokens": 2}, 200),
    ("/v1/completions", {"prompt": "x", "min_tokens": 2**63}, 400),
    ("/v1/completions", {"prompt": "x", "logprobs": 2**63}, 400),
    ("/v1/completions", {"prompt": [2**63]}, 400),
    ("/v1/completions", {"prompt": [[]]}, 400),
    ("/v1/completions", {"prompt": [[1, [2]]]}, 400),
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [2**63]}, 400),
    ("/v1/completions", {"prompt": "x", "temperature": 1e308}, 400),
    ("/v1/completions", {"prompt": "x", "top_p": 5e-324, "max_tokens": 2}, 200),
    ("/v1/completions", {"prompt": "\u0000\ud7ff\U0001f600", "max_tokens": 2}, 200),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": 2}, 200),
    ("/v1/chat/completions", {"messages": [[]]}, 400),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2**63, "logprobs": True}, 400),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"messages": 1}}, 400),
    ("/v1/completions", {"prompt": "\ud800"}, 400),
    ("/v1/completions", {"prompt": "a\udfff", "echo": True, "stream": True}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 400),
    ("/tokenize", {"prompt": "\ud800"}, 400),
]


@pytest.mark.parametrize(("route", "body", "status"), EDGE_CASES)
def test_edge_cases_over_the_fake_broker(fuzz_http, route, body, status) -> None:
    response = fuzz_http.post(route, json=body)
    check_answer(response, body)
    assert response.status_code == status, response.get_json()


WORST = [case for case in EDGE_CASES
         if case[1].get("min_tokens") or case[2] == 200 or "seed" in case[1] or "\\ud800" in json.dumps(case[1])]


@pytest.mark.parametrize(("route", "body", "status"), WORST)
def test_worst_cases_through_the_real_stack(api_stack, route, body, status) -> None:
    response = requests.post(f"{api_stack.base_url}{route}", json=body, timeout=60,
                             headers={"Authorization": f"Bearer {api_stack.API_KEY}"})
    assert response.status_code == status, response.text
    if status >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
