"""The pool's compact layout at its edges, always against the reference model: refcounts beyond
the in-slot maximum, table growth and shrinking (lineage references rewritten, reference width
crossing a power of two), placement failures that hand back to Python and resume, the bound on
them, the overflow-count table growing for wide shared events, and resets of big members giving
memory back. The table layout (salts) never changes results."""

from __future__ import annotations

import numpy as np
import pytest

from kvrelay.pool import pool as pool_mod
from kvrelay.pool.batch import BatchBuilder, EventBatch
from kvrelay.pool.errors import InvariantViolation
from kvrelay.pool.owners import INLINE_MAX, PM_OVERFLOW
from kvrelay.pool.pool import Pool
from kvrelay.pool.sizing import LINEAGE, OWNERS, Policy
from tests.support.pool_model import Counts, RefPool

SEED = 0x5DEECE66D1B54A33
BS = 1


def same_state(pool: Pool, model: RefPool, mids: list[int]) -> None:
    assert np.array_equal(pool.table, model.ckf.words())
    assert pool.owners() == {c: (o[0], bool(o[1])) for c, o in model.owners.items()}
    for i, mid in enumerate(mids):
        assert pool.lineage(mid) == model.lineage.get(i, {})
    assert pool.memberships == sum(len(v) for v in model.lineage.values())
    assert pool.distinct_canonical == len(model.owners)
    assert pool.invariant_violations == 0


def apply_both(pool: Pool, model: RefPool, mids: list[int], m: int, batch: EventBatch) -> None:
    res = pool.apply(mids[m], batch)
    exp = model.apply(m, batch)
    assert (res.events_applied, res.events_rejected) == (exp.applied, exp.rejected)
    assert (res.blocks_stored, res.blocks_removed) == (exp.stored, exp.removed)
    assert res.capacity_omissions == exp.capacity


def chains(member: int, first: int, count: int, shared_prefix: int, length: int = 8) -> EventBatch:
    """``count`` root chains of ``length`` blocks (B=1); the first ``shared_prefix`` tokens of
    every chain are the same in all members, so those blocks share canonical hashes."""
    bb = BatchBuilder()
    for c in range(first, first + count):
        toks = [c * length + j if j < shared_prefix else (member + 1) << 24 | (c * length + j)
                for j in range(length)]  # fmt: skip
        ext = [(member + 1) << 48 | c * length + j for j in range(length)]
        bb.store(ext, toks)
    return bb.build()


def removals(member: int, first: int, count: int, length: int = 8) -> EventBatch:
    bb = BatchBuilder()
    for c in range(first, first + count):
        bb.remove([(member + 1) << 48 | c * length + j for j in range(length)])
    return bb.build()


def new_pair(members: int, buckets: int = 1 << 16) -> tuple[Pool, RefPool, list[int]]:
    pool = Pool(buckets, SEED, BS, 1, 500, layout_seed=7)
    model = RefPool(buckets, SEED, BS, 1, 500)
    return pool, model, [pool.add_member(i, 0) for i in range(members)]


def test_refcounts_beyond_the_slot_are_exact_both_ways() -> None:
    pool, model, mids = new_pair(INLINE_MAX + 6)
    one = BatchBuilder().store([1], [42]).build()  # the same canonical in every member
    for i in range(len(mids)):
        apply_both(pool, model, mids, i, one)
        assert pool.owners() == {c: (i + 1, True) for c in model.owners}
        assert int(pool._pm[PM_OVERFLOW]) == (1 if i + 1 > INLINE_MAX else 0)
    alias = BatchBuilder().store([2], [42]).store([3], [42]).build()  # aliases count too
    apply_both(pool, model, mids, 0, alias)
    assert next(iter(pool.owners().values()))[0] == len(mids) + 2
    for i in reversed(range(len(mids))):
        apply_both(pool, model, mids, i, BatchBuilder().remove([1]).build())
        same_state(pool, model, mids)
    apply_both(pool, model, mids, 0, BatchBuilder().remove([2, 3]).build())
    assert pool.owners() == {} and not pool.table.any() and int(pool._pm[PM_OVERFLOW]) == 0


def test_growth_remap_and_shrink_against_the_model() -> None:
    """Owners and lineage grow through many rebuilds (lineage references rewritten, their
    width crossing powers of two) with overflowed counts alive, then shrink after removals."""
    pool, model, mids = new_pair(INLINE_MAX + 3)
    for i in range(len(mids)):  # 40 prefixes shared by every member: counts in the side table
        apply_both(pool, model, mids, i, chains(i, 0, 40, shared_prefix=4))
    widths = set()
    for step in range(12):
        for i in range(3):
            apply_both(pool, model, mids, i, chains(i, 40 + step * 300, 300, shared_prefix=2))
        widths.add(pool._ref_bits)
        assert all(m.lin.pbits == pool._ref_bits for m in pool._members.values())
        assert pool._ref_bits == max(1, (pool._own.cap - 1).bit_length())
    assert len(widths) >= 3
    same_state(pool, model, mids)
    grown = pool.memory_bytes()
    for step in range(12):
        for i in range(3):
            apply_both(pool, model, mids, i, removals(i, 40 + step * 300, 300))
    same_state(pool, model, mids)
    assert pool.memory_bytes() < grown / 4
    assert all(c >= INLINE_MAX + 1 for c, _ in pool.owners().values() if c > 1)


