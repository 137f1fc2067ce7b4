"""What an engine's busy loop takes from its input queue: one small typed item per kind of event.

Producers:
- input thread: `Received`, a decoded stream message (`AddRequest`, `AbortRequests`, `UtilityCall`,
  `StartWave`) with its stream entry id (an ADD is acked by that id when the request finishes);
- output thread: `ClientGone`, requests whose outputs reached no subscriber (abort them);
- heartbeat: `Rejoin`, the registry declared this engine dead (end everything, come back as a new
  incarnation);
- SIGTERM/SIGINT handler: `Drain`, which only wakes a busy loop blocked on an empty queue so that it
  sees the drain the handler has already recorded.

`engine.server.EngineServer._handle` dispatches on them with one `match`. Every item is created by
this process, so no item is ever confused with data: there are no sentinel values.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import Message


@dataclass(frozen=True, slots=True)
class Received:
    message_id: str
    message: Message


@dataclass(frozen=True, slots=True)
class ClientGone:
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class Rejoin:
    pass


@dataclass(frozen=True, slots=True)
class Drain:
    pass


InputItem = Received | ClientGone | Rejoin | Drain
