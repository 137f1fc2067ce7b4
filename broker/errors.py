"""Exceptions raised by the broker package.

Every error a caller is expected to handle derives from `BrokerError`, so the API layer can map
the whole family to HTTP responses in one place. (Bytes that are not a message raise
`protocol.errors.MessageError`, a ValueError of the codec every tier shares, not one of these.)

- `NoEngineAvailable`: no engine is READY with a live heartbeat. API: 503 with Retry-After.
- `BrokerUnavailable`: Redis cannot be reached (after the connection's own retries) or the client's
  output subscription is not up. API: 503 with Retry-After.
- `EngineOverloaded`: the chosen engine's request stream already holds its cap of unread and
  in-flight messages; the request was not sent. API: 503 with Retry-After.
- `UtilityError`: an engine ran a utility call and reported an error.
"""

from __future__ import annotations


class BrokerError(Exception):
    """Base class of every error raised on purpose by `broker`."""


class NoEngineAvailable(BrokerError):
    """No engine is READY with a live heartbeat, so a request cannot be placed."""


class BrokerUnavailable(BrokerError, ConnectionError):
    """Redis is unreachable, or this process is not subscribed to its output channel yet."""


class UtilityError(BrokerError):
    """An engine reported an error while running a utility call."""


class EngineOverloaded(BrokerError):
    """The engine's request stream is full (unread + in-flight messages at the cap); nothing was sent."""
