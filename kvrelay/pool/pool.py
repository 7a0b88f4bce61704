"""``Pool``: exact refcounted ownership + one CKF lane + dirty tracking, for one pool generation.

Python here only validates batch shapes, reserves table capacity (kernels never allocate tables),
calls the apply kernel once per batch (again after a CLEAR event or a table that ran out of room,
resuming where it stopped) and maps per-event error codes to typed errors.
"""

from __future__ import annotations

import secrets
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
    BS_ORIGIN,
    BS_TOK_OFF,
    CM_LIVE,
    CM_ROOM,
    IO_LEN,
    MAX_COPIES,
    MC_CP_KEYS,
    MC_CP_VALS,
    MC_LEN,
    MC_NS_KEYS,
    MC_NS_VALS,
    N_STATS,
    NS_INHERIT,
    NS_OWN,
    PACKED_APPLIED,
    PACKED_STOPPED,
    ST_AMBIGUOUS,
    ST_APPLIED,
    ST_CAPACITY,
    ST_COPY_REMOVED,
    ST_DUP,
    ST_INVARIANT,
    ST_REJECTED,
    ST_REMOVED,
    ST_REPORT,
    ST_STORED,
    ST_UNKNOWN,
    STOP_CLEAR,
    STOP_COPIES_FULL,
    STOP_COUNTS_FULL,
    STOP_LINEAGE_FULL,
    apply_batch,
    apply_packed,
    batch_summary,
    clear_member,
    counts_oversized,
    member_edges,
    room,
    set_capacity,
)
from kvrelay.pool.batch import AnyBatch, EventBatch, PackedBatch
from kvrelay.pool.errors import (
    CODE_MESSAGE,
    CODE_TO_ERROR,
    InvariantViolation,
    MalformedBatch,
    PoolError,
    UnknownMember,
)
from kvrelay.pool.image import EAGER_BYTES, Arming, PoolImage
from kvrelay.pool.owners import (
    CODE_MASK,
    CODE_OVERFLOW,
    OWNER_PBITS,
    PC_LEN,
    PC_OVF_COUNTS,
    PC_OVF_KEYS,
    PM_LEN,
    PM_OVERFLOW,
    PM_OVF_ROOM,
    PM_RESIDENT,
    PM_STOP,
    RES_BIT,
    check_counts,
    remap_overflow,
)
from kvrelay.pool.packed import (
    TM_CAP,
    TM_COW,
    TM_LIVE,
    PackedTable,
    Scratch,
    check_entries,
    count_payloads,
)
from kvrelay.pool.refill import refill
from kvrelay.pool.sizing import LINEAGE, OWNERS, Policy
from kvrelay.pool.tables import (
    EMPTY32,
    MAX_LOAD_DEN,
    MAX_LOAD_NUM,
    MIN_CAP,
    grown_cap,
    tab_rehash,
)
from kvrelay.pool.verify import (
    ACC_COUNT,
    ACC_MISSING,
    ACC_SUM,
    filter_digest,
    new_acc,
    owners_digest,
)

U64 = npt.NDArray[np.uint64]

FORMAT_STANDARD = 1
FORMAT_EAGLE = 2

# Layout of the exact state (see docs/architecture.md, "Exact state"): lineage tables are cuckoo
# tables of 2 subtables × nb buckets × 8 slots, the owners table is stable ("d-left") with
# 3 × nb × 16; ``sizing`` says when they grow and shrink.
LIN_KICKS = 256
# Placement failures despite the reservation (all candidate buckets full) force a growth; this
# many in one batch means something is wrong: the pool reports an invariant violation instead.
MAX_FORCED_GROWTHS = 8
#: A PackedBatch of at most this many events, with stores of up to 2,047 blocks (the duplicate
#: check's set), is applied in one call; larger ones take the general path.
_PACKED_EVENTS = 4096
_PACKED_SET = 4096
_M64 = 0xFFFF_FFFF_FFFF_FFFF


def _resize_for(t: PackedTable, policy: Policy, add: int) -> int | None:
    """The bucket count ``policy`` sizes ``t`` to for ``add`` more entries (fewer, below 0) when
    that is outside ``t``'s room (``room`` of its bounds) and changes its size, else None."""
    live = int(t.tm[TM_LIVE])
    lo, hi = room(live, *t.bounds)
    if lo <= add <= hi:
        return None
    want = policy.sized(t.nb0, live + add)
    return None if want == t.nb0 else want


def _ref_bits(owner_cap: int) -> int:
    return max(1, (owner_cap - 1).bit_length())


_warmed = False


def _warm_layout_kernels() -> None:
    """Compile (or load from numba's cache) the table-maintenance kernels once per process, on
    empty tables: they otherwise first run at a pool's first growth (or restore), and a fresh
    compile takes seconds inside whatever batch triggered it."""
    global _warmed
    if _warmed:
        return
    sc = Scratch(LIN_KICKS)
    lin = PackedTable(LINEAGE.d, LINEAGE.b, 1, [1] * LINEAGE.d, 1, LIN_KICKS)
    own = PackedTable(OWNERS.d, OWNERS.b, OWNER_PBITS, [1] * OWNERS.d, 2)
    remap = np.zeros(own.cap, dtype=np.uint32)
    own.rebuilt([2] * OWNERS.d, sc, remap)
    lin.rebuilt([2] * LINEAGE.d, sc)
    lin.repacked(2, remap)
    lin.repacked(1, remap)
    lin.entries()
    check_entries(lin.tm, lin.w)  # a restart's restore (from_state) checks every table
    count_payloads(lin.tm, lin.w, np.zeros(2, dtype=np.uint32))
    xk = np.zeros(MIN_CAP, dtype=np.uint64)
    xv = np.full(MIN_CAP, EMPTY32, dtype=np.uint32)
    remap_overflow(xk, xv, xk.copy(), xv.copy(), remap)
    check_counts(own.tm, own.w, xk, xv, 0, np.zeros(own.cap, dtype=np.uint32))
    tab_rehash(xk, xv, EMPTY32, xk.copy(), xv.copy())
    # restores and scrubs compare the filter with the owners; reloads refill a filter
    filter_divergence(own.tm, own.w, np.zeros(2, dtype=np.uint64), np.uint64(0),
                      np.ones(65536, dtype=np.uint64))  # fmt: skip
    lane = ckf.Lane(2, 0, 0)
    refill(own.tm, own.w, lane.table, lane.cfg, lane.deltas, lane.rng, lane.mark, lane.dlog_b,
           lane.dlog_o, lane.dmeta, lane.undo_b, lane.undo_o)  # fmt: skip
    _warmed = True


