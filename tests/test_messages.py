import dataclasses
import time

import msgpack
import pytest

from protocol.messages import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    ErrorCode,
    FinishReason,
    MessageError,
    RequestOutput,
    StartWave,
    UtilityCall,
    UtilityResult,
    decode,
    encode,
)
from protocol.sampling_params import SamplingParams

SAMPLES = [
    AddRequest("r1", "c1", [1, 2, 3], SamplingParams(temperature=0.5, n=2, seed=7), 1700000000.25, 1700000060.0),
    AddRequest("r2", "c1", [], SamplingParams(), 1.0),
    AbortRequests(["r1", "r2"], "c1"),
    UtilityCall("u1", "c1", "reset_prefix_cache", [1, "x", None]),
    StartWave(7, None),
    StartWave(8, "e1"),
    AbortRequests(["r1"], "c1", index=1),
    EngineOutputs(
        "e0",
        [
            RequestOutput("r1", 0, [5, 6], None, None, 3, 0, None),
            RequestOutput("r1", 1, [7], FinishReason.STOP, 13, 3, 2, [[-0.1, 1, [7, 8], [-0.1, -2.5]]]),
            RequestOutput("r2", 0, [], FinishReason.ERROR, "</s>", 0, 0, None, ErrorCode.ENGINE_ERROR,
                          error_message="boom"),
            RequestOutput.failure("r3", ErrorCode.DEADLINE_EXCEEDED, "too slow: really", index=2),
        ],
        123.5,
        [UtilityResult("u1", {"a": [1, 2]}, None), UtilityResult("u2", None, "failed")],
        seq=42,
    ),
]
TOP_LEVEL = [AddRequest, AbortRequests, UtilityCall, StartWave, EngineOutputs]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_wire_is_a_tagged_versioned_map_without_defaults():
    raw = msgpack.unpackb(encode(AbortRequests(["r"], "c")))
    assert raw == {"t": "abort", "v": 1, "request_ids": ["r"], "client_id": "c"}
    assert list(raw)[:2] == ["t", "v"]  # tag first: readable in redis-cli output
    assert msgpack.unpackb(encode(AbortRequests(["r"], "c", index=0)))["index"] == 0
    outs = msgpack.unpackb(encode(EngineOutputs("e0", [], 1.0, seq=1)))
    assert outs == {"t": "outputs", "v": 2, "engine_id": "e0", "outputs": [], "timestamp": 1.0, "seq": 1}


def test_request_outputs_are_arrays_in_declared_order_trailing_defaults_left_out():
    outs = msgpack.unpackb(encode(SAMPLES[-1]))["outputs"]
    assert outs[0] == ["r1", 0, [5, 6], None, None, 3]  # a running sequence: no finish, logprobs or error
    assert outs[1] == ["r1", 1, [7], "stop", 13, 3, 2, [[-0.1, 1, [7, 8], [-0.1, -2.5]]]]
    assert outs[2] == ["r2", 0, [], "error", "</s>", 0, 0, None, "engine_error", None, "boom"]
    assert outs[3] == ["r3", 2, [], "error", None, 0, 0, None, "deadline_exceeded", None, "too slow: really"]
    names = [f.name for f in dataclasses.fields(RequestOutput)]
    assert names[:9] == ["request_id", "index", "new_token_ids", "finish_reason", "stop_reason",
                         "num_prompt_tokens", "num_cached_tokens", "logprobs", "error_code"]
    assert msgpack.unpackb(encode(SAMPLES[-1]))["utility_results"] == [["u1", {"a": [1, 2]}], ["u2", None, "failed"]]


def test_enums_decode_to_enum_members():
    got = decode(encode(SAMPLES[-1]))
    assert got.outputs[1].finish_reason is FinishReason.STOP
    assert got.outputs[3].error_code is ErrorCode.DEADLINE_EXCEEDED and got.outputs[3].finished


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


_RUNNING = ["r1", 0, [5], None, None, 1, 0]


