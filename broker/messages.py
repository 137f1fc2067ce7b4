"""Every message that crosses Redis, and its one encode/decode path.

Rules:
- Wire format is msgpack (never pickle: whoever can write to Redis must not run code in an engine).
  A message is a map with a type tag "t", a version "v" and its fields by name. `RequestOutput` and
  `UtilityResult` travel only inside `EngineOutputs`, as positional arrays (compact on the hot path).
- `decode` raises `MessageError` for garbage, an unknown "t", an unsupported "v", a missing field or
  a field of the wrong type; it never raises anything else. Receivers catch it, log and drop.
  Unknown extra fields are ignored, so adding an optional field needs no version bump; changing or
  removing one does.
- `AddRequest.prompt_token_ids` is checked to be a list of ints (an engine must not crash on a
  bad request); token ids are not checked against the vocabulary here, the engine does that.
- Errors are not a separate message type: a failed request ends with a `RequestOutput` whose
  `finish_reason` is "error" and whose `error` is "<ErrorCode>: <detail>" (see `make_error`).
  An engine that fails as a whole sends such an output for each of its requests, then deregisters.
- `EngineOutputs.seq` numbers the messages one engine publishes to one client (1, 2, 3, ...);
  `OutputPublisher` assigns it, `BrokerClient` uses it to drop duplicates and to detect loss.

Stream messages (client -> engine, on `rs:req:{engine}`): AddRequest, AbortRequests, UtilityCall,
StartWave. Channel messages (engine -> client, on `rs:out:{client}`): EngineOutputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

import msgpack

from broker.errors import MessageError

__all__ = [
    "AbortRequests",
    "AddRequest",
    "EngineOutputs",
    "ErrorCode",
    "FinishReason",
    "Message",
    "MessageError",
    "RequestOutput",
    "StartWave",
    "UtilityCall",
    "UtilityResult",
    "decode",
    "encode",
    "error_code",
    "make_error",
]


class FinishReason(StrEnum):
    """Values of `RequestOutput.finish_reason` (None while a sequence is still running)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class ErrorCode(StrEnum):
    """First word of `RequestOutput.error`, so callers can branch without parsing prose."""

    ENGINE_ERROR = "engine_error"  # the engine failed while running the request
    INVALID_REQUEST = "invalid_request"  # the engine rejected the request (bad params, too long)
    ENGINE_GONE = "engine_gone"  # the owning engine's heartbeat expired or it restarted
    ENGINE_FAILED = "engine_failed"  # the engine failed as a whole (e.g. a TP worker died); clients may resume
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the request ran past AddRequest.deadline
    BROKER_DISCONNECTED = "broker_disconnected"  # the client lost its output subscription
    OUTPUT_LOST = "output_lost"  # a gap in EngineOutputs.seq: some outputs never arrived
    NO_ENGINE = "no_engine"  # re-placing the request found no live engine


def make_error(code: ErrorCode, detail: str) -> str:
    """Format an error string for `RequestOutput.error`: "<code>: <detail>"."""
    return f"{code.value}: {detail}"


def error_code(error: str | None) -> str | None:
    """The code part of an error made by `make_error` (the whole string if it has no code)."""
    if error is None:
        return None
    return error.split(":", 1)[0]


def _need(d: dict, name: str, types: type | tuple[type, ...]) -> Any:
    try:
        value = d[name]
    except KeyError:
        raise MessageError(f"missing field {name!r}") from None
    if not isinstance(value, types):
        raise MessageError(f"field {name!r} has type {type(value).__name__}")
    return value


def _check(value: Any, name: str, types: type | tuple[type, ...]) -> Any:
    if not isinstance(value, types):
        raise MessageError(f"field {name!r} has type {type(value).__name__}")
    return value


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:
        raise MessageError(f"field {name!r} must be a list of ints")
    return value


_NUM = (int, float)
_OPT_STR = (str, type(None))
_OPT_NUM = (int, float, type(None))


