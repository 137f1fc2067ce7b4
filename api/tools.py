"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`.

Rules:
- `tools` are OpenAI function tools ({"type": "function", "function": {"name", "description",
  "parameters"}}); they are passed to the chat template (``tools=``). `tool_choice` is "none",
  "auto", "required" or {"type": "function", "function": {"name": ...}}; absent, it is "auto" with
  tools and "none" without (as OpenAI and vLLM).
- "none": the tools are rendered, the output is plain content (nothing parsed).
- "auto": needs the server's ``--enable-auto-tool-choice`` and ``--tool-call-parser`` (400 otherwise,
  as vLLM); the output is parsed by that parser (`api.tool_parsers`).
- "required" and a named function are enforced with a grammar (`engine.structured_output`), so the
  output always parses: "required" asks for a JSON array of {"name": const, "parameters": {...}}
  (one item when `parallel_tool_calls` is false); a named function asks for its parameters object.
  The calls are read straight from that JSON (no parser). Neither combines with another
  structured output (400).
- Arguments are the raw JSON the model wrote; `partial_calls` gives them as far as a partial output
  goes (`api.tool_parsers.PartialCall`), so streaming sends them as they are written.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from api.errors import bad_request
from api.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    PartialCall,
    ToolCall,
    call_from_object,
    json_value_prefix,
    scan_calls_array,
    with_raw_arguments,
)

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolRequest:
    """The tool fields of one chat request, checked."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    choice: str = "none"  # none | auto | required | function
    function_name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def parameters(self, name: str) -> dict[str, Any]:
        tool = next(t for t in self.tools if t["function"]["name"] == name)
        return tool["function"].get("parameters") or _ANY_OBJECT

    def forced_spec(self) -> dict[str, Any]:
        """The structured-output spec that makes the output a valid forced call (see the rules)."""
        if self.choice == "function":
            schema = self.parameters(self.function_name)
        else:
            items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       "parameters": self.parameters(t["function"]["name"])},
                      "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
        return {"kind": "json_schema", "value": json.dumps(schema)}

    def content_prefix(self, text: str, parser_name: str | None) -> int:
        """How many leading characters of a partial output are surely content (0 for forced choices)."""
        if self.choice == "none" or (self.choice == "auto" and parser_name is None):
            return len(text)
        return TOOL_PARSERS[parser_name]().content_prefix(text) if self.choice == "auto" else 0

    def partial_calls(self, text: str, parser_name: str | None) -> list[PartialCall]:
        """The calls of a partial output as far as they go (none while they are not parsed)."""
        if self.choice == "none" or (self.choice == "auto" and parser_name is None):
            return []
        if self.choice == "auto":
            return TOOL_PARSERS[parser_name]().partial_calls(text)
        start = len(text) - len(text.lstrip())
        if self.choice == "function":
            return [PartialCall(self.function_name, json_value_prefix(text, start)[0] if text[start:] else None)]
        return scan_calls_array(text, start, ("parameters",)) if text[start:start + 1] == "[" else []

    def extract(self, text: str, parser_name: str | None) -> ExtractedToolCalls:
        """The calls and content of one output."""
        if self.choice == "none" or (self.choice == "auto" and parser_name is None):
            return ExtractedToolCalls(text)
        if self.choice == "auto":
            return TOOL_PARSERS[parser_name]().extract(text)
        try:
            value = json.loads(text)
        except ValueError:
            return ExtractedToolCalls(text or None)  # cut short (max_tokens): left as content
        if self.choice == "function" and isinstance(value, dict):
            return ExtractedToolCalls(None, [ToolCall(self.function_name, text.strip())])
        calls = [call_from_object(v, ("parameters",)) for v in value] if isinstance(value, list) else [None]
        if not calls or None in calls:
            return ExtractedToolCalls(text or None)
        return with_raw_arguments(ExtractedToolCalls(None, calls), self.partial_calls(text, parser_name))


def parse_tool_request(data: dict[str, Any]) -> ToolRequest:
    """The body's tool fields (ApiError 400 naming the field)."""
    tools = data.get("tools") or []
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str) and function["name"]):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}",
                              param="tools")
        if not isinstance(function.get("parameters") or {}, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    parallel = data.get("parallel_tool_calls")
    if parallel is not None and type(parallel) is not bool:
        raise bad_request("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    request = ToolRequest(tools=list(tools), parallel=parallel is not False)
    choice = data.get("tool_choice")
    if choice is None:
        request.choice = "auto" if tools else "none"
    elif choice in ("none", "auto", "required"):
        request.choice = choice
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        request.choice, request.function_name = "function", choice["function"]["name"]
        if request.function_name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names {request.function_name!r}, which is not in 'tools'",
                              param="tool_choice")
    else:
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if request.choice != "none" and not tools:
        raise bad_request(f"tool_choice {request.choice!r} needs 'tools'", param="tool_choice")
    return request


def check_auto_allowed(request: ToolRequest, parser_name: str | None, auto_enabled: bool) -> None:
    if request.choice == "auto" and request.tools and not (auto_enabled and parser_name):
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                          param="tool_choice")


def tool_call_dicts(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's message `tool_calls` for `calls`."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