@pytest.mark.parametrize(
    "data",
    [
        _wire(SAMPLES[0], v=2),
        _wire(SAMPLES[0], v=None),
        _wire(SAMPLES[-1], v=1),  # version 1 carried the error as "<code>: detail" text in item 8
        _wire(SAMPLES[0], prompt_token_ids=[1, "2"]),
        _wire(SAMPLES[0], prompt_token_ids=[1, True]),
        _wire(SAMPLES[0], prompt_token_ids=None),
        _wire(SAMPLES[0], params=[1]),
        _wire(SAMPLES[0], params=None),
        _wire(SAMPLES[0], params={"temperature": "hot"}),
        _wire(SAMPLES[0], params={"n": 1.5}),
        _wire(SAMPLES[0], params={"seed": True}),
        _wire(SAMPLES[0], params={"stop_token_ids": [1, "2"]}),
        _wire(SAMPLES[0], params={"structured_output": "json"}),
        _wire(SAMPLES[0], v=1, params={"n": 2}, handoff="yes"),
        _wire(SAMPLES[0], arrival_time="now"),
        _wire(SAMPLES[0], arrival_time=True),
        _wire(SAMPLES[0], deadline="later"),
        _wire(SAMPLES[0], request_id=None),
        _wire(SAMPLES[2], request_ids=[1]),
        _wire(SAMPLES[2], index="0"),
        _wire(SAMPLES[3], args={"a": 1}),
        _wire(SAMPLES[4], wave="1"),
        _wire(SAMPLES[4], exclude_engine=3),
        _wire(SAMPLES[-1], outputs=[["r1", 0]]),
        _wire(SAMPLES[-1], outputs=[["r1", "0", [], None, None, 0, 0, None, None]]),
        _wire(SAMPLES[-1], outputs=[["r1", 0, [1.5]]]),
        _wire(SAMPLES[-1], outputs=[[*_RUNNING, "logprobs"]]),
        _wire(SAMPLES[-1], outputs=["r1"]),
        _wire(SAMPLES[-1], outputs={"r1": 0}),
        _wire(SAMPLES[-1], outputs=[["r1", 0, [], "finished"]]),  # not a FinishReason
        _wire(SAMPLES[-1], outputs=[["r1", 0, [], "error", None, 0, 0, None, "kaput"]]),  # not an ErrorCode
        _wire(SAMPLES[-1], outputs=[["r1", 0, [], "error", None, 0, 0, None, ["engine_error"]]]),
        _wire(SAMPLES[-1], outputs=[["r1", 0, [], "error", None, 0, 0, None, "engine_error", None, 7]]),
        _wire(SAMPLES[-1], utility_results=[[1, None, None]]),
        _wire(SAMPLES[-1], utility_results=None),
        _wire(SAMPLES[-1], seq="1"),
        _wire(SAMPLES[-1], timestamp=None),
    ],
)
def test_bad_version_or_fields_raise_message_error(data):
    with pytest.raises(MessageError):
        decode(data)


@pytest.mark.parametrize("cls", TOP_LEVEL, ids=lambda c: c.__name__)
def test_each_missing_required_field_raises_message_error(cls):
    sample = next(m for m in SAMPLES if type(m) is cls)
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    assert required
    for name in required:
        raw = msgpack.unpackb(encode(sample))
        del raw[name]
        with pytest.raises(MessageError, match=name):
            decode(msgpack.packb(raw))


def test_numbers_widen_to_float_and_optional_fields_take_their_defaults():
    raw = {"t": "add", "v": 1, "request_id": "r", "client_id": "c", "prompt_token_ids": [1], "params": {},
           "arrival_time": 5}
    got = decode(msgpack.packb(raw))
    assert got.arrival_time == 5.0 and type(got.arrival_time) is float and got.deadline is None
    got = decode(msgpack.packb({"t": "outputs", "v": 2, "engine_id": "e", "outputs": [["r", 0, []]], "timestamp": 2}))
    assert got == EngineOutputs("e", [RequestOutput("r", 0, [])], 2.0, [], 0)


def test_unknown_extra_fields_are_ignored():
    assert decode(_wire(SAMPLES[2], future_field=1)) == SAMPLES[2]
    assert decode(_wire(SAMPLES[1], arrival_time=1, future_field=1)) == SAMPLES[1]  # the field-by-field path
    full = msgpack.unpackb(encode(SAMPLES[-1]))["outputs"][2] + [False]  # every declared field, handoff last
    assert len(full) == len(dataclasses.fields(RequestOutput))
    longer = [*full, "a future field"]
    assert decode(_wire(SAMPLES[-1], outputs=[longer])).outputs == [SAMPLES[-1].outputs[2]]


def test_expect_rejects_other_types():
    with pytest.raises(MessageError, match="expected"):
        decode(encode(SAMPLES[2]), expect=EngineOutputs)
    assert decode(encode(SAMPLES[2]), expect=AbortRequests) == SAMPLES[2]


