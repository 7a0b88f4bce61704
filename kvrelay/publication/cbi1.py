"""CBI1 ("Cuckoo Bucket Images v1") codec, §5: snapshot chunks, deltas and snapshot assembly.

The decoder is shared with the consumer SDK, so every rejection is a distinct ``Cbi1Error``
subclass raised in exactly the order §5.1 lists the checks (a stable ``reason`` string on each
class feeds error counters). Bodies are built and parsed with numpy views: no per-entry Python
loops, and decoded arrays are read-only views of the payload (no copy of 4 MiB chunks).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt
import xxhash

MAGIC = b"CBI1"
WIRE_VERSION = 1
FLAG_SNAPSHOT_CHUNK = 1
FLAG_DELTA = 2
FORMAT_VERSION = 1
FINGERPRINT_BITS = 16
SLOTS_PER_BUCKET = 4

HEADER = 48
SNAPSHOT_PREFIX = 16
DELTA_PREFIX = 12
DELTA_ENTRY = 12
SNAPSHOT_CHUNK_BUCKETS = 524_288
MAX_FRAME = 4_194_368
MAX_DELTA_IMAGES = (MAX_FRAME - HEADER - DELTA_PREFIX) // DELTA_ENTRY  # 349,525
MIN_BUCKET_COUNT = 2
MAX_BUCKET_COUNT = 1 << 24
_U64_MAX = (1 << 64) - 1

_HEADER = struct.Struct("<4sHHBBHQQQQI")
_SNAP_PREFIX = struct.Struct("<IIQ")
_DELTA_PREFIX = struct.Struct("<QI")
_WORD = np.dtype("<u8")
_ENTRY = np.dtype([("bucket", "<u4"), ("word", "<u8")])  # packed: 12 bytes
assert _HEADER.size == HEADER and _ENTRY.itemsize == DELTA_ENTRY


# --------------------------------------------------------------------------- errors


class Cbi1Error(ValueError):
    """Base of every CBI1 encode/decode/assembly failure."""

    reason: ClassVar[str] = "cbi1_error"


class TooShort(Cbi1Error):
    reason = "too_short"


class TooLong(Cbi1Error):
    reason = "too_long"


class BadMagic(Cbi1Error):
    reason = "bad_magic"


class BadWireVersion(Cbi1Error):
    reason = "bad_wire_version"


class ChecksumMismatch(Cbi1Error):
    reason = "checksum_mismatch"


class FormatMismatch(Cbi1Error):
    """Header CKF format (version, fp bits, slots, seed, bucket_count) is not the expected one."""

    reason = "format_mismatch"


class BadFlags(Cbi1Error):
    reason = "bad_flags"


class BadBody(Cbi1Error):
    """Body length/shape invalid (prefix missing, ragged words, wrong delta length)."""

    reason = "bad_body"


class BadChunk(Cbi1Error):
    """Snapshot chunk header invalid (chunk_count 0, index ≥ count, too many words)."""

    reason = "bad_chunk"


class BucketOutOfRange(Cbi1Error):
    reason = "bucket_out_of_range"


class DuplicateBucket(Cbi1Error):
    reason = "duplicate_bucket"


class TooManyImages(Cbi1Error):
    reason = "too_many_images"


class SequenceViolation(Cbi1Error):
    """Snapshot chunk out of order, from another epoch, or inconsistent with the assembly."""

    reason = "sequence_violation"


class IncompleteCoverage(Cbi1Error):
    reason = "incomplete_coverage"


class InvalidArgument(Cbi1Error):
    """Encoder/decoder called with arguments that can never form a valid frame."""

    reason = "invalid_argument"


# --------------------------------------------------------------------------- values


@dataclass(frozen=True, slots=True, eq=False)
class SnapshotChunk:
    """One decoded snapshot chunk; ``words`` is a read-only uint64 view into the payload."""

    seed: int
    bucket_count: int
    dc_id: int
    epoch: int
    chunk_index: int
    chunk_count: int
    bucket_offset: int
    words: np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
class Delta:
    """One decoded delta: absolute post-mutation words for unique buckets (wire order kept)."""

    seed: int
    bucket_count: int
    dc_id: int
    base_epoch: int
    epoch: int
    buckets: np.ndarray
    words: np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
class AssembledSnapshot:
    """A complete, validated snapshot table (``words`` has exactly bucket_count entries)."""

    seed: int
    bucket_count: int
    dc_id: int
    epoch: int
    words: np.ndarray


# --------------------------------------------------------------------------- helpers


def checksum(body: bytes | bytearray | memoryview) -> int:
    """Low 32 bits of unseeded XXH3-64 over the body."""
    return int(xxhash.xxh3_64_intdigest(body, 0)) & 0xFFFFFFFF


def chunk_count_for(bucket_count: int) -> int:
    return -(-bucket_count // SNAPSHOT_CHUNK_BUCKETS)


def delta_frame_len(image_count: int) -> int:
    return HEADER + DELTA_PREFIX + DELTA_ENTRY * image_count


def _check_u64(name: str, v: int) -> int:
    if not isinstance(v, int | np.integer) or not 0 <= int(v) <= _U64_MAX:
        raise InvalidArgument(f"{name} must be a u64, got {v!r}")
    return int(v)


def _check_bucket_count(bc: int) -> int:
    bc = _check_u64("bucket_count", bc)
    if not MIN_BUCKET_COUNT <= bc <= MAX_BUCKET_COUNT or bc & (bc - 1):
        raise InvalidArgument(f"bucket_count must be a power of two in [2, 2^24], got {bc}")
    return bc


def _as_u64(name: str, a: object) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise InvalidArgument(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype == np.uint64:
        return arr
    if arr.size == 0:
        return np.empty(0, dtype=np.uint64)
    if arr.dtype.kind not in "iu" or (arr.dtype.kind == "i" and int(arr.min()) < 0):
        raise InvalidArgument(f"{name} must hold non-negative integers (dtype {arr.dtype})")
    return arr.astype(np.uint64)


def _has_duplicates(a: np.ndarray) -> bool:
    """Sort-based (np.unique is ~50x slower here on numpy 2.x for 300k entries)."""
    s = np.sort(a)
    return bool(np.any(s[1:] == s[:-1]))


def _seal(
    buf: bytearray | npt.NDArray[np.uint8], flags: int, seed: int, bc: int, dc: int, epoch: int
) -> bytes:
    """Fill the header of a frame whose body is already in place (checksum covers [48..end))."""
    with memoryview(buf) as mv:  # type: ignore[arg-type]  # numpy arrays are buffers
        csum = checksum(mv[HEADER:])
        _HEADER.pack_into(
            mv, 0, MAGIC, WIRE_VERSION, flags, FINGERPRINT_BITS, SLOTS_PER_BUCKET, FORMAT_VERSION,
            seed, bc, dc, epoch, csum,
        )  # fmt: skip
        return bytes(mv)


# --------------------------------------------------------------------------- encoding


def encode_snapshot_chunks(
    words: np.ndarray, *, seed: int, bucket_count: int, dc_id: int, epoch: int
) -> list[bytes]:
    """Split a full lane (``bucket_count`` words) into ≤524,288-word chunks, in order."""
    seed = _check_u64("seed", seed)
    bc = _check_bucket_count(bucket_count)
    dc = _check_u64("dc_id", dc_id)
    ep = _check_u64("epoch", epoch)
    w = _as_u64("words", words)
    if w.size != bc:
        raise InvalidArgument(f"snapshot needs exactly bucket_count={bc} words, got {w.size}")
    count = chunk_count_for(bc)
    out = []
    for i in range(count):
        off = i * SNAPSHOT_CHUNK_BUCKETS
        part = w[off : off + SNAPSHOT_CHUNK_BUCKETS]
        buf = bytearray(HEADER + SNAPSHOT_PREFIX + 8 * part.size)
        _SNAP_PREFIX.pack_into(buf, HEADER, i, count, off)
        body = np.frombuffer(buf, dtype=_WORD, count=part.size, offset=HEADER + SNAPSHOT_PREFIX)
        body[:] = part
        del body  # release the buffer export before sealing
        out.append(_seal(buf, FLAG_SNAPSHOT_CHUNK, seed, bc, dc, ep))
    return out


def encode_delta(
    buckets: np.ndarray,
    words: np.ndarray,
    *,
    seed: int,
    bucket_count: int,
    dc_id: int,
    base_epoch: int,
    epoch: int,
) -> bytes:
    """Encode absolute bucket images; buckets must be unique and < bucket_count."""
    seed = _check_u64("seed", seed)
    bc = _check_bucket_count(bucket_count)
    dc = _check_u64("dc_id", dc_id)
    base = _check_u64("base_epoch", base_epoch)
    ep = _check_u64("epoch", epoch)
    b = _as_u64("buckets", buckets)
    w = _as_u64("words", words)
    if b.size != w.size:
        raise InvalidArgument(f"{b.size} buckets but {w.size} words")
    k = int(b.size)
    if k > MAX_DELTA_IMAGES:
        raise TooManyImages(f"{k} images > {MAX_DELTA_IMAGES}; publish a snapshot instead")
    if k and int(b.max()) >= bc:
        raise BucketOutOfRange(f"bucket {int(b.max())} >= bucket_count {bc}")
    if k and _has_duplicates(b):
        raise DuplicateBucket("a bucket appears more than once in one delta")
    return encode_delta_validated(
        b, w, seed=seed, bucket_count=bc, dc_id=dc, base_epoch=base, epoch=ep
    )


def encode_delta_validated(
    buckets: np.ndarray,
    words: np.ndarray,
    *,
    seed: int,
    bucket_count: int,
    dc_id: int,
    base_epoch: int,
    epoch: int,
) -> bytes:
    """``encode_delta`` without its checks, for a caller that has made them already (the hub
    validates every publication once, before it touches its mirror): 1-D integer arrays of equal
    length, at most ``MAX_DELTA_IMAGES``, buckets unique and ``< bucket_count``, header fields
    u64 and ``bucket_count`` valid. Same bytes as ``encode_delta``."""
    k = int(buckets.size)
    entries = np.empty(k, dtype=_ENTRY)
    entries["bucket"] = buckets
    entries["word"] = words
    body = _DELTA_PREFIX.pack(base_epoch, k) + entries.tobytes()
    head = _HEADER.pack(
        MAGIC, WIRE_VERSION, FLAG_DELTA, FINGERPRINT_BITS, SLOTS_PER_BUCKET, FORMAT_VERSION,
        seed, bucket_count, dc_id, epoch, checksum(body),
    )  # fmt: skip
    return head + body


def seal_delta(
    frame: bytearray | npt.NDArray[np.uint8],
    *,
    seed: int,
    bucket_count: int,
    dc_id: int,
    epoch: int,
) -> bytes:
    """A delta frame whose body (from ``HEADER`` on: base epoch, count, entries) is already in
    place, with its header filled in, for a caller that checked the body and the header fields
    as ``encode_delta_validated`` trusts its own caller to. Same bytes as ``encode_delta``."""
    return _seal(frame, FLAG_DELTA, seed, bucket_count, dc_id, epoch)


# --------------------------------------------------------------------------- decoding


def decode(
    payload: bytes | bytearray | memoryview, *, expected_seed: int, expected_bucket_count: int
) -> SnapshotChunk | Delta:
    """Validate and parse one CBI1 frame (checks in §5.1 order). ``dc_id`` is NOT checked here:
    the caller compares it with the enclosing producer identity."""
    data = bytes(payload)
    n = len(data)
    if n < HEADER:
        raise TooShort(f"{n} bytes < {HEADER}-byte header")
    if n > MAX_FRAME:
        raise TooLong(f"{n} bytes > {MAX_FRAME}")
    (magic, wire, flags, fp_bits, slots, fmt, seed, bc, dc, epoch, csum) = _HEADER.unpack_from(
        data, 0
    )
    if magic != MAGIC:
        raise BadMagic(f"magic {magic!r}")
    if wire != WIRE_VERSION:
        raise BadWireVersion(f"wire_version {wire}")
    body = memoryview(data)[HEADER:]
    actual = checksum(body)
    if actual != csum:
        raise ChecksumMismatch(f"body checksum {actual:#010x} != header {csum:#010x}")
    if fmt != FORMAT_VERSION:
        raise FormatMismatch(f"format_version {fmt}")
    if fp_bits != FINGERPRINT_BITS:
        raise FormatMismatch(f"fingerprint_bits {fp_bits}")
    if slots != SLOTS_PER_BUCKET:
        raise FormatMismatch(f"slots_per_bucket {slots}")
    if seed != expected_seed:
        raise FormatMismatch(f"seed {seed:#x} != expected {expected_seed:#x}")
    if bc != expected_bucket_count:
        raise FormatMismatch(f"bucket_count {bc} != expected {expected_bucket_count}")
    if not MIN_BUCKET_COUNT <= bc <= MAX_BUCKET_COUNT or bc & (bc - 1):
        raise FormatMismatch(f"bucket_count {bc} is not a power of two in [2, 2^24]")
    if flags == FLAG_SNAPSHOT_CHUNK:
        return _parse_snapshot(data, seed, bc, dc, epoch)
    if flags == FLAG_DELTA:
        return _parse_delta(data, seed, bc, dc, epoch)
    raise BadFlags(f"flags {flags:#06x}")


def _parse_snapshot(data: bytes, seed: int, bc: int, dc: int, epoch: int) -> SnapshotChunk:
    blen = len(data) - HEADER
    if blen < SNAPSHOT_PREFIX:
        raise BadBody(f"snapshot body {blen} bytes < {SNAPSHOT_PREFIX}")
    if (blen - SNAPSHOT_PREFIX) % 8:
        raise BadBody("snapshot word area is not a multiple of 8 bytes")
    index, count, offset = _SNAP_PREFIX.unpack_from(data, HEADER)
    n = (blen - SNAPSHOT_PREFIX) // 8
    if count < 1:
        raise BadChunk("chunk_count is 0")
    if index >= count:
        raise BadChunk(f"chunk_index {index} >= chunk_count {count}")
    if n > SNAPSHOT_CHUNK_BUCKETS:
        raise BadChunk(f"{n} words > {SNAPSHOT_CHUNK_BUCKETS} per chunk")
    if offset + n > bc:
        raise BucketOutOfRange(f"bucket_offset {offset} + {n} words > bucket_count {bc}")
    words = np.frombuffer(data, dtype=_WORD, count=n, offset=HEADER + SNAPSHOT_PREFIX)
    return SnapshotChunk(seed, bc, dc, epoch, index, count, offset, words)


def _parse_delta(data: bytes, seed: int, bc: int, dc: int, epoch: int) -> Delta:
    blen = len(data) - HEADER
    if blen < DELTA_PREFIX:
        raise BadBody(f"delta body {blen} bytes < {DELTA_PREFIX}")
    base, k = _DELTA_PREFIX.unpack_from(data, HEADER)
    if blen != DELTA_PREFIX + DELTA_ENTRY * k:
        raise BadBody(f"delta body {blen} bytes != 12 + 12*{k}")
    if k > MAX_DELTA_IMAGES:
        raise TooManyImages(f"{k} images > {MAX_DELTA_IMAGES}")
    entries = np.frombuffer(data, dtype=_ENTRY, count=k, offset=HEADER + DELTA_PREFIX)
    buckets = entries["bucket"].astype(np.uint32)
    words = entries["word"].astype(np.uint64)
    if k and int(buckets.max()) >= bc:
        raise BucketOutOfRange(f"bucket {int(buckets.max())} >= bucket_count {bc}")
    if k and _has_duplicates(buckets):
        raise DuplicateBucket("a bucket appears more than once in the delta")
    buckets.flags.writeable = False
    words.flags.writeable = False
    return Delta(seed, bc, dc, base, epoch, buckets, words)


# --------------------------------------------------------------------------- assembly


class SnapshotAssembler:
    """Reassembles one snapshot from its chunks (§5.2); exposes nothing before the last chunk.

    Any violation discards the in-progress assembly (never a half-built table) and raises; a
    chunk with index 0 always starts over. Memory bound: one table of ``bucket_count`` words.
    """

    def __init__(self) -> None:
        self._table: np.ndarray | None = None
        self._first: SnapshotChunk | None = None
        self._next_index = 0
        self._covered = 0

    @property
    def in_progress(self) -> bool:
        return self._first is not None

    def reset(self) -> None:
        self._table = None
        self._first = None
        self._next_index = 0
        self._covered = 0

    def _fail(self, exc: Cbi1Error) -> Cbi1Error:
        self.reset()
        return exc

    def feed(self, chunk: SnapshotChunk) -> AssembledSnapshot | None:
        """Add the next chunk; returns the full table when the final chunk completes it."""
        if chunk.chunk_index == 0:
            self.reset()
            if chunk.bucket_offset != 0:
                raise self._fail(SequenceViolation("chunk 0 must start at bucket_offset 0"))
            self._first = chunk
            self._table = np.empty(chunk.bucket_count, dtype=np.uint64)
        else:
            first = self._first
            if first is None:
                raise SequenceViolation(f"chunk {chunk.chunk_index} without chunk 0")
            if (chunk.epoch, chunk.dc_id, chunk.seed) != (first.epoch, first.dc_id, first.seed):
                raise self._fail(SequenceViolation("chunk from a different snapshot/epoch"))
            if (chunk.chunk_count, chunk.bucket_count) != (first.chunk_count, first.bucket_count):
                raise self._fail(SequenceViolation("chunk_count/bucket_count changed mid-snapshot"))
            if chunk.chunk_index != self._next_index:
                raise self._fail(
                    SequenceViolation(f"chunk {chunk.chunk_index}, expected {self._next_index}")
                )
            if chunk.bucket_offset != self._covered:
                raise self._fail(
                    SequenceViolation(f"bucket_offset {chunk.bucket_offset} != {self._covered}")
                )
        table = self._table
        assert table is not None and self._first is not None
        n = int(chunk.words.size)
        if self._covered + n > table.size:
            raise self._fail(BucketOutOfRange("chunk words overflow bucket_count"))
        table[self._covered : self._covered + n] = chunk.words
        self._covered += n
        self._next_index = chunk.chunk_index + 1
        if self._next_index < chunk.chunk_count:
            return None
        if self._covered != table.size:
            raise self._fail(IncompleteCoverage(f"covered {self._covered} of {table.size} buckets"))
        first = self._first
        self.reset()
        table.flags.writeable = False
        return AssembledSnapshot(first.seed, first.bucket_count, first.dc_id, first.epoch, table)
