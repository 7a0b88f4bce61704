"""A bounded walk over a Control reply's protobuf wire format, run before betterproto2 parses it.

betterproto2 parses in pure Python at a few microseconds a field, and collects unknown fields by
concatenating bytes (quadratic: 500,000 two-byte unknown fields in one message took 20 s). A
reply under ``MAX_REPLY_BYTES`` can hold half a million fields, so an engine answering 1 MiB of
empty LoRA entries cost 2.2 s of CPU per poll (GIL held, so the event loop slowed too) before
the reply was refused for its entry count. ``scan`` refuses such a reply from the wire format
alone, at a cost set by ``budget`` rather than by the reply's size:

- it walks the fields, recursing only into fields the reply's schema (``shape_of``, derived from
  the betterproto2 class) declares as messages, and skips scalars, strings, bytes and unknown
  fields by their wire type (an unknown field's bytes are never looked into: betterproto2 keeps
  them whole too);
- ``implausible``: a repeated field with more than ``list_limit`` entries, or more than
  ``budget`` fields in the whole reply (nested ones and unknown ones included);
- ``undecodable``: broken wire format (a varint or length running past its message or longer
  than ten bytes, field number 0, groups, wire types 6 and 7), or a declared field with a wire
  type its type cannot have (betterproto2 stored such a value as it came: an int where a message
  belongs, which the client then failed on outside its typed errors).

The first error found is raised, as a ``WireRefusal`` carrying its kind.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import betterproto2

_B = betterproto2
#: The wire type of each proto type the scan knows (numbers: as they arrive when not packed).
_TYPES_BY_WIRE = (
    (0, (_B.TYPE_ENUM, _B.TYPE_BOOL, _B.TYPE_INT32, _B.TYPE_INT64, _B.TYPE_UINT32,
         _B.TYPE_UINT64, _B.TYPE_SINT32, _B.TYPE_SINT64)),
    (1, (_B.TYPE_FIXED64, _B.TYPE_SFIXED64, _B.TYPE_DOUBLE)),
    (2, (_B.TYPE_STRING, _B.TYPE_BYTES, _B.TYPE_MESSAGE)),
    (5, (_B.TYPE_FIXED32, _B.TYPE_SFIXED32, _B.TYPE_FLOAT)),
)  # fmt: skip
_WIRE_OF = {proto_type: wire for wire, types in _TYPES_BY_WIRE for proto_type in types}
_MAX_FIELD_NUMBER = (1 << 29) - 1


class WireRefusal(Exception):
    """The reply's wire format is refused; ``kind`` is ``implausible`` or ``undecodable``."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the scan knows of one message type: each declared field's wire type, the shapes of
    its message fields, the names of its repeated fields, and the most fields a valid message of
    the type holds (``list_limit`` entries in each repeated field, every other field once)."""

    name: str
    wire: dict[int, int]
    messages: dict[int, Shape]
    repeated: dict[int, str]
    most_fields: int


@cache
def shape_of(cls: type[betterproto2.Message], list_limit: int) -> Shape:
    """The ``Shape`` of a betterproto2 message class. A field kind the scan cannot bound is a
    ``TypeError`` here (at import of the client), never a reply let through: maps, wrapped
    well-known types, repeated numbers (packed), and a message type that contains itself."""
    return _shape(cls, list_limit, ())


def _shape(cls: type[betterproto2.Message], list_limit: int, within: tuple[type, ...]) -> Shape:
    if cls in within:
        raise TypeError(f"{cls.__name__} contains itself: its nesting has no bound")
    wire: dict[int, int] = {}
    messages: dict[int, Shape] = {}
    repeated: dict[int, str] = {}
    most = 0
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        meta = betterproto2.FieldMetadata.get(f)
        if meta.proto_type not in _WIRE_OF or meta.unwrap is not None:
            raise TypeError(f"{cls.__name__}.{f.name}: a {meta.proto_type} field is not scanned")
        wire[meta.number] = _WIRE_OF[meta.proto_type]
        one = 1
        if meta.proto_type == betterproto2.TYPE_MESSAGE:
            sub_cls = cls._betterproto.cls_by_field[f.name]  # type: ignore[arg-type]
            sub = _shape(sub_cls, list_limit, (*within, cls))
            messages[meta.number] = sub
            one += sub.most_fields
        if meta.repeated:
            if wire[meta.number] != 2:
                raise TypeError(f"{cls.__name__}.{f.name}: repeated numbers are not scanned")
            repeated[meta.number] = f.name
            one *= list_limit
        most += one
    return Shape(cls.__name__, wire, messages, repeated, most)


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it, within ``end`` and ten bytes."""
    value = shift = 0
    last = min(end, pos + 10)
    while pos < last:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
    if last == end:
        raise WireRefusal("undecodable", "a varint runs past the end of its message")
    raise WireRefusal("undecodable", "a varint longer than ten bytes")


def scan(data: bytes, shape: Shape, list_limit: int, budget: int) -> None:
    """Walk ``data`` as a message of ``shape``; raise ``WireRefusal`` at the first field that
    passes ``list_limit`` or ``budget`` or breaks the wire format. Reads at most ``budget`` + 1
    field tags, whatever the reply's size."""
    _walk(data, 0, len(data), shape, list_limit, budget, budget)


def _walk(
    data: bytes, pos: int, end: int, shape: Shape, list_limit: int, left: int, budget: int
) -> int:
    """Scan the message in ``data[pos:end]``; returns how much of the field budget is left."""
    wire_of = shape.wire
    messages = shape.messages
    repeated = shape.repeated
    counts: dict[int, int] = {}
    while pos < end:
        left -= 1
        if left < 0:
            raise WireRefusal("implausible", f"more than {budget} fields in one reply")
        key = data[pos]
        pos += 1
        if key >= 0x80:
            key, pos = _varint(data, pos - 1, end)
        number = key >> 3
        wire = key & 7
        if number == 0 or number > _MAX_FIELD_NUMBER:
            raise WireRefusal("undecodable", f"field number {number} in {shape.name}")
        declared = wire_of.get(number)
        if declared is not None and declared != wire:
            raise WireRefusal("undecodable", f"{shape.name} field {number}: wire type {wire}")
        if wire == 0:
            if pos < end and data[pos] < 0x80:
                pos += 1
            else:
                pos = _varint(data, pos, end)[1]
        elif wire == 2:
            if pos < end and data[pos] < 0x80:
                length = data[pos]
                pos += 1
            else:
                length, pos = _varint(data, pos, end)
            nxt = pos + length
            if nxt > end:
                raise WireRefusal("undecodable", f"a length in {shape.name} runs past its end")
            sub = messages.get(number)
            if sub is not None:
                left = _walk(data, pos, nxt, sub, list_limit, left, budget)
            pos = nxt
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            if pos > end:
                raise WireRefusal("undecodable", f"a fixed-size value in {shape.name} is cut")
        else:  # 3 and 4 start and end groups (no Control message has one); 6 and 7 do not exist
            raise WireRefusal("undecodable", f"wire type {wire} in {shape.name}")
        name = repeated.get(number)
        if name is not None:
            n = counts.get(number, 0) + 1
            if n > list_limit:
                detail = f"{shape.name}.{name}: more than {list_limit} entries"
                raise WireRefusal("implausible", detail)
            counts[number] = n
    return left