@dataclass(slots=True)
class AddRequest:
    """Start a request. `params` is `SamplingParams.to_engine_dict()`; the engine rebuilds it with
    `SamplingParams.from_dict`, defaults for missing keys. Stop strings (and the other API-only
    fields) are not sent: the API applies them to the text, the engine never sees text. Dropping a
    key from `params` is compatible both ways (an old engine fills in the default, a new one still
    accepts the key), so it needs no version bump.

    `client_id` names the output channel the engine publishes to. `arrival_time` and `deadline`
    are wall-clock seconds (time.time()); past its deadline a request is failed (client side) and
    should be aborted (engine side). n > 1 is expanded by the engine; outputs carry an `index`.
    """

    TYPE: ClassVar[str] = "add"
    VERSION: ClassVar[int] = 1

    request_id: str
    client_id: str
    prompt_token_ids: list[int]
    params: dict
    arrival_time: float
    deadline: float | None = None

    def _to_wire(self) -> dict:
        return {
            "request_id": self.request_id,
            "client_id": self.client_id,
            "prompt_token_ids": self.prompt_token_ids,
            "params": self.params,
            "arrival_time": self.arrival_time,
            "deadline": self.deadline,
        }

    @classmethod
    def _from_wire(cls, d: dict) -> AddRequest:
        params = _need(d, "params", dict)
        if not all(isinstance(k, str) for k in params):
            raise MessageError("field 'params' must have string keys")
        deadline = _check(d.get("deadline"), "deadline", _OPT_NUM)
        return cls(
            request_id=_need(d, "request_id", str),
            client_id=_need(d, "client_id", str),
            prompt_token_ids=_int_list(d.get("prompt_token_ids"), "prompt_token_ids"),
            params=params,
            arrival_time=float(_need(d, "arrival_time", _NUM)),
            deadline=None if deadline is None else float(deadline),
        )


@dataclass(slots=True)
class AbortRequests:
    """Abort requests (unknown or finished ids are ignored by the engine).

    With `index`, abort only that sequence of each request (one of its n, e.g. one that hit a stop
    string); the engine answers with an "abort" output for it and the other sequences go on.
    """

    TYPE: ClassVar[str] = "abort"
    VERSION: ClassVar[int] = 1

    request_ids: list[str]
    client_id: str
    index: int | None = None

    def _to_wire(self) -> dict:
        wire = {"request_ids": self.request_ids, "client_id": self.client_id}
        if self.index is not None:
            wire["index"] = self.index
        return wire

    @classmethod
    def _from_wire(cls, d: dict) -> AbortRequests:
        ids = _need(d, "request_ids", list)
        if not all(isinstance(i, str) for i in ids):
            raise MessageError("field 'request_ids' must be a list of strings")
        index = _check(d.get("index"), "index", (int, type(None)))
        return cls(request_ids=ids, client_id=_need(d, "client_id", str), index=index)


@dataclass(slots=True)
class UtilityCall:
    """Ask an engine to run `method(*args)` (e.g. "reset_prefix_cache", "get_stats").

    The answer is a `UtilityResult` with the same `call_id` inside an `EngineOutputs`.
    `args` and the result must be msgpack-able (None, bool, int, float, str, bytes, list, dict).
    """

    TYPE: ClassVar[str] = "utility"
    VERSION: ClassVar[int] = 1

    call_id: str
    client_id: str
    method: str
    args: list

    def _to_wire(self) -> dict:
        return {"call_id": self.call_id, "client_id": self.client_id, "method": self.method, "args": self.args}

    @classmethod
    def _from_wire(cls, d: dict) -> UtilityCall:
        return cls(
            call_id=_need(d, "call_id", str),
            client_id=_need(d, "client_id", str),
            method=_need(d, "method", str),
            args=_need(d, "args", list),
        )


@dataclass(slots=True)
class StartWave:
    """Data parallelism: start wave `wave` on every engine except `exclude_engine`."""

    TYPE: ClassVar[str] = "wave"
    VERSION: ClassVar[int] = 1

    wave: int
    exclude_engine: str | None = None

    def _to_wire(self) -> dict:
        return {"wave": self.wave, "exclude_engine": self.exclude_engine}

    @classmethod
    def _from_wire(cls, d: dict) -> StartWave:
        return cls(
            wave=_need(d, "wave", int),
            exclude_engine=_check(d.get("exclude_engine"), "exclude_engine", _OPT_STR),
        )


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one sequence (`index` < n) of one request since the last step.

    `finish_reason` is None while running, else a `FinishReason` value; `stop_reason` is the stop
    token id or stop string that ended it, if any. `logprobs`, when requested, has one entry per
    new token: [sampled_logprob, sampled_rank, top_token_ids, top_logprobs]. `prompt_logprobs`, on
    the first output of a request that asked for them, has one entry of that shape per prompt token
    after the first (an optional 10th array item: older readers ignore it). `error` is set (and
    finish_reason is "error") when the request failed; an error ends every index of the request.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list | None = None
    error: str | None = None
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _to_wire(self) -> list:
        return [
            self.request_id,
            self.index,
            self.new_token_ids,
            self.finish_reason,
            self.stop_reason,
            self.num_prompt_tokens,
            self.num_cached_tokens,
            self.logprobs,
            self.error,
        ] + ([] if self.prompt_logprobs is None else [self.prompt_logprobs])

    @classmethod
    def _from_wire(cls, a: Any) -> RequestOutput:
        if not isinstance(a, list) or len(a) < 9:
            raise MessageError("a RequestOutput must be an array of 9 items")
        rid, index, tokens, finish, stop, n_prompt, n_cached, logprobs, error = a[:9]
        if not (
            type(rid) is str
            and type(index) is int
            and type(tokens) is list
            and isinstance(finish, _OPT_STR)
            and isinstance(stop, (int, str, type(None)))
            and type(n_prompt) is int
            and type(n_cached) is int
            and isinstance(logprobs, (list, type(None)))
            and isinstance(error, _OPT_STR)
        ):
            raise MessageError(f"RequestOutput fields have wrong types: {[type(x).__name__ for x in a[:9]]}")
        prompt_logprobs = a[9] if len(a) > 9 else None
        if not isinstance(prompt_logprobs, (list, type(None))):
            raise MessageError("RequestOutput prompt_logprobs must be an array or null")
        return cls(rid, index, tokens, finish, stop, n_prompt, n_cached, logprobs, error, prompt_logprobs)


