"""An engine's presence: a pub/sub subscription that lives exactly as long as the engine process.

A heartbeat key says an engine is alive only until its TTL runs out, so a killed engine looks alive for
seconds. A subscription is faster: when the process dies, the kernel closes its socket and Redis drops
the subscription at once. Clients read `PUBSUB NUMSUB` (on a cluster `PUBSUB SHARDNUMSUB` of the channel's
node, `broker.channels`) of the channels of the engines they use (no special rights needed, unlike CLIENT LIST)
and declare an engine gone when its channel has no subscriber.

Rules:
- The channel is `keys.engine_presence(engine_id, incarnation)`: a restarted engine (new incarnation)
  subscribes to a new channel, so the old incarnation reads as gone.
- The engine writes `presence = 1` in its registration hash; clients check only engines that say so
  (an engine without it is judged by its heartbeat alone).
- The subscription is up before the engine is READY (`wait_subscribed`) and follows a new incarnation
  (`incarnation()` is read on every tick). Nobody publishes on the channel.
- Lost connections (Redis restarted) are re-made with backoff; the thread never dies of an error.
  A client may see the channel empty for that moment: it needs two empty reads in a row.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from broker.channels import Subscriber
from broker.keys import RedisKeys

logger = logging.getLogger(__name__)

_TICK = 0.1


class EnginePresence:
    """Daemon thread holding the engine's presence subscription; see the module rules."""

    def __init__(self, redis_url: str, keys: RedisKeys, engine_id: str, incarnation: Callable[[], str]) -> None:
        self._url = redis_url
        self._keys = keys
        self._engine_id = engine_id
        self._incarnation = incarnation
        self._stop = threading.Event()
        self._subscribed_to: str | None = None
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def start(self) -> EnginePresence:
        self._thread = threading.Thread(target=self._run, name=f"presence-{self._engine_id}", daemon=True)
        self._thread.start()
        return self

    def wait_subscribed(self, timeout: float) -> bool:
        """True once the channel of the current incarnation has this engine's subscription."""
        with self._changed:
            return self._changed.wait_for(lambda: self._subscribed_to == self._channel(), timeout)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _channel(self) -> str:
        return self._keys.engine_presence(self._engine_id, self._incarnation())

    def _set_subscribed(self, channel: str | None) -> None:
        with self._changed:
            self._subscribed_to = channel
            self._changed.notify_all()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            pubsub = None
            try:
                pubsub = Subscriber(self._url, self._channel(), f"engine-{self._engine_id}-presence")
                current = None
                while not self._stop.is_set():
                    wanted = self._channel()
                    if wanted != current:
                        if current is not None:
                            pubsub.unsubscribe(current)
                        pubsub.subscribe(wanted)
                        current = wanted
                    msg = pubsub.get_message(timeout=_TICK)
                    if msg is not None and msg["type"] == "subscribe" and _text(msg["channel"]) == current:
                        self._set_subscribed(current)
                        failures = 0
            except Exception as e:  # noqa: BLE001 - presence must outlive any error
                if failures == 0:
                    logger.warning("engine %s: presence subscription lost (%s); resubscribing", self._engine_id, e)
                failures += 1
                self._stop.wait(min(1.0, 0.05 * 2**failures))
            finally:
                self._set_subscribed(None)
                if pubsub is not None:
                    pubsub.close()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
