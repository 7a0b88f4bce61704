"""CBI1 codec (§5): §12.4 golden behaviour, byte layout rebuilt with ``struct`` + ``xxhash`` as the
independent oracle, every decoder rejection in §5.1 order, and snapshot assembly rules."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.publication import cbi1
from kvrelay.publication.cbi1 import (
    AssembledSnapshot,
    BadBody,
    BadChunk,
    BadFlags,
    BadMagic,
    BadWireVersion,
    BucketOutOfRange,
    Cbi1Error,
    ChecksumMismatch,
    Delta,
    DuplicateBucket,
    FormatMismatch,
    IncompleteCoverage,
    InvalidArgument,
    SequenceViolation,
    SnapshotAssembler,
    SnapshotChunk,
    TooLong,
    TooManyImages,
    TooShort,
    decode,
    encode_delta,
    encode_snapshot_chunks,
)

SEED = 0x5EED
BC = 1024


def oracle_frame(
    body: bytes,
    *,
    flags: int,
    seed: int = SEED,
    bc: int = BC,
    dc: int = 7,
    epoch: int = 5,
    magic: bytes = b"CBI1",
    wire: int = 1,
    fp: int = 16,
    slots: int = 4,
    fmt: int = 1,
    csum: int | None = None,
) -> bytes:
    """Hand-built frame straight from the §5.1 table (independent of the codec)."""
    if csum is None:
        csum = xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF
    hdr = (
        magic
        + struct.pack("<H", wire)
        + struct.pack("<H", flags)
        + bytes([fp, slots])
        + struct.pack("<H", fmt)
        + struct.pack("<QQQQ", seed, bc, dc, epoch)
        + struct.pack("<I", csum)
    )
    assert len(hdr) == 48
    return hdr + body


def delta_body(base: int, images: list[tuple[int, int]], k: int | None = None) -> bytes:
    n = len(images) if k is None else k
    return struct.pack("<QI", base, n) + b"".join(struct.pack("<IQ", b, w) for b, w in images)


def snap_body(index: int, count: int, offset: int, words: list[int]) -> bytes:
    return struct.pack("<IIQ", index, count, offset) + b"".join(struct.pack("<Q", w) for w in words)


def dec(payload: bytes, seed: int = SEED, bc: int = BC) -> SnapshotChunk | Delta:
    return decode(payload, expected_seed=seed, expected_bucket_count=bc)


# --------------------------------------------------------------------------- constants


def test_constants() -> None:
    assert cbi1.HEADER == 48
    assert cbi1.SNAPSHOT_CHUNK_BUCKETS == 524_288
    assert cbi1.MAX_FRAME == 4_194_368
    assert cbi1.MAX_DELTA_IMAGES == 349_525
    assert cbi1.delta_frame_len(2) == 84


# --------------------------------------------------------------------------- §12.4


def test_a4_delta_round_trip_and_bytes() -> None:
    images = [(3, 0xAAAABBBBCCCCDDDD), (1000, 42)]
    payload = encode_delta(
        np.array([3, 1000], np.uint32),
        np.array([0xAAAABBBBCCCCDDDD, 42], np.uint64),
        seed=SEED,
        bucket_count=BC,
        dc_id=7,
        base_epoch=4,
        epoch=5,
    )
    assert payload == oracle_frame(delta_body(4, images), flags=2, dc=7, epoch=5)
    assert len(payload) == 60 + 12 * 2
    d = dec(payload)
    assert isinstance(d, Delta)
    assert (d.seed, d.bucket_count, d.dc_id, d.base_epoch, d.epoch) == (SEED, BC, 7, 4, 5)
    assert d.buckets.tolist() == [3, 1000]
    assert d.words.tolist() == [0xAAAABBBBCCCCDDDD, 42]
    assert d.buckets.dtype == np.uint32 and d.words.dtype == np.uint64


@settings(max_examples=60, deadline=None)
@given(
    images=st.dictionaries(st.integers(0, BC - 1), st.integers(0, 2**64 - 1), max_size=40),
    base=st.integers(0, 2**64 - 2),
)
def test_validated_delta_encoder_matches_the_oracle(images: dict[int, int], base: int) -> None:
    """The hub's unchecked encoder writes the §5.1 bytes for any valid delta (0..40 images)."""
    items = list(images.items())
    payload = cbi1.encode_delta_validated(
        np.array([b for b, _ in items], np.uint32),
        np.array([w for _, w in items], np.uint64),
        seed=SEED, bucket_count=BC, dc_id=7, base_epoch=base, epoch=base + 1,
    )  # fmt: skip
    assert payload == oracle_frame(delta_body(base, items), flags=2, dc=7, epoch=base + 1)


