"""langchain-openai against the real stack: `bind_tools` with a forced tool and `with_structured_output`.

The stack is the tiny model (random weights) behind an API that renders tools with a Hermes template
(`tests/test_tool_calls.py`'s `hermes_model_dir`). Only the grammar makes its output valid, so these tests
show that what LangChain sends (a Pydantic tool turned into a JSON schema, `tool_choice` naming it,
`response_format` json_schema) reaches the grammar, and that what comes back is what LangChain parses:
`AIMessage.tool_calls` (invoke and stream) and a Pydantic instance.
"""

from __future__ import annotations

from functools import reduce
from typing import Literal

import pytest
import requests
from pydantic import BaseModel, ConfigDict, Field
from test_tool_calls import hermes_model_dir  # noqa: F401 - fixture

pytest.importorskip("langchain_openai", reason="langchain-openai is a dev extra")
from langchain_openai import ChatOpenAI  # noqa: E402

KEY = "test-key"
ASK = "Weather in Paris for 3 days?"


class GetWeather(BaseModel):
    """Weather forecast for a city."""

    model_config = ConfigDict(extra="forbid")  # additionalProperties false: random weights would add keys forever
    city: str = Field(max_length=10)
    days: int = Field(ge=1, le=9)


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]


@pytest.fixture(scope="module")
def server(api_stack, hermes_model_dir) -> tuple[str, str]:  # noqa: F811 - fixture
    """(base URL, model id) of an API serving the Hermes-template copy of the tiny model."""
    proc, url = api_stack.spawn_api("api-langchain", "--model", hermes_model_dir, "--api-key", KEY, workers=1)
    api_stack.wait_healthy(url, watch=(proc,))
    models = requests.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    return f"{url}/v1", models["data"][0]["id"]


def chat_model(server: tuple[str, str], **kwargs) -> ChatOpenAI:
    base_url, model = server
    kwargs.setdefault("max_tokens", 120)
    return ChatOpenAI(model=model, base_url=base_url, api_key=KEY, max_retries=0, timeout=120, temperature=1.0,
                      **kwargs)


def check_weather_call(calls: list[dict]) -> None:
    [call] = calls
    assert call["name"] == "GetWeather" and call["id"].startswith("call_")
    GetWeather.model_validate(call["args"])


def test_bind_tools_forced_by_name(server) -> None:
    bound = chat_model(server, seed=3).bind_tools([GetWeather], tool_choice="GetWeather")
    message = bound.invoke(ASK)
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert message.invalid_tool_calls == []
    check_weather_call(message.tool_calls)

    chunks = list(bound.stream(ASK))
    assert len(chunks) > 1
    streamed = reduce(lambda a, b: a + b, chunks)
    assert streamed.invalid_tool_calls == []
    check_weather_call(streamed.tool_calls)


@pytest.mark.parametrize("seed", [1, 2])
def test_with_structured_output_json_schema(server, seed) -> None:
    # max_tokens: a string of 8 characters may take 48 tokens (\uXXXX escapes) on random weights
    structured = chat_model(server, seed=seed, max_tokens=300).with_structured_output(Person, method="json_schema")
    person = structured.invoke("Describe a person as JSON.")
    assert isinstance(person, Person)
    Person.model_validate(person.model_dump())
