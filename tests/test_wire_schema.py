"""The declaration drives the codec: every wire type round-trips whatever its declared fields hold,
a value of the wrong declared type is a MessageError, and a declaration the codec cannot honour is
refused at import time. Values come from hypothesis strategies built from the declarations themselves."""

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import messages, step_types
from protocol.errors import MessageError
from protocol.sampling_params import MAX_LOGPROBS, SamplingParams
from protocol.wire_schema import off_wire, wire
from worker import serialization

MESSAGES = [messages.AddRequest, messages.AbortRequests, messages.UtilityCall, messages.StartWave,
            messages.EngineOutputs]
RECORDS = [messages.RequestOutput, messages.UtilityResult]
BY_NAME = [SamplingParams]
STEP_TYPES = [step_types.NewRequestData, step_types.CachedRequestData, step_types.SchedulerOutput,
              step_types.SampledToken, step_types.ModelRunnerOutput]
SCALARS = {str: st.text(max_size=6), int: st.integers(-(2**63), 2**64 - 1), bool: st.booleans(),
           float: st.floats(allow_nan=False), bytes: st.binary(max_size=6)}
ANY = st.none() | st.integers(-5, 5) | st.text(max_size=3) | st.lists(st.integers(0, 9), max_size=3)


def sampling_params() -> st.SearchStrategy:
    """SamplingParams that pass its range checks (its constructor refuses the others)."""
    unit = st.floats(0.01, 1.0)
    maybe_k = st.none() | st.integers(0, MAX_LOGPROBS)
    return st.builds(SamplingParams, n=st.integers(1, 4), temperature=st.floats(0.0, 2.0), top_p=unit,
                     top_k=st.integers(-1, 50), min_p=st.floats(0.0, 1.0), seed=st.none() | st.integers(-(2**63), 2**63 - 1),
                     presence_penalty=st.floats(-2.0, 2.0), repetition_penalty=st.floats(0.5, 2.0),
                     max_tokens=st.none() | st.integers(1, 100), stop_token_ids=st.lists(st.integers(0, 9), max_size=3),
                     ignore_eos=st.booleans(), logprobs=maybe_k, prompt_logprobs=maybe_k,
                     structured_output=st.none() | st.just({"kind": "regex", "value": "a+"}))


def strategy(tp: Any) -> st.SearchStrategy:
    """Values of the declared type `tp` (what a field may legally hold)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in SCALARS:
        return SCALARS[tp]
    if tp is Any:
        return ANY
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if hasattr(tp, "__wire__"):
        return instances(tp)
    if origin in (types.UnionType, typing.Union):
        return st.one_of(*(st.none() if a is type(None) else strategy(a) for a in args))
    if tp is list or origin is list:
        return st.lists(strategy(args[0]) if args else ANY, max_size=3)
    if tp is dict or origin is dict:
        return st.dictionaries(st.text(max_size=4), strategy(args[1]) if args else ANY, max_size=3)
    raise AssertionError(f"no strategy for {tp!r}")


def instances(cls: type) -> st.SearchStrategy:
    if cls is SamplingParams:
        return sampling_params()
    spec = cls.__wire__
    return st.builds(cls, **{f.name: strategy(spec.hints[f.name]) for f in spec.fields})


def _message_round_trip(msg):
    return messages.decode(messages.encode(msg))


def _record_round_trip(record):
    return type(record).from_wire(msgpack.unpackb(msgpack.packb(record.to_wire(), use_bin_type=True)))


def _shm_round_trip(record):
    return type(record).from_wire(serialization.decode(serialization.encode(record.to_wire())))


_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
@_SETTINGS
@given(data=st.data())
def test_every_message_round_trips(cls, data):
    msg = data.draw(instances(cls))
    assert _message_round_trip(msg) == msg


@pytest.mark.parametrize("cls", RECORDS + BY_NAME, ids=lambda c: c.__name__)
@_SETTINGS
@given(data=st.data())
def test_every_record_round_trips(cls, data):
    record = data.draw(instances(cls))
    assert _record_round_trip(record) == record


@pytest.mark.parametrize("cls", STEP_TYPES, ids=lambda c: c.__name__)
@_SETTINGS
@given(data=st.data())
def test_every_step_type_round_trips_through_the_shm_codec(cls, data):
    record = data.draw(instances(cls))
    assert _shm_round_trip(record) == record


def _wrong_value(tp: Any) -> Any:
    """A value that no field of type `tp` accepts."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):  # X | None: what X refuses
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    is_map = typing.get_origin(tp) is dict or tp is dict or (hasattr(tp, "__wire__") and not tp.__wire__.array)
    return ["no", "way"] if is_map else {"no": "way"}


def _checked_fields(cls):
    return [f for f in cls.__wire__.fields if cls.__wire__.hints[f.name] is not Any]


@pytest.mark.parametrize("cls", MESSAGES + RECORDS + BY_NAME, ids=lambda c: c.__name__)
@_SETTINGS
@given(data=st.data())
def test_a_field_of_the_wrong_type_is_a_message_error(cls, data):
    obj = data.draw(instances(cls))
    f = data.draw(st.sampled_from(_checked_fields(cls)))
    wire_value = obj.to_wire()
    bad = _wrong_value(cls.__wire__.hints[f.name])
    if cls.__wire__.array:
        index = cls.__wire__.fields.index(f)
        fields = cls.__wire__.fields
        wire_value += [getattr(obj, fl.name) for fl in fields[len(wire_value):index + 1]]  # trimmed defaults
        wire_value[index] = bad
    else:
        wire_value[f.name] = bad
    with pytest.raises(MessageError, match=f.name):
        cls.from_wire(msgpack.unpackb(msgpack.packb(wire_value)))