def _a4_delta() -> bytes:
    return encode_delta(
        np.array([3, 1000]),
        np.array([0xAAAABBBBCCCCDDDD, 42], np.uint64),
        seed=SEED,
        bucket_count=BC,
        dc_id=7,
        base_epoch=4,
        epoch=5,
    )


def test_a4_trailing_byte_fails_checksum() -> None:
    with pytest.raises(ChecksumMismatch):
        dec(_a4_delta() + b"\x00")


def test_a4_flags_0x8000_rejected() -> None:
    p = bytearray(_a4_delta())
    struct.pack_into("<H", p, 6, 0x8000)
    with pytest.raises(BadFlags):
        dec(bytes(p))


def test_a4_format_version_2_rejected() -> None:
    p = bytearray(_a4_delta())
    struct.pack_into("<H", p, 10, 2)
    with pytest.raises(FormatMismatch):
        dec(bytes(p))


def test_a4_two_chunk_snapshot_reassembles() -> None:
    bc = 1 << 20
    words = np.zeros(bc, np.uint64)
    words[0], words[524_289], words[-1] = 11, 22, 33
    chunks = encode_snapshot_chunks(words, seed=SEED, bucket_count=bc, dc_id=7, epoch=6)
    assert len(chunks) == 2
    assert all(len(c) == cbi1.MAX_FRAME for c in chunks)
    # Independent byte check of chunk 1's prefix and first word.
    assert chunks[1][48:64] == struct.pack("<IIQ", 1, 2, 524_288)
    assert struct.unpack_from("<Q", chunks[1], 64 + 8)[0] == 22
    asm = SnapshotAssembler()
    c0 = dec(chunks[0], bc=bc)
    c1 = dec(chunks[1], bc=bc)
    assert isinstance(c0, SnapshotChunk) and isinstance(c1, SnapshotChunk)
    assert asm.feed(c0) is None
    assert asm.in_progress
    out = asm.feed(c1)
    assert isinstance(out, AssembledSnapshot)
    assert out.epoch == 6 and out.dc_id == 7 and out.bucket_count == bc
    assert np.array_equal(out.words, words)
    assert not asm.in_progress


def test_a4_chunk_1_first_is_sequence_violation() -> None:
    bc = 1 << 20
    chunks = encode_snapshot_chunks(
        np.zeros(bc, np.uint64), seed=SEED, bucket_count=bc, dc_id=7, epoch=6
    )
    c1 = dec(chunks[1], bc=bc)
    assert isinstance(c1, SnapshotChunk)
    with pytest.raises(SequenceViolation):
        SnapshotAssembler().feed(c1)


def test_readme_word_example() -> None:
    words = np.zeros(BC, np.uint64)
    words[0] = 0x0001_ABCD_0000_1234
    (payload,) = encode_snapshot_chunks(words, seed=SEED, bucket_count=BC, dc_id=1, epoch=1)
    assert payload[64:72] == bytes([0x34, 0x12, 0x00, 0x00, 0xCD, 0xAB, 0x01, 0x00])
    chunk = dec(payload)
    assert isinstance(chunk, SnapshotChunk)
    w = int(chunk.words[0])
    assert [(w >> (16 * s)) & 0xFFFF for s in range(4)] == [0x1234, 0, 0xABCD, 1]


def test_single_chunk_snapshot_matches_oracle_bytes() -> None:
    rng = np.random.default_rng(1)
    words = rng.integers(0, 2**64, size=BC, dtype=np.uint64)
    (payload,) = encode_snapshot_chunks(words, seed=SEED, bucket_count=BC, dc_id=9, epoch=77)
    body = snap_body(0, 1, 0, words.tolist())
    assert payload == oracle_frame(body, flags=1, dc=9, epoch=77)
    chunk = dec(payload)
    assert isinstance(chunk, SnapshotChunk)
    assert (chunk.chunk_index, chunk.chunk_count, chunk.bucket_offset) == (0, 1, 0)
    assert not chunk.words.flags.writeable


