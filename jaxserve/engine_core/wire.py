"""One codec for the records that cross the ZeroMQ socket (jaxserve/engine/messages.py).

A dataclass travels as the list of its fields' values in declaration order (what msgpack packs
cheapest); a field whose type is itself a dataclass travels the same way, nested. Decoding
reads the class's own field list, so neither side writes a position by hand, and a record whose
length does not match its class is a ValueError naming the class.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import typing
from typing import Any, TypeVar

T = TypeVar("T")


@functools.cache
def _schema(cls: type) -> tuple[tuple[str, type | None], ...]:
    """(field name, its dataclass type or None) per field, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        nested = None
        for t in (hints[f.name], *typing.get_args(hints[f.name])):  # X or X | None
            if dataclasses.is_dataclass(t):
                nested = t
        out.append((f.name, nested))
    return tuple(out)


@functools.cache
def _getter(cls: type) -> tuple[Any, bool]:
    """All fields at once (one C call per record, always a tuple), and whether any field
    nests a record."""
    schema = _schema(cls)
    names = [n for n, _ in schema]
    get = operator.attrgetter(*names) if len(names) > 1 else lambda r: (getattr(r, names[0]),)
    return get, any(t for _, t in schema)


def encode_record(record: Any) -> list[Any]:
    """`record`'s field values in order, nested records encoded alike."""
    get, nests = _getter(type(record))
    values = get(record)
    if not nests:
        return list(values)
    return [encode_record(v) if t is not None and v is not None else v
            for (_, t), v in zip(_schema(type(record)), values)]


def decode_record(cls: type[T], values: list[Any]) -> T:
    """The record `encode_record` made (the class's own validation runs)."""
    schema = _schema(cls)
    if not isinstance(values, list | tuple) or len(values) != len(schema):
        raise ValueError(f"a {cls.__name__} record has {len(schema)} fields "
                         f"({', '.join(n for n, _ in schema)}), got {values!r:.200}")
    if not _getter(cls)[1]:
        return cls(*values)
    return cls(*(decode_record(t, v) if t is not None and v is not None else v
                 for (_, t), v in zip(schema, values)))