@pytest.mark.parametrize("cls", RECORDS + STEP_TYPES, ids=lambda c: c.__name__)
def test_records_that_do_not_unpack_are_message_errors(cls):
    required = sum(1 for f in cls.__wire__.fields
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    bad = ["not an array", {"a": 1}, 7, None] + ([[None] * (required - 1)] if required else [])
    for raw in bad:
        with pytest.raises(MessageError):
            cls.from_wire(raw)
        with pytest.raises(MessageError):
            cls.from_wire_list([raw])
    with pytest.raises(MessageError):
        cls.from_wire_list("not a list")


def test_trusted_records_skip_type_checks_but_untrusted_ones_do_not():
    """The step types (engine <-> its own workers) unpack by position only, as before the schema."""
    assert step_types.CachedRequestData.from_wire(["r", "not-a-list", 3]).new_block_ids == "not-a-list"
    with pytest.raises(MessageError, match="new_token_ids"):
        messages.RequestOutput.from_wire(["r", 0, "not-a-list"])


# --- the declaration machinery itself, on toy types --------------------------------------------------

class Color(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@wire(array=True)
@dataclass
class Point:
    x: int
    y: int
    color: Color | None = None
    label: str | None = None


@wire(tag="shape", version=3)
@dataclass
class Shape:
    name: str
    points: list[Point]
    by_name: dict[str, Point] = field(default_factory=dict)
    scale: float = 1.0
    hidden: bool = False


def test_layouts_follow_the_declaration():
    shape = Shape("tri", [Point(0, 0), Point(1, 2, Color.RED), Point(3, 4, None, "top")], {"o": Point(0, 0)})
    raw = shape.to_wire()
    assert raw == {"t": "shape", "v": 3, "name": "tri", "points": [[0, 0], [1, 2, "red"], [3, 4, None, "top"]],
                   "by_name": {"o": [0, 0]}}  # scale and hidden are at their defaults: left out
    assert Shape.from_wire(msgpack.unpackb(msgpack.packb(raw))) == shape
    assert Shape.from_wire({**raw, "scale": 2}).scale == 2.0  # an int where a float is declared widens
    assert Shape.from_wire({**raw, "hidden": True, "more": 1}).hidden is True


@pytest.mark.parametrize("bad, match", [
    ({"points": [[0, 0, "green"]]}, "unknown Color 'green'"),
    ({"points": [[0]]}, "Point needs 2 items"),
    ({"points": [["0", 0]]}, "Point.x"),
    ({"by_name": {"o": [0, None]}}, "Point.y"),
    ({"scale": "big"}, "Shape.scale"),
    ({"hidden": 1}, "Shape.hidden"),
])
def test_validation_follows_the_declaration(bad, match):
    raw = {"t": "shape", "v": 3, "name": "s", "points": [], **bad}
    with pytest.raises(MessageError, match=match):
        Shape.from_wire(raw)
    raw.pop("name")
    with pytest.raises(MessageError, match="name"):
        Shape.from_wire({**raw, "points": []})


@pytest.mark.parametrize("annotation", [set[int], tuple[int, int], dict[int, str], list[set], "Point | str"])
def test_types_the_codec_cannot_check_are_refused_at_declaration(annotation):
    cls = dataclasses.make_dataclass("Odd", [("value", annotation)])
    cls.__module__ = __name__
    with pytest.raises(TypeError, match="does not support|keys must be str"):
        wire(array=True)(cls)


def test_a_wire_type_is_either_a_map_or_an_array():
    with pytest.raises(TypeError):
        wire(tag="x", array=True)(dataclasses.make_dataclass("Both", [("a", int)]))
    with pytest.raises(TypeError):
        wire(array=True, by_name=True)(dataclasses.make_dataclass("Both", [("a", int)]))
    with pytest.raises(TypeError):
        wire()(dataclasses.make_dataclass("Neither", [("a", int)]))


@wire(by_name=True)
@dataclass
class Pen:
    width: float = 1.0
    color: Color | None = None
    owner: str = off_wire(default="me")
    marks: list[int] = off_wire(default_factory=list)


def test_a_by_name_record_is_a_map_of_its_changed_fields_and_off_wire_fields_never_travel():
    assert Pen().to_wire() == {}
    pen = Pen(2.0, Color.RED, owner="you", marks=[1])
    assert pen.to_wire() == {"width": 2.0, "color": "red"}
    back = Pen.from_wire(msgpack.unpackb(msgpack.packb(pen.to_wire())))
    assert back == Pen(2.0, Color.RED) and (back.owner, back.marks) == ("me", [])
    assert Pen.from_wire({"owner": "them", "marks": [2], "width": 3}) == Pen(3.0)  # not read from the wire either
    with pytest.raises(MessageError, match="Pen.width"):
        Pen.from_wire({"width": "thick"})
    with pytest.raises(MessageError, match="Pen"):
        Pen.from_wire([2.0])


def test_a_nested_record_of_the_wrong_layout_names_its_field():
    @wire(tag="box")
    @dataclass
    class Box:
        pen: Pen
        point: Point | None = None

    assert Box.from_wire({"t": "box", "v": 1, "pen": {"width": 2}, "point": [1, 2]}) == Box(Pen(2.0), Point(1, 2))
    with pytest.raises(MessageError, match="Box.pen: expected a map"):
        Box.from_wire({"t": "box", "v": 1, "pen": [2.0]})
    with pytest.raises(MessageError, match="Box.point: expected an array"):
        Box.from_wire({"t": "box", "v": 1, "pen": {}, "point": {"x": 1}})


def test_a_field_off_the_wire_needs_a_default():
    with pytest.raises(TypeError, match="off the wire"):
        wire(by_name=True)(dataclasses.make_dataclass("NoDefault", [("a", int, off_wire())]))
