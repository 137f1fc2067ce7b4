"""A prompt too long for the context, found from its length in characters before any tokenizing.

Tokenizing costs time linear in the text (a 10 MB prompt: ~25 s on one core), so a prompt whose
size alone proves it cannot fit is refused before the tokenizer sees it.

Rules:
- `max_chars_per_token` is the length, in characters, of the longest token string in the
  vocabulary (added tokens included), computed once. A text longer than
  ``max_model_len * max_chars_per_token`` characters has more than max_model_len tokens.
- Why that bound is safe (it never refuses a prompt that would fit): a byte-level BPE token string
  spells its bytes one character per byte, so a token covers at most `max_chars_per_token` bytes of
  the text, and a text has at least as many UTF-8 bytes as characters: tokens >= bytes / L >=
  characters / L. A SentencePiece-style vocabulary spells a token's text itself ("▁" for a space)
  or one byte as "<0xNN>": again at most L characters of text per token. Special tokens match their
  own text, which the vocabulary holds.
- What could break it: a normalizer that shortens the text (NFC composing) or a pre-tokenizer that
  drops characters (BERT-style whitespace splitting). So the text is measured after the tokenizer's
  normalizer (only when it is over the bound, and then mostly a head of it), and at startup a few
  probe texts (runs of spaces, newlines, control and zero-width characters, combining marks) must
  honour the bound; a tokenizer that fails a probe gets no shortcut (`max_chars_per_token` None).
- The bound only refuses; a prompt under it is tokenized and checked exactly as before.
"""

from __future__ import annotations

from typing import Any

PROBES = (" " * 512, "\n" * 512, "\t \n" * 171, "\x00\x01\x1f\x7f" * 128, "\u200b\ufeff\u00ad" * 170,
          "e\u0301" * 256, "A\u0308\u0304" * 170, "\u1100\u1161\u11a8" * 170, "é" * 512, "😀" * 256)


class PromptCharBound:
    """Decides from a text's size that it cannot fit `max_model_len` tokens; see the module rules."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._normalizer = getattr(backend, "normalizer", None)
        longest = max((len(token) for token in tokenizer.get_vocab()), default=0)
        self.max_chars_per_token: int | None = longest if longest > 0 and self._probes_hold(longest) else None

    def _measure(self, text: str) -> int:
        return len(self._normalizer.normalize_str(text)) if self._normalizer is not None else len(text)

    def _probes_hold(self, longest: int) -> bool:
        return all(len(self._tokenizer.encode(p, add_special_tokens=False)) * longest >= self._measure(p)
                   for p in PROBES)

    def max_chars(self, max_model_len: int) -> int | None:
        """Characters that `max_model_len` tokens can hold at most (None: no shortcut for this tokenizer)."""
        return None if self.max_chars_per_token is None else max_model_len * self.max_chars_per_token

    def too_long(self, text: str, max_model_len: int) -> bool:
        """True if `text` surely has more than `max_model_len` tokens (checked without tokenizing)."""
        limit = self.max_chars(max_model_len)
        if limit is None or len(text) <= limit:
            return False
        if self._normalizer is None:
            return True
        head = text[:2 * limit + 64]  # normalizers work locally: a long enough head decides it cheaply
        return self._measure(head) > limit + 16 or self._measure(text) > limit
