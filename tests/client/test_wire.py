"""The wire reader (``client/wire.py``) parses FilterUpdates and plane envelopes as official
protobuf does, strict for the mirror and lenient for the benchmark subscribers."""

from __future__ import annotations

import contextlib
import random
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client.wire import WireError, parse_envelope, parse_filter_update, parse_frame
from kvrelay.publication.splice import FilterUpdateEncoder, varint
from tests.support.mem_relay import make_producer

RELAY = pb.RelayIdentity(drt_instance_id=77, relay_incarnation=0x1234_5678_9ABC_DEF)
PRODUCER = make_producer("pool-a", bucket_count=1024)
U64 = st.integers(min_value=0, max_value=2**64 - 1)


def _official(pb2: dict[str, ModuleType], data: bytes) -> object:
    return pb2["relay"].FilterUpdate.FromString(data)


@settings(max_examples=200, deadline=None)
@given(kind=st.integers(0, 5), base=U64, seq=U64, ts=U64, payload=st.binary(max_size=300))
def test_splice_frames_parse_like_official(
    official_pb2: dict[str, ModuleType], kind: int, base: int, seq: int, ts: int, payload: bytes
) -> None:
    data = FilterUpdateEncoder(RELAY, PRODUCER).encode(kind, base, seq, payload, ts)
    f = parse_frame(data)
    o = _official(official_pb2, data)
    assert (f.kind, f.base_sequence, f.sequence, f.send_ts_us, f.payload) == (
        o.kind, o.base_sequence, o.sequence, o.send_ts_us, o.payload  # type: ignore[attr-defined]
    )
    assert f.marker == o.contract_marker and f.protocol_version == 1  # type: ignore[attr-defined]
    assert f.relay == o.relay.SerializeToString()  # type: ignore[attr-defined]
    assert f.producer == o.producer.SerializeToString()  # type: ignore[attr-defined]
    # the leading fields 1-3 are the envelope prefix another encoder can reuse byte for byte
    again = FilterUpdateEncoder(RELAY, PRODUCER, prefix=data[: f.prefix])
    assert again.encode(kind, base, seq, payload, ts) == data
    k, b, q, t, view = parse_filter_update(data)  # the lenient mode reads the same fields
    assert (k, b, q, t, bytes(view)) == (f.kind, f.base_sequence, f.sequence, f.send_ts_us,
                                         f.payload)  # fmt: skip


def _field(num: int, wt: int, body: bytes) -> bytes:
    return varint(num << 3 | wt) + body


def test_unknown_fields_wrong_wire_types_and_repeats_follow_proto3(
    official_pb2: dict[str, ModuleType],
) -> None:
    """Unknown fields skipped, a known field with another wire type is unknown, last scalar
    wins; the prefix is only offered when fields 1-3 lead."""
    base = FilterUpdateEncoder(RELAY, PRODUCER).encode(2, 4, 5, b"abc", 9)
    extra = (
        _field(99, 0, varint(7))  # unknown varint
        + _field(5, 2, varint(3) + b"xyz")  # sequence as length-delimited: unknown
        + _field(4, 0, varint(6))  # base repeated: last wins
        + _field(100, 1, b"\x01" * 8)  # unknown fixed64
        + _field(101, 5, b"\x02" * 4)  # unknown fixed32
    )
    data = base + extra
    f = parse_frame(data)
    o = _official(official_pb2, data)
    assert (f.base_sequence, f.sequence, f.payload) == (6, 5, b"abc")
    assert (o.base_sequence, o.sequence, o.payload) == (6, 5, b"abc")  # type: ignore[attr-defined]
    assert f.prefix > 0
    reordered = _field(7, 0, varint(2)) + base
    assert parse_frame(reordered).prefix == 0 and parse_frame(reordered).kind == 2


@pytest.mark.parametrize(
    "data",
    [
        b"\x28",  # key without value
        b"\x42\x05ab",  # payload runs past the end
        b"\x28" + b"\xff" * 11,  # varint too long
        b"\x0b",  # group wire type 3
        b"\xfd\x07\x01\x02",  # truncated marker
    ],
)
def test_malformed_bytes_raise_wire_error(data: bytes) -> None:
    with pytest.raises(WireError):
        parse_frame(data)


def test_repeated_identity_sub_messages_are_refused() -> None:
    """protobuf would merge them; the mirror compares identities as bytes and refuses."""
    data = FilterUpdateEncoder(RELAY, PRODUCER).encode(3, 1, 1)
    twice = data + _field(2, 2, varint(len(bytes(RELAY))) + bytes(RELAY))
    with pytest.raises(WireError, match="relay"):
        parse_frame(twice)
    assert parse_filter_update(twice)[:3] == (3, 1, 1)  # the lenient mode measures, not judges


def test_random_bytes_never_crash() -> None:
    rng = random.Random(5)
    for _ in range(3000):
        blob = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        for parse in (parse_frame, parse_envelope, parse_filter_update):
            with contextlib.suppress(WireError):
                parse(blob)  # type: ignore[operator]


def test_plane_envelopes(official_pb2: dict[str, ModuleType]) -> None:
    m = official_pb2["relay"]
    for msg, version in (
        (pb.KvPoolCatalogUpdate(protocol_version=1, relay=RELAY, revision=7,
                                snapshot=pb.KvPoolCatalogSnapshot(), contract_marker=1), 7),
        (pb.ServingReadinessUpdate(protocol_version=1, relay=RELAY, revision=2**40,
                                   contract_marker=5), 2**40),
        (pb.KvPoolLoadUpdate(protocol_version=1, relay=RELAY, window_sequence=3, observed_ms=9,
                             window_ms=1000, contract_marker=0x4B565231), 3),
    ):  # fmt: skip
        data = bytes(msg)
        env = parse_envelope(data)
        official = getattr(m, type(msg).__name__).FromString(data)
        assert env.version == version and env.protocol_version == 1
        assert env.marker == official.contract_marker
        assert env.relay == official.relay.SerializeToString()
