"""Duplicate stores of one hash: physical copies counted per (member, hash), reports not counted,
the ambiguous case taken as a report and counted; the copy counts through a state handover
(version 3, and version 2 states still read)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvrelay.pool.batch import ORIGIN_NEW, ORIGIN_REPORT, BatchBuilder
from kvrelay.pool.errors import MalformedBatch
from kvrelay.pool.pool import Pool
from tests.support.pool_model import RefPool

SEED = 0x5DEECE66D1B54A33
BS = 4
TOK = list(range(3 * BS))


def _pools(reports: bool) -> tuple[Pool, RefPool, int]:
    pool = Pool(1024, SEED, BS, 1, reports=reports)
    return pool, RefPool(1024, SEED, BS, 1, 500, reports=reports), pool.add_member(1, 0)


def _both(pool: Pool, model: RefPool, m: int, bb: BatchBuilder) -> None:
    b = bb.build()
    res = pool.apply(m, b)
    exp = model.apply(0, b)
    assert res.events_rejected == exp.rejected == 0
    got = (res.duplicate_stores, res.report_stores, res.ambiguous_stores, res.copy_removals)
    assert got == (exp.duplicate, exp.report, exp.ambiguous, exp.copy_removed)
    assert pool.copies(m) == model.copies[0]
    assert pool.lineage(m) == model.lineage[0]
    assert np.array_equal(pool.table, model.ckf.words())


def _held(pool: Pool, m: int) -> set[int]:
    return set(pool.lineage(m))


def test_a_hash_stored_twice_and_removed_once_is_still_held() -> None:
    """A block-aligned prompt sent again: its last block recomputed into a new physical block
    (store with a parent), then evicted once: the engine still holds the other copy."""
    pool, model, m = _pools(reports=False)
    _both(pool, model, m, BatchBuilder().store([1, 2, 3], TOK))
    _both(pool, model, m, BatchBuilder().store([3], TOK[2 * BS :], parent=2))
    assert pool.copies(m) == {3: 2} and pool.duplicate_stores == 1
    _both(pool, model, m, BatchBuilder().remove([3]))
    assert _held(pool, m) == {1, 2, 3} and pool.copy_removals == 1 and pool.copies(m) == {}
    assert pool.contains(np.array(sorted(pool.resident_canonical(m)), np.uint64)).all()
    _both(pool, model, m, BatchBuilder().remove([3]))
    assert _held(pool, m) == {1, 2}


def test_parallel_siblings_count_every_copy() -> None:
    """n > 1 siblings computing one prompt: each sends the whole prompt as its own store."""
    pool, model, m = _pools(reports=False)
    for _ in range(3):
        _both(pool, model, m, BatchBuilder().store([1, 2, 3], TOK))
    assert pool.copies(m) == {1: 3, 2: 3, 3: 3}
    for _ in range(2):
        _both(pool, model, m, BatchBuilder().remove([3]).remove([2]).remove([1]))
    assert _held(pool, m) == {1, 2, 3} and pool.copies(m) == {}
    _both(pool, model, m, BatchBuilder().remove([3]).remove([2]).remove([1]))
    assert _held(pool, m) == set() and not pool.table.any()


def test_with_reports_a_parentless_store_of_held_blocks_is_ambiguous_and_not_counted() -> None:
    """vLLM's report mode re-announces a cache hit (prefix from block 0, every block held): no
    new copy, so one remove drops the block; the store is counted as ambiguous."""
    pool, model, m = _pools(reports=True)
    _both(pool, model, m, BatchBuilder().store([1, 2, 3], TOK))
    _both(pool, model, m, BatchBuilder().store([1, 2], TOK[: 2 * BS]))
    assert pool.copies(m) == {} and pool.ambiguous_stores == 1 and pool.report_stores == 2
    # with a parent it cannot be a report: copies
    _both(pool, model, m, BatchBuilder().store([3], TOK[2 * BS :], parent=2))
    assert pool.copies(m) == {3: 2} and pool.ambiguous_stores == 1
    # no parent and a block not held: still the report of a hit the relay lost track of (an
    # earlier wrong guess's miss); the held blocks are not copies, the new one is an edge
    _both(pool, model, m, BatchBuilder().store([1, 2, 3, 4], TOK + [7] * BS))
    assert pool.copies(m) == {3: 2} and pool.ambiguous_stores == 2 and 4 in _held(pool, m)
    _both(pool, model, m, BatchBuilder().remove([1]))
    assert 1 not in _held(pool, m)


def test_with_reports_a_lost_copy_never_turns_a_later_report_into_a_phantom() -> None:
    """The sequence that made a phantom: a one-block prompt's recomputed block taken as a report
    (the engine holds two copies, the relay one), the spare copy evicted (the relay drops the
    block: a miss), then a full report of the hit [1, 2] with no parent. Counting 2 as a copy
    there (1 was not held) left 2 held after the engine's only copy went."""
    pool, model, m = _pools(reports=True)
    _both(pool, model, m, BatchBuilder().store([1, 2], TOK[: 2 * BS]))
    _both(pool, model, m, BatchBuilder().store([1], TOK[:BS]))  # recomputed: ambiguous
    _both(pool, model, m, BatchBuilder().remove([1]))  # the engine still holds a copy of 1
    _both(pool, model, m, BatchBuilder().store([1, 2], TOK[: 2 * BS]))  # the report of the hit
    _both(pool, model, m, BatchBuilder().remove([2]))  # the engine's only 2
    assert 2 not in _held(pool, m) and pool.copies(m) == {}


