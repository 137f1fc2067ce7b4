"""Tool-call parsers: the function calls a model wrote in its own format, taken out of its text.

Rules:
- One small class per format, chosen by the server's ``--tool-call-parser`` (as vLLM's names):
  ``hermes`` (Hermes / Qwen ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks),
  ``llama3_json`` (``{"name": ..., "parameters": ...}`` objects, optionally after ``<|python_tag|>``,
  several separated by ``;``), ``mistral`` (``[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]``).
- `extract(text)` gives the calls and the content: the text outside the calls (None when empty).
  Text with no call, or with a call whose JSON does not parse or lacks a string ``name``, is all
  content and no calls (a malformed call is never half-returned).
- A call's arguments are always a JSON string (an object given as text is kept as written).
- `content_prefix(text)`: how many leading characters of a partial output are surely content (before
  any call marker, or a marker's possible beginning), so streaming can send them at once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str


@dataclass
class ExtractedToolCalls:
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


def arguments_json(arguments: Any) -> str:
    """A call's arguments as a JSON string (text is kept as written)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def call_from_object(obj: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """The call an object {"name": str, "arguments" | "parameters": ...} describes, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in arguments_keys if k in obj), {})
    return ToolCall(obj["name"], arguments_json(arguments))


def _no_calls(text: str) -> ExtractedToolCalls:
    return ExtractedToolCalls(text or None)


def _before_markers(text: str, markers: tuple[str, ...]) -> int:
    """The length of `text` before the first marker, or before a tail that may begin one."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    if found:
        return min(found)
    for start in range(max(0, len(text) - max(map(len, markers)) + 1), len(text)):
        if any(m.startswith(text[start:]) for m in markers):
            return start
    return len(text)


def _json_values(text: str, separators: str = "") -> list[Any] | None:
    """Every JSON value in `text`, one after another (whitespace and `separators` between); None if
    anything else is there."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


class HermesToolParser:
    """``<tool_call>{json}</tool_call>`` blocks (a last unterminated block counts)."""

    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def content_prefix(self, text: str) -> int:
        return _before_markers(text, ("<tool_call>",))

    def extract(self, text: str) -> ExtractedToolCalls:
        blocks = self._BLOCK.findall(text)
        if not blocks:
            return _no_calls(text)
        calls = []
        for block in blocks:
            values = _json_values(block)
            call = call_from_object(values[0]) if values and len(values) == 1 else None
            if call is None:
                return _no_calls(text)
            calls.append(call)
        content = self._BLOCK.sub("", text).strip()
        return ExtractedToolCalls(content or None, calls)


class Llama3JsonToolParser:
    """Llama 3.x JSON calls: the whole output is ``{"name": ..., "parameters": ...}`` objects (``;``
    between several), optionally after ``<|python_tag|>``; text before the tag is content."""

    TAG = "<|python_tag|>"

    def content_prefix(self, text: str) -> int:
        if not text.strip() or text.lstrip().startswith("{"):
            return 0
        return _before_markers(text, (self.TAG,))

    def extract(self, text: str) -> ExtractedToolCalls:
        before, tag, calls_text = text.partition(self.TAG)
        if not tag:
            before, calls_text = "", text
        if not calls_text.lstrip().startswith("{"):
            return _no_calls(text)
        values = _json_values(calls_text, separators=";")
        calls = [call_from_object(v, ("parameters", "arguments")) for v in values or []]
        if not calls or None in calls:
            return _no_calls(text)
        return ExtractedToolCalls(before.strip() or None, calls)


class MistralToolParser:
    """``[TOOL_CALLS]`` then a JSON array of {"name", "arguments"}; the text before it is content."""

    TOKEN = "[TOOL_CALLS]"

    def content_prefix(self, text: str) -> int:
        return _before_markers(text, (self.TOKEN,))

    def extract(self, text: str) -> ExtractedToolCalls:
        before, token, calls_text = text.partition(self.TOKEN)
        if not token:
            return _no_calls(text)
        values = _json_values(calls_text)
        if not values or len(values) != 1:
            return _no_calls(text)
        objects = values[0] if isinstance(values[0], list) else [values[0]]
        calls = [call_from_object(v) for v in objects]
        if not calls or None in calls:
            return _no_calls(text)
        return ExtractedToolCalls(before.strip() or None, calls)


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser}
