"""Streamed tool calls: the name first, then the arguments in pieces as they are written.

The parsers' `partial_calls` on every prefix of a fixed output (always growing, never taking back what
was sent); and the Flask app over the scripted broker (one token per engine output) for each parser and
the forced choices: the concatenated argument deltas equal the non-streamed arguments, a long call
arrives in several pieces, and each call's header (id, type, name) comes before its arguments. The real
stack's named-choice stream is in tests/test_tool_calls.py.
"""

from __future__ import annotations

import json

import pytest
from fake_broker import FakeClient, make_app, sse_events, token_script
from test_tool_calls import ASK, TOOLS, assemble

from api.tool_parsers import HermesToolParser, Llama3JsonToolParser, MistralToolParser, PartialCall

LONG_ARGS = '{"city": "Paris\\u00e9", "days": 3, "note": "a long note that takes many tokens to write"}'
TIME_ARGS = '{"zone": "utc"}'
OUTPUTS = {
    "hermes": (f'Let me see.<tool_call>{{"name": "get_weather", "arguments": {LONG_ARGS}}}</tool_call>\n'
               f'<tool_call>{{"name": "get_time", "arguments": {TIME_ARGS}}}</tool_call>'),
    "llama3_json": f'{{"name": "get_weather", "parameters": {LONG_ARGS}}}; {{"name": "get_time", "parameters": {TIME_ARGS}}}',
    "mistral": (f'Let me see.[TOOL_CALLS][{{"name": "get_weather", "arguments": {LONG_ARGS}}}, '
                f'{{"name": "get_time", "arguments": {TIME_ARGS}}}]'),
}
PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser}


@pytest.mark.parametrize("parser_name", list(OUTPUTS))
def test_partial_calls_only_grow_and_end_as_the_extracted_calls(parser_name) -> None:
    parser, text = PARSERS[parser_name](), OUTPUTS[parser_name]
    previous: list[PartialCall] = []
    for end in range(len(text) + 1):
        calls = parser.partial_calls(text[:end])
        assert len(calls) >= len(previous)
        for old, new in zip(previous, calls, strict=False):
            assert old.name is None or new.name == old.name
            assert (new.arguments or "").startswith(old.arguments or "")
        previous = calls
    found = parser.extract(text)
    assert [(c.name, c.arguments) for c in found.calls] == [("get_weather", LONG_ARGS), ("get_time", TIME_ARGS)]
    assert [(c.name, c.arguments) for c in previous] == [("get_weather", LONG_ARGS), ("get_time", TIME_ARGS)]


def test_arguments_given_as_a_string_appear_once_closed() -> None:
    text = 'Checking.[TOOL_CALLS][{"name": "a", "arguments": "{\\"x\\": 1}"}]'
    parser = MistralToolParser()
    assert parser.partial_calls(text[:-8]) == [PartialCall("a", None)]
    assert parser.partial_calls(text) == [PartialCall("a", '{"x": 1}')] and parser.extract(text).calls[0].arguments == '{"x": 1}'


def stream_and_answer(app, body: dict) -> tuple[list[dict], dict]:
    events = sse_events(app.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [e["choices"][0] for e in events[:-1] if e["choices"]]
    return deltas, app.post("/v1/chat/completions", json=body).get_json()["choices"][0]


def argument_pieces(deltas: list[dict], index: int) -> list[str]:
    return [part["function"]["arguments"] for d in deltas for part in d["delta"].get("tool_calls") or []
            if part["index"] == index and part["function"].get("arguments")]


@pytest.mark.parametrize("parser_name", list(OUTPUTS))
def test_auto_streams_arguments_in_pieces(tiny_llama_dir, tokenizer, parser_name) -> None:
    tokens = tokenizer.encode(OUTPUTS[parser_name], add_special_tokens=False)
    app = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(tokens)), tool_call_parser=parser_name,
                   enable_auto_tool_choice=True)
    deltas, answer = stream_and_answer(app, {"messages": ASK, "tools": TOOLS, "max_tokens": 200})
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in answer["message"]["tool_calls"]]
    assert want == [("get_weather", LONG_ARGS), ("get_time", TIME_ARGS)]
    assert assemble(d["delta"] for d in deltas) == want
    assert len(argument_pieces(deltas, 0)) > 3
    first_call = next(k for k, d in enumerate(deltas) if d["delta"].get("tool_calls"))
    assert deltas[first_call]["delta"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    second_header = next(k for k, d in enumerate(deltas) for p in d["delta"].get("tool_calls") or [] if p.get("id")
                         and p["index"] == 1)
    assert second_header < len(deltas) - 2, "the second call was held back to the end"
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert "".join(d["delta"].get("content") or "" for d in deltas) == (answer["message"]["content"] or "")


@pytest.mark.parametrize("choice, output", [
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Paris", "days": 3}'),
    ("required", f'[{{"name": "get_weather", "parameters": {LONG_ARGS}}}]'),
], ids=["named", "required"])
def test_forced_choices_stream_arguments_in_pieces(tiny_llama_dir, tokenizer, choice, output) -> None:
    tokens = tokenizer.encode(output, add_special_tokens=False)
    app = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(tokens)))
    deltas, answer = stream_and_answer(app, {"messages": ASK, "tools": TOOLS, "tool_choice": choice,
                                             "max_tokens": 200})
    [call] = answer["message"]["tool_calls"]
    assert assemble(d["delta"] for d in deltas) == [(call["function"]["name"], call["function"]["arguments"])]
    assert json.loads(call["function"]["arguments"])["city"].startswith("Paris")
    assert len(argument_pieces(deltas, 0)) > 3
