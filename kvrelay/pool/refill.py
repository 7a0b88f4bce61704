"""A pool's cuckoo filter rebuilt from its exact state, under other filter settings.

The exact state (lineage, owners, refcounts) does not depend on the filter's bucket count or
seed; only the filter does. So a reload (or restart) that changes ``expected_blocks`` or
``ckf_seed`` keeps the exact state and inserts every owner's fingerprint into an empty filter
of the new shape, in owner-slot order, through the same insert as the apply kernel (§6.4 kicks
and rollback): nothing is rebuilt from replay. An owner that finds no room stays out of the
filter (not resident, a capacity omission), as it would have under the apply kernel.

The test oracle is the reference model's filter (``tests/support/pool_model.RefCKF``) fed the
same owners in the same order.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from kvrelay.pool.bitops import ctz
from kvrelay.pool.ckf import _addr, ckf_insert_fp
from kvrelay.pool.owners import RES_BIT
from kvrelay.pool.packed import _H8, TM_CAP, key_of, pay_of, set_pay

U64 = npt.NDArray[np.uint64]
_ZERO = np.uint64(0)
_ONE = np.uint64(1)


@njit(cache=True, _nrt=False)  # type: ignore[misc,call-overload,untyped-decorator]
def refill(
    otm: U64,
    ow: U64,
    table: U64,
    cfg: U64,
    deltas: U64,
    rng: U64,
    mark: npt.NDArray[np.uint8],
    dlog_b: npt.NDArray[np.uint32],
    dlog_o: U64,
    dmeta: npt.NDArray[np.int64],
    undo_b: npt.NDArray[np.uint32],
    undo_o: U64,
) -> int:
    """Insert every owner into the empty ``table`` (``cfg = [seed, mask, _, _, max_kicks]``) and
    set each owner's resident bit to whether it found room; returns the resident count."""
    seed = cfg[0]
    mask = cfg[1]
    mk = np.int64(cfg[4])
    res = 0
    for q in range(np.int64(otm[TM_CAP]) >> 3):
        v = ow[q] & _H8
        while v != _ZERO:
            s = q * 8 + (ctz(v) >> 3)
            v &= v - _ONE
            fp, a = _addr(key_of(otm, ow, s), seed, mask, deltas)
            ok = ckf_insert_fp(
                table, fp, a, deltas, mk, rng, mark, dlog_b, dlog_o, dmeta, undo_b, undo_o
            )
            p = pay_of(otm, ow, s)
            if ok:
                set_pay(otm, ow, s, p | RES_BIT)
                res += 1
            else:
                set_pay(otm, ow, s, p & ~RES_BIT)
    return res
