"""POST /v1/responses (OpenAI's Responses API): the body's translation to a chat request, the answer and
stream shapes over a scripted broker, and end to end (the official openai client's `responses.create`
over HTTP -> `redserve api` -> Redis -> `redserve engine` on the tiny model, random weights): plain and
message-list input, streaming, structured output, tool calls and a tool-result turn, greedy equality with
/v1/chat/completions, and the errors.

The end-to-end API serves the Hermes-template copy of the tiny model (tests/test_tool_calls.py) with the
hermes parser and auto tool choice, so earlier calls and their results render into the prompt.
"""

from __future__ import annotations

import json

import openai
import pytest
import requests
from fake_broker import FakeClient, make_app, token_script
from hypothesis import event, given
from hypothesis import strategies as st
from openai import OpenAI
from openai.types import responses as types
from pydantic import TypeAdapter
from test_api_fuzz import FUZZ, INTS, JSON_VALUES, SAMPLING, TEXTS, bodies, echo_script
from test_tool_calls import check_call, hermes_model_dir  # noqa: F401 - fixture

from api.errors import ApiError
from api.responses_protocol import parse_responses_request

KEY = "test-key"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": CLOCK, "strict": True}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
HERMES_OUTPUT = 'Checking.<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


def squeeze(kinds: list[str]) -> list[str]:
    """Event types with runs of the same type written once (the deltas)."""
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


def error_of(call) -> dict:
    with pytest.raises(ApiError) as caught:
        call()
    return {"status": caught.value.status, "param": caught.value.param, "message": caught.value.message}


# ------------------------------------------------------------------------------------------ the body

def test_input_items_become_chat_messages() -> None:
    request = parse_responses_request({"model": "m", "instructions": "Be brief.", "input": [
        {"role": "user", "content": "Time?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"zone": "utc"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": '{"zone": "cet"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "13:00"}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
    ], "tools": TOOLS, "tool_choice": "none"})
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_time", "arguments": args}}
             for i, args in ((1, '{"zone": "utc"}'), (2, '{"zone": "cet"}'))]
    assert request.chat.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00", "name": "get_time"},
        {"role": "tool", "tool_call_id": "call_2", "content": "13:00", "name": "get_time"},
        {"role": "system", "content": "a\nb"}]
    assert request.chat.tools.tools[1] == {"type": "function", "function": {"name": "get_time", "parameters": CLOCK,
                                                                            "strict": True}}
    assert request.chat.tools.choice == "none" and request.chat.params.max_tokens is None


def test_fields_map_to_the_chat_request() -> None:
    request = parse_responses_request({"input": "hi", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                                       "top_k": 3, "user": "u", "metadata": {"k": "v"}, "store": True,
                                       "tool_choice": {"type": "function", "name": "get_time"}, "tools": TOOLS,
                                       "parallel_tool_calls": False, "n": 4, "max_tokens": 99})
    params = request.chat.params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.n) == (7, 0.5, 0.9, 3, 1)
    assert request.chat.messages == [{"role": "user", "content": "hi"}] and request.chat.user == "u"
    assert request.chat.tools.choice == "function" and request.chat.tools.function_name == "get_time"
    assert json.loads(params.structured_output["value"]) == CLOCK and not request.chat.tools.parallel
    assert request.metadata == {"k": "v"} and request.text == {"format": {"type": "text"}}
    schema = parse_responses_request({"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}})
    assert schema.chat.params.structured_output == {"kind": "json_schema", "value": json.dumps(PERSON)}
    json_object = parse_responses_request({"input": "hi", "text": {"format": {"type": "json_object"}}})
    assert json_object.chat.params.structured_output == {"kind": "json_object"}


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": 5}, "input", "string or a non-empty array"),
    ({"input": []}, "input", "non-empty array"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", "only text"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "must be one of"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "non-empty"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]", "does not store"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "does not store"),
    ({"input": [{"type": "web_search_call"}]}, "input[0]", "not supported"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "does not store responses"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "does not store responses"),
    ({"input": "hi", "background": True}, "background", "does not store responses"),
    ({"input": "hi", "store": "yes"}, "store", "boolean"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "'web_search' are not supported"),
    ({"input": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "flat"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice", "must be"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": PERSON}}}, "text.format.name", "name"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format.schema", "schema"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type", "'xml'"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "nonsense"}}}},
     "text.format", "'text.format' cannot be compiled"),
    ({"input": "hi", "max_output_tokens": "9"}, "max_output_tokens", "integer"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature", "temperature"),
    ({"input": "hi", "metadata": {"k": 1}}, "metadata", "strings"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning", "not a reasoning model"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "disabled"),
    ({"input": "hi", "instructions": ["x"]}, "instructions", "string"),
])
def test_bad_bodies_are_400s_naming_the_responses_field(body, param, words) -> None:
    error = error_of(lambda: parse_responses_request(body))
    assert error["status"] == 400 and error["param"] == param and words in error["message"], error
    assert "max_tokens" not in error["message"] and "response_format" not in error["message"]


