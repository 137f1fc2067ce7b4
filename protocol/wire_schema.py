"""Wire types declared once: a dataclass plus `@wire(...)` gets its msgpack codec and its validation.

Declaring: decorate a `@dataclass` with `@wire(tag=..., version=...)` (a top-level message, a msgpack
map; the class gets `TYPE` and `VERSION`), `@wire(array=True)` (a record, a positional array) or
`@wire(by_name=True)` (a record, a map of its fields by name, without tag or version: readable where
most fields keep their defaults). Its fields, in declared order, are the wire fields; a field with a
default is optional on the wire. A field declared with `off_wire(...)` never travels: it is for the
sender's side only, and a decoded object has its default there.
Field types: `str`, `int`, `float`, `bool`, `bytes`, `Any`, an `Enum` (travels as its value), another
wire type, `list[...]` / `dict[str, ...]` of those, `X | None`, and unions of scalars such as
`int | str | None`. Anything else is a TypeError at import time, so no field goes unchecked by accident.
The class gets `to_wire()` (what msgpack packs), `from_wire(raw)` (from what msgpack unpacked) and, to
decode a list of records in one call, `from_wire_list(items)` (arrays also get `to_wire_list`).

Layouts (plain msgpack, readable with any msgpack library, e.g. what `redis-cli` hands you):
- map: `{"t": tag, "v": version, name: value, ...}`; a field equal to its default is left out.
  A `by_name` record is the same map without "t" and "v".
- array: `[field0, field1, ...]` in declared order; trailing fields equal to their defaults are left
  out, so a rarely-set field declared last costs nothing; a shorter array gets them back as defaults.
Adding a field with a default (at the end, for an array) is compatible both ways and needs no version
bump; removing, reordering or retyping one does.

Decoding checks every field against its type
and raises `MessageError`, never anything else, for a missing required field, a wrong type or an
unknown enum value; unknown map keys and extra trailing array items are ignored.
`trusted=True` is for peers of the same build on the hot path (the engine and its own TP workers):
decoding then only unpacks by position (garbage that does not unpack is still a MessageError) and
skips the type checks, which would cost as much as the unpacking.

The codec of each type is generated once as Python source, like dataclasses' `__init__`: as fast as
hand-written code, with no per-field dispatch at run time.
"""

from __future__ import annotations

import dataclasses
import enum
import linecache
import types
import typing
from collections.abc import Callable
from typing import Any

from protocol.errors import MessageError

__all__ = ["WireSpec", "off_wire", "wire"]

_SCALARS = (str, int, float, bool, bytes)


@dataclasses.dataclass(frozen=True)
class WireSpec:
    """What `@wire` attaches to a class as `__wire__`: its layout and fields, for codecs and tests."""

    cls: type
    tag: str | None
    version: int
    array: bool
    fields: tuple[dataclasses.Field, ...]
    hints: dict[str, Any]
    local: tuple[dataclasses.Field, ...] = ()  # `off_wire` fields: never sent, their defaults when decoded


def off_wire(**field_args: Any) -> Any:
    """`dataclasses.field(...)` for a field that never travels (it needs a default or a default_factory)."""
    return dataclasses.field(**field_args, metadata={"wire": False})


def wire(cls: type | None = None, *, tag: str | None = None, version: int = 1, array: bool = False,
         by_name: bool = False, trusted: bool = False) -> Any:
    """Give a dataclass its codec (see the module rules)."""

    def build(c: type) -> type:
        if not dataclasses.is_dataclass(c):
            raise TypeError(f"@wire needs a dataclass, got {c.__qualname__}")
        if c.__dataclass_params__.frozen:
            raise TypeError(f"{c.__qualname__}: @wire decodes by setting fields, so it cannot be frozen")
        if (tag is not None) + array + by_name != 1:
            raise TypeError(f"{c.__qualname__}: a wire type is one of a tagged map, an array or a by_name map")
        fields = tuple(f for f in dataclasses.fields(c) if f.metadata.get("wire", True))
        local = tuple(f for f in dataclasses.fields(c) if f not in fields)
        if any(not _has_default(f) for f in local):
            raise TypeError(f"{c.__qualname__}: a field off the wire needs a default")
        spec = WireSpec(c, tag, version, array, fields, typing.get_type_hints(c), local)
        c.__wire__ = spec
        if tag is not None:
            c.TYPE, c.VERSION = tag, version
        c.to_wire = _compile(_Codegen(spec, trusted).encoder())
        if array:
            c.to_wire_list = _compile(_Codegen(spec, trusted).encoder(as_list=True))
        c.from_wire = staticmethod(_compile(_Codegen(spec, trusted).decoder()))
        c.from_wire_list = staticmethod(_compile(_Codegen(spec, trusted).decoder(as_list=True)))
        return c

    return build if cls is None else build(cls)


