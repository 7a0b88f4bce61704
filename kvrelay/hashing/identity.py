"""Relay identities (§8.1): BLAKE3 identity digests, dc_id, incarnation, layout generations, and
the CKF format/sizing that goes into every ``ProducerKey``.

Digests must be byte-identical to Dynamo's so that the same model behind the same endpoint in two
DCs maps to one ``IndexerDomainId``; hence the exact length-framed material below.
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import blake3

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.hashing.tokens import HashFormat

IDENTITY_VERSION = 1
DIGEST_LEN = 16

_TAG_CACHE_DEFAULT = b"dynamo/indexer-cache-semantics/default/v1"
_TAG_CACHE_EXPLICIT = b"dynamo/indexer-cache-semantics/explicit/v1"
_TAG_SCOPE_DEFAULT = b"dynamo/indexer-routing-scope/default/v1"
_TAG_SCOPE_EXPLICIT = b"dynamo/indexer-routing-scope/explicit/v1"
_TAG_DC = b"dynamo/indexer-dc/v1"

MAX_EXPLICIT_ENTRIES = 32
MAX_KEY_BYTES = 128
MAX_VALUE_BYTES = 1024

DEFAULT_CKF_SEED = 0x5DEECE66D1B54A33
DEFAULT_BUCKET_COUNT = 524_288
DEFAULT_EXPECTED_BLOCKS = 1_048_576
MIN_BUCKET_COUNT = 2
MAX_BUCKET_COUNT = 1 << 24


class IdentityError(ValueError):
    """An identity input violates §8.1 (explicit map shape, block size, format, sizing)."""


def _frame(x: bytes) -> bytes:
    return struct.pack("<I", len(x)) + x


def _count(n: int) -> bytes:
    return struct.pack("<I", n)


def _digest(material: bytes) -> bytes:
    return bytes(blake3.blake3(material).digest()[:DIGEST_LEN])


def _check_block_and_format(kv_block_size: int, hash_format: int) -> bytes:
    if not 1 <= kv_block_size <= 0xFFFFFFFF:
        raise IdentityError(f"kv_block_size must be a positive u32, got {kv_block_size}")
    try:
        fmt = HashFormat(hash_format)
    except ValueError:
        raise IdentityError(f"unknown hash format {hash_format!r}") from None
    return struct.pack("<IH", kv_block_size, int(fmt))


def _explicit_entries(mapping: Mapping[str, str] | Mapping[bytes, bytes]) -> bytes:
    """Validated, byte-wise key-sorted ``count(m) ‖ (frame(k) ‖ frame(v))…``."""
    n = len(mapping)
    if not 1 <= n <= MAX_EXPLICIT_ENTRIES:
        raise IdentityError(f"explicit map needs 1..{MAX_EXPLICIT_ENTRIES} entries, got {n}")
    items: dict[bytes, bytes] = {}
    for k, v in mapping.items():
        kb = k.encode("utf-8") if isinstance(k, str) else bytes(k)
        vb = v.encode("utf-8") if isinstance(v, str) else bytes(v)
        if not 1 <= len(kb) <= MAX_KEY_BYTES:
            raise IdentityError(f"explicit identity key must be 1..{MAX_KEY_BYTES} bytes")
        if not 1 <= len(vb) <= MAX_VALUE_BYTES:
            raise IdentityError(f"explicit identity value must be 1..{MAX_VALUE_BYTES} bytes")
        if kb in items:
            raise IdentityError(f"duplicate explicit identity key {kb!r}")
        items[kb] = vb
    parts = [_count(n)]
    for kb in sorted(items):
        parts.append(_frame(kb))
        parts.append(_frame(items[kb]))
    return b"".join(parts)


def cache_semantics_digest(source_path: str, kv_block_size: int, hash_format: int) -> bytes:
    """Default-derived cache_semantics: tag, [source_path], block size, format identity version."""
    src = source_path.encode("utf-8")
    if not src:
        raise IdentityError("source_path must be non-empty")
    tail = _check_block_and_format(kv_block_size, hash_format)
    return _digest(_frame(_TAG_CACHE_DEFAULT) + _count(1) + _frame(src) + tail)


def cache_semantics_digest_explicit(
    mapping: Mapping[str, str] | Mapping[bytes, bytes], kv_block_size: int, hash_format: int
) -> bytes:
    """Explicit cache_semantics from the card's map; block size and format are still mixed in."""
    body = _explicit_entries(mapping)
    tail = _check_block_and_format(kv_block_size, hash_format)
    return _digest(_frame(_TAG_CACHE_EXPLICIT) + body + tail)