# ------------------------------------------------------------------------------------------ scripted broker

def test_sse_body_names_events_and_sends_no_done() -> None:
    from api.app import sse_body

    def chunks():
        yield {"type": "response.created", "text": "é"}
        yield ApiError(500, "boom")

    assert list(sse_body(chunks(), named_events=True)) == [
        'event: response.created\ndata: {"type":"response.created","text":"é"}\n\n',
        'event: error\ndata: {"type": "error", "code": "server_error", "message": "boom", "param": null}\n\n']


STREAM_EVENT = TypeAdapter(types.ResponseStreamEvent)


def answer_of(response) -> dict:
    """A non-streamed answer, validated (strictly: pydantic, every required field) as the SDK's Response."""
    answer = response.get_json()
    types.Response.model_validate(answer)
    return answer


def events_of(response) -> list[dict]:
    """The named events of a Responses stream (each event line checked against its data's type; each event
    validated strictly as the SDK's stream event)."""
    events = []
    for block in response.get_data(as_text=True).split("\n\n"):
        if block:
            name, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert name == f"event: {event['type']}"
            assert type(STREAM_EVENT.validate_python(event)).__name__.endswith("Event")
            events.append(event)
    return events


def test_auto_tool_call_answer_and_stream(tiny_llama_dir, tokenizer) -> None:
    tokens = tokenizer.encode(HERMES_OUTPUT, add_special_tokens=False)
    client = FakeClient(token_script([*tokens, tokens[0]], finish="stop"))  # the last: the hidden stop token
    app = make_app(tiny_llama_dir, tokenizer, client, tool_call_parser="hermes", enable_auto_tool_choice=True)
    body = {"input": "Time?", "tools": TOOLS, "max_output_tokens": 100}
    answer = answer_of(app.post("/v1/responses", json=body))
    message, call = answer["output"]
    assert answer["status"] == "completed" and message["content"][0]["text"] == "Checking."
    assert call["type"] == "function_call" and call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert (call["name"], call["arguments"], call["status"]) == ("get_time", '{"zone": "utc"}', "completed")

    events = events_of(app.post("/v1/responses", json={**body, "stream": True}))
    assert squeeze([e["type"] for e in events]) == [*TEXT_EVENTS, *CALL_EVENTS, "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert sum(e["type"] == "response.function_call_arguments.delta" for e in events) > 1
    final = events[-1]["response"]
    assert [(i["type"], i["status"]) for i in final["output"]] == [("message", "completed"),
                                                                   ("function_call", "completed")]
    assert final["output"][1]["arguments"] == "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1]


def test_stream_cut_by_max_output_tokens_is_incomplete(tiny_llama_dir, tokenizer) -> None:
    app = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(list(range(100, 140)))))
    events = events_of(app.post("/v1/responses", json={"input": "hi", "max_output_tokens": 5, "stream": True}))
    assert squeeze([e["type"] for e in events]) == [*TEXT_EVENTS, "response.incomplete"]
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete" and final["usage"]["output_tokens"] == 5
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert final["output"][0]["content"][0]["text"] == text


