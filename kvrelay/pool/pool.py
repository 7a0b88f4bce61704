"""``Pool``: exact refcounted ownership + one CKF lane + dirty tracking, for one pool generation.

Python here only validates batch shapes, reserves table capacity (kernels never allocate tables),
calls the apply kernel once per batch and maps per-event error codes to typed errors.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvrelay.pool import ckf
from kvrelay.pool.apply import (
    BS_BLK_OFF,
    BS_CLEAR_BLOCKS,
    BS_LENGTHS,
    BS_MM_OFF,
    BS_OK,
    BS_TOK_OFF,
    N_STATS,
    ST_APPLIED,
    ST_CAPACITY,
    ST_INVARIANT,
    ST_REJECTED,
    ST_REMOVED,
    ST_STORED,
    ST_UNKNOWN,
    apply_batch,
    batch_summary,
    clear_member,
    member_edges,
)
from kvrelay.pool.batch import EventBatch
from kvrelay.pool.errors import (
    CODE_MESSAGE,
    CODE_TO_ERROR,
    InvariantViolation,
    MalformedBatch,
    PoolError,
    UnknownMember,
)
from kvrelay.pool.tables import (
    COUNT_MASK,
    EMPTY32,
    EMPTY64,
    GROW_DEN,
    GROW_NUM,
    MIN_CAP,
    OM_FREE,
    OM_HW,
    OM_LIVE,
    OM_RESIDENT,
    RESIDENT,
    grown_cap,
    own_rebuild,
    tab_rehash,
)

U64 = npt.NDArray[np.uint64]

FORMAT_STANDARD = 1
FORMAT_EAGLE = 2


@dataclass(frozen=True, slots=True)
class ApplyResult:
    events_applied: int
    events_rejected: int
    blocks_stored: int
    blocks_removed: int
    unknown_removals: int
    capacity_omissions: int
    errors: tuple[tuple[int, PoolError], ...]


class _Member:
    """One member's lineage table and (lazily grown) namespace side table."""

    __slots__ = ("dp_rank", "lkeys", "lmeta", "lvals", "nkeys", "nmeta", "nvals", "worker_id")

    def __init__(self, worker_id: int, dp_rank: int) -> None:
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.lkeys = np.zeros(MIN_CAP, dtype=np.uint64)
        self.lvals = np.full(MIN_CAP, EMPTY32, dtype=np.uint32)
        self.lmeta = np.zeros(1, dtype=np.int64)
        self.nkeys = np.zeros(2, dtype=np.uint64)  # unused until a namespace is recorded
        self.nvals = np.zeros(2, dtype=np.uint64)
        self.nmeta = np.zeros(1, dtype=np.int64)

    def reserve(self, add: int, ns: bool) -> None:
        need = int(self.lmeta[0]) + add + 1
        cap = grown_cap(self.lkeys.shape[0], need)
        if cap != self.lkeys.shape[0]:
            k = np.zeros(cap, dtype=np.uint64)
            v = np.full(cap, EMPTY32, dtype=np.uint32)
            tab_rehash(self.lkeys, self.lvals, EMPTY32, k, v)
            self.lkeys, self.lvals = k, v
        if ns:
            need = int(self.nmeta[0]) + add + 1
            cap = grown_cap(max(self.nkeys.shape[0], MIN_CAP), need)
            if cap != self.nkeys.shape[0]:
                nk = np.zeros(cap, dtype=np.uint64)
                nv = np.zeros(cap, dtype=np.uint64)
                tab_rehash(self.nkeys, self.nvals, np.uint64(0), nk, nv)
                self.nkeys, self.nvals = nk, nv

    def nbytes(self) -> int:
        return int(self.lkeys.nbytes + self.lvals.nbytes + self.nkeys.nbytes + self.nvals.nbytes)