def test_unencodable_payload_raises_message_error():
    with pytest.raises(MessageError):
        encode(UtilityCall("u", "c", "m", [object()]))


def test_params_must_be_sampling_params_never_a_dict():
    with pytest.raises(MessageError, match="AddRequest"):
        encode(AddRequest("r", "c", [1], {"temperature": 0.5}, 1.0))


def test_params_travel_as_a_map_of_changed_engine_fields_without_the_api_only_ones():
    params = SamplingParams(temperature=0.5, max_tokens=100, stop=["\n"], include_stop_str_in_output=True,
                            skip_special_tokens=False, stop_token_ids=[2])
    raw = msgpack.unpackb(encode(AddRequest("r", "c", [1], params, 1.0)))
    assert raw["params"] == {"temperature": 0.5, "max_tokens": 100, "stop_token_ids": [2]}
    got = decode(encode(AddRequest("r", "c", [1], params, 1.0))).params
    assert got == SamplingParams(temperature=0.5, max_tokens=100, stop_token_ids=[2])
    assert (got.stop, got.include_stop_str_in_output, got.skip_special_tokens) == ([], False, True)
    assert msgpack.unpackb(encode(SAMPLES[1]))["params"] == {}


def test_a_version_1_dict_of_every_engine_field_reads_as_the_same_params():
    """What an older client sent (`to_engine_dict`: every engine field by name, stop strings left out)."""
    old = {"n": 2, "temperature": 0.5, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": 7, "presence_penalty": 0.0,
           "frequency_penalty": 0.0, "repetition_penalty": 1.0, "max_tokens": 16, "min_tokens": 0,
           "stop_token_ids": [], "ignore_eos": False, "logprobs": None, "prompt_logprobs": None}
    assert decode(_wire(SAMPLES[0], params=old)) == SAMPLES[0]


def test_decoded_params_are_type_checked_and_validate_checks_their_ranges():
    got = decode(_wire(SAMPLES[0], params={"temperature": -1.0, "top_k": -1}))
    with pytest.raises(ValueError, match="temperature"):
        got.params.validate()
    assert decode(_wire(SAMPLES[0], params={"top_k": -1})).params.validate().top_k == 0


def test_failure_carries_the_code_and_the_message_apart():
    out = RequestOutput.failure("r", ErrorCode.INVALID_REQUEST, "prompt too long: 9000 tokens")
    assert out.finish_reason is FinishReason.ERROR and out.error_code is ErrorCode.INVALID_REQUEST
    assert out.error_message == "prompt too long: 9000 tokens"
    assert out.error_text() == "invalid_request: prompt too long: 9000 tokens"


def test_a_text_finish_reason_becomes_the_enum_and_errors_never_travel_as_text():
    assert RequestOutput("r", 0, [5], "length").finish_reason is FinishReason.LENGTH  # engine.request's text
    running = RequestOutput("r", 0, [5])
    assert running.error_code is None and running.error_message is None and running.error_text() is None
    with pytest.raises(TypeError):
        RequestOutput("r", 0, [], "error", error="engine_failed: worker died")  # no "<code>: detail" way in
    sent = RequestOutput.failure("r", ErrorCode.ENGINE_FAILED, "worker died: rank 1", index=2)
    back = decode(encode(EngineOutputs("e", [sent], 1.0))).outputs[0]
    assert (back.index, back.finish_reason, back.error_code) == (2, FinishReason.ERROR, ErrorCode.ENGINE_FAILED)
    assert type(back.error_code) is ErrorCode and back.error_message == "worker died: rank 1"


def test_client_disconnected_is_an_error_code():
    assert ErrorCode("client_disconnected") is ErrorCode.CLIENT_DISCONNECTED


def _per_call_us(fn, n=2000):
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def test_engine_outputs_64_speed(capsys):
    outs = EngineOutputs(
        "engine-0",
        [RequestOutput(f"req-{i:06d}", 0, [1000 + i], None, None, 512, 128) for i in range(64)],
        time.time(),
        seq=1,
    )
    data = encode(outs)
    enc, dec = _per_call_us(lambda: encode(outs)), _per_call_us(lambda: decode(data))
    with capsys.disabled():
        print(f"\nEngineOutputs x64: {len(data)} bytes, encode {enc:.1f} us, decode {dec:.1f} us")
    assert enc < 2000 and dec < 2000  # generous: a regression guard, not a benchmark