def test_engine_failure_mid_stream_is_an_error_event(tiny_llama_dir, tokenizer) -> None:
    from protocol.messages import ErrorCode, RequestOutput

    def script(add):
        return [RequestOutput(add.request_id, 0, [100], num_prompt_tokens=3),
                RequestOutput(add.request_id, 0, [], "error", error_code=ErrorCode.ENGINE_FAILED,
                              error_message="boom")]

    app = make_app(tiny_llama_dir, tokenizer, FakeClient(script))
    events = events_of(app.post("/v1/responses", json={"input": "hi", "stream": True}))
    assert events[-1]["type"] == "error" and events[-1]["message"] == "boom"
    assert events[-1]["sequence_number"] == len(events) - 1 and events[-1]["code"] == ErrorCode.ENGINE_FAILED.value


# Valid JSON never gets a 500 (as tests/test_api_fuzz.py for the other endpoints): fuzzed bodies of mostly
# what a client would send, some edge values and any JSON; every answer is an error body or validates as the
# SDK's Response / stream events, and a stream ends in response.completed or response.incomplete.
FUNCTION_CALLS = st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.text(max_size=4),
                                        "name": st.sampled_from(["get_time", ""]),
                                        "arguments": st.sampled_from(['{"zone": "utc"}', "{"])})
CALL_OUTPUTS = st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.text(max_size=4),
                                      "output": TEXTS | JSON_VALUES})
PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                        "text": TEXTS}), max_size=2)
MESSAGES = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]),
                                  "content": TEXTS | PARTS})
ITEMS = st.lists(MESSAGES | FUNCTION_CALLS | CALL_OUTPUTS | JSON_VALUES, min_size=1, max_size=4)
FORMATS = st.sampled_from([{"type": "json_object"}, {"type": "json_schema", "name": "p", "schema": PERSON},
                           {"type": "json_schema", "name": "p", "schema": {"type": "nonsense"}}, {"type": "xml"}])
RESPONSES_FIELDS = {
    **{name: SAMPLING[name] for name in ("temperature", "top_p", "top_k", "seed", "stop", "stream", "user", "model")},
    "input": (TEXTS.filter(bool) | ITEMS, JSON_VALUES), "instructions": (TEXTS, JSON_VALUES),
    "max_output_tokens": (st.integers(1, 100), INTS),
    "text": (st.just({"format": {"type": "text"}}), st.fixed_dictionaries({"format": FORMATS}) | JSON_VALUES),
    "tools": (st.just(TOOLS), st.lists(JSON_VALUES, max_size=1) | st.just([{"type": "web_search"}])),
    "tool_choice": (st.sampled_from(["none", "auto", "required", {"type": "function", "name": "get_time"}]),
                    JSON_VALUES),
    "parallel_tool_calls": (st.booleans(), JSON_VALUES), "metadata": (st.just({"k": "v"}), JSON_VALUES),
    "store": (st.booleans(), JSON_VALUES), "previous_response_id": (st.none(), st.text(max_size=5)),
    "background": (st.just(False), JSON_VALUES), "include": (st.just([]), JSON_VALUES),
    "reasoning": (st.none(), JSON_VALUES), "truncation": (st.just("disabled"), JSON_VALUES),
}


@pytest.fixture(scope="module")
def fuzz_app(tiny_llama_dir, tokenizer):
    return make_app(tiny_llama_dir, tokenizer, FakeClient(echo_script, max_model_len=64), tool_call_parser="hermes",
                    enable_auto_tool_choice=True)


@FUZZ
@given(body=bodies(RESPONSES_FIELDS, ("input",)) | JSON_VALUES)
def test_fuzz_responses(fuzz_app, body) -> None:
    response = fuzz_app.post("/v1/responses", data=json.dumps(body), content_type="application/json")
    status = response.status_code
    assert status != 500 and status < 600, f"{status} for {body!r}: {response.get_data(as_text=True)[:500]}"
    if status >= 400:
        error = response.get_json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    elif response.mimetype == "text/event-stream":
        assert events_of(response)[-1]["type"] in ("response.completed", "response.incomplete"), body
    else:
        answer_of(response)
    event(f"status {status}")


# ------------------------------------------------------------------------------------------ end to end

@pytest.fixture(scope="module")
def base_url(api_stack, hermes_model_dir) -> str:  # noqa: F811 - the fixture imported above
    proc, url = api_stack.spawn_api("api-responses", "--model", hermes_model_dir, "--api-key", KEY,
                                    "--tool-call-parser", "hermes", "--enable-auto-tool-choice", workers=1)
    api_stack.wait_healthy(url, watch=(proc,))
    return url


