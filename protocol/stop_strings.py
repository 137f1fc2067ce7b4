"""Stop strings for one output sequence, applied to its text as it streams.

Rules:
- `feed(text)` returns `(emit, stop)`: `emit` is text that can be shown now, `stop` is the stop
  string that ended the sequence (None while it goes on). After a match, `feed` returns ("", stop)
  for good: the caller finishes the sequence with finish_reason "stop", stop_reason = `stop`, and
  aborts it in the engine.
- A match is the earliest occurrence of any stop string in the text (ties: the one listed first).
  The text is cut before the match, or after it with `include_stop_str_in_output`.
- Without `include_stop_str_in_output`, a tail of the text that is the start of some stop string is
  held back until later text decides it: a stop string split across tokens (or pieces) is never
  shown. With it, nothing is held back (the stop string would be shown either way); the text already
  shown is still searched, so a stop string split across pieces ends the sequence right after it.
- `flush()` returns the held-back tail when the sequence ends for another reason (EOS, length).
- Pure Python, no tokenizer: it works on text only.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Applies a list of stop strings to one sequence's text; see the module rules."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self._stop = list(stop)
        self._include = include_stop_str_in_output
        self._held = ""
        self._shown_tail = ""
        self.matched: str | None = None

    @property
    def active(self) -> bool:
        return bool(self._stop)

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add `text`; return the text to emit now and the stop string if one matched."""
        if self.matched is not None:
            return "", self.matched
        if not self._stop:
            return text, None
        if self._include:
            return self._feed_shown(text)
        buffer = self._held + text
        found = self._earliest_match(buffer)
        if found is not None:
            position, stop = found
            self.matched, self._held = stop, ""
            return buffer[:position], stop
        keep = self._partial_tail(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], None

    def _feed_shown(self, text: str) -> tuple[str, str | None]:
        """include_stop_str_in_output: emit at once, but keep the shown tail to match across pieces."""
        shown = self._shown_tail
        search = shown + text
        found = self._earliest_match(search)
        if found is not None:
            position, stop = found
            self.matched = stop
            return text[:position + len(stop) - len(shown)], stop
        keep = max(len(s) for s in self._stop) - 1
        self._shown_tail = search[-keep:] if keep else ""
        return text, None

    def flush(self) -> str:
        """The held-back text, released because the sequence ended without a stop string."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            position = text.find(stop)
            if position != -1 and (best is None or position < best[0]):
                best = (position, stop)
        return best

    def _partial_tail(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
