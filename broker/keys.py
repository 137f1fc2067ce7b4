"""Every Redis key and channel name used by redserve.

Nobody types a key by hand: build names with `RedisKeys`. The prefix (default "rs") lets several
deployments share one Redis. Layout, for prefix "rs" (all inspectable with plain `redis-cli`):

    rs:req:{engine}            stream   ADD / ABORT / UTILITY / START_WAVE messages for one engine;
                                        consumer group `RedisKeys.consumer_group`. Holds only unread
                                        and in-flight messages (finished requests are XACK+XDEL'd).
    rs:out:{client}            pub/sub  EngineOutputs for one API process / Celery worker
    rs:engine:{engine}         hash     registration (host, pid, dp_rank, tp, model, state,
                                        incarnation, num_kv_blocks, block_size, max_model_len, ...)
                                        plus live counters (waiting, running, kv_usage, ...)
    rs:engine:{engine}:alive   string   heartbeat, value = the engine's incarnation, with a TTL
    rs:engines                 set      ids of registered engines
    rs:client:{client}:alive   string   heartbeat of an API process / Celery worker, with a TTL
    rs:clients                 set      ids of clients that have started
    rs:lb                      hash     coordinator load snapshot: engine id -> JSON
                                        {"waiting", "running", "kv_usage", "step", "ts"}
    rs:wave                    string   DP wave counter (INCR)
    rs:coordinator:lock        string   SET NX EX lock held by the active coordinator
    rs:batch:{id}              hash     batch job state (Celery)
    rs:batch:{id}:items        list     batch job items (Celery)

Ids (engine, client, batch) must be non-empty and contain no ':' or whitespace, so that no two
names can collide (an engine called "x:alive" would alias the heartbeat of engine "x").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

_BAD_ID_CHARS = frozenset(":\r\n\t ")


class EngineState(StrEnum):
    """Lifecycle of an engine, stored as the `state` field of its hash.

    starting -> ready -> draining -> (deregistered); dead is set by whoever finds it gone.
    Clients route new requests only to `ready` engines with a live heartbeat; `draining` engines
    finish what they have.
    """

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


def check_id(kind: str, value: str) -> str:
    """Return `value` if it is usable inside a key name, else raise ValueError saying why."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} id must be a non-empty string, got {value!r}")
    if _BAD_ID_CHARS.intersection(value):
        raise ValueError(f"{kind} id {value!r} must not contain ':' or whitespace")
    return value


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Builds every key name; see the module docstring for the layout."""

    prefix: str = "rs"
    consumer_group: ClassVar[str] = "engine"

    def __post_init__(self) -> None:
        check_id("prefix", self.prefix)

    def request_stream(self, engine_id: str) -> str:
        return f"{self.prefix}:req:{check_id('engine', engine_id)}"

    def output_channel(self, client_id: str) -> str:
        return f"{self.prefix}:out:{check_id('client', client_id)}"

    def engine(self, engine_id: str) -> str:
        return f"{self.prefix}:engine:{check_id('engine', engine_id)}"

    def engine_alive(self, engine_id: str) -> str:
        return f"{self.prefix}:engine:{check_id('engine', engine_id)}:alive"

    def engines(self) -> str:
        return f"{self.prefix}:engines"

    def client_alive(self, client_id: str) -> str:
        return f"{self.prefix}:client:{check_id('client', client_id)}:alive"

    def clients(self) -> str:
        return f"{self.prefix}:clients"

    def lb(self) -> str:
        return f"{self.prefix}:lb"

    def wave(self) -> str:
        return f"{self.prefix}:wave"

    def coordinator_lock(self) -> str:
        return f"{self.prefix}:coordinator:lock"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{check_id('batch', batch_id)}"

    def batch_items(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{check_id('batch', batch_id)}:items"