def routing_scope_digest(namespace: str, component: str, endpoint: str) -> bytes:
    """Default routing_scope of the serving endpoint triple."""
    parts = [_frame(_TAG_SCOPE_DEFAULT), _count(3)]
    parts += [_frame(s.encode("utf-8")) for s in (namespace, component, endpoint)]
    return _digest(b"".join(parts))


def routing_scope_digest_explicit(mapping: Mapping[str, str] | Mapping[bytes, bytes]) -> bytes:
    """Explicit routing_scope from an operator/card map."""
    return _digest(_frame(_TAG_SCOPE_EXPLICIT) + _explicit_entries(mapping))


def dc_id(name: str) -> int:
    """Stable u64 DC id: first 8 bytes (LE) of BLAKE3(tag ‖ frame(name))."""
    raw = name.encode("utf-8")
    if not raw:
        raise IdentityError("dc name must be non-empty")
    return int.from_bytes(blake3.blake3(_TAG_DC + _frame(raw)).digest()[:8], "little")


def new_relay_incarnation() -> int:
    """Random non-zero 63-bit incarnation, fresh per relay start (fits signed and unsigned u64)."""
    while True:
        v = secrets.randbits(63)
        if v:
            return v


class LayoutGenerationCounter:
    """Per-relay layout_generation source: 1, 2, 3, … one per pool attachment, never 0."""

    def __init__(self) -> None:
        self._next = 1

    def next(self) -> int:
        v = self._next
        self._next += 1
        return v

    @property
    def last(self) -> int:
        """The most recently issued value (0 before the first call)."""
        return self._next - 1


def bucket_count_for(expected_blocks: int) -> int:
    """§6.2: next_pow2(max((5·expected + 15) // 16, 2)); raises IdentityError above 2^24."""
    if expected_blocks < 1:
        raise IdentityError(f"expected_blocks must be >= 1, got {expected_blocks}")
    need = max((5 * expected_blocks + 15) // 16, MIN_BUCKET_COUNT)
    n = 1 << (need - 1).bit_length()
    if n > MAX_BUCKET_COUNT:
        raise IdentityError(f"bucket_count {n} for {expected_blocks} blocks exceeds 2^24")
    return n


@dataclass(frozen=True, slots=True)
class CkfFormatSpec:
    """The advertised ``CkfFormat``; validated so a bad config fails at startup, not on the wire."""

    format_version: int = 1
    seed: int = DEFAULT_CKF_SEED
    bucket_count: int = DEFAULT_BUCKET_COUNT
    fingerprint_bits: int = 16
    slots_per_bucket: int = 4

    def __post_init__(self) -> None:
        if (self.format_version, self.fingerprint_bits, self.slots_per_bucket) != (1, 16, 4):
            raise IdentityError("only CKF format_version 1 with 16-bit fp and 4 slots exists")
        if not 0 <= self.seed < 1 << 64:
            raise IdentityError("CKF seed must be a u64")
        bc = self.bucket_count
        if not MIN_BUCKET_COUNT <= bc <= MAX_BUCKET_COUNT or bc & (bc - 1):
            raise IdentityError(f"bucket_count must be a power of two in [2, 2^24], got {bc}")

    def to_proto(self) -> pb.CkfFormat:
        return pb.CkfFormat(
            format_version=self.format_version,
            seed=self.seed,
            bucket_count=self.bucket_count,
            fingerprint_bits=self.fingerprint_bits,
            slots_per_bucket=self.slots_per_bucket,
        )
