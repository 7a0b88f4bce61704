"""Open-addressing hash tables on numpy arrays for the exact ownership state (§8.2).

Why not dicts: a Python dict costs ~100 B per entry and a Python call per block; these tables cost
12 B per lineage slot and 12 B per owner plus an 8 B index slot, driven from inside the kernel.

* Lineage (one per member): ``keys u64[cap]`` (external vLLM hash) → ``vals u32[cap]`` (index into
  the owners slab); ``EMPTY32`` marks a free slot. The same functions drive the optional namespace
  side table (``vals u64``, empty = 0, since only non-zero namespace components are recorded).
* Owners (one per pool): a dense slab ``canon u64[n]`` + ``cnt u32[n]`` (refcount, resident flag in
  the high bit) with an intrusive free list (a free entry has ``cnt == 0`` and keeps ``next+1`` in
  ``canon``), plus a ``u64`` open-addressing index of ``hash-tag << 32 | slab index``.

Linear probing with backward-shift deletion (no tombstones, so equal-rate stores and removes never
degrade probes). Slots are addressed with multiply-shift range reduction of a mixed hash, so
capacities need not be powers of two and grow by 1.25× (far less memory slack than doubling;
rehash work stays amortised O(1)).
Capacity is reserved from Python before each kernel call; kernels never grow tables.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]

EMPTY32 = np.uint32(0xFFFFFFFF)
EMPTY64 = np.uint64(0xFFFFFFFFFFFFFFFF)
LOW32 = np.uint64(0xFFFFFFFF)
RESIDENT = np.uint32(0x80000000)
COUNT_MASK = np.uint32(0x7FFFFFFF)
MAX_LOAD_NUM = 17  # max load factor 0.85
MAX_LOAD_DEN = 20
GROW_NUM = 5  # growth factor 1.25
GROW_DEN = 4
MIN_CAP = 16

# owners meta indices
OM_LIVE = 0
OM_FREE = 1  # free-list head, -1 = empty
OM_HW = 2  # high-water mark of the slab
OM_RESIDENT = 3


@njit(cache=True, inline="always")  # type: ignore[misc]
def _mix(h: np.uint64) -> np.uint64:
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    h ^= h >> np.uint64(33)
    return h


@njit(cache=True, inline="always")  # type: ignore[misc]
def home(key: np.uint64, cap: int) -> int:
    return np.int64(((_mix(key) >> np.uint64(32)) * np.uint64(cap)) >> np.uint64(32))  # type: ignore[return-value]


@njit(cache=True, inline="always")  # type: ignore[misc]
def tab_find(keys: U64, vals: npt.NDArray[np.generic], empty: np.generic, key: np.uint64) -> int:
    cap = keys.shape[0]
    i = home(key, cap)
    while True:
        if vals[i] == empty:
            return -1
        if keys[i] == key:
            return i
        i += 1
        if i == cap:
            i = 0


@njit(cache=True, inline="always")  # type: ignore[misc]
def tab_put(
    keys: U64, vals: npt.NDArray[np.generic], empty: np.generic, key: np.uint64, val: np.generic
) -> None:
    """Insert a key known to be absent (caller reserved capacity)."""
    cap = keys.shape[0]
    i = home(key, cap)
    while vals[i] != empty:
        i += 1
        if i == cap:
            i = 0
    keys[i] = key
    vals[i] = val


@njit(cache=True, inline="always")  # type: ignore[misc]
def tab_del(keys: U64, vals: npt.NDArray[np.generic], empty: np.generic, i: int) -> None:
    """Backward-shift deletion of slot ``i``."""
    cap = keys.shape[0]
    j = i
    while True:
        j += 1
        if j == cap:
            j = 0
        if vals[j] == empty:
            break
        k = home(keys[j], cap)
        if (j - k + cap) % cap >= (j - i + cap) % cap:
            keys[i] = keys[j]
            vals[i] = vals[j]
            i = j
    vals[i] = empty


@njit(cache=True)  # type: ignore[misc]
def tab_rehash(
    okeys: U64,
    ovals: npt.NDArray[np.generic],
    empty: np.generic,
    nkeys: U64,
    nvals: npt.NDArray[np.generic],
) -> None:
    for i in range(okeys.shape[0]):
        if ovals[i] != empty:
            tab_put(nkeys, nvals, empty, okeys[i], ovals[i])


# ---- owners: slab + u32 index -------------------------------------------------------------------


@njit(cache=True, inline="always")  # type: ignore[misc]
def _tag(key: np.uint64) -> np.uint64:
    return _mix(key) >> np.uint64(32)


@njit(cache=True, inline="always")  # type: ignore[misc]
def _tag_home(tag: np.uint64, cap: int) -> int:
    return np.int64((tag * np.uint64(cap)) >> np.uint64(32))  # type: ignore[return-value]


@njit(cache=True, inline="always")  # type: ignore[misc]
def own_find(oidx: U64, canon: U64, key: np.uint64) -> tuple[int, int]:
    """``(index slot, slab idx)``, or ``(-1, -1)`` if the canonical hash has no owner.

    Index entries are ``tag << 32 | slab_idx`` with ``tag`` = the 32 hash bits that pick the home
    slot, so probing and backward shifts rarely touch the slab (no dependent cache misses)."""
    cap = oidx.shape[0]
    tag = _tag(key)
    i = _tag_home(tag, cap)
    while True:
        v = oidx[i]
        if v == EMPTY64:
            return -1, -1
        if (v >> np.uint64(32)) == tag:
            sidx = np.int64(v & LOW32)
            if canon[sidx] == key:
                return i, sidx  # type: ignore[return-value]
        i += 1
        if i == cap:
            i = 0


@njit(cache=True, inline="always")  # type: ignore[misc]
def own_put(oidx: U64, canon: U64, sidx: int) -> None:
    cap = oidx.shape[0]
    tag = _tag(canon[sidx])
    i = _tag_home(tag, cap)
    while oidx[i] != EMPTY64:
        i += 1
        if i == cap:
            i = 0
    oidx[i] = (tag << np.uint64(32)) | np.uint64(sidx)


@njit(cache=True, inline="always")  # type: ignore[misc]
def own_del(oidx: U64, i: int) -> None:
    cap = oidx.shape[0]
    j = i
    while True:
        j += 1
        if j == cap:
            j = 0
        v = oidx[j]
        if v == EMPTY64:
            break
        k = _tag_home(v >> np.uint64(32), cap)
        if (j - k + cap) % cap >= (j - i + cap) % cap:
            oidx[i] = v
            i = j
    oidx[i] = EMPTY64


@njit(cache=True, inline="always")  # type: ignore[misc]
def own_alloc(canon: U64, cnt: U32, ometa: I64, key: np.uint64) -> int:
    head = ometa[OM_FREE]
    if head >= 0:
        idx = head
        ometa[OM_FREE] = np.int64(canon[idx]) - 1
    else:
        idx = ometa[OM_HW]
        ometa[OM_HW] = idx + 1
    canon[idx] = key
    cnt[idx] = 0
    ometa[OM_LIVE] += 1
    return np.int64(idx)  # type: ignore[return-value]


@njit(cache=True, inline="always")  # type: ignore[misc]
def own_free(canon: U64, cnt: U32, ometa: I64, idx: int | np.int64) -> None:
    canon[idx] = np.uint64(ometa[OM_FREE] + 1)
    cnt[idx] = 0
    ometa[OM_FREE] = idx
    ometa[OM_LIVE] -= 1


@njit(cache=True)  # type: ignore[misc]
def own_rebuild(oidx: U64, canon: U64, cnt: U32, hw: int) -> None:
    oidx[:] = EMPTY64
    for i in range(hw):
        if cnt[i] != 0:
            own_put(oidx, canon, i)


def grown_cap(cap: int, need: int) -> int:
    """Smallest ``cap·1.25^k`` (k ≥ 0) that keeps ``need`` entries under the max load."""
    while need * MAX_LOAD_DEN > cap * MAX_LOAD_NUM:
        cap = cap * GROW_NUM // GROW_DEN + 1
    return cap