def _compile(source_and_ns: tuple[str, str, dict]) -> Callable:
    name, source, ns = source_and_ns
    filename = f"<wire codec {ns['_cls'].__qualname__}.{name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for tracebacks
    exec(compile(source, filename, "exec"), ns)
    return ns[name]


def _bad(where: str, expected: str, value: Any) -> typing.NoReturn:
    raise MessageError(f"{where}: expected {expected}, got {type(value).__name__}")


class _Codegen:
    """Writes the source of one type's encoder or decoder."""

    def __init__(self, spec: WireSpec, trusted: bool) -> None:
        self.spec = spec
        self.trusted = trusted
        self.ns: dict[str, Any] = {"MessageError": MessageError, "_bad": _bad, "_new": object.__new__,
                                   "_cls": spec.cls}
        self.lines: list[str] = []

    def name(self, obj: Any, hint: str) -> str:
        key = f"_{hint}{len(self.ns)}"
        self.ns[key] = obj
        return key

    # --- encoding ---------------------------------------------------------------------------------

    def encoder(self, as_list: bool = False) -> tuple[str, str, dict]:
        """`to_wire(o)`, or with `as_list` `to_wire_list(items)` (arrays only: one loop, no call per item)."""
        fields = self.spec.fields
        values = {f.name: self.encode_value(self.spec.hints[f.name], f"o.{f.name}") for f in fields}
        out = self.lines
        if self.spec.array:
            if as_list:
                out += ["def to_wire_list(items):", "    out = []", "    append = out.append", "    for o in items:"]
                pad, emit = " " * 8, ["append({})", "continue"]
            else:
                out.append("def to_wire(o):")
                pad, emit = " " * 4, ["return {}"]
            required = len(fields)
            while required and _has_default(fields[required - 1]):
                required -= 1
            for last in range(len(fields) - 1, required - 1, -1):
                out.append(f"{pad}if {self.differs(fields[last])}:")
                items = f"[{', '.join(values[f.name] for f in fields[:last + 1])}]"
                out.extend(f"{pad}    {line.format(items)}" for line in emit)
            shortest = f"[{', '.join(values[f.name] for f in fields[:required])}]"
            out.append(f"{pad}{emit[0].format(shortest)}")
            if as_list:
                out.append("    return out")
            return ("to_wire_list" if as_list else "to_wire"), "\n".join(out), self.ns
        out.append("def to_wire(o):")
        head = [] if self.spec.tag is None else [f"'t': {self.spec.tag!r}", f"'v': {self.spec.version!r}"]
        head += [f"{f.name!r}: {values[f.name]}" for f in fields if not _has_default(f)]
        out.append(f"    d = {{{', '.join(head)}}}")
        for f in fields:
            if _has_default(f):
                out.append(f"    if {self.differs(f)}:")
                out.append(f"        d[{f.name!r}] = {values[f.name]}")
        out.append("    return d")
        return "to_wire", "\n".join(out), self.ns

    def differs(self, f: dataclasses.Field) -> str:
        """An expression true when field `f` of `o` is not its default."""
        default = _default_of(f)
        if default is None or isinstance(default, bool):
            return f"o.{f.name} is not {default}"
        if isinstance(default, (list, dict)) and not default:
            return f"o.{f.name}"
        return f"o.{f.name} != {self.name(default, 'default')}"

    def encode_value(self, tp: Any, expr: str) -> str:
        optional, tp = _strip_optional(tp)
        if _is_wire(tp):
            enc = f"{self.name(tp.to_wire, 'enc')}({expr})"
        elif typing.get_origin(tp) is list and _is_wire(_args(tp)[0]):
            item = _args(tp)[0]
            enc = (f"{self.name(item.to_wire_list, 'enclist')}({expr})" if item.__wire__.array
                   else f"[{self.name(item.to_wire, 'enc')}(x) for x in {expr}]")
        elif typing.get_origin(tp) is dict and _is_wire(_args(tp)[1]):
            enc = f"{{k: {self.name(_args(tp)[1].to_wire, 'enc')}(x) for k, x in {expr}.items()}}"
        else:
            return expr  # msgpack packs it as is (an enum as its value: StrEnum is a str, IntEnum an int)
        return f"(None if {expr} is None else {enc})" if optional else enc

    # --- decoding ---------------------------------------------------------------------------------
    # Two decoders per type. The fast one reads every field, tests all the cheap type checks in one
    # condition, then does the per-field work (enum lookups, nested records, item checks). When that
    # condition fails it hands the raw value to the checked one, which tests field by field and
    # raises a MessageError naming the field (or, for an int where a float is declared, converts it).

    def decoder(self, as_list: bool = False) -> tuple[str, str, dict]:
        """`from_wire(raw)`, or with `as_list` `from_wire_list(items)` (one loop, no call per item)."""
        spec = self.spec
        self.ns["_slow"] = _compile(_Codegen(spec, trusted=False).checked_decoder())
        fields = spec.fields
        if self.trusted and self.plain_positional():
            return self.positional_decoder(as_list)
        if as_list:
            self.lines += ["def from_wire_list(items):", "    if type(items) is not list:",
                           f"        _bad({spec.cls.__name__ + '[]'!r}, 'an array', items)",
                           "    out = []", "    append = out.append", "    for raw in items:"]
            pad, fail = " " * 8, ["append(_slow(raw))", "continue"]
        else:
            self.lines.append("def from_wire(raw):")
            pad, fail = " " * 4, ["return _slow(raw)"]

        def add(line: str, then_fail: bool = False) -> None:
            self.lines.append(pad + line)
            if then_fail:
                self.lines.extend(f"{pad}    {f}" for f in fail)

        if spec.array:
            required = sum(1 for f in fields if not _has_default(f))
            add(f"if type(raw) is not list or len(raw) < {required}:" if required else "if type(raw) is not list:",
                then_fail=True)
            if required < len(fields):
                add("n = len(raw)")
            for i, f in enumerate(fields):
                add(f"v{i} = raw[{i}] if n > {i} else {self.default_expr(f)}" if _has_default(f) else f"v{i} = raw[{i}]")
        else:
            add("if type(raw) is not dict:", then_fail=True)
            add("try:")
            for i, f in enumerate(fields):
                key = repr(f.name)
                add(f"    v{i} = raw[{key}] if {key} in raw else {self.default_expr(f)}" if _has_default(f)
                    else f"    v{i} = raw[{key}]")
            add("except KeyError:", then_fail=True)
        conditions = [c for i, f in enumerate(fields) if (c := self.shallow(spec.hints[f.name], f"v{i}"))]
        if conditions:
            add(f"if not ({' and '.join(conditions)}):", then_fail=True)
        for i, f in enumerate(fields):
            self.check(spec.hints[f.name], f"v{i}", f"{spec.cls.__name__}.{f.name}", len(pad), shallow_done=True)
        self.construct(pad)
        if as_list:
            self.lines += ["        append(o)", "    return out"]
            return "from_wire_list", "\n".join(self.lines), self.ns
        self.lines.append("    return o")
        return "from_wire", "\n".join(self.lines), self.ns

    def plain_positional(self) -> bool:
        """True if the class can be built as `cls(*raw)`: an array whose fields need no decoding."""
        return (self.spec.array and not hasattr(self.spec.cls, "__post_init__") and not self.spec.local
                and all(_plain(self.spec.hints[f.name]) for f in self.spec.fields))

    def positional_decoder(self, as_list: bool) -> tuple[str, str, dict]:
        """A trusted record with plain fields: `cls(*raw)` (the dataclass fills trailing defaults);
        the checked decoder explains whatever does not fit (wrong length, not an array)."""
        if as_list:
            self.lines += ["def from_wire_list(items):", "    try:",
                           "        return [_cls(*raw) if type(raw) is list else _slow(raw) for raw in items]",
                           "    except TypeError:",
                           "        if type(items) is not list:",
                           f"            _bad({self.spec.cls.__name__ + '[]'!r}, 'an array', items)",
                           "        return [from_wire(raw) for raw in items]",
                           "def from_wire(raw):"]
        else:
            self.lines.append("def from_wire(raw):")
        self.lines += ["    if type(raw) is list:", "        try:", "            return _cls(*raw)",
                       "        except TypeError:", "            pass", "    return _slow(raw)"]
        return "from_wire_list" if as_list else "from_wire", "\n".join(self.lines), self.ns

    def checked_decoder(self) -> tuple[str, str, dict]:
        spec, out = self.spec, self.lines
        cls_name = spec.cls.__name__
        out.append("def from_wire_checked(raw):")
        if spec.array:
            required = sum(1 for f in spec.fields if not _has_default(f))
            out.append("    if type(raw) is not list:")
            out.append(f"        _bad({cls_name!r}, 'an array', raw)")
            out.append("    n = len(raw)")
            if required:
                out.append(f"    if n < {required}:")
                out.append(f"        raise MessageError(f'{cls_name} needs {required} items, got {{n}}')")
        else:
            out.append("    if type(raw) is not dict:")
            out.append(f"        _bad({cls_name!r}, 'a map', raw)")
        for i, f in enumerate(spec.fields):
            where = f"{cls_name}.{f.name}"
            present = f"n > {i}" if spec.array else f"{f.name!r} in raw"
            out.append(f"    if {present}:")
            out.append(f"        v{i} = raw[{i if spec.array else repr(f.name)}]")
            self.check(spec.hints[f.name], f"v{i}", where, indent=8)
            out.append("    else:")
            out.append(f"        v{i} = {self.default_expr(f)}" if _has_default(f)
                       else f"        raise MessageError({f'missing field {f.name!r} of {cls_name}'!r})")
        self.construct("    ")
        out.append("    return o")
        return "from_wire_checked", "\n".join(out), self.ns

    def construct(self, pad: str) -> None:
        # Built without __init__: every field is set here, and __post_init__ is for callers' conveniences.
        self.lines.append(f"{pad}o = _new(_cls)")
        self.lines.extend(f"{pad}o.{f.name} = v{i}" for i, f in enumerate(self.spec.fields))
        self.lines.extend(f"{pad}o.{f.name} = {self.default_expr(f)}" for f in self.spec.local)

    def default_expr(self, f: dataclasses.Field) -> str:
        if f.default_factory is not dataclasses.MISSING:
            return f"{self.name(f.default_factory, 'factory')}()"
        return "None" if f.default is None else self.name(f.default, "default")

    def shallow(self, tp: Any, var: str) -> str | None:
        """The cheap part of the check of `var` against `tp` as one expression (None: nothing cheap)."""
        if self.trusted and _plain(tp):
            return None  # trusted: check only the containers that hold records to decode
        optional, tp = _strip_optional(tp)
        origin = typing.get_origin(tp)
        if tp in _SCALARS:
            cond = f"type({var}) is {tp.__name__}"
        elif origin in (types.UnionType, typing.Union) and all(a in _SCALARS for a in _args(tp)):
            cond = f"type({var}) in {self.name(frozenset(_args(tp)), 'types')}"
        elif tp is list or origin is list:
            cond = f"type({var}) is list"
        elif tp is dict or origin is dict:
            cond = f"type({var}) is dict"
        elif _is_wire(tp):
            cond = f"type({var}) is {'list' if tp.__wire__.array else 'dict'}"  # its own decoder checks the rest
        else:
            return None  # Any and enums are checked (and decoded) by `check`
        return f"({var} is None or {cond})" if optional else cond

    def check(self, tp: Any, var: str, where: str, indent: int, shallow_done: bool = False) -> None:
        """Lines that check `var` against `tp`, replacing it by its decoded value where one is needed.

        With `shallow_done`, only what `shallow` does not test (the fast decoder tested that already).
        """
        pad = " " * indent
        optional, tp = _strip_optional(tp)
        body: list[str] = []
        self._check(tp, var, where, pad + "    " if optional else pad, shallow_done, body.append)
        if optional and body:
            body.insert(0, f"{pad}if {var} is not None:")
        if not body and not shallow_done:
            body.append(f"{pad}pass")
        self.lines.extend(body)

    def _check(self, tp: Any, var: str, where: str, pad: str, shallow_done: bool, add: Callable) -> None:
        origin = typing.get_origin(tp)
        if tp is Any:
            return
        if tp is float:
            if not shallow_done:
                add(f"{pad}if type({var}) is not float:")
                add(f"{pad}    if type({var}) is not int:")
                add(f"{pad}        _bad({where!r}, 'a number', {var})")
                add(f"{pad}    {var} = float({var})")
        elif tp in _SCALARS:
            if not shallow_done:
                add(f"{pad}if type({var}) is not {tp.__name__}:")
                add(f"{pad}    _bad({where!r}, {tp.__name__!r}, {var})")
        elif _is_enum(tp):
            members = self.name({m.value: m for m in tp}, "members")
            add(f"{pad}try:")
            add(f"{pad}    {var} = {members}[{var}]")
            add(f"{pad}except (KeyError, TypeError):")
            add(f"{pad}    raise MessageError({f'{where}: unknown {tp.__name__} '!r} + repr({var})) from None")
        elif _is_wire(tp):
            if not shallow_done:
                layout = "list" if tp.__wire__.array else "dict"
                add(f"{pad}if type({var}) is not {layout}:")
                add(f"{pad}    _bad({where!r}, {'an array' if tp.__wire__.array else 'a map'!r}, {var})")
            add(f"{pad}{var} = {self.name(tp.from_wire, 'dec')}({var})")
        elif origin in (types.UnionType, typing.Union) and all(a in _SCALARS for a in _args(tp)):
            if not shallow_done:
                allowed = self.name(frozenset(_args(tp)), "types")
                add(f"{pad}if type({var}) not in {allowed}:")
                add(f"{pad}    _bad({where!r}, {' | '.join(a.__name__ for a in _args(tp))!r}, {var})")
        elif tp is list or origin is list:
            if not shallow_done:
                add(f"{pad}if type({var}) is not list:")
                add(f"{pad}    _bad({where!r}, 'an array', {var})")
            self._check_list(tp, var, where, pad, add)
        elif tp is dict or origin is dict:
            if not shallow_done:
                add(f"{pad}if type({var}) is not dict:")
                add(f"{pad}    _bad({where!r}, 'a map', {var})")
            self._check_dict(tp, var, where, pad, add)
        else:
            raise TypeError(f"{where}: @wire does not support the type {tp!r}")

    def _check_list(self, tp: Any, var: str, where: str, pad: str, add: Callable) -> None:
        item = _args(tp)[0] if _args(tp) else Any
        if _is_wire(item):
            add(f"{pad}{var} = {self.name(item.from_wire_list, 'declist')}({var})")
        elif item in _SCALARS:
            if not self.trusted:
                allowed = self.name(frozenset({item}), "types")
                add(f"{pad}if not set(map(type, {var})) <= {allowed}:")
                add(f"{pad}    raise MessageError('{where}: expected an array of {item.__name__}')")
        elif item is not Any:
            raise TypeError(f"{where}: @wire does not support list items of type {item!r}")

    def _check_dict(self, tp: Any, var: str, where: str, pad: str, add: Callable) -> None:
        key, value = _args(tp) or (Any, Any)
        if key not in (str, Any):
            raise TypeError(f"{where}: @wire map keys must be str")
        if key is str and not self.trusted:
            add(f"{pad}if not set(map(type, {var})) <= {self.name(frozenset({str}), 'types')}:")
            add(f"{pad}    raise MessageError('{where}: map keys must be strings')")
        if _is_wire(value):
            add(f"{pad}{var} = {{k: {self.name(value.from_wire, 'dec')}(x) for k, x in {var}.items()}}")
        elif value in _SCALARS:
            if not self.trusted:
                allowed = self.name(frozenset({value}), "types")
                add(f"{pad}if not set(map(type, {var}.values())) <= {allowed}:")
                add(f"{pad}    raise MessageError('{where}: expected map values of type {value.__name__}')")
        elif value is not Any:
            raise TypeError(f"{where}: @wire does not support map values of type {value!r}")


def _args(tp: Any) -> tuple:
    return typing.get_args(tp)


def _strip_optional(tp: Any) -> tuple[bool, Any]:
    """(True, X) for `X | None`, (False, tp) otherwise; `A | B | None` keeps `A | B`."""
    if typing.get_origin(tp) not in (types.UnionType, typing.Union) or type(None) not in _args(tp):
        return False, tp
    rest = tuple(a for a in _args(tp) if a is not type(None))
    return True, rest[0] if len(rest) == 1 else typing.Union[rest]  # noqa: UP007 (built from a tuple)


def _plain(tp: Any) -> bool:
    """True if a value of type `tp` is used as msgpack gives it (no record or enum inside to decode)."""
    tp = _strip_optional(tp)[1]
    inner = _args(tp) if typing.get_origin(tp) in (list, dict) else ()
    return not (_is_wire(tp) or _is_enum(tp) or any(_is_wire(a) for a in inner))


def _is_enum(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, enum.Enum)


def _is_wire(tp: Any) -> bool:
    return isinstance(tp, type) and hasattr(tp, "__wire__")


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
