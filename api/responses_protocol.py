"""Request bodies of /v1/responses (OpenAI's Responses API), read as a chat request.

Rules:
- A Responses body is turned into a chat-completions body and parsed by `api.protocol.parse_chat_request`,
  so sampling, structured output, tools and all their checks are the chat endpoint's; `ResponsesRequest`
  holds that `ChatRequest` and what the answer echoes. Unknown fields are ignored, as on chat.
- `input`: a string (one user message) or a non-empty array of input items: messages (`type` "message"
  or absent; `role` user, assistant, system or developer (a system message); `content` a string or an
  array of input_text / output_text parts), `function_call` items (a call of an earlier turn: the
  assistant message's `tool_calls`, consecutive calls in one message) and `function_call_output` items
  (a "tool" message). `instructions` is a system message in front of them.
- `max_output_tokens` is chat's max_completion_tokens (absent: up to the context); `text.format` text /
  json_object / json_schema ({type, name, schema, strict}, flat) is chat's response_format. Of the sampling
  fields, temperature and top_p are OpenAI's; vLLM's extras (`_SAMPLING_FIELDS`) are passed on as well.
- `tools` are flat function tools ({"type": "function", "name", "description", "parameters", "strict"});
  `tool_choice` "none", "auto", "required" or {"type": "function", "name"}. Any other tool type
  (web_search, file_search, ...) or choice is a 400 naming the field: the server runs no built-in tools.
- The server stores nothing. As vLLM without its store, `store` true (OpenAI's default) is accepted and the
  answer says ``store: false``; what needs stored state is a 400 naming its field: `previous_response_id`,
  `conversation`, `background` true, and the input items `item_reference` and `reasoning`.
- Other fields that would change the answer are a 400 too, never silently ignored: `include`,
  `top_logprobs` > 0, `reasoning` settings, `truncation` "auto", `prompt`, `max_tool_calls`, content parts
  other than text.
- Errors name the Responses fields: the chat fields a request was read as are renamed
  (`responses_field_names`, also around the chat path's prompt and context checks).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from api.errors import ApiError, bad_request
from api.protocol import Body, ChatRequest, parse_chat_request

# vLLM's sampling extras, passed on to the chat request as they are
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
                    "include_stop_str_in_output", "skip_special_tokens")
_PASSED_FIELDS = ("model", "user", "stream", "parallel_tool_calls", *_SAMPLING_FIELDS)

_STATELESS = "this server does not store responses: send the whole conversation in 'input'"
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")
_MAX_METADATA_KEYS, _MAX_METADATA_KEY_CHARS, _MAX_METADATA_VALUE_CHARS = 16, 64, 512

# chat field -> Responses field, for the errors the chat path raises
_CHAT_FIELDS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "response_format": "text.format", "messages": "input", "prompt": "input"}
_RENAMED_IN_MESSAGES = re.compile(r"\b(max_completion_tokens|max_tokens|response_format)\b")


@dataclass
class ResponsesRequest:
    """A /v1/responses body, checked: the chat request it runs as and the fields the answer echoes."""

    chat: ChatRequest
    instructions: str | None
    max_output_tokens: int | None
    text: dict[str, Any]
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    metadata: dict[str, str] | None


def parse_responses_request(data: Any) -> ResponsesRequest:
    """Parse and check a /v1/responses body (raises ApiError 400 naming the Responses field)."""
    body = Body(data)
    _refuse_stateful(body)
    _refuse_unsupported(body)
    instructions = body.get("instructions", "str")
    messages = [{"role": "system", "content": instructions}] if instructions is not None else []
    messages += input_messages(body)
    text_format = _text_format(body)
    tools = _function_tools(body)
    tool_choice = body.data.get("tool_choice")
    max_output_tokens = body.get("max_output_tokens", "int")
    metadata = _metadata(body)
    chat_body: dict[str, Any] = {name: body.data[name] for name in _PASSED_FIELDS if name in body.data}
    chat_body.update(messages=messages, max_completion_tokens=max_output_tokens,
                     response_format=_chat_response_format(text_format),
                     tools=[_chat_tool(t) for t in tools] or None, tool_choice=_chat_tool_choice(tool_choice))
    with responses_field_names():
        chat = parse_chat_request(chat_body)
    return ResponsesRequest(chat=chat, instructions=instructions, max_output_tokens=max_output_tokens,
                            text={"format": text_format}, tools=tools,
                            tool_choice=tool_choice if tool_choice is not None else "auto", metadata=metadata)


@contextmanager
def responses_field_names() -> Iterator[None]:
    """An ApiError raised inside names the Responses fields rather than the chat fields they were read as."""
    try:
        yield
    except ApiError as e:
        raise _renamed(e) from e


def _renamed(error: ApiError) -> ApiError:
    param = error.param
    if param is not None:
        head, sep, rest = param.partition("[")
        param = _CHAT_FIELDS.get(head, head) + sep + rest
    message = _RENAMED_IN_MESSAGES.sub(lambda m: _CHAT_FIELDS[m.group(1)], error.message)
    return ApiError(error.status, message, type=error.type, param=param, code=error.code, headers=error.headers)


def _refuse_stateful(body: Body) -> None:
    for name in ("previous_response_id", "conversation"):
        if body.has(name):
            raise bad_request(f"'{name}' is not supported: {_STATELESS}", param=name)
    body.get("store", "bool")  # true or false: nothing is stored either way, and the answer says false
    if body.get("background", "bool", False):
        raise bad_request(f"'background' responses are not supported: {_STATELESS}", param="background")


def _refuse_unsupported(body: Body) -> None:
    if body.get("include", "list"):
        raise bad_request("'include' is not supported", param="include")
    if body.get("top_logprobs", "int", 0):
        raise bad_request("'top_logprobs' is not supported on /v1/responses", param="top_logprobs")
    reasoning = body.get("reasoning", "dict", {})
    if any(value is not None for value in reasoning.values()):
        raise bad_request("'reasoning' settings are not supported: the served model is not a reasoning model",
                          param="reasoning")
    if body.get("truncation", "str", "disabled") != "disabled":
        raise bad_request("'truncation' must be 'disabled': a conversation longer than the context is a 400",
                          param="truncation")
    for name in ("prompt", "max_tool_calls"):
        if body.has(name):
            raise bad_request(f"'{name}' is not supported", param=name)


def input_messages(body: Body) -> list[dict[str, Any]]:
    """The chat messages of the body's `input` (ApiError 400 naming the item)."""
    value = body.data.get("input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty array of input items", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        _add_input_item(messages, item, f"input[{i}]")
    return messages


def _add_input_item(messages: list[dict[str, Any]], item: Any, param: str) -> None:
    if not isinstance(item, dict):
        raise bad_request(f"{param} must be an input item (an object)", param=param)
    kind = item.get("type", "message")
    if kind == "message":
        messages.append(_message(item, param))
    elif kind == "function_call":
        _add_call(messages, item, param)
    elif kind == "function_call_output":
        messages.append(_call_output(messages, item, param))
    elif kind in ("item_reference", "reasoning"):
        raise bad_request(f"{param}: {kind!r} input items are not supported: {_STATELESS}", param=param)
    else:
        raise bad_request(f"{param}: input items of type {kind!r} are not supported; use messages, "
                          "'function_call' and 'function_call_output' items", param=param)


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"{param}.role must be one of {sorted(_ROLES)}, got {role!r}", param=f"{param}.role")
    return {"role": _ROLES[role], "content": _text(item.get("content"), f"{param}.content")}


