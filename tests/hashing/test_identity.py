"""§8.1 identity digests, dc_id and §6.2 sizing: golden vectors plus hand-built BLAKE3 material."""

from __future__ import annotations

import blake3
import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.hashing.identity import (
    CkfFormatSpec,
    IdentityError,
    LayoutGenerationCounter,
    bucket_count_for,
    cache_semantics_digest,
    cache_semantics_digest_explicit,
    dc_id,
    new_relay_incarnation,
    routing_scope_digest,
    routing_scope_digest_explicit,
)
from kvrelay.hashing.tokens import HashFormat


def _fr(b: bytes) -> bytes:
    return len(b).to_bytes(4, "little") + b


def test_a3_golden_vectors() -> None:
    got = cache_semantics_digest("meta/llama", 512, HashFormat.STANDARD)
    assert got.hex() == "7d31eb9019357572470605f4a8be687e"
    assert routing_scope_digest("prod", "router", "generate").hex() == (
        "18270d3ba03effaec8d167ba02c7752d"
    )


def test_dc_id_golden() -> None:
    assert dc_id("dc-a") == 356084303347317832
    assert dc_id("dc-a") != dc_id("dc-b")
    with pytest.raises(IdentityError):
        dc_id("")


def test_format_and_block_size_enter_digest() -> None:
    base = cache_semantics_digest("meta/llama", 512, HashFormat.STANDARD)
    assert cache_semantics_digest("meta/llama", 512, HashFormat.EAGLE) != base
    assert cache_semantics_digest("meta/llama", 16, HashFormat.STANDARD) != base
    assert len(base) == 16


def test_explicit_cache_semantics_material() -> None:
    mapping = {"b": "2", "a": "1", "ä": "x"}
    material = (
        _fr(b"dynamo/indexer-cache-semantics/explicit/v1")
        + (3).to_bytes(4, "little")
        + _fr(b"a") + _fr(b"1")
        + _fr(b"b") + _fr(b"2")
        + _fr("ä".encode()) + _fr(b"x")
        + (64).to_bytes(4, "little")
        + (2).to_bytes(2, "little")
    )  # fmt: skip
    expect = blake3.blake3(material).digest()[:16]
    assert cache_semantics_digest_explicit(mapping, 64, HashFormat.EAGLE) == expect
    # Key order is byte-wise, independent of insertion order.
    rev = dict(reversed(list(mapping.items())))
    assert cache_semantics_digest_explicit(rev, 64, 2) == expect


def test_explicit_routing_scope_material_and_no_alias() -> None:
    material = (
        _fr(b"dynamo/indexer-routing-scope/explicit/v1")
        + (1).to_bytes(4, "little")
        + _fr(b"scope")
        + _fr(b"prod")
    )
    expect = blake3.blake3(material).digest()[:16]
    assert routing_scope_digest_explicit({"scope": "prod"}) == expect
    assert routing_scope_digest_explicit({b"scope": b"prod"}) == expect
    # Default and explicit material never alias, even with look-alike contents.
    assert routing_scope_digest_explicit({"prod": "router"}) != routing_scope_digest(
        "prod", "router", "generate"
    )


@pytest.mark.parametrize(
    "mapping",
    [
        {},
        {f"k{i}": "v" for i in range(33)},
        {"": "v"},
        {"k" * 129: "v"},
        {"k": ""},
        {"k": "v" * 1025},
        {"é": "v", "é".encode(): b"w"},  # same key bytes twice
    ],
)
def test_explicit_map_validation(mapping: dict[object, object]) -> None:
    with pytest.raises(IdentityError):
        routing_scope_digest_explicit(mapping)  # type: ignore[arg-type]
    with pytest.raises(IdentityError):
        cache_semantics_digest_explicit(mapping, 16, 1)  # type: ignore[arg-type]


def test_explicit_map_limits_accepted() -> None:
    ok = {f"k{i:02d}" + "x" * 124: "v" * 1024 for i in range(32)}
    assert len(routing_scope_digest_explicit(ok)) == 16


def test_bad_block_size_or_format() -> None:
    for bs, fmt in [(0, 1), (2**32, 1), (16, 0), (16, 3)]:
        with pytest.raises(IdentityError):
            cache_semantics_digest("m", bs, fmt)
    with pytest.raises(IdentityError):
        cache_semantics_digest("", 16, 1)


def test_incarnation_and_layout_generation() -> None:
    vals = {new_relay_incarnation() for _ in range(200)}
    assert len(vals) == 200
    assert all(0 < v < 2**63 for v in vals)
    c = LayoutGenerationCounter()
    assert c.last == 0
    assert [c.next(), c.next(), c.next()] == [1, 2, 3]
    assert c.last == 3


@pytest.mark.parametrize(
    ("expected", "buckets"),
    [
        (1, 2),
        (16, 8),
        (32, 16),
        (64, 32),
        (256, 128),
        (1_048_576, 524_288),
        (10_000_000, 4_194_304),
        (53_687_091, 1 << 24),
    ],
)
def test_sizing_examples(expected: int, buckets: int) -> None:
    assert bucket_count_for(expected) == buckets


def test_sizing_rejects_too_large_and_zero() -> None:
    with pytest.raises(IdentityError):
        bucket_count_for(53_687_092)
    with pytest.raises(IdentityError):
        bucket_count_for(0)


def test_ckf_format_spec_to_proto_roundtrip() -> None:
    spec = CkfFormatSpec()
    msg = spec.to_proto()
    assert isinstance(msg, pb.CkfFormat)
    back = pb.CkfFormat.parse(bytes(msg))
    assert (back.format_version, back.seed, back.bucket_count) == (1, 0x5DEECE66D1B54A33, 524288)
    assert (back.fingerprint_bits, back.slots_per_bucket) == (16, 4)
    with pytest.raises(AttributeError):
        spec.seed = 1  # type: ignore[misc]
    bads = [{"bucket_count": 3}, {"bucket_count": 1 << 25}, {"seed": -1}, {"format_version": 2}]
    for bad in bads:
        with pytest.raises(IdentityError):
            CkfFormatSpec(**bad)  # type: ignore[arg-type]
