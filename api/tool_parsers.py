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
- `partial_calls(text)`: the calls of a partial output as far as they go (`PartialCall`: the name once
  its string is closed, the arguments' raw text so far), so streaming can send arguments as they are
  written. An object's arguments are its raw text as the model wrote it, in `extract` too (so the
  streamed pieces always add up to the final arguments); arguments given as a JSON string appear once
  the string is closed, decoded.
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
class PartialCall:
    """A call as far as the text goes: `name` once its string is closed, `arguments` the raw text of an
    object so far (a string's value once closed; None before any)."""

    name: str | None = None
    arguments: str | None = None


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


_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


def _skip(text: str, i: int, chars: str = _WHITESPACE) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def json_value_prefix(text: str, i: int) -> tuple[str, bool]:
    """The raw text of the JSON value that starts at `text[i]` as far as it goes, and whether it is
    complete (a number at the very end may still go on)."""
    try:
        _, end = _DECODER.raw_decode(text, i)
    except ValueError:
        return text[i:], False
    return text[i:end], end < len(text) or text[i] in '{["tfn'


def scan_call(text: str, i: int, arguments_keys: tuple[str, ...]) -> tuple[PartialCall, int | None]:
    """The call object that starts at `text[i]` ("{") as far as it goes, and the index after its "}"
    (None while it is open or if it is not an object of key-value pairs)."""
    call, i = PartialCall(), i + 1
    while True:
        i = _skip(text, i, _WHITESPACE + ",")
        if i >= len(text) or text[i] == "}":
            return call, (i + 1 if i < len(text) else None)
        key, complete = json_value_prefix(text, i)
        i = _skip(text, i + len(key))
        if not complete or not key.startswith('"') or i >= len(text) or text[i] != ":":
            return call, None
        i = _skip(text, i + 1)
        raw, complete = json_value_prefix(text, i)
        _fill(call, json.loads(key), raw, complete, arguments_keys)
        if not complete:
            return call, None
        i += len(raw)


def _fill(call: PartialCall, key: str, raw: str, complete: bool, arguments_keys: tuple[str, ...]) -> None:
    if key == "name" and complete and raw.startswith('"'):
        call.name = json.loads(raw)
    elif key in arguments_keys and call.arguments is None:  # the first arguments key counts
        if raw.startswith("{"):
            call.arguments = raw
        elif complete and raw.startswith('"'):
            call.arguments = json.loads(raw)


def scan_calls_array(text: str, i: int, arguments_keys: tuple[str, ...]) -> list[PartialCall]:
    """The call objects of the array that starts at `text[i]` ("["), as far as they go."""
    calls: list[PartialCall] = []
    i += 1
    while True:
        i = _skip(text, i, _WHITESPACE + ",")
        if i >= len(text) or text[i] != "{":
            return calls
        call, end = scan_call(text, i, arguments_keys)
        calls.append(call)
        if end is None:
            return calls
        i = end


def with_raw_arguments(found: ExtractedToolCalls, partial: list[PartialCall]) -> ExtractedToolCalls:
    """`found` with each call's arguments as the model wrote them (see the rules), when the scan agrees."""
    if [c.name for c in found.calls] != [p.name for p in partial]:
        return found
    calls = [ToolCall(c.name, p.arguments if p.arguments is not None else c.arguments)
             for c, p in zip(found.calls, partial, strict=True)]
    return ExtractedToolCalls(found.content, calls)


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

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls = []
        for marker in re.finditer("<tool_call>", text):
            i = _skip(text, marker.end())
            if i < len(text) and text[i] == "{":
                calls.append(scan_call(text, i, ("arguments", "parameters"))[0])
        return calls

    def extract(self, text: str) -> ExtractedToolCalls:
        return with_raw_arguments(self._extract(text), self.partial_calls(text))

    def _extract(self, text: str) -> ExtractedToolCalls:
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

    def partial_calls(self, text: str) -> list[PartialCall]:
        _, tag, calls_text = text.partition(self.TAG)
        calls_text = calls_text if tag else text
        calls: list[PartialCall] = []
        i = _skip(calls_text, 0)
        while i < len(calls_text) and calls_text[i] == "{":
            call, end = scan_call(calls_text, i, ("parameters", "arguments"))
            calls.append(call)
            if end is None:
                break
            i = _skip(calls_text, end, _WHITESPACE + ";")
        return calls

    def extract(self, text: str) -> ExtractedToolCalls:
        return with_raw_arguments(self._extract(text), self.partial_calls(text))

    def _extract(self, text: str) -> ExtractedToolCalls:
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

    def partial_calls(self, text: str) -> list[PartialCall]:
        _, token, calls_text = text.partition(self.TOKEN)
        i = _skip(calls_text, 0)
        if not token or i >= len(calls_text):
            return []
        if calls_text[i] == "{":
            return [scan_call(calls_text, i, ("arguments",))[0]]
        return scan_calls_array(calls_text, i, ("arguments",)) if calls_text[i] == "[" else []

    def extract(self, text: str) -> ExtractedToolCalls:
        return with_raw_arguments(self._extract(text), self.partial_calls(text))

    def _extract(self, text: str) -> ExtractedToolCalls:
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
