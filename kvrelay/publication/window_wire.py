"""A window's wire bytes from pieces encoded once (the load and serving-load planes).

Every window lists every pool generation, and betterproto2 serializes a window by serializing
each nested identity again: a 64-pool load window took 5 ms and its serving-load window 9 ms,
once per window while anyone subscribed (``benchmarks/results/planes.json``). The planes already
hold each identity's bytes (``contract/identity_memo.py``), so an entry here is laid out as
protobuf's canonical encoding lays it out — fields in number order, a message field as tag,
length and bytes — with those bytes in place of a new serialization, and betterproto2 writes
only the small rest. The result is byte for byte ``bytes(message)`` (the tests compare both,
and the official runtime's canonical encoding, on random windows).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import betterproto2

__all__ = ["NewestWire", "leading_field", "message_field", "uint_field", "window"]

_LEN = 2
_FIXED32 = 5
_MARKER = struct.Struct("<I")


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def message_field(number: int, payload: bytes) -> bytes:
    """Field ``number`` holding an encoded message (or any length-delimited bytes)."""
    return _varint(number << 3 | _LEN) + _varint(len(payload)) + payload


def uint_field(number: int, value: int) -> bytes:
    """A proto3 ``uint32``/``uint64`` field: nothing for 0 (the default is never written)."""
    return _varint(number << 3) + _varint(value) if value else b""


def leading_field(number: int, payload: bytes, rest: betterproto2.Message) -> bytes:
    """A message whose field ``number`` (encoded: ``payload``) is its lowest-numbered field, and
    ``rest`` the same message without it."""
    return message_field(number, payload) + bytes(rest)


def window(
    header: betterproto2.Message, repeated: Sequence[tuple[int, Sequence[bytes]]], marker: int
) -> bytes:
    """A window: ``header`` (its fields below the repeated ones, nothing else set), then each
    ``(field number, encoded entries)`` in order, then the fixed32 contract marker (field 127,
    every window message's last field)."""
    parts = [bytes(header)]
    for number, entries in repeated:
        tag = _varint(number << 3 | _LEN)
        parts += [tag + _varint(len(e)) + e for e in entries]
    parts.append(_varint(127 << 3 | _FIXED32) + _MARKER.pack(marker))
    return b"".join(parts)


class NewestWire:
    """The wire bytes of a snapshot plane's newest revision, written the first time someone is
    to be sent them (``build(revision)``), and None for any other revision (or revision 0, the
    empty snapshot a plane starts with, which is serialized as it is)."""

    __slots__ = ("_data", "_revision")

    def __init__(self) -> None:
        self._revision = 0
        self._data: bytes | None = None

    def published(self, revision: int) -> None:
        """``revision`` is the newest now: its bytes are written when first asked for."""
        self._revision, self._data = revision, None

    def get(self, version: int, build: Callable[[int], bytes]) -> bytes | None:
        if version != self._revision or version == 0:
            return None
        if self._data is None:
            self._data = build(version)
        return self._data
