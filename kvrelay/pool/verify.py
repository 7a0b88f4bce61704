"""Does the cuckoo filter hold exactly the resident owners' fingerprints? Kernels and their twins.

A fingerprint ``fp`` of a resident owner sits in bucket ``a`` or ``b = a ^ delta(fp)``; kicks move
it between the two and nowhere else. So the filter is right exactly when the multiset of
``(fp, min(a, b))`` over its occupied slots equals that over the resident owners. Both sides are
summarized as a count plus a commutative sum of a 64-bit mix of each pair: order-free, so each
side can be accumulated in bounded steps (a scrub) over any split of the tables, and a wrong,
missing or extra fingerprint changes the sum except with probability about 2^-64. The owners side
also counts owners whose fingerprint is in neither of their buckets (a restore refuses those
outright, whatever the sums say).

Accumulators are ``u64[3]``: ``[pair sum, count, missing]``. The pure-Python twins
(``*_py``) compute the same values from plain data with the ``xxhash`` package: the test oracle.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt
import xxhash
from numba import njit

from kvrelay._jit import inline
from kvrelay.pool.bitops import ctz
from kvrelay.pool.ckf import GOLDEN, _addr, _word_has
from kvrelay.pool.owners import RES_BIT
from kvrelay.pool.packed import _H8, TM_CAP, Int, clamp, fmix, key_of, pay_of

U64 = npt.NDArray[np.uint64]

ACC_SUM = 0
ACC_COUNT = 1
ACC_MISSING = 2
ACC_LEN = 3

_FP = np.uint64(0xFFFF)
_ZERO = np.uint64(0)
_ONE = np.uint64(1)
_M64 = 0xFFFF_FFFF_FFFF_FFFF


@inline
def _pair(lo: np.uint64, fp: np.uint64) -> np.uint64:
    return fmix(((lo << np.uint64(16)) | fp) + GOLDEN)


@njit(cache=True, _nrt=False)  # type: ignore[misc,call-overload,untyped-decorator]
def owners_digest(
    otm: U64, ow: U64, table: U64, seed: np.uint64, deltas: U64, q0: Int, q1: Int, acc: U64
) -> None:
    """Add the resident owners of owner tag words ``[q0, q1)`` to ``acc`` (``table`` is only read
    to count owners whose fingerprint is in neither bucket)."""
    mask = np.uint64(table.shape[0] - 1)
    nw = np.int64(otm[TM_CAP]) >> 3
    for q in range(clamp(q0, 0, nw), clamp(q1, 0, nw)):
        v = ow[q] & _H8
        while v != _ZERO:
            s = q * 8 + (ctz(v) >> 3)
            v &= v - _ONE
            if pay_of(otm, ow, s) & RES_BIT == _ZERO:
                continue
            fp, a = _addr(key_of(otm, ow, s), seed, mask, deltas)
            b = a ^ deltas[fp]
            if not (_word_has(table[a], fp) or _word_has(table[b], fp)):
                acc[ACC_MISSING] += _ONE
            acc[ACC_SUM] += _pair(min(a, b), fp)
            acc[ACC_COUNT] += _ONE


@njit(cache=True, _nrt=False)  # type: ignore[misc,call-overload,untyped-decorator]
def filter_digest(table: U64, deltas: U64, b0: Int, b1: Int, acc: U64) -> None:
    """Add the occupied slots of buckets ``[b0, b1)`` to ``acc``."""
    for x in range(clamp(b0, 0, table.shape[0]), clamp(b1, 0, table.shape[0])):
        w = table[x]
        if w == _ZERO:
            continue
        bx = np.uint64(x)
        for s in range(4):
            fp = (w >> np.uint64(16 * s)) & _FP
            if fp != _ZERO:
                acc[ACC_SUM] += _pair(min(bx, bx ^ deltas[fp]), fp)
                acc[ACC_COUNT] += _ONE


def new_acc() -> U64:
    return np.zeros(ACC_LEN, dtype=np.uint64)


# ---- pure-Python twins (test oracle) -------------------------------------------------------------


def _fmix_py(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _M64
    return x ^ (x >> 33)


def _pair_py(lo: int, fp: int) -> int:
    return _fmix_py((((lo << 16) | fp) + int(GOLDEN)) & _M64)


def _delta_py(fp: int, seed: int, mask: int) -> int:
    d = xxhash.xxh3_64_intdigest(fp.to_bytes(2, "little"), seed=seed ^ int(GOLDEN)) & mask
    return d or 1


def owners_digest_py(
    resident: Iterable[int], table: Iterable[int], seed: int, bucket_count: int
) -> tuple[int, int, int]:
    """``(pair sum, count, missing)`` of the resident owners' canonical hashes."""
    words = list(table)
    mask = bucket_count - 1
    total = count = missing = 0
    for h in resident:
        mixed = xxhash.xxh3_64_intdigest(h.to_bytes(8, "little"), seed=seed)
        fp = (mixed & 0xFFFF) or 1
        a = (mixed >> 16) & mask
        b = a ^ _delta_py(fp, seed, mask)
        if not any((words[k] >> (16 * s)) & 0xFFFF == fp for k in (a, b) for s in range(4)):
            missing += 1
        total = (total + _pair_py(min(a, b), fp)) & _M64
        count += 1
    return total, count, missing


def filter_digest_py(table: Iterable[int], seed: int) -> tuple[int, int]:
    """``(pair sum, count)`` of a table's occupied slots."""
    words = list(table)
    mask = len(words) - 1
    total = count = 0
    for x, w in enumerate(words):
        for s in range(4):
            fp = (w >> (16 * s)) & 0xFFFF
            if fp:
                total = (total + _pair_py(min(x, x ^ _delta_py(fp, seed, mask)), fp)) & _M64
                count += 1
    return total, count
