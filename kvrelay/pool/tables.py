"""Plain open-addressing side tables on numpy arrays: ``keys u64[cap]`` → ``vals[cap]``.

They hold what is rare: the optional namespace component per lineage edge (``vals u64``, empty = 0,
since only non-zero components are recorded) and owner refcounts above the in-slot maximum
(``vals u32``, empty = ``EMPTY32``). The bulk of the exact state lives in ``packed`` tables.

Linear probing with backward-shift deletion (no tombstones, so equal-rate puts and deletes never
degrade probes). Slots are addressed with multiply-shift range reduction of a mixed hash, so
capacities need not be powers of two and grow by 1.25×.
Capacity is reserved from Python before each kernel call; kernels never grow tables.
Writes take the control blocks of the checkpoint barrier of ``keys`` and ``vals`` (``kc``, ``vc``:
``pool/cow.py``; 0 when no checkpoint reads the table).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from kvrelay.pool import cow

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]

EMPTY32 = np.uint32(0xFFFFFFFF)
MAX_LOAD_NUM = 17  # max load factor 0.85
MAX_LOAD_DEN = 20
GROW_NUM = 5  # growth factor 1.25
GROW_DEN = 4
MIN_CAP = 16
_NONE = np.uint64(0)  # no checkpoint barrier: a table just allocated


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
    keys: U64,
    vals: npt.NDArray[np.generic],
    empty: np.generic,
    key: np.uint64,
    val: np.generic,
    kc: np.uint64,
    vc: np.uint64,
) -> None:
    """Insert a key known to be absent (caller reserved capacity)."""
    cap = keys.shape[0]
    i = home(key, cap)
    while vals[i] != empty:
        i += 1
        if i == cap:
            i = 0
    cow.touch_item(kc, keys, i)
    cow.touch_item(vc, vals, i)
    keys[i] = key
    vals[i] = val


@njit(cache=True, inline="always")  # type: ignore[misc]
def tab_del(
    keys: U64,
    vals: npt.NDArray[np.generic],
    empty: np.generic,
    i: int,
    kc: np.uint64,
    vc: np.uint64,
) -> None:
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
            cow.touch_item(kc, keys, i)
            cow.touch_item(vc, vals, i)
            keys[i] = keys[j]
            vals[i] = vals[j]
            i = j
    cow.touch_item(vc, vals, i)
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
            tab_put(nkeys, nvals, empty, okeys[i], ovals[i], _NONE, _NONE)


def grown_cap(cap: int, need: int) -> int:
    """Smallest ``cap·1.25^k`` (k ≥ 0) that keeps ``need`` entries under the max load."""
    while need * MAX_LOAD_DEN > cap * MAX_LOAD_NUM:
        cap = cap * GROW_NUM // GROW_DEN + 1
    return cap
