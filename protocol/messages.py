"""Every message that crosses Redis, declared once (`protocol.wire_schema`): codec and validation follow.

Rules:
- Wire format is msgpack (never pickle: whoever can write to Redis must not run code in an engine).
  A message is a map with a type tag "t", a version "v" and its fields by name (a field equal to its
  default is left out). `RequestOutput` and `UtilityResult` travel only inside `EngineOutputs`, as
  positional arrays in declared field order, trailing defaults left out (compact on the hot path).
- `decode` raises `MessageError` for garbage, an unknown "t", an unsupported "v", a missing field,
  a field of the wrong type or an unknown enum value; it never raises anything else. Receivers catch
  it, log and drop. Unknown extra fields are ignored, so adding an optional field (last, in a record)
  needs no version bump; changing or removing one does.
- `AddRequest.prompt_token_ids` is checked to be a list of ints (an engine must not crash on a
  bad request); token ids are not checked against the vocabulary here, the engine does that.
- `AddRequest.params` is a typed `SamplingParams` (a map of its non-default engine fields by name), never a
  dict: decoding checks the types; the engine checks the ranges (`SamplingParams.validate`).
- Errors are not a separate message type: a failed request ends with a `RequestOutput` whose
  `finish_reason` is `FinishReason.ERROR`, `error_code` an `ErrorCode` and `error_message` the detail
  for humans (`RequestOutput.failure` builds one). An engine that fails as a whole sends such an output
  for each of its requests, then deregisters.
- `EngineOutputs.seq` numbers the messages one engine publishes to one client (1, 2, 3, ...);
  `OutputPublisher` assigns it, `BrokerClient` uses it to drop duplicates and to detect loss.

Stream messages (client -> engine, on `rs:req:{engine}`): AddRequest, AbortRequests, UtilityCall,
StartWave. Channel messages (engine -> client, on `rs:out:{client}`): EngineOutputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

import msgpack

from protocol.errors import MessageError
from protocol.sampling_params import SamplingParams
from protocol.wire_schema import wire

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
    "make_error",
]


class FinishReason(StrEnum):
    """Values of `RequestOutput.finish_reason` (None while a sequence is still running)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class ErrorCode(StrEnum):
    """Why a request failed (`RequestOutput.error_code`), so callers branch without parsing prose."""

    ENGINE_ERROR = "engine_error"  # the engine failed while running the request
    INVALID_REQUEST = "invalid_request"  # the engine rejected the request (bad params, too long)
    ENGINE_GONE = "engine_gone"  # the owning engine's heartbeat expired or it restarted
    ENGINE_FAILED = "engine_failed"  # the engine failed as a whole (e.g. a TP worker died); clients may resume
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the request ran past AddRequest.deadline
    BROKER_DISCONNECTED = "broker_disconnected"  # the client lost its output subscription
    OUTPUT_LOST = "output_lost"  # a gap in EngineOutputs.seq: some outputs never arrived
    NO_ENGINE = "no_engine"  # re-placing the request found no live engine
    CLIENT_DISCONNECTED = "client_disconnected"  # the HTTP client went away; the request was aborted


def make_error(code: ErrorCode, detail: str) -> str:
    """Text for logs and humans only: "<code>: <detail>" (`RequestOutput.error_text`, `UtilityResult.error`).
    Nothing parses it back: code branches on `RequestOutput.error_code`."""
    return f"{code.value}: {detail}"


@wire(tag="add")
@dataclass(slots=True)
class AddRequest:
    """Start a request. `params` is the request's `SamplingParams`, built and checked by the API; on the wire
    a map of its fields that differ from their defaults (`protocol.sampling_params`). Stop strings (and the
    other API-only fields) are not sent: the API applies them to the text, the engine never sees text. The
    engine checks the decoded params' ranges (`SamplingParams.validate`) and answers a bad request with
    `ErrorCode.INVALID_REQUEST`. Version 1 carried the params as a plain dict of the same names, which this
    map reads alike (both ways), so the layout is unchanged; a new sampling field that an older engine must
    not ignore needs a version bump.

    `client_id` names the output channel the engine publishes to. `arrival_time` and `deadline`
    are wall-clock seconds (time.time()); past its deadline a request is failed (client side) and
    should be aborted (engine side). n > 1 is expanded by the engine; outputs carry an `index`.

    `handoff` (prefill/decode disaggregation, set by the client on a request it places on a prefill engine): the
    engine computes the prompt, samples the first token, stores the prompt's blocks in its KV tier and then
    answers that token with `RequestOutput.handoff` set and drops the request; the client continues it on a
    decode engine (`broker.client.migration`). An engine without a KV tier, or a request with n > 1, ignores it.
    """

    request_id: str
    client_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    deadline: float | None = None
    handoff: bool = False  # prefill only: after the first token the engine hands the request on (through the KV tier)