class Pool:
    """Exact state (lineage per member, shared owners) projected into one CKF lane."""

    def __init__(
        self,
        bucket_count: int,
        seed: int,
        block_size: int,
        hash_format: int,
        max_kicks: int = ckf.DEFAULT_MAX_KICKS,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if hash_format not in (FORMAT_STANDARD, FORMAT_EAGLE):
            raise ValueError("hash_format must be 1 (standard) or 2 (eagle)")
        lane = ckf.Lane(bucket_count, seed, max_kicks)
        self.lane = lane
        self.bucket_count = bucket_count
        self.seed = lane.seed
        self.block_size = block_size
        self.hash_format = hash_format
        self.max_kicks = max_kicks
        self._cfg = np.array(
            [self.seed, bucket_count - 1, block_size, hash_format, max_kicks], dtype=np.uint64
        )
        self.table: U64 = lane.table
        self._deltas = lane.deltas
        self._rng = lane.rng
        self._mark = lane.mark
        self._dlog_b = lane.dlog_b
        self._dlog_o = lane.dlog_o
        self._dmeta = lane.dmeta
        self._undo_b = lane.undo_b
        self._undo_o = lane.undo_o
        # Owners slab + index.
        self._ocanon = np.zeros(MIN_CAP, dtype=np.uint64)
        self._ocnt = np.zeros(MIN_CAP, dtype=np.uint32)
        self._ometa = np.array([0, -1, 0, 0], dtype=np.int64)
        self._oidx = np.full(MIN_CAP, EMPTY64, dtype=np.uint64)
        self._mm_scratch = np.empty(8, dtype=np.uint8)
        # XXH3 long-input scratch (blocks over 240 bytes, e.g. 64-token blocks): the apply kernel
        # runs without numba's runtime and cannot allocate.
        self._hash_sec = np.empty(192, dtype=np.uint8)
        self._hash_acc = np.empty(8, dtype=np.uint64)
        self._members: dict[int, _Member] = {}
        self._ids: dict[tuple[int, int], int] = {}
        self._next_id = 0
        self._stats = np.zeros(N_STATS, dtype=np.int64)
        self._summary = np.zeros(3, dtype=np.int64)
        self._canon_buf = np.empty(0, dtype=np.uint64)
        self._slot_buf = np.empty(0, dtype=np.int64)
        self.errors_by_kind: Counter[str] = Counter()
        self.first_error: tuple[int, PoolError] | None = None
        self.last_error: tuple[int, PoolError] | None = None
        self.invariant_violations = 0

    # ---- membership -----------------------------------------------------------------------------

    def add_member(self, worker_id: int, dp_rank: int) -> int:
        key = (worker_id, dp_rank)
        mid = self._ids.get(key)
        if mid is None:
            mid = self._next_id
            self._next_id += 1
            self._ids[key] = mid
            self._members[mid] = _Member(worker_id, dp_rank)
        return mid

    def members(self) -> dict[int, tuple[int, int]]:
        return {mid: (m.worker_id, m.dp_rank) for mid, m in self._members.items()}

    def _member(self, member: int) -> _Member:
        m = self._members.get(member)
        if m is None:
            raise UnknownMember(f"unknown member id {member}")
        return m

    def _clear(self, m: _Member, stats: npt.NDArray[np.int64]) -> None:
        clear_member(
            self._cfg,
            self.table,
            self._deltas,
            self._mark,
            self._dlog_b,
            self._dlog_o,
            self._dmeta,
            m.lkeys,
            m.lvals,
            m.lmeta,
            m.nkeys,
            m.nvals,
            m.nmeta,
            self._ocanon,
            self._ocnt,
            self._ometa,
            self._oidx,
            stats,
        )

    def reset_member(self, member: int) -> None:
        """Drop every edge of the member (same as an AllBlocksCleared event)."""
        m = self._member(member)
        stats = np.zeros(N_STATS, dtype=np.int64)
        self._clear(m, stats)
        self._stats += stats
        self._note_invariant(int(stats[ST_INVARIANT]))

    def remove_member(self, member: int) -> None:
        """Reset then forget the member (its id is not reused)."""
        self.reset_member(member)
        m = self._members.pop(member)
        del self._ids[(m.worker_id, m.dp_rank)]

    # ---- apply ----------------------------------------------------------------------------------

    def _reserve_owners(self, add: int) -> None:
        live = int(self._ometa[OM_LIVE])
        cap = self._ocanon.shape[0]
        if live + add > cap:
            new = cap
            while live + add > new:
                new = new * GROW_NUM // GROW_DEN + 1
            c = np.zeros(new, dtype=np.uint64)
            n = np.zeros(new, dtype=np.uint32)
            c[:cap] = self._ocanon
            n[:cap] = self._ocnt
            self._ocanon, self._ocnt = c, n
        icap = grown_cap(self._oidx.shape[0], live + add + 1)
        if icap != self._oidx.shape[0]:
            self._oidx = np.full(icap, EMPTY64, dtype=np.uint64)
            own_rebuild(self._oidx, self._ocanon, self._ocnt, int(self._ometa[OM_HW]))

    def _mm_scratch_for(self, b: EventBatch) -> npt.NDArray[np.uint8]:
        """Bytes for one multimodal block (window tokens + its mm values); the kernel does not
        allocate. Grows on demand and is reused across batches."""
        if b.mm_off.shape[0] < 2:
            return self._mm_scratch
        most_mm = int(np.max(np.diff(b.mm_off)))
        need = 4 * (self.block_size + 1) + 8 * most_mm
        if self._mm_scratch.shape[0] < need:
            self._mm_scratch = np.empty(need, dtype=np.uint8)
        return self._mm_scratch

    def apply(self, member: int, batch: EventBatch) -> ApplyResult:
        """Apply one engine batch for one member (one kernel call)."""
        m = self._member(member)
        try:
            b = _normalized(batch)
            code = batch_summary(
                b.ops, b.parent, b.has_parent, b.salt, b.ns_part, b.ns_inherit, b.blk_off,
                b.ext_hashes, b.tok_off, b.tokens, b.mm_off, b.mm, self._summary,
            )  # fmt: skip
            if code != BS_OK:
                raise MalformedBatch(_SUMMARY_MESSAGES[code])
        except MalformedBatch as bad:
            self._record_error(-1, bad)
            raise
        n = b.ops.shape[0]
        store_blocks = int(self._summary[0])
        max_k = int(self._summary[1])
        m.reserve(store_blocks, bool(self._summary[2]))
        self._reserve_owners(store_blocks)
        err = np.zeros(n, dtype=np.uint8)
        stats = np.zeros(N_STATS, dtype=np.int64)
        nb = b.ext_hashes.shape[0]
        if self._canon_buf.shape[0] < nb:
            self._canon_buf = np.empty(nb, dtype=np.uint64)
            self._slot_buf = np.empty(nb, dtype=np.int64)
        canon_buf = self._canon_buf
        slot_buf = self._slot_buf
        set_cap = 1 << max(4, (2 * max_k).bit_length()) if max_k > 16 else 1
        set_keys = np.zeros(set_cap, dtype=np.uint64)
        set_stamp = np.zeros(set_cap, dtype=np.int64)
        mm_scratch = self._mm_scratch_for(b)
        start = 0
        while start < n:
            stop = apply_batch(
                b.ops, b.parent, b.has_parent, b.salt, b.ns_part, b.ns_inherit, b.blk_off,
                b.ext_hashes, b.tok_off, b.tokens, b.mm_off, b.mm, self._cfg, self.table,
                self._deltas, self._rng, self._mark, self._dlog_b, self._dlog_o, self._dmeta,
                self._undo_b, self._undo_o, m.lkeys, m.lvals, m.lmeta, m.nkeys, m.nvals, m.nmeta,
                self._ocanon, self._ocnt, self._ometa, self._oidx, canon_buf, slot_buf, set_keys,
                set_stamp, mm_scratch, self._hash_sec, self._hash_acc, start, err, stats,
            )  # fmt: skip
            if stop >= n:
                break
            self._clear(m, stats)  # the kernel stopped at a CLEAR event
            stats[ST_APPLIED] += 1
            start = stop + 1
        self._stats += stats
        self._note_invariant(int(stats[ST_INVARIANT]))
        errors: list[tuple[int, PoolError]] = []
        if stats[ST_REJECTED]:
            for i in np.flatnonzero(err).tolist():
                code = int(err[i])
                exc = CODE_TO_ERROR[code](f"event {i}: {CODE_MESSAGE[code]}")
                errors.append((i, exc))
                self._record_error(i, exc)
        return ApplyResult(
            events_applied=int(stats[ST_APPLIED]),
            events_rejected=int(stats[ST_REJECTED]),
            blocks_stored=int(stats[ST_STORED]),
            blocks_removed=int(stats[ST_REMOVED]),
            unknown_removals=int(stats[ST_UNKNOWN]),
            capacity_omissions=int(stats[ST_CAPACITY]),
            errors=tuple(errors),
        )

    def _record_error(self, index: int, exc: PoolError) -> None:
        self.errors_by_kind[exc.kind] += 1
        if self.first_error is None:
            self.first_error = (index, exc)
        self.last_error = (index, exc)

    def record_error(self, exc: PoolError) -> None:
        """Count an error detected outside the kernel (e.g. ingest's BlockSizeMismatch)."""
        self._record_error(-1, exc)

    def _note_invariant(self, n: int) -> None:
        if n:
            self.invariant_violations += n
            for _ in range(n):
                self._record_error(-1, InvariantViolation("resident fingerprint missing"))

    # ---- publication ----------------------------------------------------------------------------

    def take_publication(self) -> tuple[npt.NDArray[np.uint32], U64] | None:
        """Net-changed buckets since the last take (first-touch order, absolute words), or None
        when nothing net-changed (never an empty batch)."""
        return self.lane.take_publication()

    @property
    def pending_dirty(self) -> int:
        return int(self._dmeta[0])

    # ---- queries / counters ---------------------------------------------------------------------

    def contains(self, hashes: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        return ckf.contains(self.table, self.seed, hashes)

    def _edges(self, member: int) -> tuple[U64, npt.NDArray[np.bool_]]:
        m = self._member(member)
        n = int(m.lmeta[0])
        c = np.empty(n, dtype=np.uint64)
        r = np.empty(n, dtype=np.bool_)
        member_edges(m.lkeys, m.lvals, self._ocanon, self._ocnt, c, r)
        return c, r

    def owned_canonical(self, member: int) -> U64:
        """Distinct canonical hashes the member owns (sorted)."""
        c, _ = self._edges(member)
        return np.unique(c)

    def resident_canonical(self, member: int) -> U64:
        c, r = self._edges(member)
        return np.unique(c[r])

    def lineage(self, member: int) -> dict[int, int]:
        """External hash → canonical hash for one member (tests/diagnostics; builds a dict)."""
        m = self._member(member)
        occ = m.lvals != EMPTY32
        return dict(zip(m.lkeys[occ].tolist(), self._ocanon[m.lvals[occ]].tolist(), strict=True))

    def owners(self) -> dict[int, tuple[int, bool]]:
        """Canonical → (refcount, resident) (tests/diagnostics; builds a dict)."""
        hw = int(self._ometa[OM_HW])
        cnt = self._ocnt[:hw]
        live = cnt != 0
        return {
            int(c): (int(v & 0x7FFFFFFF), bool(v & 0x80000000))
            for c, v in zip(self._ocanon[:hw][live].tolist(), cnt[live].tolist(), strict=True)
        }

    @property
    def occupancy(self) -> int:
        """Fingerprints in the table (= resident canonical hashes)."""
        return int(self._ometa[OM_RESIDENT])

    @property
    def memberships(self) -> int:
        return sum(int(m.lmeta[0]) for m in self._members.values())

    @property
    def distinct_canonical(self) -> int:
        return int(self._ometa[OM_LIVE])

    @property
    def capacity_omissions(self) -> int:
        return int(self._stats[ST_CAPACITY])

    @property
    def unknown_removals(self) -> int:
        return int(self._stats[ST_UNKNOWN])

    @property
    def events_rejected(self) -> int:
        return int(self._stats[ST_REJECTED])

    def memory_breakdown(self) -> dict[str, int]:
        """Allocated bytes per structure (capacity, not just the used part)."""
        return {
            "lineage": sum(int(m.lkeys.nbytes + m.lvals.nbytes) for m in self._members.values()),
            "namespace": sum(int(m.nkeys.nbytes + m.nvals.nbytes) for m in self._members.values()),
            "owners_slab": int(self._ocanon.nbytes + self._ocnt.nbytes),
            "owners_index": int(self._oidx.nbytes),
        }

    def memory_bytes(self) -> int:
        """Allocated bytes of the exact state (lineage + namespace + owners), not the CKF."""
        return sum(self.memory_breakdown().values())

    def snapshot_state(
        self,
    ) -> tuple[bytes, dict[int, dict[int, int]], dict[int, tuple[int, bool]]]:
        """Table bytes + exact state as plain data (tests compare before/after a rejection)."""
        return (
            self.table.tobytes(),
            {mid: self.lineage(mid) for mid in self._members},
            self.owners(),
        )

    @property
    def free_owner_head(self) -> int:
        return int(self._ometa[OM_FREE])

    # ---- state handover -------------------------------------------------------------------------

    #: Bumped whenever the exported arrays change meaning; a file of another version is refused.
    STATE_VERSION = 1

    def export_state(self) -> tuple[dict[str, Any], dict[str, npt.NDArray[Any]]]:
        """The exact state as plain metadata + named arrays (views, not copies: the caller writes
        them out before the pool changes). The kick RNG goes with it, so a restored pool places
        fingerprints exactly as the saved one would have. The dirty log and counters do not: a
        restored pool starts with nothing pending, as a fresh generation does."""
        arrays: dict[str, npt.NDArray[Any]] = {
            "table": self.table, "ocanon": self._ocanon, "ocnt": self._ocnt,
            "ometa": self._ometa, "oidx": self._oidx, "rng": self._rng,
        }  # fmt: skip
        members = []
        for mid, m in self._members.items():
            members.append([mid, m.worker_id, m.dp_rank])
            for name in _MEMBER_ARRAYS:
                arrays[f"m{mid}.{name}"] = getattr(m, name)
        return {"next_id": self._next_id, "members": members}, arrays

    @classmethod
    def from_state(
        cls,
        meta: dict[str, Any],
        arrays: dict[str, npt.NDArray[Any]],
        *,
        bucket_count: int,
        seed: int,
        block_size: int,
        hash_format: int,
        max_kicks: int = ckf.DEFAULT_MAX_KICKS,
    ) -> Pool:
        """A pool holding exported state, after checks that it is one consistent state (ValueError
        otherwise): every array of the right type and shape, every lineage slot naming a live
        owner, refcounts equal to the lineage edges, and the table holding exactly the resident
        owners' fingerprints."""
        pool = cls(bucket_count, seed, block_size, hash_format, max_kicks)
        table = _state_array(arrays, "table", np.uint64)
        rng = _state_array(arrays, "rng", np.uint64, 1)
        if table.shape != pool.table.shape:
            raise ValueError(f"table has {table.shape[0]} buckets, the pool {bucket_count}")
        ocanon = _state_array(arrays, "ocanon", np.uint64)
        ocnt = _state_array(arrays, "ocnt", np.uint32, ocanon.shape[0])
        ometa = _state_array(arrays, "ometa", np.int64, 4)
        oidx = _state_array(arrays, "oidx", np.uint64)
        hw = int(ometa[OM_HW])
        if not 0 <= hw <= ocanon.shape[0] or oidx.shape[0] < MIN_CAP:
            raise ValueError("owners table bounds out of range")
        counts = ocnt[:hw] & COUNT_MASK
        live = ocnt[:hw] != 0
        if int(np.count_nonzero(live)) != int(ometa[OM_LIVE]):
            raise ValueError("owners live count disagrees with the slab")
        resident = int(np.count_nonzero(ocnt[:hw] & RESIDENT))
        in_table = int(np.count_nonzero(table.view(np.uint16)))
        if resident != int(ometa[OM_RESIDENT]) or resident != in_table:
            raise ValueError("the table does not hold exactly the resident owners")
        edges = np.zeros(hw, dtype=np.int64)
        next_id = int(meta["next_id"])
        for mid_, wid_, rank_ in meta["members"]:
            mid, wid, rank = int(mid_), int(wid_), int(rank_)
            if not 0 <= mid < next_id or mid in pool._members or (wid, rank) in pool._ids:
                raise ValueError(f"member {mid} ({wid}, {rank}) repeated or out of range")
            m = _Member(wid, rank)
            m.lkeys = _state_array(arrays, f"m{mid}.lkeys", np.uint64)
            m.lvals = _state_array(arrays, f"m{mid}.lvals", np.uint32, m.lkeys.shape[0])
            m.lmeta = _state_array(arrays, f"m{mid}.lmeta", np.int64, 1)
            m.nkeys = _state_array(arrays, f"m{mid}.nkeys", np.uint64)
            m.nvals = _state_array(arrays, f"m{mid}.nvals", np.uint64, m.nkeys.shape[0])
            m.nmeta = _state_array(arrays, f"m{mid}.nmeta", np.int64, 1)
            used = m.lvals[m.lvals != EMPTY32]
            if used.shape[0] != int(m.lmeta[0]) or (used.shape[0] and int(used.max()) >= hw):
                raise ValueError(f"member {mid}: lineage does not match its owners")
            np.add.at(edges, used.astype(np.int64), 1)
            pool._members[mid] = m
            pool._ids[(wid, rank)] = mid
        if not np.array_equal(edges[live], counts[live].astype(np.int64)):
            raise ValueError("owner refcounts differ from the members' lineage")
        pool._next_id = next_id
        pool.table[:] = table
        pool._rng[:] = rng
        pool._ocanon, pool._ocnt, pool._ometa, pool._oidx = ocanon, ocnt, ometa, oidx
        return pool


_MEMBER_ARRAYS = ("lkeys", "lvals", "lmeta", "nkeys", "nvals", "nmeta")


def _state_array(
    arrays: dict[str, npt.NDArray[Any]], name: str, dtype: type, length: int | None = None
) -> npt.NDArray[Any]:
    a = arrays.get(name)
    bad_length = a is not None and length is not None and a.shape[0] != length
    if a is None or a.dtype != dtype or a.ndim != 1 or bad_length:
        raise ValueError(f"state array {name!r} missing or of the wrong type or shape")
    return np.array(a, copy=True)  # owned and writable: files may be read into shared buffers


_SPEC: tuple[tuple[str, type], ...] = (
    ("ops", np.uint8),
    ("parent", np.uint64),
    ("has_parent", np.bool_),
    ("salt", np.uint64),
    ("ns_part", np.uint64),
    ("ns_inherit", np.bool_),
    ("blk_off", np.int64),
    ("ext_hashes", np.uint64),
    ("tok_off", np.int64),
    ("tokens", np.uint32),
    ("mm_off", np.int64),
    ("mm", np.uint64),
)

_SUMMARY_MESSAGES = {
    BS_LENGTHS: "per-event arrays do not all have one entry per event",
    BS_BLK_OFF: "blk_off is not a valid offset array over ext_hashes",
    BS_TOK_OFF: "tok_off is not a valid offset array over tokens",
    BS_MM_OFF: "mm_off is not a valid offset array over mm",
    BS_CLEAR_BLOCKS: "a clear event carries block hashes",
}


def _arr(x: object, dtype: type, name: str) -> npt.NDArray[np.generic]:
    a = np.asarray(x)
    if a.ndim != 1:
        raise MalformedBatch(f"{name} must be one-dimensional")
    if a.dtype != dtype and a.size:
        want = np.dtype(dtype)
        ok = a.dtype.kind in "iub"
        if ok and want.kind in "iu":
            info = np.iinfo(want)  # type: ignore[type-var]
            ok = int(a.min()) >= info.min and int(a.max()) <= info.max
        elif ok and want.kind == "b":
            ok = bool(np.all((a == 0) | (a == 1)))
        if not ok:
            raise MalformedBatch(f"{name}: dtype {a.dtype} or values not convertible to {want}")
    return np.ascontiguousarray(a, dtype=dtype)


def _normalized(b: EventBatch) -> EventBatch:
    """The batch itself when every array already has the right dtype/layout (the normal case),
    else a converted copy. Raises MalformedBatch for arrays that cannot be converted."""
    for name, dtype in _SPEC:
        a = getattr(b, name)
        if not (
            isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == 1 and a.flags.c_contiguous
        ):
            break
    else:
        return b
    return EventBatch(**{name: _arr(getattr(b, name), dtype, name) for name, dtype in _SPEC})  # type: ignore[arg-type]
