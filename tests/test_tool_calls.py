"""Tool calling: the three parsers on fixed strings, the request checks, "auto" parsing over a scripted
broker, and end to end (the official openai client over HTTP -> `redserve api` -> Redis -> `redserve
engine` on the tiny model, random weights) for "required" / named choices, which only the grammar makes
valid, streamed and not, and a tool-role round trip.

The tiny model's ChatML template ignores `tools`, so the end-to-end API serves a copy of the model whose
tokenizer_config carries `HERMES_TEMPLATE` (Hermes / Qwen style: tools in the system turn, calls as
<tool_call> blocks, tool results as "tool" turns); the engine runs the original (same weights, same
tokenizer).
"""

from __future__ import annotations

import json
import os
import shutil

import openai
import pytest
from fake_broker import FakeClient, make_app, sse_events, token_script
from openai import OpenAI

from api.errors import ApiError
from api.protocol import parse_chat_request
from api.tokenizer import ModelTokenizer
from api.tool_parsers import HermesToolParser, Llama3JsonToolParser, MistralToolParser, ToolCall

KEY = "test-key"
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{%- if message.content %}{{ '\n' + message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": \
{{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
ASK = [{"role": "user", "content": "Weather in Paris for 3 days, and the time?"}]


def check_call(name: str, arguments: str) -> None:
    """The call names a tool and its arguments parse and match that tool's schema (checked by hand)."""
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "days"} and isinstance(args["city"], str) and len(args["city"]) <= 10
        assert type(args["days"]) is int and 1 <= args["days"] <= 9
    else:
        assert name == "get_time" and args in ({"zone": "utc"}, {"zone": "cet"}), (name, args)


# ------------------------------------------------------------------------------------------ parsers

def test_hermes_parser_content_and_calls() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>')
    found = HermesToolParser().extract(text)
    assert found.content == "Let me check."
    assert found.calls == [ToolCall("get_weather", '{"city": "Paris", "days": 3}'),
                           ToolCall("get_time", '{"zone": "utc"}')]
    unterminated = HermesToolParser().extract('<tool_call>{"name": "f", "arguments": {}}')
    assert unterminated.content is None and unterminated.calls == [ToolCall("f", "{}")]


@pytest.mark.parametrize("parser, text", [
    (HermesToolParser(), 'Hi <tool_call>{"name": "f", "arguments": {"a": </tool_call>'),
    (HermesToolParser(), '<tool_call>{"arguments": {}}</tool_call>'),
    (Llama3JsonToolParser(), '{"name": "f", "parameters": {"a": 1}'),
    (Llama3JsonToolParser(), '{"value": 1}'),
    (MistralToolParser(), '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}'),
    (MistralToolParser(), "no calls at all"),
])
def test_malformed_or_absent_calls_stay_content(parser, text) -> None:
    found = parser.extract(text)
    assert found.calls == [] and found.content == text


def test_llama3_json_parser() -> None:
    found = Llama3JsonToolParser().extract('{"name": "get_time", "parameters": {"zone": "cet"}}')
    assert found.content is None and found.calls == [ToolCall("get_time", '{"zone": "cet"}')]
    found = Llama3JsonToolParser().extract(
        'Sure.<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert found.content == "Sure." and found.calls == [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")]
    assert Llama3JsonToolParser().extract("Plain answer.").calls == []


def test_mistral_parser() -> None:
    found = MistralToolParser().extract(
        'Checking.[TOOL_CALLS][{"name": "a", "arguments": {"x": "é"}}, {"name": "b", "arguments": "{}"}]')
    assert found.content == "Checking." and found.calls == [ToolCall("a", '{"x": "é"}'), ToolCall("b", "{}")]


def test_content_prefix_holds_back_only_what_may_be_a_call() -> None:
    assert HermesToolParser().content_prefix("Sure, <tool") == len("Sure, ")
    assert HermesToolParser().content_prefix('Hi <tool_call>{"name"') == len("Hi ")
    assert HermesToolParser().content_prefix("Plain < text") == len("Plain < text")
    assert MistralToolParser().content_prefix("ok [TOOL_") == len("ok ")
    assert Llama3JsonToolParser().content_prefix(' {"name"') == 0
    assert Llama3JsonToolParser().content_prefix("Hello <|py") == len("Hello ")


# ------------------------------------------------------------------------------------------ requests

@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_fields_are_400s(body, param) -> None:
    with pytest.raises(ApiError) as e:
        parse_chat_request({"messages": ASK, **body})
    assert e.value.status == 400 and e.value.param == param


def test_forced_choices_become_grammars() -> None:
    required = parse_chat_request({"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                   "parallel_tool_calls": False})
    schema = json.loads(required.params.structured_output["value"])
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    named = parse_chat_request({"messages": ASK, "tools": TOOLS,
                                "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert json.loads(named.params.structured_output["value"]) == CLOCK
    assert parse_chat_request({"messages": ASK, "tools": TOOLS}).tools.choice == "auto"
    assert parse_chat_request({"messages": ASK, "tools": TOOLS, "tool_choice": "none"}).params.structured_output is None


# ------------------------------------------------------------------------------ "auto", scripted broker

HERMES_OUTPUT = 'Checking.<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'


def test_auto_parses_a_hermes_block(tiny_llama_dir, tokenizer) -> None:
    client = FakeClient(token_script(tokenizer.encode(HERMES_OUTPUT, add_special_tokens=False)))
    app = make_app(tiny_llama_dir, tokenizer, client, tool_call_parser="hermes", enable_auto_tool_choice=True)
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 100}
    message = app.post("/v1/chat/completions", json=body).get_json()["choices"][0]
    assert message["finish_reason"] == "tool_calls" and message["message"]["content"] == "Checking."
    [call] = message["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "utc"}'}

    events = sse_events(app.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Checking."
    assert assemble(d["delta"] for d in deltas) == [("get_time", '{"zone": "utc"}')]
    assert deltas[-1]["finish_reason"] == "tool_calls"

    plain = app.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).get_json()["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": HERMES_OUTPUT}


def test_auto_streams_plain_content_as_it_comes(tiny_llama_dir, tokenizer) -> None:
    text = "No tool is needed < here; the answer is four."
    client = FakeClient(token_script(tokenizer.encode(text, add_special_tokens=False)))
    app = make_app(tiny_llama_dir, tokenizer, client, tool_call_parser="hermes", enable_auto_tool_choice=True)
    events = sse_events(app.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "stream": True,
                                                              "max_tokens": 100}))
    choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
    early = [c for c in choices if c["finish_reason"] is None and c["delta"].get("content")]
    assert len(early) > 3 and "".join(c["delta"].get("content") or "" for c in choices) == text
    assert choices[-1]["finish_reason"] == "length" and not any("tool_calls" in c["delta"] for c in choices)


def test_auto_without_the_server_flag_is_a_400(tiny_llama_dir, tokenizer) -> None:
    app = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script([5])), tool_call_parser="hermes")
    answer = app.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})
    assert answer.status_code == 400 and "--enable-auto-tool-choice" in answer.get_json()["error"]["message"]


