"""Incremental detokenization of one output sequence (vLLM's prefix/read offsets).

Rules:
- `add(token_ids)` returns only text that is final: the decoded window `ids[prefix_offset:]` minus the
  decoded window `ids[prefix_offset:read_offset]`. While that window ends with U+FFFD (a multi-byte
  character split across tokens) nothing is returned and the offsets stay put, so a stream never
  shows a replacement character that a later token would have completed.
- `flush()` returns what is still held back (e.g. a trailing U+FFFD when the sequence really ends
  on an incomplete character); call it once, when the sequence finishes. The concatenation of all
  returned pieces then equals ``tokenizer.decode(output_ids, skip_special_tokens=...)`` for
  byte-level BPE tokenizers.
- The window keeps the tokens of the last piece as left context, so tokenizers whose decoding of a
  token depends on its neighbour (SentencePiece's leading-space rule) decode it as it reads in
  context. The first output token gets the prompt's last `CONTEXT_TOKENS` tokens as context, unless
  they do not decode cleanly (they end inside a character); then the output starts a fresh window.
- Pure Python: anything with ``decode(ids, skip_special_tokens=bool) -> str`` is a tokenizer here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns one sequence's tokens into text, piece by piece; see the module rules."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        if context and REPLACEMENT_CHAR in self._decode(context):
            context = []
        self._ids: list[int] = context
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context:]

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that became final (may be "")."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Return the text still held back (call once, when the sequence has finished)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""
