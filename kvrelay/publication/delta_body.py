"""One publication's checks and its CBI1 delta bytes, in one kernel call.

Why: at light load every delta is a handful of images, and the relay's cost per delta was a
dozen small numpy calls (the hub's checks: ``asarray``, ``sort``, a compare, ``astype``; the
codec's structured-array fill and ``tobytes``). Each costs little in a loop, but a relay that
sleeps between deltas runs them with cold caches, where each small call costs several times
more. ``delta_frame`` makes the same checks and writes the whole body in one call; its pure
numpy twin (``hub._checked`` with ``cbi1.encode_delta_validated``) is the test oracle and the
path for any input that is not already the pool's own array types. ``delta_message`` goes one
step further for a delta that is to be sent: the same checks and body, and around them the CBI1
header with its checksum and the FilterUpdate envelope, so the message a stream sends comes out
of one call (``cbi1.seal_delta`` and ``FilterUpdateEncoder.encode`` are its twins). ``scatter``
writes a checked publication into the hub's table image, which numpy's ``mirror[buckets] =
words`` (its twin) does with a fancy-indexing call that costs as much again as the kernel call
cold.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import types

from kvrelay._jit import inline, kernel
from kvrelay.hashing.xxh3 import SECRET_SIZE, xxh3_64_bytes_with
from kvrelay.publication import cbi1
from kvrelay.publication import splice as sp

#: ``delta_frame`` results.
OK = 0
OUT_OF_RANGE = 1
REPEATED = 2
LENGTHS = 3
#: What each refusal means (the numpy twin, ``hub._checked``, says the same).
ERRORS = {
    OUT_OF_RANGE: "bucket index out of range",
    REPEATED: "bucket repeated within one delta",
    LENGTHS: "buckets and words must be 1-D of equal length",
}


@inline  # type: ignore[misc]
def _le(out: npt.NDArray[np.uint8], p: int, v: np.uint64, n: int) -> int:
    for j in range(n):
        out[p + j] = np.uint8((v >> np.uint64(8 * j)) & np.uint64(0xFF))
    return p + n


@inline  # type: ignore[misc]
def _check(
    buckets: npt.NDArray[np.uint32], words: npt.NDArray[np.uint64], bucket_count: int
) -> int:
    """``OK``, or why the publication is refused (``LENGTHS``, ``OUT_OF_RANGE``, ``REPEATED``)."""
    k = buckets.shape[0]
    if words.shape[0] != k:
        return LENGTHS
    for i in range(k):
        if buckets[i] >= bucket_count:
            return OUT_OF_RANGE
    if k > 1:
        s = np.sort(buckets)
        for i in range(1, k):
            if s[i] == s[i - 1]:
                return REPEATED
    return OK


@inline  # type: ignore[misc]
def _body(
    buckets: npt.NDArray[np.uint32],
    words: npt.NDArray[np.uint64],
    base_epoch: np.uint64,
    out: npt.NDArray[np.uint8],
    p: int,
) -> None:
    """A checked publication's CBI1 delta body at ``out[p:]``: base epoch (u64 LE), image count
    (u32 LE), then each (bucket u32 LE, word u64 LE)."""
    k = buckets.shape[0]
    p = _le(out, p, base_epoch, 8)
    p = _le(out, p, np.uint64(k), 4)
    for i in range(k):
        p = _le(out, p, np.uint64(buckets[i]), 4)
        p = _le(out, p, words[i], 8)


@kernel(  # type: ignore[misc]
    "pool",
    types.int64(types.uint32[::1], types.uint64[::1], types.int64, types.uint64, types.uint8[::1]),
)
def delta_frame(
    buckets: npt.NDArray[np.uint32],
    words: npt.NDArray[np.uint64],
    bucket_count: int,
    base_epoch: np.uint64,
    out: npt.NDArray[np.uint8],
) -> int:
    """Check one publication (buckets ``< bucket_count`` and unique) and, when ``out`` is not
    empty, write its CBI1 delta frame after the header: ``out[HEADER:]`` = base epoch (u64 LE),
    image count (u32 LE), then each (bucket u32 LE, word u64 LE). ``out`` is ``delta_frame_len``
    bytes or empty; the header (and its checksum) is the caller's. Returns ``OK``,
    ``OUT_OF_RANGE``, ``REPEATED`` or ``LENGTHS`` (not one word per bucket, or ``out`` of another
    size); nothing is written unless it is ``OK``."""
    code = _check(buckets, words, bucket_count)
    if code != OK or out.shape[0] == 0:
        return code
    if out.shape[0] != cbi1.HEADER + cbi1.DELTA_PREFIX + cbi1.DELTA_ENTRY * buckets.shape[0]:
        return LENGTHS
    _body(buckets, words, base_epoch, out, cbi1.HEADER)
    return OK


#: An empty ``out``: check only.
NO_FRAME = np.zeros(0, dtype=np.uint8)


@kernel(  # type: ignore[misc]
    "pool",
    types.int64(types.uint64[::1], types.uint32[::1], types.uint64[::1]),
)
def scatter(
    mirror: npt.NDArray[np.uint64],
    buckets: npt.NDArray[np.uint32],
    words: npt.NDArray[np.uint64],
) -> int:
    """``mirror[buckets] = words`` for a publication ``delta_frame`` accepted (every bucket in
    range, one word each); ``LENGTHS`` (nothing written) when the lengths disagree or a bucket is
    past the mirror, else ``OK``."""
    k = buckets.shape[0]
    if words.shape[0] != k:
        return LENGTHS
    n = mirror.shape[0]
    for i in range(k):
        if buckets[i] >= n:
            return LENGTHS
    for i in range(k):
        mirror[buckets[i]] = words[i]
    return OK


_RO_U8 = types.Array(types.uint8, 1, "C", readonly=True)
#: The FilterUpdate fields ``delta_message`` writes after the envelope's constant prefix, at most
#: (four varint fields and the payload's key and length, 11 bytes each) and the trailing marker.
ENVELOPE_MAX = 6 * 11 + len(sp.MARKER_FIELD)


_MAGIC = np.frombuffer(cbi1.MAGIC, dtype=np.uint8)  # numba freezes global arrays as constants
_MARKER = np.frombuffer(sp.MARKER_FIELD, dtype=np.uint8)


def delta_message_cap(prefix_len: int, image_count: int) -> int:
    """Bytes ``delta_message`` may write for a delta of ``image_count`` images."""
    return prefix_len + ENVELOPE_MAX + cbi1.delta_frame_len(image_count)


@inline  # type: ignore[misc]
def _field(out: npt.NDArray[np.uint8], p: int, key: int, v: np.uint64) -> int:
    """A protobuf varint field (``key``, then ``v`` in base 128); omitted when ``v`` is 0, as
    protobuf omits a proto3 default."""
    if v == np.uint64(0):
        return p
    out[p] = np.uint8(key)
    p += 1
    while v >= np.uint64(0x80):
        out[p] = np.uint8((v & np.uint64(0x7F)) | np.uint64(0x80))
        v >>= np.uint64(7)
        p += 1
    out[p] = np.uint8(v)
    return p + 1


@kernel(  # type: ignore[misc]
    "pool",
    types.int64(
        types.uint32[::1], types.uint64[::1], types.int64, types.uint64, types.uint64,
        types.uint64, types.uint64, types.uint64, _RO_U8, types.uint8[::1],
    ),
)
def delta_message(
    buckets: npt.NDArray[np.uint32],
    words: npt.NDArray[np.uint64],
    bucket_count: int,
    base_epoch: np.uint64,
    epoch: np.uint64,
    send_ts_us: np.uint64,
    seed: np.uint64,
    dc_id: np.uint64,
    prefix: npt.NDArray[np.uint8],
    out: npt.NDArray[np.uint8],
) -> int:
    """The whole FilterUpdate of one delta into ``out`` (at least ``delta_message_cap`` bytes):
    ``prefix`` (the encoder's fields 1–3), base sequence, sequence, send time, kind DELTA, the
    CBI1 delta frame (``delta_frame``'s checks and body, its header and checksum) as the
    payload, and the contract marker. Returns the message's length, or minus ``delta_frame``'s
    refusal (``-LENGTHS`` too when ``out`` is short); nothing is written unless it succeeds."""
    code = _check(buckets, words, bucket_count)
    if code != OK:
        return -code
    plen = cbi1.HEADER + cbi1.DELTA_PREFIX + cbi1.DELTA_ENTRY * buckets.shape[0]
    if out.shape[0] < prefix.shape[0] + ENVELOPE_MAX + plen:
        return -LENGTHS
    for i in range(prefix.shape[0]):
        out[i] = prefix[i]
    p = prefix.shape[0]
    p = _field(out, p, 0x20, base_epoch)
    p = _field(out, p, 0x28, epoch)
    p = _field(out, p, 0x30, send_ts_us)
    p = _field(out, p, 0x38, np.uint64(sp.KIND_DELTA))
    p = _field(out, p, 0x42, np.uint64(plen))
    f = p
    _body(buckets, words, base_epoch, out, f + cbi1.HEADER)
    for j in range(_MAGIC.shape[0]):
        out[f + j] = _MAGIC[j]
    q = _le(out, f + 4, np.uint64(cbi1.WIRE_VERSION), 2)
    q = _le(out, q, np.uint64(cbi1.FLAG_DELTA), 2)
    q = _le(out, q, np.uint64(cbi1.FINGERPRINT_BITS), 1)
    q = _le(out, q, np.uint64(cbi1.SLOTS_PER_BUCKET), 1)
    q = _le(out, q, np.uint64(cbi1.FORMAT_VERSION), 2)
    q = _le(out, q, seed, 8)
    q = _le(out, q, np.uint64(bucket_count), 8)
    q = _le(out, q, dc_id, 8)
    q = _le(out, q, epoch, 8)
    # the helper, not the hashing group's kernel: warming this group must not compile that one
    csum = xxh3_64_bytes_with(
        out, f + cbi1.HEADER, plen - cbi1.HEADER, np.uint64(0),
        np.empty(SECRET_SIZE, dtype=np.uint8), np.empty(8, dtype=np.uint64),
    )  # fmt: skip
    _le(out, q, csum & np.uint64(0xFFFFFFFF), 4)
    p = f + plen
    for j in range(_MARKER.shape[0]):
        out[p + j] = _MARKER[j]
    return p + _MARKER.shape[0]  # type: ignore[no-any-return]
