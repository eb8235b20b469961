"""One codec for the records that cross the ZeroMQ socket (jaxserve/engine/messages.py).

A dataclass travels as the list of its fields' values in declaration order (what msgpack packs
cheapest). A field typed as a dataclass, a list of dataclasses or an enum travels as the nested
record(s) (a list, or a tuple[X, ...]) or the enum's value; a field whose metadata holds a `WireField` travels as its own
functions say, given the message's shared context (e.g. a table of steps several outputs point
at). Decoding reads the class's own field list, so neither side writes a position by hand, and
a record whose length does not match its class is a ValueError naming the class.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
import types
import typing
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")

# How a field's value travels.
_PLAIN, _RECORD, _RECORDS, _ENUM, _CUSTOM = range(5)


class WireField(NamedTuple):
    """A field's own codec: `encode(value, ctx)` and `decode(wire, ctx)`, where `ctx` is the
    message's shared context (passed to encode_record / decode_record)."""

    encode: Callable[[Any, Any], Any]
    decode: Callable[[Any, Any], Any]


def wire_field(encode: Callable[[Any, Any], Any], decode: Callable[[Any, Any], Any],
               **kwargs: Any) -> Any:
    """`dataclasses.field(**kwargs)` that travels through `encode` / `decode`."""
    return dataclasses.field(metadata={"wire": WireField(encode, decode)}, **kwargs)


def _kind(hint: Any) -> tuple[int, Any]:
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    for t in typing.get_args(hint) if union else (hint,):  # X, or X | None
        if dataclasses.is_dataclass(t):
            return _RECORD, t
        if isinstance(t, type) and issubclass(t, enum.Enum):
            return _ENUM, t
        origin, args = typing.get_origin(t), typing.get_args(t)
        if (origin is list and len(args) == 1) or (origin is tuple and args[1:] == (...,)):
            if dataclasses.is_dataclass(args[0]):
                return _RECORDS, (args[0], origin)
    return _PLAIN, None


@functools.cache
def _schema(cls: type) -> tuple[tuple[str, int, Any], ...]:
    """(field name, how it travels, its class or WireField) per field, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        custom = f.metadata.get("wire")
        kind, arg = (_CUSTOM, custom) if custom is not None else _kind(hints[f.name])
        out.append((f.name, kind, arg))
    return tuple(out)


@functools.cache
def _getter(cls: type) -> tuple[Any, tuple[tuple[int, int, Any], ...]]:
    """All fields at once (one C call per record, always a tuple), and (position, how it
    travels, its class or WireField) of the fields that do not travel as they are."""
    schema = _schema(cls)
    names = [n for n, _, _ in schema]
    get = operator.attrgetter(*names) if len(names) > 1 else lambda r: (getattr(r, names[0]),)
    return get, tuple((i, kind, arg) for i, (_, kind, arg) in enumerate(schema) if kind != _PLAIN)


def encode_record(record: Any, ctx: Any = None) -> list[Any]:
    """`record`'s field values in order, in plain types (`ctx`: the message's shared context)."""
    cls: type = type(record)  # plain `type`: mypy sees no `type[T]` as Hashable (mypy#11470)
    get, special = _getter(cls)
    out = list(get(record))
    for i, kind, arg in special:  # only the fields that need it: most records have none
        v = out[i]
        if v is None:
            continue
        if kind == _RECORD:
            out[i] = encode_record(v, ctx)
        elif kind == _RECORDS:
            out[i] = [encode_record(x, ctx) for x in v]
        elif kind == _ENUM:
            out[i] = v.value
        else:
            out[i] = arg.encode(v, ctx)
    return out


def decode_record(cls: type[T], values: object, ctx: Any = None) -> T:
    """The record `encode_record` made (the class's own validation runs); `values` is
    whatever came off the wire, checked here."""
    key: type = cls  # plain `type`: mypy sees no `type[T]` as Hashable (mypy#11470)
    schema = _schema(key)
    if not isinstance(values, list | tuple) or len(values) != len(schema):
        raise ValueError(f"a {cls.__name__} record has {len(schema)} fields "
                         f"({', '.join(n for n, _, _ in schema)}), got {values!r:.200}")
    special = _getter(key)[1]
    if not special:
        return cls(*values)
    args = list(values)
    for i, kind, arg in special:
        v = args[i]
        if v is None:
            continue
        if kind == _RECORD:
            args[i] = decode_record(arg, v, ctx)
        elif kind == _RECORDS:
            item, container = arg
            args[i] = container(decode_record(item, x, ctx) for x in v)
        elif kind == _ENUM:
            args[i] = arg(v)
        else:
            args[i] = arg.decode(v, ctx)
    return cls(*args)