def test_placement_failures_hand_back_and_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no load headroom and short cuckoo walks, inserts find full buckets inside the kernel:
    the event's placements are undone, the table grows and the event is applied once."""
    monkeypatch.setattr(pool_mod, "LINEAGE", Policy(LINEAGE.d, LINEAGE.b, (1, 1), LINEAGE.step))
    monkeypatch.setattr(pool_mod, "OWNERS", Policy(OWNERS.d, OWNERS.b, (1, 1), OWNERS.step))
    monkeypatch.setattr(pool_mod, "LIN_KICKS", 2)
    pool, model, mids = new_pair(3)
    for step in range(20):
        for i in range(3):
            apply_both(pool, model, mids, i, chains(i, step * 50, 50, shared_prefix=3))
        if step % 5 == 4:
            same_state(pool, model, mids)
            for i in range(3):
                apply_both(pool, model, mids, i, removals(i, step * 50 - 100, 30))
    same_state(pool, model, mids)
    assert pool.forced_growths > 0


def test_an_event_that_never_finds_room_is_reported_not_looped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_mod, "OWNERS", Policy(OWNERS.d, OWNERS.b, (1, 1), OWNERS.step))
    pool, model, mids = new_pair(1)
    batch = chains(0, 0, 10, shared_prefix=0)  # 80 distinct canonicals, owners hold 48
    monkeypatch.setattr(pool, "_resize_owners", lambda nb: None)  # growth that never helps
    res = pool.apply(mids[0], batch)
    assert pool.invariant_violations == 1
    assert isinstance(pool.last_error[1], InvariantViolation)  # type: ignore[index]
    assert pool.forced_growths == pool_mod.MAX_FORCED_GROWTHS + 1
    applied = res.events_applied  # the events before the stuck one, each whole
    assert 0 < applied < 10 and pool.memberships == 8 * applied
    assert model.apply(0, chains(0, 0, applied, shared_prefix=0)).applied == applied
    assert pool.owners() == {c: (o[0], bool(o[1])) for c, o in model.owners.items()}
    assert pool.lineage(mids[0]) == model.lineage[0]
    assert np.array_equal(pool.table, model.ckf.words())


def test_overflow_count_table_grows_for_wide_shared_events() -> None:
    pool, model, mids = new_pair(INLINE_MAX + 2)
    toks = list(range(60))
    for i in range(len(mids)):  # one 60-block chain, same tokens in every member
        bb = BatchBuilder().store([(i + 1) << 32 | j for j in range(60)], toks)
        apply_both(pool, model, mids, i, bb.build())
    same_state(pool, model, mids)
    assert int(pool._pm[PM_OVERFLOW]) == 60 and pool._xk.shape[0] > 64
    for i in range(len(mids)):
        apply_both(pool, model, mids, i, BatchBuilder().clear().build())
    pool.reset_member(mids[0])  # compaction after mass removals
    model.clear(0, Counts())
    same_state(pool, model, mids)
    assert int(pool._pm[PM_OVERFLOW]) == 0 and pool._xk.shape[0] <= 32


def test_reset_of_a_big_member_gives_memory_back() -> None:
    pool, model, mids = new_pair(2, buckets=1 << 18)  # a roomy CKF: the model's kicks are slow
    empty = pool.memory_bytes()
    for step in range(12):
        apply_both(pool, model, mids, 0, chains(0, step * 1000, 1000, shared_prefix=0))
    apply_both(pool, model, mids, 1, chains(1, 0, 10, shared_prefix=0))
    big = pool.memory_bytes()
    assert pool.memberships == 96_080 and big / pool.memberships < 24
    pool.reset_member(mids[0])
    model.clear(0, Counts())
    same_state(pool, model, mids)
    assert pool.memory_bytes() < empty + 10_000
    apply_both(pool, model, mids, 0, chains(0, 0, 100, shared_prefix=0))  # usable again
    pool.remove_member(mids[1])
    model.clear(1, Counts())
    del model.lineage[1]
    same_state(pool, model, [mids[0]])


def test_layout_salt_never_changes_results() -> None:
    pools = [Pool(1 << 10, SEED, BS, 1, 500, layout_seed=s) for s in (1, 2, None)]
    for p in pools:
        mids = [p.add_member(i, 0) for i in range(3)]
        for i in range(3):
            p.apply(mids[i], chains(i, 0, 200, shared_prefix=4))
            p.apply(mids[i], removals(i, 50, 60))
        p.apply(mids[1], BatchBuilder().clear().build())
    a, *rest = (p.snapshot_state() for p in pools)
    assert all(r == a for r in rest)


def test_memory_per_membership_stays_compact() -> None:
    """Allocated bytes, not used entries: 4 members × 64k unshared blocks, and with prefixes
    shared by all four (distinct = 0.625 × memberships)."""
    for shared, bound in ((0, 20.5), (4, 17.5)):
        pool = Pool(1 << 16, SEED, BS, 1, 0, layout_seed=3)
        mids = [pool.add_member(i, 0) for i in range(4)]
        for step in range(8):
            for i in range(4):
                pool.apply(mids[i], chains(i, step * 1000, 1000, shared))
        assert pool.memberships == 4 * 8 * 8000
        assert pool.memory_bytes() / pool.memberships < bound
