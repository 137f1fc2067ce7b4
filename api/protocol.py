"""Request bodies of /v1/completions and /v1/chat/completions: type checks and sampling parameters.

Rules:
- Unknown fields are ignored (the OpenAI SDK sends extras); a known field of the wrong type, or a
  value out of range, is an `ApiError` 400 naming the field (`param`). JSON null means "default".
- Integers must be JSON integers (not booleans, not 1.0); numbers may be integers or floats.
- Strings must be Unicode text: a lone surrogate ("\\ud800", valid JSON) anywhere in the body is a 400.
- vLLM's extra sampling fields are accepted: top_k, min_p, repetition_penalty, ignore_eos,
  min_tokens, stop_token_ids, seed, include_stop_str_in_output, skip_special_tokens; and vLLM's
  `return_tokens_as_token_ids` (logprob tokens written "token_id:N") and `return_token_ids` (the prompt's
  and each choice's token ids in the response, in vLLM's fields: see `api.completions`, `api.chat`).
- The sampling parameters are checked by `SamplingParams` (its ValueError becomes a 400 naming the
  field). Bounded cost: at most 16 stop strings of 4096 UTF-8 bytes in all, at most 1024
  stop_token_ids (400 naming `stop` / `stop_token_ids`).
  `max_tokens` None means "up to the context length": the handler fills it in once the prompt
  lengths and the engines' max_model_len are known (`fit_params`, which also checks stop_token_ids
  against the vocabulary: the model's limits are arguments, this module reads no server state).
- Completions: `max_tokens` absent -> 16 (OpenAI's default), null -> up to the context.
  `echo` with `logprobs` asks the engine for the prompt's logprobs (`prompt_logprobs`); `echo` with
  `max_tokens` 0 answers the prompt alone (one token is generated and dropped, as vLLM).
  vLLM's `prompt_logprobs` (k) adds a `prompt_logprobs` list per choice, in vLLM's shape; on chat, one
  list for the rendered prompt at the top of the (non-streamed only, as vLLM) response.
  Chat: `max_completion_tokens` wins over `max_tokens`; both absent -> up to the context.
- Structured outputs: `response_format` text / json_object / json_schema (OpenAI's shapes), vLLM's
  `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (Lark or GBNF) and its
  `structured_outputs` dict ({json, regex, choice, grammar, json_object}); at most one. The grammar
  is compiled here once (llguidance): one that does not compile is a 400 naming the field.
- Tools: `tools`, `tool_choice`, `parallel_tool_calls` are read by `api.tools`; a forced choice
  ("required" or a named function) becomes the request's structured output.
- Unsupported features that would change the answer (best_of != n, suffix, logit_bias,
  non-text message parts) are a 400, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from api.errors import bad_request
from api.tools import ToolRequest, parse_tool_request
from protocol.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_BYTES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)}
_MISSING = object()


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_number(v: Any) -> bool:
    return type(v) in (int, float)


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) for s in v)


def _is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (_is_int, "an integer"),
    "number": (_is_number, "a number"),
    "bool": (lambda v: type(v) is bool, "a boolean"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
    "list": (lambda v: isinstance(v, list), "an array"),
    "stop": (lambda v: isinstance(v, str) or _is_str_list(v), "a string or an array of strings"),
    "int_list": (_is_int_list, "an array of integers"),
    "schema": (lambda v: isinstance(v, dict | str), "a JSON schema (an object, or its JSON text)"),
}

# name -> (kind, default) of the SamplingParams fields read the same way by both endpoints
_SAMPLING_FIELDS: dict[str, tuple[str, Any]] = {
    "n": ("int", 1),
    "temperature": ("number", 1.0),
    "top_p": ("number", 1.0),
    "top_k": ("int", 0),
    "min_p": ("number", 0.0),
    "seed": ("int", None),
    "presence_penalty": ("number", 0.0),
    "frequency_penalty": ("number", 0.0),
    "repetition_penalty": ("number", 1.0),
    "min_tokens": ("int", 0),
    "stop": ("stop", None),
    "stop_token_ids": ("int_list", None),
    "ignore_eos": ("bool", False),
    "include_stop_str_in_output": ("bool", False),
    "skip_special_tokens": ("bool", True),
    "prompt_logprobs": ("int", None),
}


class Body:
    """Typed access to a JSON object body; see the module rules."""

    def __init__(self, data: Any) -> None:
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        _reject_lone_surrogates(data)
        self.data = data

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def get(self, name: str, kind: str, default: Any = None) -> Any:
        value = self.data.get(name, _MISSING)
        if value is _MISSING or value is None:
            return default
        check, what = _KINDS[kind]
        if not check(value):
            raise bad_request(f"'{name}' must be {what}, got {type(value).__name__}", param=name)
        return value


def _reject_lone_surrogates(data: dict[str, Any]) -> None:
    """ApiError 400 naming the top-level field if any string in it (keys too) holds a lone UTF-16
    surrogate: valid JSON ("\\ud800"), but not text the tokenizer or a UTF-8 response can carry."""
    for name, value in data.items():
        pending = [name, value]
        while pending:
            item = pending.pop()
            if isinstance(item, str):
                if not item.isascii():
                    try:
                        item.encode("utf-8")
                    except UnicodeEncodeError:
                        raise bad_request(f"'{name}' is not valid Unicode text: it holds a lone surrogate",
                                          param=name if name.isascii() else None) from None
            elif isinstance(item, list):
                pending.extend(item)
            elif isinstance(item, dict):
                pending.extend(item.keys())
                pending.extend(item.values())


@dataclass
class CommonRequest:
    """What both endpoints share after parsing."""

    model: str | None
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False


@dataclass
class CompletionRequest(CommonRequest):
    prompts: list[str | list[int]] = field(default_factory=list)
    echo: bool = False
    echo_only: bool = False
    logprobs: int | None = None
    show_prompt_logprobs: bool = False


@dataclass
class ChatRequest(CommonRequest):
    messages: list[dict[str, Any]] = field(default_factory=list)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    tools: ToolRequest = field(default_factory=ToolRequest)
    show_prompt_logprobs: bool = False


def parse_completion_request(data: Any) -> CompletionRequest:
    """Parse and check a /v1/completions body (raises ApiError 400)."""
    body = Body(data)
    _reject_unsupported(body)
    if body.has("suffix"):
        raise bad_request("'suffix' is not supported", param="suffix")
    logprobs = body.get("logprobs", "int")
    explicit_null = "max_tokens" in body.data and body.data["max_tokens"] is None
    max_tokens = None if explicit_null else body.get("max_tokens", "int", 16)
    echo = body.get("echo", "bool", False)
    echo_only = echo and max_tokens == 0
    if echo_only and logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", param="logprobs")
    # as vLLM: echo with max_tokens 0 generates one token that is never shown, and takes the prompt
    # logprobs from the engine when logprobs are asked
    params = _sampling_params(body, max_tokens=1 if echo_only else max_tokens,
                              logprobs=None if echo_only else logprobs)
    if echo and logprobs is not None:
        wanted = max(logprobs, params.prompt_logprobs or 0)
        params = dataclasses.replace(params, prompt_logprobs=wanted)
    common = _common(body, params)
    return CompletionRequest(**common, prompts=_prompts(body), echo=echo, echo_only=echo_only, logprobs=logprobs,
                             show_prompt_logprobs=body.has("prompt_logprobs"))


def parse_chat_request(data: Any) -> ChatRequest:
    """Parse and check a /v1/chat/completions body (raises ApiError 400)."""
    body = Body(data)
    _reject_unsupported(body)
    tools = parse_tool_request(body.data)
    logprobs = body.get("logprobs", "bool", False)
    top_logprobs = body.get("top_logprobs", "int")
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top_logprobs}", param="top_logprobs")
    if top_logprobs is not None and not logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    show_prompt_logprobs = body.has("prompt_logprobs")
    if show_prompt_logprobs and body.get("stream", "bool", False):  # as vLLM
        raise bad_request("'prompt_logprobs' are not available when 'stream' is true", param="prompt_logprobs")
    max_tokens = body.get("max_completion_tokens", "int")
    if max_tokens is None:
        max_tokens = body.get("max_tokens", "int")
    params = _sampling_params(body, max_tokens=max_tokens, logprobs=(top_logprobs or 0) if logprobs else None)
    if tools.forced:
        if params.structured_output is not None:
            raise bad_request("tool_choice 'required' or a named function cannot be combined with another "
                              "structured output", param="tool_choice")
        params = dataclasses.replace(params, structured_output=_checked_spec(tools.forced_spec(), "tools"))
    template_kwargs = dict(body.get("chat_template_kwargs", "dict", {}))
    if body.has("chat_template"):  # the caller's own template: refused unless the server trusts them
        template_kwargs["chat_template"] = body.get("chat_template", "str")
    return ChatRequest(**_common(body, params), messages=parse_messages(body),
                       add_generation_prompt=body.get("add_generation_prompt", "bool", True),
                       chat_template_kwargs=template_kwargs, logprobs=logprobs,
                       top_logprobs=top_logprobs or 0, tools=tools, show_prompt_logprobs=show_prompt_logprobs)


def fit_to_context(params: SamplingParams, prompt_len: int, max_model_len: int | None) -> SamplingParams:
    """Check the prompt (+ max_tokens, or min_tokens when max_tokens is None) against the context;
    fill in max_tokens None. ApiError 400 naming the field to reduce."""
    if max_model_len is None:
        if params.max_tokens is None:
            raise bad_request("'max_tokens' is required: the model's context length is not known yet")
        return params
    completion = params.max_tokens if params.max_tokens is not None else max(1, params.min_tokens)
    wanted = prompt_len + completion
    if prompt_len >= max_model_len or wanted > max_model_len:
        field_name = "min_tokens" if params.max_tokens is None else "max_tokens"
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{wanted} tokens ({prompt_len} in the prompt, {completion} in the completion"
            f"{' by min_tokens' if field_name == 'min_tokens' else ''}). "
            "Please reduce the length of the prompt or of the completion.",
            param=field_name if prompt_len < max_model_len else "prompt", code="context_length_exceeded")
    if params.max_tokens is None:
        return dataclasses.replace(params, max_tokens=max_model_len - prompt_len)
    return params


def fit_params(params: SamplingParams, prompt_lens: list[int], max_model_len: int | None,
               vocab_size: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: stop_token_ids checked against the vocabulary, then each prompt against
    the context (`fit_to_context`). ApiError 400 naming the field."""
    if any(t >= vocab_size for t in params.stop_token_ids):
        raise bad_request(f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
    return [fit_to_context(params, prompt_len, max_model_len) for prompt_len in prompt_lens]


def _common(body: Body, params: SamplingParams) -> dict[str, Any]:
    stream = body.get("stream", "bool", False)
    options = body.get("stream_options", "dict")
    if options is not None and not stream:
        raise bad_request("'stream_options' can only be given with 'stream': true", param="stream_options")
    include_usage = Body(options).get("include_usage", "bool", False) if options else False
    return {"model": body.get("model", "str"), "params": params, "stream": stream,
            "include_usage": include_usage, "user": body.get("user", "str"),
            "return_tokens_as_token_ids": body.get("return_tokens_as_token_ids", "bool", False),
            "return_token_ids": body.get("return_token_ids", "bool", False)}


def _sampling_params(body: Body, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    values = {name: body.get(name, kind, default) for name, (kind, default) in _SAMPLING_FIELDS.items()}
    seed = values["seed"]
    if seed is not None and not _INT64_MIN <= seed <= _INT64_MAX:
        raise bad_request("'seed' must fit in a signed 64-bit integer", param="seed")
    if any(t < 0 or t > _INT64_MAX for t in values["stop_token_ids"] or []):
        raise bad_request("'stop_token_ids' must be non-negative token ids", param="stop_token_ids")
    _check_stop_sizes(values["stop"], values["stop_token_ids"])
    best_of = body.get("best_of", "int")
    if best_of is not None and best_of != values["n"]:
        raise bad_request("'best_of' is not supported (only best_of == n)", param="best_of")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", param="logprobs")
    try:
        return SamplingParams(**values, max_tokens=max_tokens, logprobs=logprobs,
                              structured_output=_structured_output(body))
    except (ValueError, TypeError) as e:
        named = str(e).split(" ", 1)[0].strip(":'")
        raise bad_request(str(e), param=named if named in _PARAM_NAMES else None) from e


def _check_stop_sizes(stop: str | list[str] | None, stop_token_ids: list[int] | None) -> None:
    """The bounded-cost rules of `SamplingParams`, as 400s naming the field, before anything is built."""
    strings = [stop] if isinstance(stop, str) else stop or []
    if len(strings) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' may list at most {MAX_STOP_STRINGS} strings, got {len(strings)}", param="stop")
    size = sum(len(s.encode("utf-8", "surrogatepass")) for s in strings)
    if size > MAX_STOP_BYTES:
        raise bad_request(f"'stop' strings may hold at most {MAX_STOP_BYTES} bytes (UTF-8) in all, got {size}",
                          param="stop")
    if len(stop_token_ids or []) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"'stop_token_ids' may list at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_token_ids)}",
                          param="stop_token_ids")


def _reject_unsupported(body: Body) -> None:
    if body.get("logit_bias", "dict"):
        raise bad_request("'logit_bias' is not supported", param="logit_bias")


def _structured_output(body: Body) -> dict[str, Any] | None:
    """The grammar spec (`engine.structured_output`) asked by `response_format`, vLLM's `guided_*`
    fields or its `structured_outputs` dict; at most one. ApiError 400 naming the field when it is
    malformed or its grammar does not compile."""
    found = []
    response_format = body.get("response_format", "dict")
    if response_format:
        found.append(("response_format", _response_format_spec(response_format)))
    for name, (kind, value_kind) in _GUIDED_FIELDS.items():
        if body.has(name):
            found.append((name, _guided_spec(kind, body.get(name, value_kind), name)))
    options = body.get("structured_outputs", "dict")
    if options:
        for key, (kind, value_kind) in _STRUCTURED_OUTPUTS_KEYS.items():
            value = Body(options).get(key, value_kind)
            if value:
                found.append(("structured_outputs", _guided_spec(kind, value, "structured_outputs")))
    found = [(name, spec) for name, spec in found if spec is not None]
    if len(found) > 1:
        raise bad_request(f"only one structured output may be asked, got {[name for name, _ in found]}",
                          param=found[1][0])
    if not found:
        return None
    name, spec = found[0]
    return _checked_spec(spec, name)


def _checked_spec(spec: dict[str, Any], name: str) -> dict[str, Any]:
    from protocol.grammar_spec import spec_error  # llguidance: loaded on the first constrained request

    error = spec_error(spec)
    if error:
        raise bad_request(f"'{name}' cannot be compiled to a grammar: {error}", param=name)
    return spec


def _response_format_spec(response_format: dict[str, Any]) -> dict[str, Any] | None:
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"kind": "json_object"}
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}",
                              param="response_format")
        return {"kind": "json_schema", "value": json.dumps(schema)}
    raise bad_request(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                      param="response_format")


