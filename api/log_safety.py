"""Text from callers, made fit for a log line.

Rules:
- `printable(text)` is what every log line uses for text a caller chose: request paths (werkzeug
  percent-decodes them, so ``%0a`` arrives as a newline), batch ``custom_id``s, model names.
- The result is one line of printable ASCII: control characters (CR, LF, ESC of ANSI sequences, NUL...),
  backslashes and non-ASCII characters are written as Python escapes (``\\n``, ``\\x1b``, ``\\u2028``),
  so a caller can neither start a forged log line nor repaint a terminal.
- Long text is cut to `limit` characters (before escaping) and marked with ``...(N chars)``.
- Anything that is not a string is shown through its ``repr``, escaped the same way.
"""

from __future__ import annotations

from typing import Any

DEFAULT_LIMIT = 200


def printable(text: Any, limit: int = DEFAULT_LIMIT) -> str:
    """`text` as one escaped line of at most about `limit` characters; see the module rules."""
    if not isinstance(text, str):
        text = repr(text)
    cut = ""
    if len(text) > limit:
        cut = f"...({len(text)} chars)"
        text = text[:limit]
    return text.translate(_CONTROL).encode("ascii", "backslashreplace").decode("ascii") + cut


def _control_escapes() -> dict[int, str]:
    table = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7f]}
    table.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", ord("\\"): "\\\\"})
    return table


_CONTROL = _control_escapes()
