"""Chat template rendering with a time and size bound, and the checks on what a caller may pass to it.

Rules:
- Rendering is transformers' own (``apply_chat_template``: same sandbox, filters, globals, special
  tokens and message normalisation); this module only bounds it. transformers compiles each template
  once (``_compile_jinja_template``, cached per template text) into an ``ImmutableSandboxedEnvironment``
  of its own; `bound_template` gives that environment a ``concat`` (jinja joins every rendered body
  (template, macro, call block) with ``environment.concat``) that checks a deadline and an output size
  between chunks, and a ``range`` that checks the deadline while a loop runs, so a loop that writes
  nothing is bounded too. Outside `render_budget` both behave exactly as jinja's own.
- Over budget, rendering stops with `TemplateLimitExceeded` (a ValueError: the API answers 400).
- A caller-supplied template (``chat_template`` in the body or in ``chat_template_kwargs``) is the
  caller's code running in the server; it is refused unless the server trusts request templates
  (`CallerTemplateRefused`).
- ``chat_template_kwargs`` may not carry the variables and options the renderer sets itself
  (`RESERVED_TEMPLATE_KWARGS`): ``messages``, ``add_generation_prompt``, ``tokenize``... (ValueError).
Not bounded: one single huge operation inside an expression (``'x' * 10**9``) runs to its end; only
trusted templates (the model's own, or callers' under ``--trust-request-chat-template``) can do that.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from jinja2.sandbox import safe_range

DEFAULT_RENDER_TIMEOUT = 2.0
DEFAULT_MAX_RENDER_CHARS = 16 << 20

RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})
_RANGE_CHECK_EVERY = 256


class TemplateLimitExceeded(ValueError):
    """Rendering ran past its time or size budget."""


class CallerTemplateRefused(ValueError):
    """The request carries its own chat template and the server does not run callers' templates."""


@dataclass
class _Budget:
    deadline: float
    timeout: float
    max_chars: int

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitExceeded(f"chat template rendering exceeded {self.timeout:g} s")


_BUDGET: ContextVar[_Budget | None] = ContextVar("redserve_chat_template_budget", default=None)


@contextlib.contextmanager
def render_budget(timeout: float, max_chars: int) -> Iterator[None]:
    """Bound every bounded template rendered inside this block (this thread or context only)."""
    token = _BUDGET.set(_Budget(time.monotonic() + timeout, timeout, max_chars))
    try:
        yield
    finally:
        _BUDGET.reset(token)


def bound_template(chat_template: str) -> None:
    """Make transformers' compiled form of `chat_template` honour `render_budget` (idempotent)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    environment = _compile_jinja_template(chat_template).environment
    if environment.concat is not _bounded_concat:
        environment.concat = _bounded_concat
        environment.globals["range"] = _bounded_range


def check_template_kwargs(kwargs: dict[str, Any], caller_template: Any, trusted: bool) -> None:
    """Refuse a caller's template unless `trusted`, and kwargs that would override the renderer's own."""
    if caller_template is not None:
        if not trusted:
            raise CallerTemplateRefused(
                "this server does not render chat templates sent with requests ('chat_template'); "
                "its operator can allow them with --trust-request-chat-template")
        if not isinstance(caller_template, str):
            raise ValueError("'chat_template' must be a string")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: "
                         "the server sets these itself")


def _bounded_concat(chunks: Iterable[str]) -> str:
    budget = _BUDGET.get()
    if budget is None:
        return "".join(chunks)
    parts, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        if size > budget.max_chars:
            raise TemplateLimitExceeded(f"chat template rendering exceeded {budget.max_chars} characters")
        budget.check_time()
        parts.append(chunk)
    return "".join(parts)


class _BoundedRange(Sequence):
    """jinja's sandboxed ``range`` (at most MAX_RANGE items) whose iteration checks the render deadline."""

    def __init__(self, *args: int) -> None:
        self._range = safe_range(*args) if args else range(0)

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index):
        item = self._range[index]
        if isinstance(item, range):
            sliced = _BoundedRange()
            sliced._range = item
            return sliced
        return item

    def __iter__(self) -> Iterator[int]:
        budget = _BUDGET.get()
        for i, value in enumerate(self._range):
            if budget is not None and i % _RANGE_CHECK_EVERY == 0:
                budget.check_time()
            yield value

    def __repr__(self) -> str:
        return repr(self._range)


def _bounded_range(*args: int) -> _BoundedRange:
    return _BoundedRange(*args)