def _guided_spec(kind: str, value: Any, name: str) -> dict[str, Any] | None:
    if kind == "json_object":
        return {"kind": "json_object"} if value is True else None
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise bad_request(f"'{name}' is not valid JSON: {e}", param=name) from None
        if not isinstance(value, dict):
            raise bad_request(f"'{name}' must be a JSON schema object", param=name)
        return {"kind": "json_schema", "value": json.dumps(value)}
    if kind == "choice" and not (_is_str_list(value) and value):
        raise bad_request(f"'{name}' choices must be a non-empty list of strings", param=name)
    return {"kind": kind, "value": value}


# vLLM's extra_body fields, and the keys of its newer `structured_outputs` dict: (spec kind, value type)
_GUIDED_FIELDS = {"guided_json": ("json_schema", "schema"), "guided_regex": ("regex", "str"),
                  "guided_choice": ("choice", "list"), "guided_grammar": ("grammar", "str")}
_STRUCTURED_OUTPUTS_KEYS = {"json": ("json_schema", "schema"), "regex": ("regex", "str"), "choice": ("choice", "list"),
                            "grammar": ("grammar", "str"), "json_object": ("json_object", "bool")}


def _prompts(body: Body) -> list[str | list[int]]:
    prompt = body.data.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if _is_str_list(prompt):
            return list(prompt)
        if _is_int_list(prompt):
            return [list(prompt)]
        if all(_is_int_list(p) and p for p in prompt):
            return [list(p) for p in prompt]
    raise bad_request("'prompt' must be a string, an array of strings, an array of token ids or an array of "
                      "token-id arrays (non-empty)", param="prompt")


def parse_messages(body: Body) -> list[dict[str, Any]]:
    """The body's `messages`, checked, with text-part arrays joined into strings (ApiError 400)."""
    messages = body.data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of message objects", param="messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(message: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_request(f"{param} must be an object with a string 'role'", param=param)
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(_text_part(part, f"{param}.content[{j}]") for j, part in enumerate(content))
    elif content is not None and not isinstance(content, str):
        raise bad_request(f"{param}.content must be a string, an array of text parts or null", param=param)
    return {**message, "content": content}


def _text_part(part: Any, param: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if isinstance(part, dict) and isinstance(part.get("type"), str) and part["type"] != "text":
        raise bad_request(f"{param}: only text content parts are supported, got {part['type']!r}", param=param)
    raise bad_request(f"{param} must be {{'type': 'text', 'text': str}}", param=param)

