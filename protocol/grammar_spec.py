"""A structured-output spec (``SamplingParams.structured_output``: ``{"kind": K, "value": V}`` with K one of
``protocol.sampling_params.GRAMMAR_KINDS``) as an llguidance grammar: V is the schema (JSON text or an object) for
"json_schema", text for "regex" and "grammar" (Lark, or GBNF), a list of strings for "choice", absent for
"json_object".

Rules:
- `grammar_from_spec` builds the grammar; `spec_error` says why one cannot compile (None when it can), with
  no tokenizer: the API calls it once per request (a 400 naming the field), and the engine compiles again
  when it builds the request's matcher (``engine.structured_output``: an engine never trusts the wire).
- JSON is written without free whitespace (``_JSON_LAYOUT``), vLLM's ``disable_any_whitespace``.
- llguidance is imported when this module is (the API imports it on the first constrained request).
"""

from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher, grammar_from

# JSON without free whitespace (as OpenAI's structured outputs write it): a model that prefers
# whitespace cannot pad an answer forever; a schema's "x-guidance" options can still override this.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_from_spec(spec: dict[str, Any]) -> str:
    """The llguidance grammar of a spec. Raises ValueError for an unknown kind or a malformed value."""
    kind, value = spec.get("kind"), spec.get("value")
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_LAYOUT)
    if kind == "json_schema":
        schema = json.loads(value) if isinstance(value, str) else value
        if not isinstance(schema, dict | bool):
            raise ValueError("the JSON schema must be an object")
        return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_LAYOUT)
    if kind == "regex" and isinstance(value, str):
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice" and isinstance(value, list) and value and all(isinstance(c, str) for c in value):
        return grammar_from("choice", value)
    if kind == "grammar" and isinstance(value, str):
        return grammar_from("grammar", value)
    raise ValueError(f"unsupported structured output {kind!r} (or a value of the wrong type)")


def spec_error(spec: dict[str, Any]) -> str | None:
    """Why the spec's grammar cannot compile, or None when it can (no tokenizer needed)."""
    try:
        return LLMatcher.validate_grammar(grammar_from_spec(spec)) or None
    except (ValueError, TypeError, RuntimeError) as exc:
        return str(exc) or type(exc).__name__