def _text(content: Any, param: str) -> str:
    """A string, or the text of an array of text parts joined by newlines (as chat's text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or an array of input_text parts", param=param)
    return "\n".join(_text_part(part, f"{param}[{j}]") for j, part in enumerate(content))


def _text_part(part: Any, param: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
        return part["text"]
    if isinstance(kind, str) and kind not in _TEXT_PARTS:
        raise bad_request(f"{param}: only text content parts are supported, got {kind!r}", param=param)
    raise bad_request(f"{param} must be {{'type': 'input_text', 'text': str}}", param=param)


def _required_str(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param}.{name} must be a non-empty string", param=f"{param}.{name}")
    return value


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], param: str) -> None:
    """An earlier turn's call as an assistant tool call, joining the assistant message just before it."""
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise bad_request(f"{param}.arguments must be a string (the call's JSON arguments)",
                          param=f"{param}.arguments")
    call = {"id": _required_str(item, "call_id", param), "type": "function",
            "function": {"name": _required_str(item, "name", param), "arguments": arguments}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(messages: list[dict[str, Any]], item: dict[str, Any], param: str) -> dict[str, Any]:
    """A call's result as a "tool" message (with the call's name when an earlier item made that call)."""
    call_id = _required_str(item, "call_id", param)
    message = {"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), f"{param}.output")}
    names = [c["function"]["name"] for m in messages for c in m.get("tool_calls") or [] if c["id"] == call_id]
    if names:
        message["name"] = names[-1]
    return message


def _text_format(body: Body) -> dict[str, Any]:
    """The body's `text.format`, checked ({"type": "text"} when absent)."""
    text_format = body.get("text", "dict", {}).get("format")
    if text_format is None:
        return {"type": "text"}
    if not isinstance(text_format, dict):
        raise bad_request("text.format must be an object", param="text.format")
    kind = text_format.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_request(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          param="text.format.type")
    if kind == "json_schema":
        if not isinstance(text_format.get("name"), str):
            raise bad_request("text.format.name (a string) is required for 'json_schema'", param="text.format.name")
        if not isinstance(text_format.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema object", param="text.format.schema")
    return text_format


def _chat_response_format(text_format: dict[str, Any]) -> dict[str, Any]:
    if text_format["type"] != "json_schema":
        return {"type": text_format["type"]}
    schema = {k: text_format[k] for k in ("name", "schema", "strict", "description") if k in text_format}
    return {"type": "json_schema", "json_schema": schema}


def _function_tools(body: Body) -> list[dict[str, Any]]:
    """The body's flat function tools, checked (400 naming `tools` for another tool type or shape)."""
    tools = body.get("tools", "list", [])
    checked = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise bad_request(f"tools[{i}]: tools of type {kind!r} are not supported; only 'function' tools are "
                              "(the server runs no built-in tools)", param="tools")
        if kind != "function" or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'name': str, 'parameters': {{...}}}} "
                              "(Responses tools are flat, not nested under 'function')", param="tools")
        if not isinstance(tool.get("parameters") or {}, dict):
            raise bad_request(f"tools[{i}].parameters must be a JSON schema object", param="tools")
        checked.append({"type": "function", "name": tool["name"], "description": tool.get("description"),
                        "parameters": tool.get("parameters"), "strict": tool.get("strict")})
    return checked


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool[k] is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                      param="tool_choice")


def _metadata(body: Body) -> dict[str, str] | None:
    """The body's `metadata`, checked as OpenAI: at most 16 string pairs, keys up to 64 and values up to
    512 characters."""
    metadata = body.get("metadata", "dict")
    if metadata is None:
        return None
    if len(metadata) > _MAX_METADATA_KEYS:
        raise bad_request(f"'metadata' may hold at most {_MAX_METADATA_KEYS} pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > _MAX_METADATA_KEY_CHARS or not isinstance(value, str) or len(value) > _MAX_METADATA_VALUE_CHARS:
            raise bad_request(f"'metadata' keys must be strings of at most {_MAX_METADATA_KEY_CHARS} characters and "
                              f"values strings of at most {_MAX_METADATA_VALUE_CHARS}", param="metadata")
    return dict(metadata)