# --------------------------------------------------------------------------- rejection order


GOOD_DELTA = delta_body(4, [(1, 2)])


@pytest.mark.parametrize(
    ("payload", "exc"),
    [
        (b"", TooShort),
        (oracle_frame(b"", flags=2)[:47], TooShort),
        (oracle_frame(b"\x00" * (cbi1.MAX_FRAME - 47), flags=1), TooLong),
        # magic checked before wire version and checksum
        (oracle_frame(GOOD_DELTA, flags=2, magic=b"CKF1", wire=9, csum=0), BadMagic),
        (oracle_frame(GOOD_DELTA, flags=2, wire=2, csum=0), BadWireVersion),
        # checksum before format and flags
        (oracle_frame(GOOD_DELTA, flags=7, fmt=2, csum=1), ChecksumMismatch),
        (oracle_frame(GOOD_DELTA, flags=7, fmt=2), FormatMismatch),
        (oracle_frame(GOOD_DELTA, flags=7, fp=8), FormatMismatch),
        (oracle_frame(GOOD_DELTA, flags=7, slots=2), FormatMismatch),
        (oracle_frame(GOOD_DELTA, flags=7, seed=SEED + 1), FormatMismatch),
        (oracle_frame(GOOD_DELTA, flags=7, bc=2048), FormatMismatch),
        (oracle_frame(GOOD_DELTA, flags=0), BadFlags),
        (oracle_frame(GOOD_DELTA, flags=3), BadFlags),
        (oracle_frame(GOOD_DELTA, flags=1 | 2), BadFlags),
        # snapshot bodies
        (oracle_frame(b"\x00" * 15, flags=1), BadBody),
        (oracle_frame(snap_body(0, 1, 0, []) + b"\x00" * 7, flags=1), BadBody),
        (oracle_frame(snap_body(0, 0, 0, [1]), flags=1), BadChunk),
        (oracle_frame(snap_body(2, 2, 0, [1]), flags=1), BadChunk),
        (oracle_frame(snap_body(0, 1, 1020, [1] * 5), flags=1), BucketOutOfRange),
        (oracle_frame(snap_body(0, 1, 2**64 - 1, [1]), flags=1), BucketOutOfRange),
        # delta bodies
        (oracle_frame(b"\x00" * 11, flags=2), BadBody),
        (oracle_frame(delta_body(4, [(1, 2)], k=2), flags=2), BadBody),
        (oracle_frame(delta_body(4, [(1, 2)]) + b"\x00", flags=2), BadBody),
        (oracle_frame(delta_body(4, [(1, 2)], k=2**32 - 1), flags=2), BadBody),
        (oracle_frame(delta_body(4, [(1, 2), (1024, 3)]), flags=2), BucketOutOfRange),
        (oracle_frame(delta_body(4, [(5, 2), (9, 0), (5, 3)]), flags=2), DuplicateBucket),
    ],
)
def test_decoder_rejections(payload: bytes, exc: type[Cbi1Error]) -> None:
    with pytest.raises(exc) as info:
        dec(payload)
    assert type(info.value) is exc
    assert isinstance(info.value, ValueError)


def test_error_reasons_are_distinct() -> None:
    classes = [c for c in vars(cbi1).values() if isinstance(c, type) and issubclass(c, Cbi1Error)]
    reasons = [c.reason for c in classes]
    assert len(classes) >= 15
    assert len(set(reasons)) == len(reasons)


def test_decoder_accepts_empty_delta_and_edge_buckets() -> None:
    d = dec(oracle_frame(delta_body(9, []), flags=2, epoch=10))
    assert isinstance(d, Delta) and d.buckets.size == 0 and d.base_epoch == 9
    d = dec(oracle_frame(delta_body(0, [(1023, 0), (0, 2**64 - 1)]), flags=2))
    assert isinstance(d, Delta)
    assert d.buckets.tolist() == [1023, 0] and d.words.tolist() == [0, 2**64 - 1]


def test_decoder_does_not_check_dc_id() -> None:
    d = dec(oracle_frame(GOOD_DELTA, flags=2, dc=2**64 - 1))
    assert d.dc_id == 2**64 - 1


