"""The splice encoder is byte-identical to official protobuf (upb) serialization."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.wire import CONTRACT_MARKER
from kvrelay.publication.splice import (
    KIND_DELTA,
    KIND_HEARTBEAT,
    KIND_SNAPSHOT_CHUNK,
    FilterUpdateEncoder,
    varint,
)

U64 = (1 << 64) - 1
EXTREMES = [0, 1, 127, 128, 300, 1 << 32, 1 << 63, U64 - 1, U64]


def producer(seed: int = 0x5DEECE66D1B54A33, bucket_count: int = 1 << 19) -> pb.ProducerIdentity:
    return pb.ProducerIdentity(
        pool_id=pb.KvPoolId(
            identity_version=1,
            indexer_domain=pb.IndexerDomainId(
                cache_semantics=pb.DigestIdentity(digest=bytes(range(16)), source=1),
                routing_scope=pb.DigestIdentity(digest=bytes(range(16, 32)), source=2),
            ),
            dc_id=356084303347317832,
        ),
        producer_incarnation=0x7FFF_FFFF_FFFF_FFFF,
        layout_generation=3,
        ckf_format=pb.CkfFormat(
            format_version=1,
            seed=seed,
            bucket_count=bucket_count,
            fingerprint_bits=16,
            slots_per_bucket=4,
        ),
    )


RELAY = pb.RelayIdentity(drt_instance_id=U64, relay_incarnation=12345)


def official(
    m: ModuleType, enc: FilterUpdateEncoder, kind: int, base: int, seq: int, ts: int, payload: bytes
) -> bytes:
    msg: Any = m.FilterUpdate()
    msg.ParseFromString(
        bytes(pb.FilterUpdate(protocol_version=1, relay=enc.relay, producer=enc.producer))
    )
    msg.base_sequence = base
    msg.sequence = seq
    msg.send_ts_us = ts
    msg.kind = kind
    msg.payload = payload
    msg.contract_marker = CONTRACT_MARKER
    return bytes(msg.SerializeToString())


def test_varint_matches_reference() -> None:
    for v in EXTREMES:
        raw = varint(v)
        # decode independently
        out, shift = 0, 0
        for i, b in enumerate(raw):
            out |= (b & 0x7F) << shift
            shift += 7
            assert (b & 0x80 == 0) == (i == len(raw) - 1)
        assert out == v
    with pytest.raises(ValueError):
        varint(U64 + 1)
    with pytest.raises(ValueError):
        varint(-1)


@pytest.mark.parametrize("kind", [0, KIND_SNAPSHOT_CHUNK, KIND_DELTA, KIND_HEARTBEAT, 4, 1000])
@pytest.mark.parametrize("value", EXTREMES)
def test_extremes_byte_identical(
    official_pb2: dict[str, ModuleType], kind: int, value: int
) -> None:
    m = official_pb2["relay"]
    enc = FilterUpdateEncoder(RELAY, producer())
    for payload in (b"", b"\x00", b"x" * 200):
        got = enc.encode(kind, value, value, payload, send_ts_us=value)
        assert got == official(m, enc, kind, value, value, value, payload)


def test_four_mib_payload(official_pb2: dict[str, ModuleType]) -> None:
    m = official_pb2["relay"]
    enc = FilterUpdateEncoder(RELAY, producer())
    payload = bytes(range(256)) * (4 * 1024 * 1024 // 256) + b"tail" * 16
    got = enc.encode(KIND_SNAPSHOT_CHUNK, 1 << 63, 1 << 63, payload, send_ts_us=1)
    assert got == official(m, enc, KIND_SNAPSHOT_CHUNK, 1 << 63, 1 << 63, 1, payload)
    parsed = m.FilterUpdate.FromString(got)
    assert parsed.payload == payload and parsed.contract_marker == 0x4B565231


def test_marker_tag_and_defaults_omitted() -> None:
    enc = FilterUpdateEncoder(RELAY, producer())
    hb = enc.heartbeat(0, send_ts_us=0)
    assert hb.endswith(b"\xfd\x07\x31\x52\x56\x4b")
    assert hb == enc._prefix + b"\x38\x03" + b"\xfd\x07\x31\x52\x56\x4b"
    decoded = pb.FilterUpdate.parse(enc.heartbeat(7, send_ts_us=99))
    assert (decoded.base_sequence, decoded.sequence, decoded.send_ts_us) == (7, 7, 99)
    assert decoded.kind == pb.FilterUpdateKind.HEARTBEAT and decoded.payload == b""


def test_send_ts_defaults_to_wall_clock_us() -> None:
    import time

    enc = FilterUpdateEncoder(RELAY, producer())
    before = time.time_ns() // 1000
    ts = pb.FilterUpdate.parse(enc.encode(KIND_DELTA, 1, 2, b"p")).send_ts_us
    after = time.time_ns() // 1000
    assert before <= ts <= after


u64s = st.one_of(st.sampled_from(EXTREMES), st.integers(0, U64))


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.integers(0, 2**31 - 1),
    base=u64s,
    seq=u64s,
    ts=u64s,
    payload=st.binary(max_size=3000),
    seed=st.integers(0, U64),
    bc=st.sampled_from([2, 1024, 1 << 19, 1 << 24]),
    incarnation=st.integers(0, U64),
    drt=st.integers(0, U64),
)
def test_random_byte_identical(
    official_pb2: dict[str, ModuleType],
    kind: int,
    base: int,
    seq: int,
    ts: int,
    payload: bytes,
    seed: int,
    bc: int,
    incarnation: int,
    drt: int,
) -> None:
    m = official_pb2["relay"]
    prod = producer(seed, bc)
    prod.producer_incarnation = incarnation
    enc = FilterUpdateEncoder(pb.RelayIdentity(drt_instance_id=drt, relay_incarnation=0), prod)
    got = enc.encode(kind, base, seq, payload, send_ts_us=ts)
    assert got == official(m, enc, kind, base, seq, ts, payload)