@pytest.fixture(scope="module")
def client(base_url) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def prompt_tokens(base_url: str, messages: list[dict]) -> int:
    """The token count of `messages` rendered with the chat template (/tokenize)."""
    answer = requests.post(f"{base_url}/tokenize", json={"messages": messages},
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    return answer.json()["count"]


def generated_tokens(base_url: str) -> float:
    """redserve:generation_tokens_total on /metrics (the API's request metrics, summed over workers)."""
    text = requests.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("redserve:generation_tokens_total{", "redserve:generation_tokens_total ")))


def test_text_input_with_instructions_cut_by_max_output_tokens(client, model, base_url) -> None:
    generated_before = generated_tokens(base_url)
    reply = client.responses.create(model=model, input="Tell me a story.", instructions="Be brief.",
                                    max_output_tokens=5, temperature=1.0, metadata={"run": "1"}, user="u1")
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == model
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    [message] = reply.output
    assert isinstance(message, types.ResponseOutputMessage) and message.id.startswith("msg_")
    assert message.role == "assistant" and message.status == "incomplete"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert reply.output_text == message.content[0].text
    assert (reply.instructions, reply.max_output_tokens, reply.temperature, reply.top_p) == ("Be brief.", 5, 1.0, 1.0)
    assert reply.metadata == {"run": "1"} and reply.user == "u1" and reply.store is False
    assert reply.previous_response_id is None and reply.tools == [] and reply.tool_choice == "auto"
    assert reply.text.format.type == "text" and reply.parallel_tool_calls is True
    usage = reply.usage
    assert usage.output_tokens == 5 and usage.total_tokens == usage.input_tokens + 5
    # Prefix-cache hits are whole 16-token blocks, and an earlier test may have cached this chat template's start
    # (the exact counts: tests/test_cached_tokens.py).
    cached = usage.input_tokens_details.cached_tokens
    assert cached % 16 == 0 and 0 <= cached < usage.input_tokens and usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens == prompt_tokens(base_url, [{"role": "system", "content": "Be brief."},
                                                          {"role": "user", "content": "Tell me a story."}])
    assert generated_tokens(base_url) - generated_before == 5  # counted in /metrics as the other endpoints


CONVERSATION = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"type": "message", "role": "user", "content": "Name three colours."}]
AS_CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Name three colours."}]


def test_greedy_message_list_equals_chat_completions(client, model, base_url) -> None:
    reply = client.responses.create(model=model, input=CONVERSATION, instructions="You are terse.",
                                    max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model=model, messages=AS_CHAT, max_tokens=12, temperature=0)
    assert reply.output_text == chat.choices[0].message.content and reply.output_text
    assert reply.usage.input_tokens == chat.usage.prompt_tokens == prompt_tokens(base_url, AS_CHAT)
    assert reply.usage.output_tokens == chat.usage.completion_tokens


EVENT_CLASSES = {"response.created": types.ResponseCreatedEvent, "response.in_progress": types.ResponseInProgressEvent,
                 "response.output_item.added": types.ResponseOutputItemAddedEvent,
                 "response.content_part.added": types.ResponseContentPartAddedEvent,
                 "response.output_text.delta": types.ResponseTextDeltaEvent,
                 "response.output_text.done": types.ResponseTextDoneEvent,
                 "response.content_part.done": types.ResponseContentPartDoneEvent,
                 "response.output_item.done": types.ResponseOutputItemDoneEvent,
                 "response.function_call_arguments.delta": types.ResponseFunctionCallArgumentsDeltaEvent,
                 "response.function_call_arguments.done": types.ResponseFunctionCallArgumentsDoneEvent,
                 "response.completed": types.ResponseCompletedEvent,
                 "response.incomplete": types.ResponseIncompleteEvent}


def check_typed(events: list) -> None:
    """Every event parsed into its own SDK class, numbered from 0 in order, one response id throughout."""
    for sent in events:
        assert isinstance(sent, EVENT_CLASSES[sent.type]), (sent.type, type(sent))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1


