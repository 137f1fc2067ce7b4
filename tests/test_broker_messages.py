import time

import msgpack
import pytest

from broker.messages import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    ErrorCode,
    MessageError,
    RequestOutput,
    StartWave,
    UtilityCall,
    UtilityResult,
    decode,
    encode,
    error_code,
    make_error,
)

SAMPLES = [
    AddRequest("r1", "c1", [1, 2, 3], {"temperature": 0.5, "n": 2, "stop": ["\n"]}, 1700000000.25, 1700000060.0),
    AddRequest("r2", "c1", [], {}, 1.0),
    AbortRequests(["r1", "r2"], "c1"),
    UtilityCall("u1", "c1", "reset_prefix_cache", [1, "x", None]),
    StartWave(7, None),
    StartWave(8, "e1"),
    AbortRequests(["r1"], "c1", index=1),
    EngineOutputs(
        "e0",
        [
            RequestOutput("r1", 0, [5, 6], None, None, 3, 0, None, None),
            RequestOutput("r1", 1, [7], "stop", 13, 3, 2, [[-0.1, 1, [7, 8], [-0.1, -2.5]]], None),
            RequestOutput("r2", 0, [], "error", "</s>", 0, 0, None, make_error(ErrorCode.ENGINE_ERROR, "boom")),
        ],
        123.5,
        [UtilityResult("u1", {"a": [1, 2]}, None), UtilityResult("u2", None, "failed")],
        seq=42,
    ),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_wire_is_a_tagged_versioned_map():
    raw = msgpack.unpackb(encode(AbortRequests(["r"], "c")))
    assert raw == {"t": "abort", "v": 1, "request_ids": ["r"], "client_id": "c"}
    outs = msgpack.unpackb(encode(SAMPLES[-1]))
    assert outs["t"] == "outputs" and isinstance(outs["outputs"][0], list)


def _wire(msg, **changes):
    raw = msgpack.unpackb(encode(msg))
    raw.update(changes)
    return msgpack.packb(raw)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"not msgpack at all \xff\xfe",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"v": 1}),
        msgpack.packb({"t": "nope", "v": 1}),
        msgpack.packb({"t": ["unhashable"], "v": 1}),
        msgpack.packb({1: 2}),
        msgpack.packb(msgpack.ExtType(5, b"x")),
        encode(SAMPLES[0]) + b"trailing",
    ],
)
def test_garbage_raises_message_error(data):
    with pytest.raises(MessageError):
        decode(data)


@pytest.mark.parametrize(
    "data",
    [
        _wire(SAMPLES[0], v=2),
        _wire(SAMPLES[0], v=None),
        _wire(SAMPLES[0], prompt_token_ids=[1, "2"]),
        _wire(SAMPLES[0], prompt_token_ids=[1, True]),
        _wire(SAMPLES[0], params=[1]),
        _wire(SAMPLES[0], arrival_time="now"),
        _wire(SAMPLES[2], request_ids=[1]),
        _wire(SAMPLES[4], wave="1"),
        _wire(SAMPLES[-1], outputs=[["r1", 0]]),
        _wire(SAMPLES[-1], outputs=[["r1", "0", [], None, None, 0, 0, None, None]]),
        _wire(SAMPLES[-1], utility_results=[[1, None, None]]),
    ],
)
def test_bad_version_or_fields_raise_message_error(data):
    with pytest.raises(MessageError):
        decode(data)


def test_missing_field_raises_message_error():
    raw = msgpack.unpackb(encode(SAMPLES[0]))
    del raw["request_id"]
    with pytest.raises(MessageError, match="request_id"):
        decode(msgpack.packb(raw))


def test_unknown_extra_fields_are_ignored():
    assert decode(_wire(SAMPLES[2], future_field=1)) == SAMPLES[2]


def test_expect_rejects_other_types():
    with pytest.raises(MessageError, match="expected"):
        decode(encode(SAMPLES[2]), expect=EngineOutputs)
    assert decode(encode(SAMPLES[2]), expect=AbortRequests) == SAMPLES[2]


def test_unencodable_payload_raises_message_error():
    with pytest.raises(MessageError):
        encode(UtilityCall("u", "c", "m", [object()]))


def test_error_helpers():
    err = make_error(ErrorCode.DEADLINE_EXCEEDED, "too slow: really")
    assert err == "deadline_exceeded: too slow: really"
    assert error_code(err) == ErrorCode.DEADLINE_EXCEEDED
    assert error_code(None) is None


def _per_call_us(fn, n=2000):
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def test_engine_outputs_64_speed(capsys):
    outs = EngineOutputs(
        "engine-0",
        [RequestOutput(f"req-{i:06d}", 0, [1000 + i], None, None, 512, 128, None, None) for i in range(64)],
        time.time(),
        seq=1,
    )
    data = encode(outs)
    enc, dec = _per_call_us(lambda: encode(outs)), _per_call_us(lambda: decode(data))
    with capsys.disabled():
        print(f"\nEngineOutputs x64: {len(data)} bytes, encode {enc:.1f} us, decode {dec:.1f} us")
    assert enc < 2000 and dec < 2000  # generous: a regression guard, not a benchmark
