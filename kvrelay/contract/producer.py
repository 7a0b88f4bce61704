"""``ProducerKey``: what "the same producer generation" means, and its validation.

Every identity field takes part (both digests with their sources, dc_id, incarnation, layout
generation and the five CKF format fields); descriptive metadata does not (``docs/contract.md``
§3.3). Malformed known data is INVALID_REQUEST; values a future version could send (unknown enum
numbers, other versions or formats, lanes over 2^24 buckets) are UNSUPPORTED_FEATURE.
betterproto2 keeps unknown enum numbers as plain ints, so every enum is compared by ``int()``.
"""

from __future__ import annotations

from typing import NamedTuple

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.errors import RelayError
from kvrelay.contract.wire import (
    CKF_FORMAT_VERSION,
    DIGEST_BYTES,
    FINGERPRINT_BITS,
    MAX_BUCKET_COUNT,
    POOL_IDENTITY_VERSION,
    SLOTS_PER_BUCKET,
)

_KNOWN_SOURCES = frozenset(
    {int(pb.IdentitySource.DEFAULT_DERIVED), int(pb.IdentitySource.EXPLICIT)}
)


class ProducerKey(NamedTuple):
    """Equality key of a producer generation: every identity field, nothing descriptive."""

    identity_version: int
    cache_semantics_digest: bytes
    cache_semantics_source: int
    routing_scope_digest: bytes
    routing_scope_source: int
    dc_id: int
    producer_incarnation: int
    layout_generation: int
    format_version: int
    seed: int
    bucket_count: int
    fingerprint_bits: int
    slots_per_bucket: int

    @property
    def pool_part(self) -> tuple[int, bytes, int, bytes, int, int]:
        """The ``KvPoolId`` fields: same pool, whatever the generation."""
        return (
            self.identity_version,
            self.cache_semantics_digest,
            self.cache_semantics_source,
            self.routing_scope_digest,
            self.routing_scope_source,
            self.dc_id,
        )


def _check_digest(name: str, d: pb.DigestIdentity | None) -> tuple[bytes, int]:
    if d is None:
        raise RelayError.invalid_request(f"expected_producer: {name} is missing")
    if len(d.digest) != DIGEST_BYTES:
        raise RelayError.invalid_request(
            f"expected_producer: {name}.digest must be {DIGEST_BYTES} bytes, got {len(d.digest)}"
        )
    source = int(d.source)
    if source == 0:
        raise RelayError.invalid_request(f"expected_producer: {name}.source is UNSPECIFIED")
    if source not in _KNOWN_SOURCES:
        raise RelayError.unsupported_feature(
            f"expected_producer: {name}.source {source} is unknown"
        )
    return bytes(d.digest), source


def producer_key(p: pb.ProducerIdentity | None) -> ProducerKey:
    """Validate a ProducerIdentity and return its equality key (raises RelayError)."""
    if p is None:
        raise RelayError.invalid_request("expected_producer is missing")
    pool = p.pool_id
    if pool is None:
        raise RelayError.invalid_request("expected_producer: pool_id is missing")
    if pool.identity_version == 0:
        raise RelayError.invalid_request("expected_producer: pool_id.identity_version is 0")
    if pool.identity_version != POOL_IDENTITY_VERSION:
        raise RelayError.unsupported_feature(
            f"expected_producer: identity_version {pool.identity_version} is unsupported"
        )
    domain = pool.indexer_domain
    if domain is None:
        raise RelayError.invalid_request("expected_producer: indexer_domain is missing")
    cs_digest, cs_source = _check_digest("cache_semantics", domain.cache_semantics)
    rs_digest, rs_source = _check_digest("routing_scope", domain.routing_scope)
    if p.layout_generation == 0:
        raise RelayError.invalid_request("expected_producer: layout_generation is 0")
    fmt = p.ckf_format
    if fmt is None:
        raise RelayError.invalid_request("expected_producer: ckf_format is missing")
    for name in ("format_version", "bucket_count", "fingerprint_bits", "slots_per_bucket"):
        if getattr(fmt, name) == 0:
            raise RelayError.invalid_request(f"expected_producer: ckf_format.{name} is 0")
    if fmt.format_version != CKF_FORMAT_VERSION:
        raise RelayError.unsupported_feature(
            f"expected_producer: ckf format_version {fmt.format_version} is unsupported"
        )
    if fmt.fingerprint_bits != FINGERPRINT_BITS:
        raise RelayError.unsupported_feature(
            f"expected_producer: fingerprint_bits {fmt.fingerprint_bits} is unsupported"
        )
    if fmt.slots_per_bucket != SLOTS_PER_BUCKET:
        raise RelayError.unsupported_feature(
            f"expected_producer: slots_per_bucket {fmt.slots_per_bucket} is unsupported"
        )
    bc = fmt.bucket_count
    if bc > MAX_BUCKET_COUNT:
        raise RelayError.unsupported_feature(
            f"expected_producer: bucket_count {bc} exceeds {MAX_BUCKET_COUNT}"
        )
    if bc < 2 or bc & (bc - 1):
        raise RelayError.invalid_request(
            f"expected_producer: bucket_count {bc} is not a power of two >= 2"
        )
    return ProducerKey(
        int(pool.identity_version),
        cs_digest,
        cs_source,
        rs_digest,
        rs_source,
        int(pool.dc_id),
        int(p.producer_incarnation),
        int(p.layout_generation),
        int(fmt.format_version),
        int(fmt.seed),
        int(bc),
        int(fmt.fingerprint_bits),
        int(fmt.slots_per_bucket),
    )
