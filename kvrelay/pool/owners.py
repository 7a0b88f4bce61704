"""Owner records: a 4-bit payload per owners-table slot, with an exact side table for big counts.

Payload = ``code | resident << 3``. Codes 0..6 mean refcount 1..7 (counted in the slot itself);
code 7 means the refcount (≥ 8) is in the overflow table, keyed by the owner's slot. Unshared
blocks (count 1) and prefixes shared by a handful of engines never leave the slot; a count is
never saturated or approximated. The overflow table is a linear-probing table (``tables.tab_*``:
u64 slot → u32 count). A store checks, before it changes any count, that the table has room for
one more entry per count it raises; if not, the kernel hands back to Python, which grows it.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from kvrelay._jit import inline
from kvrelay.pool import cow
from kvrelay.pool.packed import TM_CAP, Int, clamp, pay_of, set_pay
from kvrelay.pool.tables import EMPTY32, tab_del, tab_find, tab_put

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]

# pool meta (pm: i64[PM_LEN]), shared with the apply kernel
PM_RESIDENT = 0  # resident owners (= fingerprints in the CKF)
PM_OVERFLOW = 1  # entries in the overflow table
PM_OVF_ROOM = 2  # entries the overflow table takes without a rehash
PM_STOP = 3  # why the apply kernel returned early
PM_LEN = 4
# the overflow table's checkpoint barrier (pc: u64[PC_LEN], ``pool/cow.py``; 0 when not armed)
PC_OVF_KEYS = 0
PC_OVF_COUNTS = 1
PC_LEN = 2

OWNER_PBITS = 4
CODE_MASK = np.uint64(7)
CODE_OVERFLOW = np.uint64(7)
INLINE_MAX = 7  # largest count held in the slot
RES_BIT = np.uint64(8)
_ONE = np.uint64(1)
_NONE = np.uint64(0)  # no checkpoint barrier: a table just allocated


@inline
def owner_count(otm: U64, ow: U64, xk: U64, xv: U32, s: Int) -> Int:
    code = pay_of(otm, ow, s) & CODE_MASK
    if code != CODE_OVERFLOW:
        return np.int64(code) + 1  # type: ignore[no-any-return]
    return np.int64(xv[tab_find(xk, xv, EMPTY32, np.uint64(s))])  # type: ignore[no-any-return]


@inline
def owner_incref(otm: U64, ow: U64, xk: U64, xv: U32, pm: I64, pc: U64, s: Int) -> None:
    """count += 1 (7 → 8 moves the count into the overflow table; capacity reserved)."""
    p = pay_of(otm, ow, s)
    code = p & CODE_MASK
    if code < np.uint64(INLINE_MAX - 1):
        set_pay(otm, ow, s, p + _ONE)
    elif code == np.uint64(INLINE_MAX - 1):
        tab_put(xk, xv, EMPTY32, np.uint64(s), np.uint32(INLINE_MAX + 1), pc[PC_OVF_KEYS],
                pc[PC_OVF_COUNTS])  # fmt: skip
        pm[PM_OVERFLOW] += 1
        set_pay(otm, ow, s, (p & RES_BIT) | CODE_OVERFLOW)
    else:
        t = tab_find(xk, xv, EMPTY32, np.uint64(s))
        cow.touch_item(pc[PC_OVF_COUNTS], xv, t)
        xv[t] += np.uint32(1)


@inline
def owner_decref(otm: U64, ow: U64, xk: U64, xv: U32, pm: I64, pc: U64, s: Int) -> bool:
    """count −= 1; True when the count was 1 (the caller frees the owner, nothing changed)."""
    p = pay_of(otm, ow, s)
    code = p & CODE_MASK
    if code == np.uint64(0):
        return True
    if code != CODE_OVERFLOW:
        set_pay(otm, ow, s, p - _ONE)
        return False
    t = tab_find(xk, xv, EMPTY32, np.uint64(s))
    c = xv[t]
    if c == np.uint32(INLINE_MAX + 1):
        tab_del(xk, xv, EMPTY32, t, pc[PC_OVF_KEYS], pc[PC_OVF_COUNTS])
        pm[PM_OVERFLOW] -= 1
        set_pay(otm, ow, s, (p & RES_BIT) | np.uint64(INLINE_MAX - 1))
    else:
        cow.touch_item(pc[PC_OVF_COUNTS], xv, t)
        xv[t] = c - np.uint32(1)
    return False


@njit(cache=True)  # type: ignore[misc]
def remap_overflow(ok: U64, ov: U32, nk: U64, nv: U32, remap: U32) -> None:
    """Re-key the overflow table after the owners table was rebuilt (slots moved)."""
    for i in range(ok.shape[0]):
        if ov[i] != EMPTY32:
            tab_put(nk, nv, EMPTY32, np.uint64(remap[np.int64(ok[i])]), ov[i], _NONE, _NONE)


@njit(cache=True, _nrt=False)  # type: ignore[misc,call-overload,untyped-decorator]
def check_counts_range(
    otm: U64, ow: U64, xk: U64, xv: U32, edges: U32, q0: Int, q1: Int, acc: I64
) -> bool:
    """Owner tag words ``[q0, q1)`` of :func:`check_counts` (a scrub checks in bounded steps):
    ``acc[0] +=`` resident owners, ``acc[1] +=`` owners whose count is in the overflow table;
    False at the first owner whose refcount is not ``edges[slot]`` or an edge naming a free slot."""
    big = 0
    res = 0
    nw = np.int64(otm[TM_CAP]) >> 3
    for q in range(clamp(q0, 0, nw), clamp(q1, 0, nw)):
        wd = ow[q]
        for i in range(8):
            s = q * 8 + i
            if (wd >> np.uint64(8 * i)) & np.uint64(0x80) == np.uint64(0):
                if edges[s] != np.uint32(0):
                    return False
                continue
            p = pay_of(otm, ow, s)
            code = p & CODE_MASK
            if code == CODE_OVERFLOW:
                t = tab_find(xk, xv, EMPTY32, np.uint64(s))
                if t < 0 or xv[t] <= np.uint32(INLINE_MAX):
                    return False
                c = np.int64(xv[t])
                big += 1
            else:
                c = np.int64(code) + 1
            if np.int64(edges[s]) != c:
                return False
            if p & RES_BIT:
                res += 1
    acc[0] += res
    acc[1] += big
    return True


def check_counts(otm: U64, ow: U64, xk: U64, xv: U32, n_big: int, edges: U32) -> int:
    """Resident owners, or -1 unless every owner's refcount equals ``edges[slot]`` (lineage
    edges naming it), no edge names a free slot, and the overflow table holds exactly the
    ``n_big`` counts of the owners whose code says overflow, each above the in-slot maximum."""
    acc = np.zeros(2, dtype=np.int64)
    if not check_counts_range(otm, ow, xk, xv, edges, 0, int(otm[TM_CAP]) >> 3, acc):
        return -1
    return int(acc[0]) if int(acc[1]) == n_big else -1