# --------------------------------------------------------------------------- encoder rejections


def test_encoder_rejections() -> None:
    kw = {"seed": SEED, "bucket_count": BC, "dc_id": 1, "base_epoch": 1, "epoch": 2}
    with pytest.raises(DuplicateBucket):
        encode_delta(np.array([1, 2, 1]), np.array([1, 2, 3], np.uint64), **kw)
    with pytest.raises(BucketOutOfRange):
        encode_delta(np.array([1024]), np.array([1], np.uint64), **kw)
    with pytest.raises(TooManyImages):
        n = cbi1.MAX_DELTA_IMAGES + 1
        encode_delta(
            np.arange(n, dtype=np.uint64),
            np.zeros(n, np.uint64),
            **{**kw, "bucket_count": 1 << 20},
        )
    with pytest.raises(InvalidArgument):
        encode_delta(np.array([1, 2]), np.array([1], np.uint64), **kw)
    with pytest.raises(InvalidArgument):
        encode_delta(np.array([-1]), np.array([1], np.uint64), **kw)
    with pytest.raises(InvalidArgument):
        encode_delta(np.array([1]), np.array([1], np.uint64), **{**kw, "bucket_count": 1000})
    with pytest.raises(InvalidArgument):
        encode_delta(np.array([1]), np.array([1], np.uint64), **{**kw, "epoch": -1})
    with pytest.raises(InvalidArgument):
        encode_snapshot_chunks(
            np.zeros(BC - 1, np.uint64), seed=1, bucket_count=BC, dc_id=1, epoch=1
        )
    with pytest.raises(InvalidArgument):
        encode_snapshot_chunks(
            np.zeros(1 << 25, np.uint8), seed=1, bucket_count=1 << 25, dc_id=1, epoch=1
        )


def test_max_delta_fits_max_frame() -> None:
    n = cbi1.MAX_DELTA_IMAGES
    payload = encode_delta(
        np.arange(n, dtype=np.uint32),
        np.arange(n, dtype=np.uint64),
        seed=SEED,
        bucket_count=1 << 20,
        dc_id=1,
        base_epoch=1,
        epoch=2,
    )
    assert len(payload) == 60 + 12 * n <= cbi1.MAX_FRAME
    d = dec(payload, bc=1 << 20)
    assert isinstance(d, Delta) and d.buckets.size == n and int(d.words[-1]) == n - 1


# --------------------------------------------------------------------------- assembly


def _chunks(bc: int, epoch: int, fill: int = 0) -> list[SnapshotChunk]:
    words = np.full(bc, fill, np.uint64)
    out = []
    for p in encode_snapshot_chunks(words, seed=SEED, bucket_count=bc, dc_id=3, epoch=epoch):
        c = dec(p, bc=bc)
        assert isinstance(c, SnapshotChunk)
        out.append(c)
    return out


BIG = 1 << 21  # 4 chunks


def test_assembler_index_zero_resets() -> None:
    a, b = _chunks(BIG, 6, fill=1), _chunks(BIG, 7, fill=2)
    asm = SnapshotAssembler()
    assert asm.feed(a[0]) is None and asm.feed(a[1]) is None
    assert asm.feed(b[0]) is None
    with pytest.raises(SequenceViolation):  # epoch 6 chunk inside the epoch 7 assembly
        asm.feed(a[2])
    assert not asm.in_progress  # violation discards the partial table
    for c in b[:-1]:
        assert asm.feed(c) is None
    out = asm.feed(b[-1])
    assert out is not None and out.epoch == 7 and int(out.words.min()) == 2


@pytest.mark.parametrize("order", [[0, 2], [0, 1, 1], [0, 1, 3]])
def test_assembler_rejects_out_of_order(order: list[int]) -> None:
    cs = _chunks(BIG, 6)
    asm = SnapshotAssembler()
    with pytest.raises(SequenceViolation):
        for i in order:
            asm.feed(cs[i])
    assert not asm.in_progress