@wire(tag="abort")
@dataclass(slots=True)
class AbortRequests:
    """Abort requests (unknown or finished ids are ignored by the engine).

    With `index`, abort only that sequence of each request (one of its n, e.g. one that hit a stop
    string); the engine answers with an "abort" output for it and the other sequences go on.
    """

    request_ids: list[str]
    client_id: str
    index: int | None = None


@wire(tag="utility")
@dataclass(slots=True)
class UtilityCall:
    """Ask an engine to run `method(*args)` (e.g. "reset_prefix_cache", "get_stats").

    The answer is a `UtilityResult` with the same `call_id` inside an `EngineOutputs`.
    `args` and the result must be msgpack-able (None, bool, int, float, str, bytes, list, dict).
    """

    call_id: str
    client_id: str
    method: str
    args: list


@wire(tag="wave")
@dataclass(slots=True)
class StartWave:
    """Data parallelism: start wave `wave` on every engine except `exclude_engine`."""

    wave: int
    exclude_engine: str | None = None


@wire(array=True)
@dataclass(slots=True)
class RequestOutput:
    """New tokens of one sequence (`index` < n) of one request since the last step.

    `finish_reason` is None while running, else a `FinishReason`; `stop_reason` is the stop token id
    or stop string that ended it, if any. `logprobs`, when requested, has one entry per new token:
    [sampled_logprob, sampled_rank, top_token_ids, top_logprobs]. `prompt_logprobs`, on the first
    output of a request that asked for them, has one entry of that shape per prompt token after the
    first. A failed request has finish_reason ERROR, an `error_code` and an `error_message` (the detail,
    for humans); an error ends every index of the request. Rarely set fields come last: a running
    sequence's output is a 7-item array.

    A `finish_reason` given as its text value is turned into the enum (an unknown one raises ValueError).
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list | None = None
    error_code: ErrorCode | None = None
    prompt_logprobs: list | None = None
    error_message: str | None = None
    handoff: bool = False  # the sequence goes on elsewhere: its prompt's KV is in the tier (see AddRequest)

    def __post_init__(self) -> None:
        if self.finish_reason is not None and type(self.finish_reason) is not FinishReason:
            self.finish_reason = FinishReason(self.finish_reason)

    @classmethod
    def failure(cls, request_id: str, code: ErrorCode, message: str, index: int = 0) -> RequestOutput:
        """The output that ends a failed request."""
        return cls(request_id, index, [], FinishReason.ERROR, error_code=code, error_message=message)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def error_text(self) -> str | None:
        """"<code>: <message>" for logs and humans, None if the request did not fail."""
        if self.error_code is None:
            return None
        return make_error(self.error_code, self.error_message) if self.error_message else self.error_code.value



@wire(array=True)
@dataclass(slots=True)
class UtilityResult:
    """Answer to `UtilityCall` `call_id`: `result` on success, else `error` (text for humans) is set."""

    call_id: str
    result: Any = None
    error: str | None = None


@wire(tag="outputs", version=2)  # 2: RequestOutput carries error_code + error_message
@dataclass(slots=True)
class EngineOutputs:
    """Everything one engine step produced for one client: ONE message per client per step.

    `timestamp` is wall-clock seconds when the step finished. `seq` is set by `OutputPublisher`.
    """

    engine_id: str
    outputs: list[RequestOutput]
    timestamp: float
    utility_results: list[UtilityResult] = field(default_factory=list)
    seq: int = 0


Message = AddRequest | AbortRequests | UtilityCall | StartWave | EngineOutputs
_TYPES: dict[str, type] = {c.TYPE: c for c in (AddRequest, AbortRequests, UtilityCall, StartWave, EngineOutputs)}
M = TypeVar("M", AddRequest, AbortRequests, UtilityCall, StartWave, EngineOutputs)


def encode(msg: Message) -> bytes:
    """Encode a top-level message; raise MessageError if a field is not msgpack-able (or not its declared record)."""
    try:
        return msgpack.packb(msg.to_wire(), use_bin_type=True)
    except (TypeError, ValueError, OverflowError, AttributeError) as e:  # AttributeError: a record field holds no record
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
        return cls.from_wire(obj)
    except MessageError:
        raise
    except Exception as e:  # a bug in a codec must not crash a receiver; report it as a bad message
        raise MessageError(f"bad {cls.TYPE!r} message: {type(e).__name__}: {e}") from None