def assemble(deltas) -> list[tuple[str, str]]:
    """OpenAI stream deltas -> [(name, arguments)] (as clients reassemble them, by tool-call index)."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for part in delta.get("tool_calls") or []:
            if "id" in part:
                assert part["id"].startswith("call_") and part["type"] == "function"
                calls[part["index"]] = [part["function"]["name"], ""]
            calls[part["index"]][1] += part["function"].get("arguments") or ""
    return [tuple(calls[i]) for i in sorted(calls)]


# ------------------------------------------------------------------------------------------ end to end

@pytest.fixture(scope="module")
def hermes_model_dir(tiny_llama_dir, tmp_path_factory) -> str:
    copy = tmp_path_factory.mktemp("hermes") / os.path.basename(tiny_llama_dir)
    shutil.copytree(tiny_llama_dir, copy)
    config_path = copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    return str(copy)


@pytest.fixture(scope="module")
def client(api_stack, hermes_model_dir) -> OpenAI:
    proc, base_url = api_stack.spawn_api("api-tools", "--model", hermes_model_dir, "--api-key", KEY,
                                         "--tool-call-parser", "hermes", "--enable-auto-tool-choice", workers=1)
    api_stack.wait_healthy(base_url, watch=(proc,))
    return OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_required_always_yields_valid_calls(client, model) -> None:
    # max_tokens left to the context: with parallel calls allowed, random weights may list many calls
    reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           n=4, temperature=1.0, seed=1)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            check_call(call.function.name, call.function.arguments)


def test_named_choice_and_streaming_reassemble_to_the_same_call(client, model) -> None:
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=7, max_tokens=100,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    reply = client.chat.completions.create(**kwargs)
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "tool_calls"
    check_call(call.function.name, call.function.arguments)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices]
    assert assemble(deltas) == [(call.function.name, call.function.arguments)]
    pieces = [p["function"]["arguments"] for d in deltas for p in d.get("tool_calls") or []
              if p["function"].get("arguments")]
    assert len(pieces) > 1, "the arguments came in one piece, not as they were written"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_parallel_tool_calls_false_yields_one_call(client, model) -> None:
    reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, n=4, temperature=1.0, seed=2, max_tokens=150)
    for choice in reply.choices:
        [call] = choice.message.tool_calls
        check_call(call.function.name, call.function.arguments)


def test_tool_role_round_trip_renders(client, model, hermes_model_dir) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    text = ModelTokenizer(hermes_model_dir).render_chat(history, True, TOOLS)
    assert '"name": "get_weather"' in text and "<|im_start|>tool\n12:00" in text
    assert '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>' in text
    reply = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=5)
    assert reply.choices[0].message.tool_calls is None and reply.usage.prompt_tokens > 20


def test_auto_needs_the_flag_over_http(api_stack, model) -> None:
    plain = OpenAI(base_url=f"{api_stack.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        plain.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=5)


def test_server_flags_are_parsed_and_checked(tiny_llama_dir) -> None:
    from api.config import ApiConfig
    from redserve.cli import build_parser

    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ApiConfig(model=tiny_llama_dir, redis_url="redis://127.0.0.1:1/0", enable_auto_tool_choice=True)
    args = build_parser().parse_args(["api", "--model", tiny_llama_dir, "--redis-url", "redis://x:1/0",
                                      "--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"])
    config = ApiConfig.from_args(args)
    assert config.tool_call_parser == "llama3_json" and config.enable_auto_tool_choice