@dataclass(slots=True)
class UtilityResult:
    """Answer to `UtilityCall` `call_id`: `result` on success, else `error` is set."""

    call_id: str
    result: Any = None
    error: str | None = None

    def _to_wire(self) -> list:
        return [self.call_id, self.result, self.error]

    @classmethod
    def _from_wire(cls, a: Any) -> UtilityResult:
        if not isinstance(a, list) or len(a) < 3 or type(a[0]) is not str or not isinstance(a[2], _OPT_STR):
            raise MessageError("a UtilityResult must be an array [call_id: str, result, error: str | None]")
        return cls(a[0], a[1], a[2])


@dataclass(slots=True)
class EngineOutputs:
    """Everything one engine step produced for one client: ONE message per client per step.

    `timestamp` is wall-clock seconds when the step finished. `seq` is set by `OutputPublisher`.
    """

    TYPE: ClassVar[str] = "outputs"
    VERSION: ClassVar[int] = 1

    engine_id: str
    outputs: list[RequestOutput]
    timestamp: float
    utility_results: list[UtilityResult] = field(default_factory=list)
    seq: int = 0

    def _to_wire(self) -> dict:
        return {
            "engine_id": self.engine_id,
            "outputs": [o._to_wire() for o in self.outputs],
            "timestamp": self.timestamp,
            "utility_results": [u._to_wire() for u in self.utility_results],
            "seq": self.seq,
        }

    @classmethod
    def _from_wire(cls, d: dict) -> EngineOutputs:
        outputs = [RequestOutput._from_wire(a) for a in _need(d, "outputs", list)]
        utility = [UtilityResult._from_wire(a) for a in _check(d.get("utility_results", []), "utility_results", list)]
        return cls(
            engine_id=_need(d, "engine_id", str),
            outputs=outputs,
            timestamp=float(_need(d, "timestamp", _NUM)),
            utility_results=utility,
            seq=_need(d, "seq", int),
        )


Message = AddRequest | AbortRequests | UtilityCall | StartWave | EngineOutputs
_TYPES: dict[str, type] = {c.TYPE: c for c in (AddRequest, AbortRequests, UtilityCall, StartWave, EngineOutputs)}
M = TypeVar("M", AddRequest, AbortRequests, UtilityCall, StartWave, EngineOutputs)


def encode(msg: Message) -> bytes:
    """Encode a top-level message; raise MessageError if a field is not msgpack-able."""
    body = msg._to_wire()
    body["t"] = msg.TYPE
    body["v"] = msg.VERSION
    try:
        return msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise MessageError(f"cannot encode {type(msg).__name__}: {e}") from e


def decode(data: bytes, expect: type[M] | None = None) -> M:
    """Decode bytes from Redis into a message; raise MessageError if they are not a valid one.

    With `expect`, a valid message of another type is also a MessageError.
    """
    try:
        obj = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises many types on garbage; all mean the same here
        raise MessageError(f"not a msgpack message: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise MessageError(f"a message must be a map, got {type(obj).__name__}")
    tag = obj.get("t")
    cls = _TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {obj.get('t')!r}")
    if obj.get("v") != cls.VERSION:
        raise MessageError(f"unsupported version {obj.get('v')!r} of message type {cls.TYPE!r}")
    if expect is not None and cls is not expect:
        raise MessageError(f"expected a {expect.TYPE!r} message, got {cls.TYPE!r}")
    try:
        return cls._from_wire(obj)
    except MessageError:
        raise
    except (TypeError, ValueError) as e:
        raise MessageError(f"bad {cls.TYPE!r} message: {e}") from None