def test_streamed_text_adds_up_to_the_answer(client, model) -> None:
    kwargs = dict(model=model, input=CONVERSATION, instructions="You are terse.", max_output_tokens=12, temperature=0)
    events = list(client.responses.create(**kwargs, stream=True))
    check_typed(events)
    assert squeeze([e.type for e in events]) == [*TEXT_EVENTS, "response.incomplete"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert len(deltas) > 1 and "".join(deltas) == final.output_text == client.responses.create(**kwargs).output_text
    assert final.status == "incomplete" and final.usage.output_tokens == 12
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == final.output_text and done.item_id == final.output[0].id
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_json_schema_and_json_object_formats(client, model) -> None:
    text_format = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    for seed in (1, 2):
        reply = client.responses.create(model=model, input="Describe a person.", text={"format": text_format},
                                        max_output_tokens=120, temperature=1.0, extra_body={"seed": seed})
        assert reply.status == "completed" and reply.text.format.type == "json_schema"
        person = json.loads(reply.output_text)
        assert set(person) == {"name", "age"} and isinstance(person["name"], str) and len(person["name"]) <= 12
        assert type(person["age"]) is int and 0 <= person["age"] <= 150
    # random weights need not ever close a free-form object (see test_structured_output.py): an object's start
    reply = client.responses.create(model=model, input="Some JSON.", text={"format": {"type": "json_object"}},
                                    max_output_tokens=20, temperature=1.0, extra_body={"seed": 3})
    assert reply.output_text.startswith("{") and reply.text.format.type == "json_object"


def test_required_tool_choice_yields_function_calls(client, model) -> None:
    kwargs = dict(model=model, input="Weather in Paris, and the time?", tools=TOOLS, tool_choice="required",
                  temperature=1.0, max_output_tokens=200, extra_body={"seed": 1})
    reply = client.responses.create(**kwargs)
    assert reply.status == "completed" and reply.output and reply.tool_choice == "required"
    for call in reply.output:
        assert isinstance(call, types.ResponseFunctionToolCall) and call.status == "completed"
        assert call.id.startswith("fc_") and call.call_id.startswith("call_")
        check_call(call.name, call.arguments)
    assert [t.name for t in reply.tools] == ["get_weather", "get_time"]
    events = list(client.responses.create(**kwargs, stream=True))
    check_typed(events)
    kinds = squeeze([e.type for e in events])
    assert kinds == ["response.created", "response.in_progress", *CALL_EVENTS * len(reply.output), "response.completed"]
    streamed = events[-1].response.output
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in reply.output]
    for index, call in enumerate(streamed):
        assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                       and e.output_index == index) == call.arguments


def test_named_tool_streamed_then_its_result_in_the_next_turn(client, model) -> None:
    ask = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    with client.responses.stream(model=model, input=ask, tools=TOOLS, temperature=1.0, max_output_tokens=100,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 extra_body={"seed": 7}) as stream:
        events = list(stream)
        reply = stream.get_final_response()
    check_typed(events)
    assert squeeze([e.type for e in events]) == ["response.created", "response.in_progress", *CALL_EVENTS,
                                                 "response.completed"]
    [call] = reply.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    check_call(call.name, call.arguments)
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == call.arguments
    assert reply.tool_choice.name == "get_weather"

    turn = [*ask, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}]
    follow = client.responses.create(model=model, input=turn, tools=TOOLS, tool_choice="none",
                                     max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model=model, max_tokens=6, temperature=0, tool_choice="none", messages=[
        *ask, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C."}],
        tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS])
    assert follow.output[0].type == "message" and follow.output_text == chat.choices[0].message.content
    assert follow.usage.input_tokens == chat.usage.prompt_tokens


def test_errors_over_http(client, model) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="hi", previous_response_id="resp_123")
    assert caught.value.body["param"] == "previous_response_id"
    assert "does not store responses" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input=123)
    assert caught.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="hi", tools=[{"type": "web_search"}])
    assert caught.value.body["param"] == "tools" and "web_search" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="no-such-model", input="hi")
    assert caught.value.body["param"] == "model" and caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="hi " * 5000, max_output_tokens=5)
    assert caught.value.body["param"] == "input" and caught.value.body["code"] == "context_length_exceeded"
