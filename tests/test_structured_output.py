"""Structured outputs end to end: the official openai client over HTTP -> `redserve api` -> Redis ->
`redserve engine` on the tiny model (random weights, so only the grammar makes the output valid).

The SmolLM2 (real weights) check lives in test_smollm2.py, next to the stack it reuses.
"""

from __future__ import annotations

import json
import re
import threading

import openai
import pytest
from openai import OpenAI

from engine.structured_output import StructuredOutputs
from protocol.grammar_spec import grammar_from_spec, spec_error

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pet": {"enum": ["cat", "dog", "none"]},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "admin"],
    "additionalProperties": False,
}


def check_person(text: str) -> None:
    """A by-hand check of PERSON (jsonschema is not installed)."""
    value = json.loads(text)
    assert set(value) == {"name", "age", "pet", "admin"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert type(value["age"]) is int and 0 <= value["age"] <= 150
    assert value["pet"] in ("cat", "dog", "none") and type(value["admin"]) is bool


def chat(client: OpenAI, model: str, **kwargs):
    kwargs.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe a person."}],
                                          **kwargs)


def test_json_schema_response_format_parses_and_validates(client, model) -> None:
    reply = chat(client, model, n=3, temperature=1.0, seed=7, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        check_person(choice.message.content)


def test_guided_json_and_structured_outputs_on_completions(client, model) -> None:
    for extra in ({"guided_json": PERSON}, {"structured_outputs": {"json": PERSON}}):
        reply = client.completions.create(model=model, prompt="def hello(", max_tokens=120, temperature=1.0, seed=3,
                                          extra_body=extra)
        assert reply.choices[0].finish_reason == "stop"
        check_person(reply.choices[0].text)


def test_regex_output_fully_matches(client, model) -> None:
    pattern = r"[A-Z][a-z]{2,6}-[0-9]{3}"
    reply = client.completions.create(model=model, prompt="import os\n", max_tokens=30, n=2, temperature=1.0,
                                      seed=1, extra_body={"guided_regex": pattern})
    for choice in reply.choices:
        assert re.fullmatch(pattern, choice.text), choice.text
        assert choice.finish_reason == "stop"


def test_choice_output_is_one_of_the_choices(client, model) -> None:
    choices = ["positive", "negative", "neutral"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        reply = chat(client, model, n=4, temperature=1.0, seed=5, extra_body=extra)
        assert {c.message.content for c in reply.choices} <= set(choices)
        assert all(c.finish_reason == "stop" for c in reply.choices)


def test_lark_grammar_output_parses(client, model) -> None:
    grammar = 'start: "SELECT " COLUMN " FROM " TABLE\nCOLUMN: "id" | "name"\nTABLE: /[a-z]{1,8}/'
    reply = chat(client, model, temperature=1.0, seed=2, extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"SELECT (id|name) FROM [a-z]{1,8}", reply.choices[0].message.content)


def test_json_object_parses_and_streams(client, model) -> None:
    """Random weights need not ever close a free-form object: every choice that stopped parses, every
    one is an object's prefix (SmolLM2 in test_smollm2.py must close it)."""
    reply = chat(client, model, n=6, temperature=1.0, seed=4, max_tokens=60, response_format={"type": "json_object"})
    stopped = [c.message.content for c in reply.choices if c.finish_reason == "stop"]
    assert stopped and all(isinstance(json.loads(text), dict) for text in stopped)
    assert all(c.message.content.startswith("{") for c in reply.choices)
    stream = chat(client, model, n=6, temperature=1.0, seed=4, max_tokens=60, stream=True,
                  response_format={"type": "json_object"})
    texts = [""] * 6
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in reply.choices]


def test_text_response_format_is_unconstrained(client, model) -> None:
    plain = chat(client, model, temperature=0.0, max_tokens=10)
    text = chat(client, model, temperature=0.0, max_tokens=10, response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("kwargs, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
    ({"extra_body": {"guided_grammar": "start: undefined_rule"}}, "guided_grammar"),
    ({"extra_body": {"guided_choice": ["a"], "guided_regex": "a"}}, "guided_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_uncompilable_grammars_are_a_400_naming_the_field(client, model, kwargs, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, model, **kwargs)
    assert info.value.body["param"] == param, info.value.body


def test_unconstrained_neighbour_is_unaffected(client, model) -> None:
    """A greedy request gives the same tokens alone and batched with constrained ones."""
    def plain():
        return client.completions.create(model=model, prompt="The quick brown fox", max_tokens=24,
                                         temperature=0.0, logprobs=0).choices[0].logprobs.tokens

    alone = plain()
    constrained: dict[str, object] = {}
    go = threading.Barrier(3)

    def neighbour(extra):
        go.wait()
        constrained[next(iter(extra))] = client.completions.create(
            model=model, prompt="def hello(", max_tokens=60, n=2, temperature=1.0, seed=9, extra_body=extra)

    threads = [threading.Thread(target=neighbour, args=(extra,))
               for extra in ({"guided_json": PERSON}, {"guided_regex": "[a-z ]{30,50}"})]
    for t in threads:
        t.start()
    go.wait()
    batched = plain()
    for t in threads:
        t.join(timeout=120)
    assert batched == alone
    for choice in constrained["guided_json"].choices:
        check_person(choice.text)
    assert all(re.fullmatch("[a-z ]{30,50}", c.text) for c in constrained["guided_regex"].choices)


def test_spec_errors_and_masks_without_a_server(tiny_llama_dir) -> None:
    assert spec_error({"kind": "json_schema", "value": json.dumps(PERSON)}) is None
    assert "nonsense" in spec_error({"kind": "json_schema", "value": '{"type": "nonsense"}'})
    assert spec_error({"kind": "choice", "value": []})
    assert grammar_from_spec({"kind": "json_object"})
    outputs = StructuredOutputs(tiny_llama_dir, 1024, [0])
    matcher = outputs.matcher({"kind": "choice", "value": ["yes", "no"]})
    mask = outputs.bitmasks([("r", matcher)])["r"]
    assert len(mask) == 1024 // 8
    allowed = [t for t in range(1024) if mask[t // 8] >> (t % 8) & 1]
    assert 0 < len(allowed) < 10  # only tokens that start "yes" or "no"


def test_tensor_parallel_workers_apply_the_engine_masks(tiny_llama_dir) -> None:
    """The masks travel with the scheduler output, so both TP ranks sample under the same mask."""
    from engine import LLM, SamplingParams

    llm = LLM(model=tiny_llama_dir, dtype="float32", tensor_parallel_size=2, num_kv_blocks=128)
    try:
        out = llm.generate(["hello", "world"], [
            SamplingParams(temperature=1.0, seed=1, max_tokens=40, n=2,
                           structured_output={"kind": "regex", "value": "[0-9]{4}-[a-z]{3}"}),
            SamplingParams(temperature=0.0, max_tokens=10)])
    finally:
        llm.shutdown()
    assert all(re.fullmatch("[0-9]{4}-[a-z]{3}", c.text) and c.finish_reason == "stop" for c in out[0].outputs)
    assert out[1].outputs[0].finish_reason == "length"
