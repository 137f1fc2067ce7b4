"""Engine logprob entries in OpenAI's two shapes.

An engine entry is ``[sampled_logprob, rank, top_ids, top_logprobs]`` per generated token.

Rules:
- Token text is the token decoded alone with special tokens kept (a byte-level token holding part
  of a character reads as U+FFFD; `bytes` is that text's UTF-8, as vLLM reports it).
- Completions (`CompletionLogprobs`): ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict
  token -> logprob with the top-N and the sampled token), ``text_offset`` (the offset of each
  token in the choice's text, counting echoed prompt text). Echoed prompt tokens carry the
  engine's prompt logprobs (the first token's is null, as OpenAI; all null if none were computed).
- vLLM's `prompt_logprobs` (`vllm_prompt_logprobs`): ``[None, {token: {logprob, rank,
  decoded_token}}, ...]`` keyed by token id (as a JSON string), the prompt token and the top-K.
- Chat (`chat_logprobs`): ``[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]``
  with the top-N (N = top_logprobs) alternatives.
- Non-finite logprobs (-inf for a masked token) become -9999.0, so the JSON stays standard.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

_FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


class CompletionLogprobs:
    """Builds a completions `logprobs` object piece by piece (one per stream chunk, or all of it)."""

    def __init__(self, token_text: Callable[[int], str], initial_offset: int = 0) -> None:
        self._token_text = token_text
        self._offset = initial_offset
        self.total: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add_prompt(self, token_ids: Sequence[int], entries: Sequence[list] | None = None) -> dict[str, list]:
        """Echoed prompt tokens; `entries` are the engine's for tokens 1.. (None: null logprobs)."""
        shifted = [None, *entries] if entries is not None else [None] * len(token_ids)
        return self._add(list(zip(token_ids, shifted, strict=True)))

    def add(self, token_ids: Sequence[int], entries: Sequence[list] | None) -> dict[str, list]:
        """Generated tokens with their engine entries; returns the piece for just these tokens."""
        entries = entries or [None] * len(token_ids)
        return self._add(list(zip(token_ids, entries, strict=True)))

    def _add(self, items: list[tuple[int, list | None]]) -> dict[str, list]:
        piece: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in items:
            text = self._token_text(token_id)
            piece["tokens"].append(text)
            piece["text_offset"].append(self._offset)
            self._offset += len(text)
            if entry is None:
                piece["token_logprobs"].append(None)
                piece["top_logprobs"].append(None)
                continue
            sampled, _rank, top_ids, top_values = entry
            top = {self._token_text(i): _finite(v) for i, v in zip(top_ids, top_values, strict=False)}
            top.setdefault(text, _finite(sampled))
            piece["token_logprobs"].append(_finite(sampled))
            piece["top_logprobs"].append(top)
        for key, values in piece.items():
            self.total[key].extend(values)
        return piece


def vllm_prompt_logprobs(token_text: Callable[[int], str], token_ids: Sequence[int],
                         entries: Sequence[list] | None) -> list[dict[str, dict] | None] | None:
    """vLLM's per-choice `prompt_logprobs` from the engine's entries for prompt tokens 1..."""
    if entries is None:
        return None
    result: list[dict[str, dict] | None] = [None]
    for token_id, (sampled, rank, top_ids, top_values) in zip(token_ids[1:], entries, strict=True):
        position = {str(i): _vllm_item(token_text(i), v, r)
                    for r, (i, v) in enumerate(zip(top_ids, top_values, strict=True), start=1)}
        position.setdefault(str(token_id), _vllm_item(token_text(token_id), sampled, rank))
        result.append(position)
    return result


def _vllm_item(text: str, logprob: float, rank: int) -> dict[str, Any]:
    return {"logprob": _finite(logprob), "rank": rank, "decoded_token": text}


def chat_logprobs(token_text: Callable[[int], str], token_ids: Sequence[int],
                  entries: Sequence[list] | None, top_n: int) -> list[dict[str, Any]]:
    """The chat `logprobs.content` items for these tokens."""
    content = []
    for token_id, entry in zip(token_ids, entries or [None] * len(token_ids), strict=True):
        text = token_text(token_id)
        if entry is None:
            content.append({"token": text, "logprob": None, "bytes": list(text.encode()), "top_logprobs": []})
            continue
        sampled, _rank, top_ids, top_values = entry
        top = [_item(token_text(i), v) for i, v in list(zip(top_ids, top_values, strict=False))[:top_n]]
        content.append({**_item(text, sampled), "top_logprobs": top})
    return content


def _item(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}
