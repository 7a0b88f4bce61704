"""One publication's checks and its CBI1 delta bytes, in one kernel call.

Why: at light load every delta is a handful of images, and the relay's cost per delta was a
dozen small numpy calls (the hub's checks: ``asarray``, ``sort``, a compare, ``astype``; the
codec's structured-array fill and ``tobytes``). Each costs little in a loop, but a relay that
sleeps between deltas runs them with cold caches, where each small call costs several times
more. ``delta_frame`` makes the same checks and writes the whole body in one call; its pure
numpy twin (``hub._checked`` with ``cbi1.encode_delta_validated``) is the test oracle and the
path for any input that is not already the pool's own array types. ``scatter`` writes a checked
publication into the hub's table image, which numpy's ``mirror[buckets] = words`` (its twin)
does with a fancy-indexing call that costs as much again as the kernel call cold.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import types

from kvrelay._jit import kernel
from kvrelay.publication import cbi1

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
    if out.shape[0] == 0:
        return OK
    if out.shape[0] != cbi1.HEADER + cbi1.DELTA_PREFIX + cbi1.DELTA_ENTRY * k:
        return LENGTHS
    p = cbi1.HEADER
    v = base_epoch
    for j in range(8):
        out[p + j] = np.uint8((v >> np.uint64(8 * j)) & np.uint64(0xFF))
    p += 8
    c = np.uint64(k)
    for j in range(4):
        out[p + j] = np.uint8((c >> np.uint64(8 * j)) & np.uint64(0xFF))
    p += 4
    for i in range(k):
        b = np.uint64(buckets[i])
        for j in range(4):
            out[p + j] = np.uint8((b >> np.uint64(8 * j)) & np.uint64(0xFF))
        w = words[i]
        for j in range(8):
            out[p + 4 + j] = np.uint8((w >> np.uint64(8 * j)) & np.uint64(0xFF))
        p += cbi1.DELTA_ENTRY
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
