"""Reading relay messages straight from their wire bytes: one FilterUpdate in a few µs.

A mirror receives every frame of every pool it mirrors and forwards the bytes unchanged, so it
parses only what it must check (betterproto2 costs ~80 µs per FilterUpdate); benchmark
subscribers must not become the bottleneck they measure. ``parse_frame`` and ``parse_envelope``
are the strict reader (the mirror's). Parsing follows
proto3 as the official runtime does: unknown fields are skipped, a known field sent with another
wire type is an unknown field, the last value of a repeated scalar wins. Sub-messages that occur
twice (protobuf would merge them) are refused: the mirror compares identities as bytes and will
not vouch for a frame whose identity it would have to merge first. ``parse_filter_update`` is the
lenient mode of the same reader, for measuring any relay's output (Dynamo's too): repeated fields
are not refused.
"""

from __future__ import annotations

from typing import NamedTuple

_FIXED32 = 5
_LEN = 2
_VARINT = 0
_FIXED64 = 1
_MARKER_FIELD = 127


class WireError(ValueError):
    """Bytes that do not parse as the expected message (truncated, bad varint, groups, …)."""


class Frame(NamedTuple):
    """The fields of one ``FilterUpdate`` a mirror checks; sub-messages stay raw bytes."""

    protocol_version: int
    relay: bytes | None
    producer: bytes | None
    base_sequence: int
    sequence: int
    send_ts_us: int
    kind: int
    payload: bytes
    marker: int | None
    #: length of the leading ``protocol_version, relay, producer`` fields when they come first and
    #: in that order (how kvrelay and Dynamo encode them), else 0: the envelope prefix to reuse.
    prefix: int


class Envelope(NamedTuple):
    """``protocol_version`` (1), ``relay`` (2, raw), field 3 (catalog and readiness ``revision``,
    load ``window_sequence``), the marker (127) of a plane message, and a window plane's
    ``window_ms`` (5; 0 when absent, and on the catalog and readiness planes, which have none)."""

    protocol_version: int
    relay: bytes | None
    version: int
    marker: int | None
    window_ms: int = 0


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    b = buf[i]
    if b < 0x80:
        return b, i + 1
    result = b & 0x7F
    shift = 7
    i += 1
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            if result >> 64:
                raise WireError("varint exceeds 64 bits")
            return result, i
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 10 bytes")


def _skip(buf: bytes, i: int, wire_type: int) -> int:
    if wire_type == _VARINT:
        return _varint(buf, i)[1]
    if wire_type == _LEN:
        n, i = _varint(buf, i)
        return i + n
    if wire_type == _FIXED32:
        return i + 4
    if wire_type == _FIXED64:
        return i + 8
    raise WireError(f"unsupported wire type {wire_type}")


def _fixed32(buf: bytes, i: int) -> tuple[int, int]:
    if i + 4 > len(buf):
        raise WireError("truncated fixed32")
    return int.from_bytes(buf[i : i + 4], "little"), i + 4


def _bytes(buf: bytes, i: int) -> tuple[bytes, int]:
    """A length-delimited field's contents (``i`` at its length) and the offset after it."""
    ln, j = _varint(buf, i)
    end = j + ln
    if end > len(buf):
        raise WireError("length-delimited field runs past the end")
    return buf[j:end], end


_PREFIX_FIELDS = ((1, _VARINT), (2, _LEN), (3, _LEN))


def parse_frame(buf: bytes, *, strict: bool = True) -> Frame:
    """Parse one encoded ``FilterUpdate``; raises WireError. ``strict=False`` (the lenient mode)
    lets a repeated field's last occurrence win instead of refusing it."""
    version = base = seq = ts = kind = 0
    relay: bytes | None = None
    producer: bytes | None = None
    payload = b""
    marker: int | None = None
    seen_version = False
    prefix = 0
    index = 0  # position of the current field; fields 0..2 may form the reusable prefix
    leading = True
    n = len(buf)
    i = 0
    try:
        while i < n:
            key, i = _varint(buf, i)
            field, wt = key >> 3, key & 7
            if leading and index < 3 and (field, wt) != _PREFIX_FIELDS[index]:
                leading = False
            if wt == _VARINT:
                v, i = _varint(buf, i)
                if field == 4:
                    base = v
                elif field == 5:
                    seq = v
                elif field == 6:
                    ts = v
                elif field == 7:
                    kind = v
                elif field == 1:
                    if seen_version and strict:
                        raise WireError("protocol_version occurs twice")
                    seen_version = True
                    version = v
            elif wt == _LEN:
                data, i = _bytes(buf, i)
                if field == 8:
                    payload = data
                elif field == 2:
                    if relay is not None and strict:
                        raise WireError("relay occurs twice")
                    relay = data
                elif field == 3:
                    if producer is not None and strict:
                        raise WireError("producer occurs twice")
                    producer = data
            elif wt == _FIXED32 and field == _MARKER_FIELD:
                marker, i = _fixed32(buf, i)
            else:
                i = _skip(buf, i, wt)
            if i > n:
                raise WireError("truncated field")
            if leading and index == 2:
                prefix = i
            index += 1
    except IndexError:
        raise WireError("truncated message") from None
    return Frame(version, relay, producer, base, seq, ts, kind, payload, marker, prefix)


def parse_envelope(buf: bytes) -> Envelope:
    """Parse the envelope fields of a catalog, readiness or load update; raises WireError."""
    version = value = window_ms = 0
    relay: bytes | None = None
    marker: int | None = None
    n = len(buf)
    i = 0
    try:
        while i < n:
            key, i = _varint(buf, i)
            field, wt = key >> 3, key & 7
            if wt == _VARINT and field in (1, 3, 5):
                v, i = _varint(buf, i)
                if field == 1:
                    version = v
                elif field == 3:
                    value = v
                else:
                    window_ms = v
            elif wt == _LEN and field == 2:
                data, i = _bytes(buf, i)
                if relay is not None:
                    raise WireError("relay occurs twice")
                relay = data
            elif wt == _FIXED32 and field == _MARKER_FIELD:
                marker, i = _fixed32(buf, i)
            else:
                i = _skip(buf, i, wt)
            if i > n:
                raise WireError("truncated field")
    except IndexError:
        raise WireError("truncated message") from None
    return Envelope(version, relay, value, marker, window_ms)



def parse_filter_update(buf: bytes) -> tuple[int, int, int, int, memoryview]:
    """``(kind, base_sequence, sequence, send_ts_us, payload)`` of an encoded FilterUpdate: the
    lenient mode of ``parse_frame``, for measuring any relay's output without judging it;
    raises WireError on bytes that do not parse."""
    f = parse_frame(buf, strict=False)
    return f.kind, f.base_sequence, f.sequence, f.send_ts_us, memoryview(f.payload)
