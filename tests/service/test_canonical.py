"""Request canonicalization (kvrelay.service.canonical) against official protobuf as the oracle.

For any bytes and every request message (and the nested types a request carries): official
protobuf accepts them exactly when ``canonicalize`` + betterproto2 accepts them, and then both
hold the same field values (official re-serialized deterministically without unknown fields ==
betterproto2 re-serialized).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.errors import RelayError
from kvrelay.publication.splice import varint
from kvrelay.service.canonical import WireFormatError, canonicalize
from kvrelay.service.codec import PassThroughCodec

NAMES = [
    "RelayInfoRequest",
    "WatchKvPoolCatalogRequest",
    "SubscribeKvPoolRequest",
    "SubscribeServingReadinessRequest",
    "SubscribeKvPoolLoadRequest",
    "ProducerIdentity",
    "KvPoolId",
    "CkfFormat",
    "DigestIdentity",
]
SETTINGS = settings(
    max_examples=400,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def valid_request(m: ModuleType) -> bytes:
    producer = m.ProducerIdentity(
        pool_id=m.KvPoolId(
            identity_version=1,
            dc_id=99,
            indexer_domain=m.IndexerDomainId(
                cache_semantics=m.DigestIdentity(digest=b"c" * 16, source=1),
                routing_scope=m.DigestIdentity(digest=b"r" * 16, source=2),
            ),
        ),
        producer_incarnation=7,
        layout_generation=3,
        ckf_format=m.CkfFormat(
            format_version=1, seed=5, bucket_count=1024, fingerprint_bits=16, slots_per_bucket=4
        ),
    )
    req = m.SubscribeKvPoolRequest(
        subscriber_id="router-ä", contract_marker=0x4B565231, expected_producer=producer
    )
    return bytes(req.SerializeToString())


def agree(m: ModuleType, name: str, data: bytes) -> None:
    official = getattr(m, name)
    ours = getattr(pb, name)
    try:
        om = official.FromString(data)
    except Exception:
        om = None
    try:
        bm = ours.FromString(canonicalize(data, ours))
    except (WireFormatError, UnicodeDecodeError):
        bm = None
    assert (om is None) == (bm is None), (name, data.hex(), om, bm)
    if om is not None:
        om.DiscardUnknownFields()
        assert om.SerializeToString(deterministic=True) == bytes(bm), (name, data.hex())


@st.composite
def mutated(draw: Any, base: bytes) -> bytes:
    """A valid request with a few byte edits, insertions, deletions or duplicated slices."""
    b = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 3))
        i = draw(st.integers(0, len(b)))
        if kind == 0 and i < len(b):
            b[i] = draw(st.integers(0, 255))
        elif kind == 1:
            b[i:i] = draw(st.binary(min_size=1, max_size=6))
        elif kind == 2:
            del b[i : i + draw(st.integers(1, 5))]
        else:
            j = draw(st.integers(0, len(b)))
            b[i:i] = b[min(i, j) : max(i, j)]
    return bytes(b)


@given(name=st.sampled_from(NAMES), data=st.binary(max_size=48))
@SETTINGS
def test_random_bytes_parse_like_official(
    official_pb2: dict[str, ModuleType], name: str, data: bytes
) -> None:
    agree(official_pb2["relay"], name, data)


@given(name=st.sampled_from(NAMES), seed=st.data())
@SETTINGS
def test_mutated_requests_parse_like_official(
    official_pb2: dict[str, ModuleType], name: str, seed: st.DataObject
) -> None:
    m = official_pb2["relay"]
    agree(m, name, seed.draw(mutated(valid_request(m))))


TAG1_VARINT = b"\x08"
EDGE_CASES = {
    "mismatched wire type on subscriber_id (fixed32)": b"\x0d\x01\x02\x03\x04",
    "mismatched wire type on expected_producer (fixed64)": b"\x11" + b"\x00" * 8,
    "padded 5-byte tag": b"\x88\x80\x80\x80\x00\x05",
    "6-byte tag": b"\x88\x80\x80\x80\x80\x00\x05",
    "tag above 32 bits": b"\x88\x80\x80\x80\x10\x05",
    "largest field number": varint(((1 << 29) - 1) << 3) + b"\x05",
    "field number 0": b"\x00\x05",
    "wire type 6": b"\x0e",
    "wire type 7": b"\x0f",
    "bare end group": b"\x0c",
    "empty group": b"\x2b\x2c",
    "nested groups": b"\x2b\x33\x34\x2c",
    "mismatched end group": b"\x2b\x34",
    "unterminated group": b"\x2b",
    "10-byte varint": TAG1_VARINT + b"\xff" * 9 + b"\x01",
    "11-byte varint": TAG1_VARINT + b"\xff" * 10 + b"\x01",
    "over-long zero varint": TAG1_VARINT + b"\x80" * 9 + b"\x00",
    "uint32 above 32 bits": TAG1_VARINT + varint((1 << 33) + 5),
    "length past the end": b"\x0a\x05ab",
    "huge length": b"\x0a" + varint(1 << 40),
    "invalid UTF-8 overridden later": b"\x0a\x01\xff\x0a\x01a",
    "truncated fixed32": b"\xfd\x07\x31\x52",
}


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_edge_cases_parse_like_official(official_pb2: dict[str, ModuleType], case: str) -> None:
    for name in NAMES:
        agree(official_pb2["relay"], name, EDGE_CASES[case])


def test_repeated_sub_message_merges_like_official(official_pb2: dict[str, ModuleType]) -> None:
    m = official_pb2["relay"]
    a = m.SubscribeKvPoolRequest(expected_producer=m.ProducerIdentity(producer_incarnation=5))
    b = m.SubscribeKvPoolRequest(expected_producer=m.ProducerIdentity(layout_generation=7))
    data = a.SerializeToString() + b.SerializeToString()
    req = pb.SubscribeKvPoolRequest.FromString(canonicalize(data, pb.SubscribeKvPoolRequest))
    producer = req.expected_producer
    assert producer is not None
    assert (producer.producer_incarnation, producer.layout_generation) == (5, 7)


def test_codec_decodes_canonical_and_rejects_malformed_as_invalid_request() -> None:
    codec = PassThroughCodec()
    body = b"\x0d\x01\x02\x03\x04" + b"\xfd\x07\x31\x52\x56\x4b"  # fixed32 in field 1, marker
    req = codec.decode(body, pb.WatchKvPoolCatalogRequest)
    assert req.subscriber_id == "" and req.contract_marker == 0x4B565231
    with pytest.raises(RelayError) as err:
        codec.decode(b"\x0e", pb.WatchKvPoolCatalogRequest)
    assert err.value.trailer_value == "RELAY_ERROR_REASON_INVALID_REQUEST"
