"""The error raised by the protocol package.

- `MessageError`: bytes that are not a message we understand (garbage, unknown type tag, unsupported
  version, a missing field, a field of the wrong type). Receivers catch it, log it and drop the message;
  a sender meets it when what it would send cannot be encoded. It is a ValueError, not a broker error:
  the codec that raises it is shared by every tier, with or without Redis.
"""

from __future__ import annotations


class MessageError(ValueError):
    """Bytes are not a valid message (garbage, unknown type or version, bad fields), or a message cannot be
    encoded."""