def test_the_engine_saying_what_a_store_is_decides() -> None:
    """An ``origin`` on the store (new blocks / report) overrides the inference both ways."""
    pool, model, m = _pools(reports=True)
    _both(pool, model, m, BatchBuilder().store([1, 2, 3], TOK))
    _both(pool, model, m, BatchBuilder().store([1, 2], TOK[: 2 * BS], origin=ORIGIN_NEW))
    _both(pool, model, m, BatchBuilder().store([3], TOK[2 * BS :], parent=2, origin=ORIGIN_REPORT))
    assert pool.copies(m) == {1: 2, 2: 2} and pool.ambiguous_stores == 0
    assert (pool.duplicate_stores, pool.report_stores) == (2, 1)


def test_many_copies_in_one_batch_grow_the_copy_table_and_a_clear_empties_it() -> None:
    pool, model, m = _pools(reports=False)
    n = 300
    toks = np.arange(n * BS, dtype=np.uint32)
    _both(pool, model, m, BatchBuilder().store(list(range(1, n + 1)), toks))
    _both(pool, model, m, BatchBuilder().store(list(range(1, n + 1)), toks))
    assert len(pool.copies(m)) == n and pool.memory_breakdown()["copies"] > 16 * n
    _both(pool, model, m, BatchBuilder().clear())
    assert pool.copies(m) == {} and _held(pool, m) == set()
    pool.reset_member(m)
    assert pool.memory_breakdown()["copies"] < 100  # back to the empty table


def test_a_member_without_copies_costs_no_copy_table() -> None:
    pool, _, m = _pools(reports=False)
    pool.apply(m, BatchBuilder().store([1, 2, 3], TOK).build())
    assert pool.memory_breakdown()["copies"] <= 2 * 12 + 16


def _copy_pool() -> Pool:
    pool = Pool(64, 7, BS, 1)
    m = pool.add_member(9, 0)
    pool.apply(m, BatchBuilder().store([1, 2, 3], TOK).build())
    pool.apply(m, BatchBuilder().store([1, 2, 3], TOK).store([3], TOK[2 * BS :], parent=2).build())
    assert pool.copies(m) == {1: 2, 2: 2, 3: 3}
    return pool


def _restore(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> Pool:
    return Pool.from_state(meta, arrays, bucket_count=64, seed=7, block_size=BS, hash_format=1)


def test_copy_counts_go_through_a_state_handover() -> None:
    pool = _copy_pool()
    meta, arrays = pool.export_state()
    back = _restore(meta, {k: a.copy() for k, a in arrays.items()})
    assert back.snapshot_state() == pool.snapshot_state()
    for p in (pool, back):
        p.apply(0, BatchBuilder().remove([3]).remove([3]).remove([1]).build())
    assert back.snapshot_state() == pool.snapshot_state()
    assert back.copies(0) == pool.copies(0) == {2: 2}


def test_a_version_2_state_reads_with_every_hash_held_once() -> None:
    pool = Pool(64, 7, BS, 1)
    pool.add_member(9, 0)
    pool.apply(0, BatchBuilder().store([1, 2, 3], TOK).build())
    meta, arrays = pool.export_state()
    old = {k: a.copy() for k, a in arrays.items() if not k.startswith("m0.c")}
    assert 2 in Pool.READABLE_STATE_VERSIONS and Pool.STATE_VERSION == 3
    back = _restore(meta, old)
    assert back.snapshot_state() == pool.snapshot_state() and back.copies(0) == {}


@pytest.mark.parametrize("damage", ["stray", "count", "live", "size"])
def test_an_inconsistent_copy_table_is_refused(damage: str) -> None:
    pool = _copy_pool()
    meta, arrays = pool.export_state()
    a = {k: v.copy() for k, v in arrays.items()}
    keys, vals, cm = a["m0.ckeys"], a["m0.cvals"], a["m0.cmeta"]
    used = np.flatnonzero(vals != 0xFFFFFFFF)
    if damage == "stray":  # a copy count for a hash the member does not hold
        keys[used[0]] = 999
        why = "edges it does not have"
    elif damage == "count":
        vals[used[0]] = 1 << 30
        why = "out of range"
    elif damage == "live":
        cm[0] += 1
        why = "count or room"
    else:
        a["m0.ckeys"] = keys[:1]
        a["m0.cvals"] = vals[:1]
        why = "size"
    with pytest.raises(ValueError, match=why):
        _restore(meta, a)


def test_an_origin_array_of_the_wrong_length_is_a_malformed_batch() -> None:
    pool, _, m = _pools(reports=False)
    b = BatchBuilder().store([1], TOK[:BS]).store([2], TOK[:BS]).build()
    b.origin = np.ones(1, dtype=np.uint8)
    with pytest.raises(MalformedBatch, match="origin"):
        pool.apply(m, b)
    assert pool.lineage(m) == {}