def test_assembler_rejects_wrong_offset_and_count_change() -> None:
    bc = 1 << 20
    hand = [
        oracle_frame(snap_body(0, 2, 0, [1] * 10), flags=1, bc=bc),
        oracle_frame(snap_body(1, 2, 11, [1] * 10), flags=1, bc=bc),
    ]
    asm = SnapshotAssembler()
    asm.feed(dec(hand[0], bc=bc))  # type: ignore[arg-type]
    with pytest.raises(SequenceViolation):
        asm.feed(dec(hand[1], bc=bc))  # type: ignore[arg-type]
    asm.feed(dec(hand[0], bc=bc))  # type: ignore[arg-type]
    with pytest.raises(SequenceViolation):
        asm.feed(dec(oracle_frame(snap_body(1, 3, 10, [1]), flags=1, bc=bc), bc=bc))  # type: ignore[arg-type]
    with pytest.raises(SequenceViolation):
        asm.feed(dec(oracle_frame(snap_body(0, 1, 5, [1]), flags=1, bc=bc), bc=bc))  # type: ignore[arg-type]


def test_assembler_incomplete_coverage() -> None:
    short = dec(oracle_frame(snap_body(0, 1, 0, [1] * 1023), flags=1))
    assert isinstance(short, SnapshotChunk)
    with pytest.raises(IncompleteCoverage):
        SnapshotAssembler().feed(short)
    two = [
        oracle_frame(snap_body(0, 2, 0, [1] * 100), flags=1),
        oracle_frame(snap_body(1, 2, 100, [2] * 100), flags=1),
    ]
    asm = SnapshotAssembler()
    assert asm.feed(dec(two[0])) is None  # type: ignore[arg-type]
    with pytest.raises(IncompleteCoverage):
        asm.feed(dec(two[1]))  # type: ignore[arg-type]
    assert not asm.in_progress


def test_assembler_custom_split_is_accepted() -> None:
    """Chunks smaller than 524,288 words are legal if contiguous and complete."""
    two = [
        oracle_frame(snap_body(0, 2, 0, list(range(600))), flags=1),
        oracle_frame(snap_body(1, 2, 600, list(range(600, 1024))), flags=1),
    ]
    asm = SnapshotAssembler()
    assert asm.feed(dec(two[0])) is None  # type: ignore[arg-type]
    out = asm.feed(dec(two[1]))  # type: ignore[arg-type]
    assert out is not None and out.words.tolist() == list(range(1024))


# --------------------------------------------------------------------------- round trips


@settings(max_examples=60, deadline=None)
@given(
    log_bc=st.integers(1, 12),
    seed=st.integers(0, 2**64 - 1),
    dc=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_round_trip_random(
    log_bc: int, seed: int, dc: int, epoch: int, data: st.DataObject
) -> None:
    bc = 1 << log_bc
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32)))
    words = rng.integers(0, 2**64, size=bc, dtype=np.uint64)
    (snap,) = encode_snapshot_chunks(words, seed=seed, bucket_count=bc, dc_id=dc, epoch=epoch)
    assert snap == oracle_frame(
        snap_body(0, 1, 0, words.tolist()), flags=1, seed=seed, bc=bc, dc=dc, epoch=epoch
    )
    out = SnapshotAssembler().feed(dec(snap, seed=seed, bc=bc))  # type: ignore[arg-type]
    assert out is not None and np.array_equal(out.words, words) and out.epoch == epoch

    buckets = data.draw(st.lists(st.integers(0, bc - 1), unique=True, max_size=bc))
    dwords = data.draw(
        st.lists(st.integers(0, 2**64 - 1), min_size=len(buckets), max_size=len(buckets))
    )
    base = data.draw(st.integers(0, 2**64 - 1))
    payload = encode_delta(
        np.array(buckets, np.uint32),
        np.array(dwords, np.uint64),
        seed=seed,
        bucket_count=bc,
        dc_id=dc,
        base_epoch=base,
        epoch=epoch,
    )
    images = list(zip(buckets, dwords, strict=True))
    assert payload == oracle_frame(
        delta_body(base, images), flags=2, seed=seed, bc=bc, dc=dc, epoch=epoch
    )
    d = dec(payload, seed=seed, bc=bc)
    assert isinstance(d, Delta)
    assert d.buckets.tolist() == buckets and d.words.tolist() == dwords  # wire order kept
    assert (d.base_epoch, d.epoch, d.dc_id) == (base, epoch, dc)
