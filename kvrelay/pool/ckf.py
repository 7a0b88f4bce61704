"""Cuckoo filter (CKF) kernels over a flat ``uint64`` bucket table (``docs/contract.md`` §6).

A bucket is one u64 word holding 4 × 16-bit fingerprint slots (slot 0 = low 16 bits, 0 = empty).
Addressing follows §6.3 exactly so that consumers probing with the same seed find our entries.

Every physical write goes through ``_write``, which records the bucket and its ORIGINAL word the
first time it is touched since the last publication (dirty log). Publication then ships only the
buckets whose current word differs from that original (§8.4), so a kick chain that was rolled back
or an insert followed by a remove leaves nothing to publish.

Batch kernels are compiled with ``_nrt=False``: they never allocate, and NRT reference counting
at every inlined helper boundary would otherwise dominate their cost.

The per-filter ``deltas`` table caches ``alt``'s XOR distance for all 65,536 fingerprints
(one XXH3 per fingerprint at construction instead of one per kick).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit, types

from kvrelay._jit import kernel
from kvrelay.hashing.xxh3 import xxh3_64_u16, xxh3_64_u64
from kvrelay.pool import cow

U64 = npt.NDArray[np.uint64]

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SM_C1 = np.uint64(0xBF58476D1CE4E5B9)
_SM_C2 = np.uint64(0x94D049BB133111EB)
_FP_MASK = np.uint64(0xFFFF)
_ONE = np.uint64(1)
_ZERO = np.uint64(0)
MAX_BUCKETS = 1 << 24
DEFAULT_MAX_KICKS = 500
# dirty-log meta (dmeta: i64[DM_LEN]): [0] the entries in the dirty log, then
DM_COW = 1  # the table's checkpoint barrier (``pool/cow.py``): its control block's address, or 0
DM_LEN = 2


def splitmix_next(state: int) -> tuple[int, int]:
    """Pure-Python SplitMix64 step: returns ``(new_state, output)`` (used for the lane seed)."""
    m = 0xFFFF_FFFF_FFFF_FFFF
    s = (state + 0x9E3779B97F4A7C15) & m
    z = s
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return s, z ^ (z >> 31)


def lane_rng_state(seed: int, lane: int = 0) -> int:
    """Initial RNG state of a lane (§6.4): ``next(seed ^ ((lane+1)·GOLDEN))``; producer = lane 0."""
    m = 0xFFFF_FFFF_FFFF_FFFF
    _, out = splitmix_next((seed ^ (((lane + 1) * 0x9E3779B97F4A7C15) & m)) & m)
    return out


def bucket_count_for(expected: int) -> int:
    """§6.2 sizing: ``next_pow2(max(floor((5·expected + 15)/16), 2))``."""
    n = max((5 * expected + 15) // 16, 2)
    return 1 << (n - 1).bit_length()


@njit(cache=True, inline="always")  # type: ignore[misc]
def _sm_next(rng: U64) -> np.uint64:
    s = rng[0] + GOLDEN
    rng[0] = s
    z = s
    z = (z ^ (z >> np.uint64(30))) * _SM_C1
    z = (z ^ (z >> np.uint64(27))) * _SM_C2
    return z ^ (z >> np.uint64(31))  # type: ignore[no-any-return]


@njit(cache=True, inline="always")  # type: ignore[misc]
def probe_one(
    h: np.uint64, seed: np.uint64, mask: np.uint64
) -> tuple[np.uint64, np.uint64, np.uint64]:
    """§6.3 addressing without the delta cache: ``(fingerprint, bucket_a, bucket_b)``."""
    mixed = xxh3_64_u64(h, seed)
    fp = mixed & _FP_MASK
    if fp == _ZERO:
        fp = _ONE
    a = (mixed >> np.uint64(16)) & mask
    d = xxh3_64_u16(fp, seed ^ GOLDEN) & mask
    if d == _ZERO:
        d = _ONE
    return fp, a, a ^ d


# The three signature-typed kernels here are declared (``_jit.kernel``), not eager ``njit(sig)``:
# that compiled them (and, through them, the XXH3 kernels they call) inside ``import
# kvrelay.pool.ckf``, before a first start could hand the hashing step to a worker, and hid those
# XXH3 kernels from ``_jit.missing("hashing")``.
@kernel("pool", types.uint64[::1](types.uint64, types.uint64))  # type: ignore[misc]
def make_deltas(seed: np.uint64, mask: np.uint64) -> U64:
    """``alt`` XOR distance for every fingerprint (index 0 unused)."""
    out = np.empty(65536, dtype=np.uint64)
    s2 = seed ^ GOLDEN
    for fp in range(65536):
        d = xxh3_64_u16(np.uint64(fp), s2) & mask
        if d == _ZERO:
            d = _ONE
        out[fp] = d
    return out


@njit(cache=True, inline="always")  # type: ignore[misc]
def _addr(
    h: np.uint64, seed: np.uint64, mask: np.uint64, deltas: U64
) -> tuple[np.uint64, np.uint64]:
    """``(fingerprint, bucket_a)``; bucket_b is ``a ^ deltas[fp]``."""
    mixed = xxh3_64_u64(h, seed)
    fp = mixed & _FP_MASK
    if fp == _ZERO:
        fp = _ONE
    return fp, (mixed >> np.uint64(16)) & mask


@njit(cache=True, inline="always")  # type: ignore[misc]
def _word_has(w: np.uint64, fp: np.uint64) -> bool:
    for s in range(4):  # noqa: SIM110 (numba: plain loop, no generator)
        if (w >> np.uint64(16 * s)) & _FP_MASK == fp:
            return True
    return False


@njit(cache=True, inline="always")  # type: ignore[misc]
def _first_empty(w: np.uint64) -> int:
    for s in range(4):
        if (w >> np.uint64(16 * s)) & _FP_MASK == _ZERO:
            return s
    return -1


@njit(cache=True, inline="always")  # type: ignore[misc]
def _set_slot(w: np.uint64, s: int | np.int64, fp: np.uint64) -> np.uint64:
    sh = np.uint64(16 * s)
    return (w & ~(_FP_MASK << sh)) | (fp << sh)


@njit(cache=True, inline="always")  # type: ignore[misc]
def _write(
    table: U64,
    b: np.uint64,
    w: np.uint64,
    mark: npt.NDArray[np.uint8],
    dlog_b: npt.NDArray[np.uint32],
    dlog_o: U64,
    dmeta: npt.NDArray[np.int64],
) -> None:
    """Physical write + first-touch dirty record (the only way kernels change the table, but
    for the undo of a kick chain, which rewrites buckets this wrote before: their chunks are
    already captured while a checkpoint reads the table)."""
    if dmeta.shape[0] > DM_COW:
        cow.touch_item(np.uint64(dmeta[DM_COW]), table, b)
    if mark[b] == 0:
        mark[b] = 1
        n = dmeta[0]
        dlog_b[n] = np.uint32(b)
        dlog_o[n] = table[b]
        dmeta[0] = n + 1
    table[b] = w


@njit(cache=True, inline="always")  # type: ignore[misc]
def ckf_insert_fp(
    table: U64,
    fp: np.uint64,
    a: np.uint64,
    deltas: U64,
    max_kicks: int | np.int64,
    rng: U64,
    mark: npt.NDArray[np.uint8],
    dlog_b: npt.NDArray[np.uint32],
    dlog_o: U64,
    dmeta: npt.NDArray[np.int64],
    undo_b: npt.NDArray[np.uint32],
    undo_o: U64,
) -> bool:
    """§6.4 insert. On kick exhaustion every write is undone in reverse order and the dirty log is
    truncated to its length at entry, so the table and log are exactly as before (returns False).
    ``undo_*`` must hold ``max_kicks + 1`` entries."""
    b = a ^ deltas[fp]
    w = table[a]
    s = _first_empty(w)
    if s >= 0:
        _write(table, a, _set_slot(w, s, fp), mark, dlog_b, dlog_o, dmeta)
        return True
    w = table[b]
    s = _first_empty(w)
    if s >= 0:
        _write(table, b, _set_slot(w, s, fp), mark, dlog_b, dlog_o, dmeta)
        return True
    if max_kicks <= 0:
        return False
    log_start = dmeta[0]
    cur = a if (_sm_next(rng) & _ONE) == _ZERO else b
    carried = fp
    nundo = 0
    for _ in range(max_kicks):
        slot = np.int64(_sm_next(rng) & np.uint64(3))
        w = table[cur]
        evicted = (w >> np.uint64(16 * slot)) & _FP_MASK
        undo_b[nundo] = np.uint32(cur)
        undo_o[nundo] = w
        nundo += 1
        _write(table, cur, _set_slot(w, slot, carried), mark, dlog_b, dlog_o, dmeta)
        carried = evicted
        cur = cur ^ deltas[carried]
        w = table[cur]
        s = _first_empty(w)
        if s >= 0:
            _write(table, cur, _set_slot(w, s, carried), mark, dlog_b, dlog_o, dmeta)
            return True
    for i in range(nundo - 1, -1, -1):
        table[np.uint64(undo_b[i])] = undo_o[i]
    for i in range(log_start, dmeta[0]):
        mark[np.uint64(dlog_b[i])] = 0
    dmeta[0] = log_start
    return False


@njit(cache=True, inline="always")  # type: ignore[misc]
def ckf_remove_fp(
    table: U64,
    fp: np.uint64,
    a: np.uint64,
    deltas: U64,
    mark: npt.NDArray[np.uint8],
    dlog_b: npt.NDArray[np.uint32],
    dlog_o: U64,
    dmeta: npt.NDArray[np.int64],
) -> bool:
    """§6.5: clear the first slot equal to ``fp`` in bucket a, then b. False if absent."""
    b = a ^ deltas[fp]
    for bk in (a, b):
        w = table[bk]
        for s in range(4):
            if (w >> np.uint64(16 * s)) & _FP_MASK == fp:
                _write(table, bk, _set_slot(w, s, _ZERO), mark, dlog_b, dlog_o, dmeta)
                return True
    return False


@njit(cache=True, _nrt=False)  # type: ignore[misc,call-overload,untyped-decorator]
def ckf_insert_many(
    table: U64,
    cfg: U64,
    deltas: U64,
    rng: U64,
    hashes: U64,
    mark: npt.NDArray[np.uint8],
    dlog_b: npt.NDArray[np.uint32],
    dlog_o: U64,
    dmeta: npt.NDArray[np.int64],
    undo_b: npt.NDArray[np.uint32],
    undo_o: U64,
    ok: npt.NDArray[np.bool_],
) -> int:
    """Batch insert; ``cfg = [seed, mask, _, _, max_kicks]``. Returns the failure count."""
    seed = cfg[0]
    mask = cfg[1]
    mk = np.int64(cfg[4])
    fails = 0
    for i in range(hashes.shape[0]):
        fp, a = _addr(hashes[i], seed, mask, deltas)
        r = ckf_insert_fp(
            table, fp, a, deltas, mk, rng, mark, dlog_b, dlog_o, dmeta, undo_b, undo_o
        )
        ok[i] = r
        if not r:
            fails += 1
    return fails


@njit(cache=True, _nrt=False)  # type: ignore[misc,call-overload,untyped-decorator]
def ckf_remove_many(
    table: U64,
    cfg: U64,
    deltas: U64,
    hashes: U64,
    mark: npt.NDArray[np.uint8],
    dlog_b: npt.NDArray[np.uint32],
    dlog_o: U64,
    dmeta: npt.NDArray[np.int64],
    ok: npt.NDArray[np.bool_],
) -> int:
    """Batch remove of canonical hashes; returns how many were not found."""
    seed = cfg[0]
    mask = cfg[1]
    missing = 0
    for i in range(hashes.shape[0]):
        fp, a = _addr(hashes[i], seed, mask, deltas)
        r = ckf_remove_fp(table, fp, a, deltas, mark, dlog_b, dlog_o, dmeta)
        ok[i] = r
        if not r:
            missing += 1
    return missing


@kernel(  # type: ignore[misc]
    "pool", types.void(types.uint64[::1], types.uint64, types.uint64[::1], types.boolean[::1]),
    _nrt=False,
)
def contains_into(table: U64, seed: np.uint64, hashes: U64, out: npt.NDArray[np.bool_]) -> None:
    """Membership test for each canonical hash (consumer-side probe; no cached deltas)."""
    mask = np.uint64(table.shape[0] - 1)
    for i in range(hashes.shape[0]):
        fp, a, b = probe_one(hashes[i], seed, mask)
        out[i] = _word_has(table[a], fp) or _word_has(table[b], fp)


@kernel(  # type: ignore[misc]
    "pool",
    types.void(
        types.uint64,
        types.uint64,
        types.uint64[::1],
        types.uint64[::1],
        types.uint64[::1],
        types.uint64[::1],
    ),
)
def probe_into(seed: np.uint64, mask: np.uint64, hashes: U64, fps: U64, bas: U64, bbs: U64) -> None:
    """§6.3 addressing for many hashes (tests, diagnostics)."""
    for i in range(hashes.shape[0]):
        fp, a, b = probe_one(hashes[i], seed, mask)
        fps[i] = fp
        bas[i] = a
        bbs[i] = b


def probe(seed: int, bucket_count: int, hashes: npt.ArrayLike) -> tuple[U64, U64, U64]:
    """Vector form of §6.3: ``(fingerprints, bucket_a, bucket_b)`` as uint64 arrays."""
    h = np.ascontiguousarray(hashes, dtype=np.uint64)
    fps = np.empty_like(h)
    bas = np.empty_like(h)
    bbs = np.empty_like(h)
    probe_into(np.uint64(seed), np.uint64(bucket_count - 1), h, fps, bas, bbs)
    return fps, bas, bbs


def contains(table: U64, seed: int, hashes: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """Plain probe over any CKF table image (producer table, consumer replica, SDK)."""
    h = np.ascontiguousarray(hashes, dtype=np.uint64)
    out = np.zeros(h.shape[0], dtype=np.bool_)
    contains_into(np.ascontiguousarray(table, dtype=np.uint64), np.uint64(seed), h, out)
    return out


@njit(cache=True, _nrt=False)  # type: ignore[misc,call-overload,untyped-decorator]
def take_dirty(
    table: U64,
    mark: npt.NDArray[np.uint8],
    dlog_b: npt.NDArray[np.uint32],
    dlog_o: U64,
    dmeta: npt.NDArray[np.int64],
    out_b: npt.NDArray[np.uint32],
    out_w: U64,
) -> int:
    """Net-changed dirty buckets in first-touch order (absolute words); resets the log."""
    n = 0
    for i in range(dmeta[0]):
        bk = np.uint64(dlog_b[i])
        mark[bk] = 0
        w = table[bk]
        if w != dlog_o[i]:
            out_b[n] = dlog_b[i]
            out_w[n] = w
            n += 1
    dmeta[0] = 0
    return n


class Lane:
    """One CKF lane with its RNG, alt-delta cache and dirty log (the producer side of §6)."""

    def __init__(self, bucket_count: int, seed: int, max_kicks: int = DEFAULT_MAX_KICKS) -> None:
        if bucket_count < 2 or bucket_count > MAX_BUCKETS or bucket_count & (bucket_count - 1):
            raise ValueError("bucket_count must be a power of two in [2, 2^24]")
        if not 0 <= max_kicks <= 4096:
            raise ValueError("max_kicks must be in [0, 4096]")
        self.bucket_count = bucket_count
        self.seed = seed & 0xFFFF_FFFF_FFFF_FFFF
        self.max_kicks = max_kicks
        self.cfg = np.array([self.seed, bucket_count - 1, 0, 0, max_kicks], dtype=np.uint64)
        self.table: U64 = np.zeros(bucket_count, dtype=np.uint64)
        self.deltas = make_deltas(np.uint64(self.seed), np.uint64(bucket_count - 1))
        self.rng = np.array([lane_rng_state(self.seed, 0)], dtype=np.uint64)
        # Dirty log: a bucket is logged at most once (first touch), so capacity = bucket_count.
        self.mark = np.zeros(bucket_count, dtype=np.uint8)
        self.dlog_b = np.zeros(bucket_count, dtype=np.uint32)
        self.dlog_o = np.zeros(bucket_count, dtype=np.uint64)
        self.dmeta = np.zeros(DM_LEN, dtype=np.int64)
        self.undo_b = np.zeros(max_kicks + 1, dtype=np.uint32)
        self.undo_o = np.zeros(max_kicks + 1, dtype=np.uint64)

    def insert(self, hashes: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Insert canonical hashes one by one; False = capacity omission (rolled back)."""
        h = np.ascontiguousarray(hashes, dtype=np.uint64)
        ok = np.zeros(h.shape[0], dtype=np.bool_)
        ckf_insert_many(
            self.table,
            self.cfg,
            self.deltas,
            self.rng,
            h,
            self.mark,
            self.dlog_b,
            self.dlog_o,
            self.dmeta,
            self.undo_b,
            self.undo_o,
            ok,
        )
        return ok

    def remove(self, hashes: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        h = np.ascontiguousarray(hashes, dtype=np.uint64)
        ok = np.zeros(h.shape[0], dtype=np.bool_)
        ckf_remove_many(
            self.table,
            self.cfg,
            self.deltas,
            h,
            self.mark,
            self.dlog_b,
            self.dlog_o,
            self.dmeta,
            ok,
        )
        return ok

    def contains(self, hashes: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        return contains(self.table, self.seed, hashes)

    @property
    def pending_dirty(self) -> int:
        return int(self.dmeta[0])

    def take_publication(self) -> tuple[npt.NDArray[np.uint32], U64] | None:
        """Net-changed buckets since the last take (first-touch order, absolute words), or None."""
        n = int(self.dmeta[0])
        if n == 0:
            return None
        ob = np.empty(n, dtype=np.uint32)
        ow = np.empty(n, dtype=np.uint64)
        k = take_dirty(self.table, self.mark, self.dlog_b, self.dlog_o, self.dmeta, ob, ow)
        if k == 0:
            return None
        if k == n:  # every touched bucket net-changed (the usual case): no copy
            return ob, ow
        return ob[:k].copy(), ow[:k].copy()