# Not frozen: built for every engine message, and a frozen dataclass sets each of its fields
# through ``object.__setattr__``, about three times the cost of a plain one on cold caches.
@dataclass(slots=True)
class ApplyResult:
    events_applied: int
    events_rejected: int
    blocks_stored: int
    blocks_removed: int
    unknown_removals: int
    capacity_omissions: int
    errors: tuple[tuple[int, PoolError], ...]
    #: stored blocks the member already held, counted as one more physical copy each
    duplicate_stores: int = 0
    #: stored blocks the member already held, taken as reports (no new copy)
    report_stores: int = 0
    #: store events that could have been either (taken as reports; see docs/contract.md)
    ambiguous_stores: int = 0
    #: removes that dropped one extra physical copy (the block stays held)
    copy_removals: int = 0


def _copy_room(cap: int) -> int:
    return max(0, cap * MAX_LOAD_NUM // MAX_LOAD_DEN - 1)


class _Member:
    """One member's lineage table (external hash → owner slot), namespace side table, and
    copy-count side table: external hash → extra physical copies (≥ 1) for the hashes the rank
    holds more than once. A hash held once has no entry, so the table is empty (2 slots) for
    most members and bounded by the lineage (one entry per edge at most)."""

    __slots__ = (
        "ckeys", "cmeta", "cow", "cvals", "dp_rank", "lin", "nkeys", "nmeta", "nvals", "worker_id",
    )  # fmt: skip

    def __init__(self, worker_id: int, dp_rank: int, salt: int, ref_bits: int) -> None:
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.lin = PackedTable(LINEAGE.d, LINEAGE.b, ref_bits, [1, 1], salt, LIN_KICKS)
        self.lin.bounds = LINEAGE.bounds(1)
        self.nkeys = np.zeros(2, dtype=np.uint64)  # unused until a namespace is recorded
        self.nvals = np.zeros(2, dtype=np.uint64)
        self.nmeta = np.zeros(1, dtype=np.int64)
        self.ckeys = np.zeros(2, dtype=np.uint64)
        self.cvals = np.full(2, EMPTY32, dtype=np.uint32)
        self.cmeta = np.zeros(2, dtype=np.int64)
        #: the side tables' checkpoint barrier while an image is read (``pool/cow.py``)
        self.cow = np.zeros(MC_LEN, dtype=np.uint64)

    def fit_copies(self, add: int) -> None:
        """Size the copy-count table for its entries plus ``add`` (back to 2 slots when empty)."""
        live = int(self.cmeta[CM_LIVE])
        cur = self.ckeys.shape[0]
        if live == 0 and add == 0:
            cap = 2
        else:
            cap = grown_cap(max(cur, MIN_CAP), live + add + 1)
            if cur > MIN_CAP and (live + add + 1) * 8 < cur:
                cap = grown_cap(MIN_CAP, (live + add + 1) * 2)
        if cap != cur:
            dk = np.zeros(cap, dtype=np.uint64)
            dv = np.full(cap, EMPTY32, dtype=np.uint32)
            tab_rehash(self.ckeys, self.cvals, EMPTY32, dk, dv)
            self.ckeys, self.cvals = dk, dv
        self.cmeta[CM_ROOM] = _copy_room(cap) if cap > 2 else 0

    def resize(self, nb: int, sc: Scratch) -> None:
        """Rebuild the lineage with ``nb`` buckets per subtable (more if the rebuild's cuckoo
        walks fail, which needs very bad luck below the max load)."""
        while (new := self.lin.rebuilt([nb] * LINEAGE.d, sc)) is None:
            nb = LINEAGE.grown(nb)
        new.bounds = LINEAGE.bounds(nb)
        self.lin = new

    def reserve(self, add: int, ns: bool, sc: Scratch) -> None:
        want = _resize_for(self.lin, LINEAGE, add)
        if want is not None:
            self.resize(want, sc)
        if ns:
            need = int(self.nmeta[0]) + add + 1
            cap = grown_cap(max(self.nkeys.shape[0], MIN_CAP), need)
            if cap != self.nkeys.shape[0]:
                nk = np.zeros(cap, dtype=np.uint64)
                nv = np.zeros(cap, dtype=np.uint64)
                tab_rehash(self.nkeys, self.nvals, np.uint64(0), nk, nv)
                self.nkeys, self.nvals = nk, nv

    def drop_namespace(self) -> None:
        if self.nkeys.shape[0] > 2 and int(self.nmeta[0]) == 0:
            self.nkeys = np.zeros(2, dtype=np.uint64)
            self.nvals = np.zeros(2, dtype=np.uint64)

    def nbytes(self) -> int:
        return int(
            self.lin.nbytes
            + self.nkeys.nbytes
            + self.nvals.nbytes
            + self.ckeys.nbytes
            + self.cvals.nbytes
        )


class Pool:
    """Exact state (lineage per member, shared owners) projected into one CKF lane.

    ``layout_seed`` salts the tables' hashing (random when None); it never changes results, only
    where entries sit."""

    def __init__(
        self,
        bucket_count: int,
        seed: int,
        block_size: int,
        hash_format: int,
        max_kicks: int = ckf.DEFAULT_MAX_KICKS,
        *,
        layout_seed: int | None = None,
        reports: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if hash_format not in (FORMAT_STANDARD, FORMAT_EAGLE):
            raise ValueError("hash_format must be 1 (standard) or 2 (eagle)")
        _warm_layout_kernels()
        lane = ckf.Lane(bucket_count, seed, max_kicks)
        self.lane = lane
        self.bucket_count = bucket_count
        self.seed = lane.seed
        self.block_size = block_size
        self.hash_format = hash_format
        self.max_kicks = max_kicks
        #: whether the engines may send reports (a store of held blocks that adds no copy)
        self.reports = reports
        self._cfg = np.array(
            [self.seed, bucket_count - 1, block_size, hash_format, max_kicks, int(reports)],
            dtype=np.uint64,
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
        self._salt_state = secrets.randbits(64) if layout_seed is None else layout_seed & _M64
        self._own = PackedTable(OWNERS.d, OWNERS.b, OWNER_PBITS, [1] * OWNERS.d, self._next_salt())
        self._own.bounds = OWNERS.bounds(1)
        self._ref_bits = _ref_bits(self._own.cap)
        self._pm = np.zeros(PM_LEN, dtype=np.int64)
        # refcounts above the in-slot maximum: owner slot → count
        self._xk = np.zeros(MIN_CAP, dtype=np.uint64)
        self._xv = np.full(MIN_CAP, EMPTY32, dtype=np.uint32)
        self._pm[PM_OVF_ROOM] = MIN_CAP * MAX_LOAD_NUM // MAX_LOAD_DEN - 1
        #: the overflow table's checkpoint barrier while an image is read (``pool/cow.py``)
        self._pcow = np.zeros(PC_LEN, dtype=np.uint64)
        self._image: PoolImage | None = None
        self._sc = Scratch(LIN_KICKS)
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
        # apply_packed's reused buffers (a batch with more events or longer stores takes the
        # general path, which allocates its own)
        self._io = np.zeros(IO_LEN, dtype=np.int64)
        self._err = np.zeros(_PACKED_EVENTS, dtype=np.uint8)
        self._packed_stats = np.zeros(N_STATS, dtype=np.int64)
        #: read-only zeros for ``apply_packed``: a packed batch's namespace columns (9 B/event)
        self._packed_zeros = np.zeros(9 * _PACKED_EVENTS, dtype=np.uint8)
        self._set_keys = np.zeros(_PACKED_SET, dtype=np.uint64)
        self._set_stamp = np.zeros(_PACKED_SET, dtype=np.int64)
        self._okey_buf = np.empty(0, dtype=np.uint64)  # owners-table keys of canonical hashes
        self._addr_buf = np.empty(0, dtype=np.uint64)  # CKF (fingerprint << 32 | bucket)
        self._own_buf = np.empty(0, dtype=np.int64)
        self.errors_by_kind: Counter[str] = Counter()
        self.first_error: tuple[int, PoolError] | None = None
        self.last_error: tuple[int, PoolError] | None = None
        self.invariant_violations = 0
        self.forced_growths = 0

    def refiltered(self, bucket_count: int, seed: int) -> Pool:
        """A new pool holding a copy of this pool's exact state under another bucket count or
        CKF seed, its filter rebuilt from the owners (the exact state does not depend on
        either); this pool is left as it is."""
        meta, arrays = self.export_state()
        return Pool.from_state(
            meta, arrays, bucket_count=bucket_count, seed=seed, block_size=self.block_size,
            hash_format=self.hash_format, max_kicks=self.max_kicks, reports=self.reports,
            refilter=True,
        )  # fmt: skip

    def _next_salt(self) -> int:
        self._salt_state, out = ckf.splitmix_next(self._salt_state)
        return out

    # ---- membership -----------------------------------------------------------------------------

    def add_member(self, worker_id: int, dp_rank: int) -> int:
        key = (worker_id, dp_rank)
        mid = self._ids.get(key)
        if mid is None:
            mid = self._next_id
            self._next_id += 1
            self._ids[key] = mid
            self._members[mid] = _Member(worker_id, dp_rank, self._next_salt(), self._ref_bits)
        return mid

    def members(self) -> dict[int, tuple[int, int]]:
        return {mid: (m.worker_id, m.dp_rank) for mid, m in self._members.items()}

    def member_blocks(self, mid: int) -> int:
        """Blocks member ``mid`` holds now (0 for one it does not know)."""
        m = self._members.get(mid)
        return 0 if m is None else int(m.lin.live)

    def _member(self, member: int) -> _Member:
        m = self._members.get(member)
        if m is None:
            raise UnknownMember(f"unknown member id {member}")
        return m

    def _clear(self, m: _Member, stats: npt.NDArray[np.int64]) -> None:
        lin, own = m.lin, self._own
        clear_member(
            self._cfg, self.table, self._deltas, self._mark, self._dlog_b, self._dlog_o,
            self._dmeta, lin.tm, lin.w, m.nkeys, m.nvals, m.nmeta, m.ckeys, m.cvals, m.cmeta,
            own.tm, own.w, self._pm, self._xk, self._xv, self._pcow, m.cow, stats,
        )  # fmt: skip

    def reset_member(self, member: int) -> None:
        """Drop every edge of the member (same as an AllBlocksCleared event)."""
        m = self._member(member)
        stats = np.zeros(N_STATS, dtype=np.int64)
        self._clear(m, stats)
        self._stats += stats
        self._note_invariant(int(stats[ST_INVARIANT]))
        self._compact(m)

    def remove_member(self, member: int) -> None:
        """Reset then forget the member (its id is not reused)."""
        self.reset_member(member)
        m = self._members.pop(member)
        del self._ids[(m.worker_id, m.dp_rank)]

    def _compact(self, m: _Member | None) -> None:
        """Give memory back after mass removals (the reservation path only shrinks on apply)."""
        if m is not None:
            m.reserve(0, False, self._sc)
            m.drop_namespace()
            m.fit_copies(0)
        self._reserve_owners(0)
        self._fit_counts(0)

    # ---- capacity -------------------------------------------------------------------------------

    def _resize_owners(self, nb: int) -> None:
        """Rebuild the owners table with ``nb`` buckets per subtable (more if a bucket overflows
        during the rebuild), then rewrite every lineage reference and the overflow keys."""
        remap = np.zeros(self._own.cap, dtype=np.uint32)
        while (new := self._own.rebuilt([nb] * OWNERS.d, self._sc, remap)) is None:
            nb = OWNERS.grown(nb)
        bits = _ref_bits(new.cap)
        for m in self._members.values():
            m.lin = m.lin.repacked(bits, remap)
        xk = np.zeros(self._xk.shape[0], dtype=np.uint64)
        xv = np.full(self._xv.shape[0], EMPTY32, dtype=np.uint32)
        remap_overflow(self._xk, self._xv, xk, xv, remap)
        self._xk, self._xv = xk, xv
        new.bounds = OWNERS.bounds(nb)
        self._own = new
        self._ref_bits = bits

    def _reserve_owners(self, add: int) -> None:
        want = _resize_for(self._own, OWNERS, add)
        if want is not None:
            self._resize_owners(want)

    def _fit_counts(self, add: int) -> None:
        """Size the overflow count table for its entries plus ``add`` (grown when the kernel asks,
        shrunk once under an eighth full)."""
        need = int(self._pm[PM_OVERFLOW]) + add + 1
        cur = self._xk.shape[0]
        cap = grown_cap(cur, need)
        if cap == cur and cur > MIN_CAP and need * 8 < cur:
            cap = grown_cap(MIN_CAP, need * 2)
        if cap != cur:
            xk = np.zeros(cap, dtype=np.uint64)
            xv = np.full(cap, EMPTY32, dtype=np.uint32)
            tab_rehash(self._xk, self._xv, EMPTY32, xk, xv)
            self._xk, self._xv = xk, xv
            self._pm[PM_OVF_ROOM] = cap * MAX_LOAD_NUM // MAX_LOAD_DEN - 1

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

    # ---- apply ----------------------------------------------------------------------------------

    def apply(self, member: int, batch: AnyBatch) -> ApplyResult:
        """Apply one engine batch for one member (one kernel call, more only for CLEAR events and
        the rare table without room). A ``PackedBatch`` goes through ``apply_packed`` when it
        needs no table change first; anything else is applied as the ``EventBatch`` it is."""
        m = self._member(member)
        if type(batch) is PackedBatch:
            done = self._apply_packed(m, batch)
            if done is not None:
                return done
            batch = batch.unpack()
        assert isinstance(batch, EventBatch)
        try:
            b = _normalized(batch)
            code = batch_summary(
                b.ops, b.parent, b.has_parent, b.salt, b.ns_part, b.ns_inherit, b.blk_off,
                b.ext_hashes, b.tok_off, b.tokens, b.mm_off, b.mm, self._summary,
            )  # fmt: skip
            if code == BS_OK and b.origin.shape[0] not in (0, b.ops.shape[0]):
                code = BS_ORIGIN
            if code != BS_OK:
                raise MalformedBatch(_SUMMARY_MESSAGES[code])
        except MalformedBatch as bad:
            self._record_error(-1, bad)
            raise
        n = b.ops.shape[0]
        store_blocks, max_k, ns = self._summary.tolist()
        self._reserve_owners(store_blocks)  # may repack every lineage table: first
        # room for namespaces: a store names one, or takes one the member holds
        takes = bool(ns & NS_INHERIT) and int(m.nmeta[0]) > 0
        m.reserve(store_blocks, bool(ns & NS_OWN) or takes, self._sc)
        if self._counts_oversized():
            self._fit_counts(0)
        err = np.zeros(n, dtype=np.uint8)
        stats = np.zeros(N_STATS, dtype=np.int64)
        nb = b.ext_hashes.shape[0]
        if self._okey_buf.shape[0] < nb:
            self._okey_buf = np.empty(nb, dtype=np.uint64)
            self._addr_buf = np.empty(nb, dtype=np.uint64)
            self._own_buf = np.full(nb, -1, dtype=np.int64)
        set_cap = set_capacity(max_k)
        set_keys = np.zeros(set_cap, dtype=np.uint64)
        set_stamp = np.zeros(set_cap, dtype=np.int64)
        self._run(m, b, None, max_k, err, stats, set_keys, set_stamp, self._mm_scratch_for(b))
        return self._finish(stats, err)

    def _counts_oversized(self) -> bool:
        """The overflow count table is over eight times larger than its entries need."""
        return counts_oversized(self._xk.shape[0], int(self._pm[PM_OVERFLOW]))

    def _state(self, m: _Member) -> tuple[Any, ...]:
        """The tables ``apply_batch`` (and ``apply_packed``) work on for member ``m``, in their
        argument order; read again after any resize."""
        lin, own = m.lin, self._own
        return (
            self._cfg, self.table, self._deltas, self._rng, self._mark, self._dlog_b,
            self._dlog_o, self._dmeta, self._undo_b, self._undo_o, lin.tm, lin.w, m.nkeys,
            m.nvals, m.nmeta, m.ckeys, m.cvals, m.cmeta, own.tm, own.w, self._pm, self._xk,
            self._xv, self._pcow, m.cow, self._okey_buf, self._addr_buf, self._own_buf,
        )  # fmt: skip

    def _apply_packed(self, m: _Member, pb: PackedBatch) -> ApplyResult | None:
        """One ``apply_packed`` call; None when the batch needs the general path (nothing was
        done). The kernel checks, from the tables' size bounds, that ``_reserve_owners`` and
        ``reserve`` would change no table (``room``) and that no count table is to shrink."""
        io = self._io
        code = apply_packed(  # type: ignore[call-arg]
            pb.work, pb.n_events, pb.e, pb.o_ops, pb.o_hp, pb.o_w64, pb.o_i64, pb.o_tok,
            *self._own.bounds, *m.lin.bounds,
            io, *self._state(m), self._set_keys, self._set_stamp, self._sc.walk,
            self._mm_scratch, self._hash_sec, self._hash_acc, self._err, self._packed_stats,
            self._stats, self._packed_zeros,
        )  # fmt: skip
        ne = pb.n_events
        err, stats = self._err[:ne], self._packed_stats
        if code == PACKED_APPLIED:  # the whole batch, its stats already in the totals
            return self._finish(stats, err, counted=True)
        if code != PACKED_STOPPED:
            return None
        # a CLEAR or a table without room: the general loop goes on from where it stopped
        _, max_k, _, stop, set_cap = io.tolist()
        self._run(m, pb.unpack(), stop, max_k, err, stats, self._set_keys[:set_cap],
                  self._set_stamp[:set_cap], self._mm_scratch)  # fmt: skip
        return self._finish(stats, err)

    def _run(
        self,
        m: _Member,
        b: EventBatch,
        stop: int | None,
        max_k: int,
        err: npt.NDArray[np.uint8],
        stats: npt.NDArray[np.int64],
        set_keys: U64,
        set_stamp: npt.NDArray[np.int64],
        mm_scratch: npt.NDArray[np.uint8],
    ) -> None:
        """``apply_batch`` from event 0 until the batch is done, handling each stop (a CLEAR, a
        table without room). ``stop``: the first call already ran and stopped there. ``max_k``:
        the most blocks one store of the batch holds."""
        n = b.ops.shape[0]
        walk = self._sc.walk
        forced = 0
        start = 0
        while start < n:
            if stop is None:
                stop = apply_batch(
                    b.ops, b.parent, b.has_parent, b.salt, b.ns_part, b.ns_inherit, b.blk_off,
                    b.ext_hashes, b.tok_off, b.tokens, b.mm_off, b.mm, b.origin, *self._state(m),
                    set_keys, set_stamp, walk, mm_scratch, self._hash_sec, self._hash_acc, start,
                    err, stats,
                )  # fmt: skip
            at, stop = stop, None
            if at >= n:
                break
            if self._pm[PM_STOP] == STOP_CLEAR:
                self._clear(m, stats)
                stats[ST_APPLIED] += 1
                start = at + 1
                continue
            # The event stopped at is validated again on resume: forget its duplicate-check stamps.
            set_stamp[:] = 0
            if self._pm[PM_STOP] == STOP_COUNTS_FULL:  # room for every count the event raises
                self._fit_counts(max_k)
                start = at
                continue
            if self._pm[PM_STOP] == STOP_COPIES_FULL:  # room for a copy of every block it holds
                m.fit_copies(max_k)
                start = at
                continue
            # a table had no room for event `at` (nothing of it applied): grow, resume there
            forced += 1
            self.forced_growths += 1
            if forced > MAX_FORCED_GROWTHS:
                self._note_invariant(1, "no room for an event after repeated table growth")
                break
            if self._pm[PM_STOP] == STOP_LINEAGE_FULL:
                m.resize(LINEAGE.grown(m.lin.nb0), self._sc)
            else:
                self._resize_owners(OWNERS.grown(self._own.nb0))
            start = at

    def _finish(
        self, stats: npt.NDArray[np.int64], err: npt.NDArray[np.uint8], *, counted: bool = False
    ) -> ApplyResult:
        """Count a batch's ``stats`` (unless ``counted``: ``apply_packed`` added them) and
        report its per-event errors."""
        if not counted:
            self._stats += stats
        st = stats.tolist()  # one conversion instead of one numpy scalar per counter
        self._note_invariant(st[ST_INVARIANT])
        errors: list[tuple[int, PoolError]] = []
        if st[ST_REJECTED]:
            for i in np.flatnonzero(err).tolist():
                code = int(err[i])
                exc = CODE_TO_ERROR[code](f"event {i}: {CODE_MESSAGE[code]}")
                errors.append((i, exc))
                self._record_error(i, exc)
        return ApplyResult(
            events_applied=st[ST_APPLIED],
            events_rejected=st[ST_REJECTED],
            blocks_stored=st[ST_STORED],
            blocks_removed=st[ST_REMOVED],
            unknown_removals=st[ST_UNKNOWN],
            capacity_omissions=st[ST_CAPACITY],
            errors=tuple(errors),
            duplicate_stores=st[ST_DUP],
            report_stores=st[ST_REPORT],
            ambiguous_stores=st[ST_AMBIGUOUS],
            copy_removals=st[ST_COPY_REMOVED],
        )

    def _record_error(self, index: int, exc: PoolError) -> None:
        self.errors_by_kind[exc.kind] += 1
        if self.first_error is None:
            self.first_error = (index, exc)
        self.last_error = (index, exc)

    def record_error(self, exc: PoolError) -> None:
        """Count an error detected outside the kernel (e.g. ingest's BlockSizeMismatch)."""
        self._record_error(-1, exc)

    def _note_invariant(self, n: int, what: str = "resident fingerprint missing") -> None:
        if n:
            self.invariant_violations += n
            for _ in range(n):
                self._record_error(-1, InvariantViolation(what))

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

    def _edges(self, member: int) -> tuple[U64, U64, npt.NDArray[np.bool_]]:
        """``(external, canonical, resident)`` per edge of one member."""
        m = self._member(member)
        lin, own = m.lin, self._own
        n = lin.live
        e = np.empty(n, dtype=np.uint64)
        c = np.empty(n, dtype=np.uint64)
        r = np.empty(n, dtype=np.bool_)
        member_edges(lin.tm, lin.w, own.tm, own.w, e, c, r)
        return e, c, r

    def copies(self, member: int) -> dict[int, int]:
        """External hash → physical copies, for the hashes the member holds more than once."""
        m = self._member(member)
        live = m.cvals != EMPTY32
        keys, extra = m.ckeys[live].tolist(), m.cvals[live].tolist()
        return {int(k): int(v) + 1 for k, v in zip(keys, extra, strict=True)}

    def owned_canonical(self, member: int) -> U64:
        """Distinct canonical hashes the member owns (sorted)."""
        _, c, _ = self._edges(member)
        return np.unique(c)

    def resident_canonical(self, member: int) -> U64:
        _, c, r = self._edges(member)
        return np.unique(c[r])

    def lineage(self, member: int) -> dict[int, int]:
        """External hash → canonical hash for one member (tests/diagnostics; builds a dict)."""
        e, c, _ = self._edges(member)
        return dict(zip(e.tolist(), c.tolist(), strict=True))

    def owners(self) -> dict[int, tuple[int, bool]]:
        """Canonical → (refcount, resident) (tests/diagnostics; builds a dict)."""
        keys, pays, slots = self._own.entries()
        live = self._xv != EMPTY32
        big = dict(zip(self._xk[live].tolist(), self._xv[live].tolist(), strict=True))
        out: dict[int, tuple[int, bool]] = {}
        for c, p, s in zip(keys.tolist(), pays.tolist(), slots.tolist(), strict=True):
            code = p & int(CODE_MASK)
            count = big[s] if code == int(CODE_OVERFLOW) else code + 1
            out[c] = (count, bool(p & int(RES_BIT)))
        return out

    @property
    def occupancy(self) -> int:
        """Fingerprints in the table (= resident canonical hashes)."""
        return int(self._pm[PM_RESIDENT])

    @property
    def memberships(self) -> int:
        return sum(m.lin.live for m in self._members.values())

    @property
    def distinct_canonical(self) -> int:
        return self._own.live

    @property
    def capacity_omissions(self) -> int:
        return int(self._stats[ST_CAPACITY])

    @property
    def unknown_removals(self) -> int:
        return int(self._stats[ST_UNKNOWN])

    @property
    def duplicate_stores(self) -> int:
        """Stored blocks counted as one more physical copy of a hash the member held."""
        return int(self._stats[ST_DUP])

    @property
    def report_stores(self) -> int:
        """Stored blocks taken as a report of a hash the member held (no new copy)."""
        return int(self._stats[ST_REPORT])

    @property
    def ambiguous_stores(self) -> int:
        """Store events that were a report or new copies, the stream cannot tell."""
        return int(self._stats[ST_AMBIGUOUS])

    @property
    def copy_removals(self) -> int:
        """Removes that dropped one extra copy of a hash (the member still holds it)."""
        return int(self._stats[ST_COPY_REMOVED])

    @property
    def events_rejected(self) -> int:
        return int(self._stats[ST_REJECTED])

    def memory_breakdown(self) -> dict[str, int]:
        """Allocated bytes per structure (capacity, not just the used part)."""
        return {
            "lineage": sum(m.lin.nbytes for m in self._members.values()),
            "namespace": sum(int(m.nkeys.nbytes + m.nvals.nbytes) for m in self._members.values()),
            "copies": sum(
                int(m.ckeys.nbytes + m.cvals.nbytes + m.cmeta.nbytes)
                for m in self._members.values()
            ),
            "owners": self._own.nbytes,
            "owner_counts": int(self._xk.nbytes + self._xv.nbytes),
        }

    def memory_bytes(self) -> int:
        """Allocated bytes of the exact state (lineage + namespace + owners), not the CKF."""
        return sum(self.memory_breakdown().values())

    def snapshot_state(
        self,
    ) -> tuple[
        bytes, dict[int, dict[int, int]], dict[int, tuple[int, bool]], dict[int, dict[int, int]]
    ]:
        """Table bytes + exact state as plain data (tests compare before/after a rejection)."""
        return (
            self.table.tobytes(),
            {mid: self.lineage(mid) for mid in self._members},
            self.owners(),
            {mid: self.copies(mid) for mid in self._members},
        )

    # ---- state handover -------------------------------------------------------------------------

    #: Bumped whenever the exported arrays change meaning; a file of another version is refused.
    #: 2: packed tables (cuckoo lineage → owner slot, d-left owners, overflow counts).
    #: 3: + per member copy-count tables (``m{id}.ckeys``/``cvals``/``cmeta``).
    STATE_VERSION = 3
    #: versions ``from_state`` reads: a version 2 state has no copy counts (its pool counted
    #: none), so it restores with every hash held once
    READABLE_STATE_VERSIONS = (2, 3)

    def export_state(self) -> tuple[dict[str, Any], dict[str, npt.NDArray[Any]]]:
        """The exact state as plain metadata + named arrays (views, not copies, but for the
        tables' small metas: the caller writes them out before the pool changes). The CKF kick
        RNG, the lineage tables' walk RNGs and the table salts go with it, so a restored pool
        places fingerprints and entries exactly as the saved one would have. The dirty log and
        counters do not: a restored pool starts with nothing pending, as a fresh generation
        does, and neither does a checkpoint's barrier (``TM_COW`` is 0 in what is exported)."""
        arrays: dict[str, npt.NDArray[Any]] = {
            "table": self.table, "rng": self._rng, "own.tm": _meta_copy(self._own.tm),
            "own.w": self._own.w, "ovf.keys": self._xk, "ovf.counts": self._xv,
        }  # fmt: skip
        members = []
        for mid, m in self._members.items():
            members.append([mid, m.worker_id, m.dp_rank, m.lin.salt])
            arrays[f"m{mid}.lin.tm"] = _meta_copy(m.lin.tm)
            arrays[f"m{mid}.lin.w"] = m.lin.w
            for name in ("nkeys", "nvals", "nmeta", "ckeys", "cvals", "cmeta"):
                arrays[f"m{mid}.{name}"] = getattr(m, name)
        meta = {
            "next_id": self._next_id, "members": members, "salt_state": self._salt_state,
            "owners_salt": self._own.salt,
        }  # fmt: skip
        return meta, arrays

    def open_image(
        self, side_bytes: int | None = None, *, eager_bytes: int = EAGER_BYTES
    ) -> PoolImage:
        """The exported state as it is now, readable from another thread while the pool goes on
        (``pool/image.py``; call between batches). At most one is open per pool; close it on the
        thread that applies batches. ``side_bytes`` bounds the pre-images it keeps (default:
        half the armed arrays, so the image stays under 1.5× the state); arrays up to
        ``eager_bytes`` are copied at once instead of armed."""
        if self._image is not None:
            raise RuntimeError("an image of this pool is already open")
        meta, arrays = self.export_state()
        armings = {
            "table": Arming(self._dmeta, ckf.DM_COW), "own.w": Arming(self._own.tm, TM_COW),
            "ovf.keys": Arming(self._pcow, PC_OVF_KEYS),
            "ovf.counts": Arming(self._pcow, PC_OVF_COUNTS),
        }  # fmt: skip
        for mid, m in self._members.items():
            armings[f"m{mid}.lin.w"] = Arming(m.lin.tm, TM_COW)
            armings[f"m{mid}.nkeys"] = Arming(m.cow, MC_NS_KEYS)
            armings[f"m{mid}.nvals"] = Arming(m.cow, MC_NS_VALS)
            armings[f"m{mid}.ckeys"] = Arming(m.cow, MC_CP_KEYS)
            armings[f"m{mid}.cvals"] = Arming(m.cow, MC_CP_VALS)

        def closed() -> None:
            self._image = None

        self._image = PoolImage(meta, arrays, armings, side_bytes, on_close=closed,
                                eager_bytes=eager_bytes)  # fmt: skip
        return self._image

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
        reports: bool = False,
        take: bool = False,
        refilter: bool = False,
    ) -> Pool:
        """A pool holding exported state, after checks that it is one consistent state (ValueError
        otherwise): every array of the right type and shape, every table exactly what this
        layout could have written (``PackedTable.restored``), every lineage entry naming a live
        owner, refcounts (overflow table included) equal to the lineage edges, namespace entries
        only for lineage edges, and the CKF holding exactly the resident owners' fingerprints, each
        in one of its two buckets (``pool/verify.py``). ``take``: the big arrays become the
        pool's own, not copied (a state file's reader allocated them for it). ``refilter``: the
        state may come from a pool of another bucket count or seed; its table is not used, the
        filter is rebuilt from the owners (``pool/refill.py``)."""
        try:
            next_id = int(meta["next_id"])
            salt_state = int(meta["salt_state"])
            owners_salt = int(meta["owners_salt"])
            rows = [(int(a), int(b), int(c), int(d)) for a, b, c, d in meta["members"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"pool metadata: {type(exc).__name__}: {exc}") from None
        if not all(0 <= x <= _M64 for x in (salt_state, owners_salt, *(r[3] for r in rows))):
            raise ValueError("pool metadata: salt out of range")
        pool = cls(
            bucket_count, seed, block_size, hash_format, max_kicks, layout_seed=salt_state,
            reports=reports,
        )  # fmt: skip
        table = _state_array(arrays, "table", np.uint64, take=take)
        rng = _state_array(arrays, "rng", np.uint64, 1)
        if table.shape != pool.table.shape and not refilter:
            raise ValueError(f"table has {table.shape[0]} buckets, the pool {bucket_count}")
        own = PackedTable.restored(
            OWNERS.d, OWNERS.b, OWNER_PBITS, 0, owners_salt,
            _state_array(arrays, "own.tm", np.uint64, take=take),
            _state_array(arrays, "own.w", np.uint64, take=take),
        )  # fmt: skip
        own.bounds = OWNERS.bounds(own.nb0)
        resident_in_table = int(np.count_nonzero(table.view(np.uint16)))
        xk = _state_array(arrays, "ovf.keys", np.uint64)
        xv = _state_array(arrays, "ovf.counts", np.uint32, xk.shape[0])
        n_big = int(np.count_nonzero(xv != EMPTY32))
        if xk.shape[0] < MIN_CAP or grown_cap(xk.shape[0], n_big + 1) != xk.shape[0]:
            raise ValueError("overflow count table size out of range")
        # re-inserted into a fresh table of the same size: probe positions are not trusted
        big_k = np.zeros(xk.shape[0], dtype=np.uint64)
        big_v = np.full(xk.shape[0], EMPTY32, dtype=np.uint32)
        tab_rehash(xk, xv, EMPTY32, big_k, big_v)
        ref_bits = _ref_bits(own.cap)
        edges = np.zeros(own.cap, dtype=np.uint32)  # lineage edges per owner slot
        for mid, wid, rank, salt in rows:
            if not 0 <= mid < next_id or mid in pool._members or (wid, rank) in pool._ids:
                raise ValueError(f"member {mid} ({wid}, {rank}) repeated or out of range")
            m = _Member(wid, rank, salt, ref_bits)
            m.lin = PackedTable.restored(
                LINEAGE.d, LINEAGE.b, ref_bits, LIN_KICKS, salt,
                _state_array(arrays, f"m{mid}.lin.tm", np.uint64, take=take),
                _state_array(arrays, f"m{mid}.lin.w", np.uint64, take=take),
            )  # fmt: skip
            m.lin.bounds = LINEAGE.bounds(m.lin.nb0)
            if not count_payloads(m.lin.tm, m.lin.w, edges):
                raise ValueError(f"member {mid}: lineage names a slot outside the owners table")
            m.nkeys, m.nvals, m.nmeta = _namespace(arrays, mid, m.lin)
            if f"m{mid}.ckeys" in arrays:  # absent from version 2 states: no copies
                m.ckeys, m.cvals, m.cmeta = _copy_counts(arrays, mid, m.lin)
            pool._members[mid] = m
            pool._ids[(wid, rank)] = mid
        resident = int(check_counts(own.tm, own.w, big_k, big_v, n_big, edges))
        if resident < 0:
            raise ValueError("owner refcounts (or their overflow counts) differ from the lineage")
        if refilter:
            resident = _refill_into(pool, own)
        else:
            if resident != resident_in_table:
                raise ValueError("the table does not hold exactly the resident owners")
            why = filter_divergence(own.tm, own.w, table, np.uint64(pool.seed), pool._deltas)
            if why is not None:
                raise ValueError(why)
            pool.table[:] = table
            pool._rng[:] = rng
        pool._next_id = next_id
        pool._salt_state = salt_state
        pool._own, pool._ref_bits = own, ref_bits
        pool._xk, pool._xv = big_k, big_v
        pool._pm[:] = 0
        pool._pm[PM_RESIDENT] = resident
        pool._pm[PM_OVERFLOW] = n_big
        pool._pm[PM_OVF_ROOM] = xk.shape[0] * MAX_LOAD_NUM // MAX_LOAD_DEN - 1
        return pool


def _meta_copy(tm: U64) -> U64:
    """A table's meta words as exported: a copy, without the checkpoint barrier's address."""
    out = tm.copy()
    out[TM_COW] = 0
    return out


def _refill_into(pool: Pool, own: PackedTable) -> int:
    """``pool``'s empty filter filled from ``own`` (resident bits set to match); the dirty log
    is cleared after: a new generation starts with nothing pending. Returns the residents."""
    lane = pool.lane
    res = int(refill(own.tm, own.w, lane.table, lane.cfg, lane.deltas, lane.rng, lane.mark,
                     lane.dlog_b, lane.dlog_o, lane.dmeta, lane.undo_b, lane.undo_o))  # fmt: skip
    lane.mark[:] = 0
    lane.dmeta[0] = 0
    pool._stats[ST_CAPACITY] += own.live - res
    return res


def filter_divergence(otm: U64, ow: U64, table: U64, seed: np.uint64, deltas: U64) -> str | None:
    """Why ``table`` is not exactly the resident owners' fingerprints (None when it is)."""
    own = new_acc()
    owners_digest(otm, ow, table, seed, deltas, 0, int(otm[TM_CAP]) >> 3, own)
    if own[ACC_MISSING]:
        return f"{int(own[ACC_MISSING])} resident owners' fingerprints are in neither bucket"
    filt = new_acc()
    filter_digest(table, deltas, 0, table.shape[0], filt)
    if filt[ACC_COUNT] != own[ACC_COUNT] or filt[ACC_SUM] != own[ACC_SUM]:
        return "the table's fingerprints are not those of the resident owners"
    return None


def _state_array(
    arrays: dict[str, npt.NDArray[Any]], name: str, dtype: type, length: int | None = None,
    take: bool = False,
) -> npt.NDArray[Any]:
    a = arrays.get(name)
    bad_length = a is not None and length is not None and a.shape[0] != length
    if a is None or a.dtype != dtype or a.ndim != 1 or bad_length:
        raise ValueError(f"state array {name!r} missing or of the wrong type or shape")
    if take and a.flags.writeable and a.flags.owndata and a.flags.c_contiguous:
        return a
    return np.array(a, copy=True)  # owned and writable


def _namespace(
    arrays: dict[str, npt.NDArray[Any]], mid: int, lineage: PackedTable
) -> tuple[U64, U64, npt.NDArray[np.int64]]:
    """One member's namespace side table, checked (entries only for its lineage edges, the live
    count, room for one more) and re-inserted into a fresh table of the same size."""
    nkeys = _state_array(arrays, f"m{mid}.nkeys", np.uint64)
    nvals = _state_array(arrays, f"m{mid}.nvals", np.uint64, nkeys.shape[0])
    nmeta = _state_array(arrays, f"m{mid}.nmeta", np.int64, 1)
    live = nvals != 0
    keys = nkeys[live]
    cap = nkeys.shape[0]
    n = int(keys.shape[0])
    if cap < 2 or grown_cap(cap, n + 1) != cap or n != int(nmeta[0]):
        raise ValueError(f"member {mid}: namespace table size or count out of range")
    if n and (np.unique(keys).shape[0] != n or not np.isin(keys, lineage.entries()[0]).all()):
        raise ValueError(f"member {mid}: namespace entries for edges it does not have")
    fk = np.zeros(cap, dtype=np.uint64)
    fv = np.zeros(cap, dtype=np.uint64)
    tab_rehash(nkeys, nvals, np.uint64(0), fk, fv)
    return fk, fv, nmeta


def _copy_counts(
    arrays: dict[str, npt.NDArray[Any]], mid: int, lineage: PackedTable
) -> tuple[U64, npt.NDArray[np.uint32], npt.NDArray[np.int64]]:
    """One member's copy-count table, checked (entries only for its lineage edges, each count in
    range, the live count, the room) and re-inserted into a fresh table of the same size."""
    ckeys = _state_array(arrays, f"m{mid}.ckeys", np.uint64)
    cvals = _state_array(arrays, f"m{mid}.cvals", np.uint32, ckeys.shape[0])
    cmeta = _state_array(arrays, f"m{mid}.cmeta", np.int64, 2)
    live = cvals != EMPTY32
    keys = ckeys[live]
    cap = ckeys.shape[0]
    n = int(keys.shape[0])
    copy_room = _copy_room(cap) if cap > 2 else 0
    if cap < 2 or (cap > 2 and grown_cap(cap, n + 1) != cap) or (cap == 2 and n):
        raise ValueError(f"member {mid}: copy-count table size out of range")
    if n != int(cmeta[CM_LIVE]) or int(cmeta[CM_ROOM]) != copy_room:
        raise ValueError(f"member {mid}: copy-count table count or room out of range")
    if n and (not (cvals[live] < MAX_COPIES).all() or np.unique(keys).shape[0] != n
              or not np.isin(keys, lineage.entries()[0]).all()):  # fmt: skip
        raise ValueError(f"member {mid}: copy counts out of range or for edges it does not have")
    fk = np.zeros(cap, dtype=np.uint64)
    fv = np.full(cap, EMPTY32, dtype=np.uint32)
    tab_rehash(ckeys, cvals, EMPTY32, fk, fv)
    return fk, fv, cmeta


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
    ("origin", np.uint8),
)

_SUMMARY_MESSAGES = {
    BS_LENGTHS: "per-event arrays do not all have one entry per event",
    BS_BLK_OFF: "blk_off is not a valid offset array over ext_hashes",
    BS_TOK_OFF: "tok_off is not a valid offset array over tokens",
    BS_MM_OFF: "mm_off is not a valid offset array over mm",
    BS_CLEAR_BLOCKS: "a clear event carries block hashes",
    BS_ORIGIN: "origin is neither empty nor one entry per event",
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
    if b.normalized:
        return b
    for name, dtype in _SPEC:
        a = getattr(b, name)
        if not (
            isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == 1 and a.flags.c_contiguous
        ):
            break
    else:
        return b
    return EventBatch(**{name: _arr(getattr(b, name), dtype, name) for name, dtype in _SPEC})  # type: ignore[arg-type]
