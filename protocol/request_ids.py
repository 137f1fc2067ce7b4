"""Request ids: every form one takes on its way from the API to the engine, made here and nowhere else.

Rules:
- The API names a request ``chatcmpl-<hex>`` (chat) or ``cmpl-<hex>`` (completions): `new_request_id`; the
  OpenAI response's ``id`` is this id.
- A completions request with several prompts sends one engine request per prompt, ``<id>-<p>``
  (`prompt_request_id`; one prompt keeps ``<id>``).
- The engine runs a request with n > 1 as n sequences ``<id>#<i>`` (`sequence_id`); n = 1 runs as ``<id>``.
- A request continued on another engine (migration, resume after a broker outage) is a new engine request,
  ``<id>~m<k>`` for n = 1 and ``<id>~m<k>.<i>`` for sequence i of n > 1, k the continuation's number
  (`continuation_id`).
- The separators ``-``, ``#`` and ``~m`` nest in that order (``cmpl-ab-1~m2.0``); none appears in the hex.
"""

from __future__ import annotations

import uuid

KINDS = ("chatcmpl", "cmpl")


def new_request_id(kind: str) -> str:
    """A fresh API request id of `kind` (``chatcmpl`` or ``cmpl``)."""
    if kind not in KINDS:
        raise ValueError(f"request id kind must be one of {KINDS}, got {kind!r}")
    return f"{kind}-{uuid.uuid4().hex}"


def prompt_request_id(request_id: str, prompt: int, prompts: int) -> str:
    """The engine request of prompt `prompt` of `prompts` in one completions request."""
    return request_id if prompts == 1 else f"{request_id}-{prompt}"


def sequence_id(request_id: str, index: int, n: int) -> str:
    """The engine's sequence `index` of a request with `n` sequences."""
    return request_id if n == 1 else f"{request_id}#{index}"


def continuation_id(original_id: str, migration: int, index: int, n: int) -> str:
    """The engine request that continues sequence `index` (of `n`) of `original_id`, continuation `migration`."""
    return f"{original_id}~m{migration}" if n == 1 else f"{original_id}~m{migration}.{index}"
