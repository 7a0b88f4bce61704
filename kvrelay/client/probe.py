"""Cuckoo-filter membership on a replica table (``docs/contract.md`` §6.3), without numba.

A hash ``h`` lives in bucket ``a`` or ``b``: ``mixed = XXH3(le64(h), seed)``, fingerprint = its
low 16 bits (0 → 1), ``a = (mixed >> 16) & mask``, ``b = a ^ max(1, XXH3(le16(fp), seed ^
0x9E3779B97F4A7C15) & mask)``; a bucket word holds four 16-bit slots. Queries probe a few
positions of one prompt per pool (an exponential then binary search), so per-hash ``xxhash``
calls plus one vectorized slot test are cheap enough, and router processes never JIT-compile.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import xxhash

ALT_SEED_XOR = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
U64 = npt.NDArray[np.uint64]


def address(h: int, seed: int, bucket_count: int) -> tuple[int, int, int]:
    """``(fingerprint, bucket_a, bucket_b)`` of canonical hash ``h``."""
    mask = bucket_count - 1
    mixed = xxhash.xxh3_64_intdigest((h & _MASK64).to_bytes(8, "little"), seed)
    fp = (mixed & 0xFFFF) or 1
    a = (mixed >> 16) & mask
    d = xxhash.xxh3_64_intdigest(fp.to_bytes(2, "little"), seed ^ ALT_SEED_XOR) & mask
    return fp, a, a ^ (d or 1)


def contains(table: U64, seed: int, hashes: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """For each hash: is its fingerprint in one of its two buckets of ``table``?"""
    hs = np.asarray(hashes, dtype=np.uint64).ravel()
    n = int(table.shape[0])
    fps = np.empty(hs.size, dtype=np.uint64)
    ab = np.empty((hs.size, 2), dtype=np.int64)
    for i, h in enumerate(hs.tolist()):
        fp, a, b = address(int(h), int(seed), n)
        fps[i] = fp
        ab[i] = (a, b)
    words = table[ab]  # (n, 2) bucket words
    shifts = np.arange(0, 64, 16, dtype=np.uint64)
    slots = (words[:, :, None] >> shifts) & np.uint64(0xFFFF)  # (n, 2, 4)
    hit: npt.NDArray[np.bool_] = (slots == fps[:, None, None]).any(axis=(1, 2))
    return hit
