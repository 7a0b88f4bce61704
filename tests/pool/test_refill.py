"""``Pool.refiltered``: the exact state kept, the filter rebuilt from the owners under another
bucket count or seed, equal to the reference model's filter fed the same owners in the same
order (kicks and capacity omissions included)."""

from __future__ import annotations

import numpy as np

from kvrelay.pool.batch import BatchBuilder
from kvrelay.pool.pool import Pool, filter_divergence
from tests.pool.test_verify import _pool
from tests.support.pool_model import RefCKF


def _lineages(p: Pool) -> dict[int, dict[int, int]]:
    return {mid: p.lineage(mid) for mid in p.members()}


def _check(old: Pool, new: Pool, bucket_count: int, seed: int) -> None:
    assert new.members() == old.members() and _lineages(new) == _lineages(old)
    assert {h: c for h, (c, _r) in new.owners().items()} == {
        h: c for h, (c, _r) in old.owners().items()}
    keys, _pays, _slots = new._own.entries()  # owner-slot order: the order refill inserts in
    ref = RefCKF(bucket_count, seed)
    fits = {int(h): ref.insert(int(h), new.max_kicks) for h in keys}
    assert new.table.tolist() == ref.words().tolist()
    assert {h for h, (_c, r) in new.owners().items() if r} == {h for h, ok in fits.items() if ok}
    assert new.occupancy == sum(fits.values())
    assert filter_divergence(new._own.tm, new._own.w, new.table, np.uint64(new.seed),
                             new._deltas) is None  # fmt: skip
    assert new.pending_dirty == 0, "a new generation starts with nothing pending"


def test_another_bucket_count_or_seed_keeps_the_exact_state() -> None:
    old = _pool(11, chains=60)
    before = (old.table.copy(), old.owners(), _lineages(old))
    for bc, seed in ((1024, 99), (256, 12345), (64, 5)):  # 64 buckets: omissions
        new = old.refiltered(bc, seed)
        _check(old, new, bc, seed)
        if bc == 64:
            assert new.occupancy < len(new.owners()) and new.capacity_omissions > 0
    assert old.table.tolist() == before[0].tolist(), "the old pool is left as it was"
    assert old.owners() == before[1] and _lineages(old) == before[2]


def test_a_refiltered_pool_goes_on_like_the_old_one() -> None:
    old = _pool(12)
    new = old.refiltered(1024, 7)
    b = BatchBuilder()
    b.store([2**62 + 1, 2**62 + 2], np.arange(8, dtype=np.uint32) + 77, parent=None)
    mid = next(iter(old.members()))
    for p in (old, new):
        p.apply(mid, b.build())
    assert _lineages(new) == _lineages(old)
    assert set(new.owners()) == set(old.owners())
    resident = [h for h, (_c, r) in new.owners().items() if r]
    assert new.contains(np.array(resident, dtype=np.uint64)).all()


def test_a_refiltered_pool_keeps_copy_counts_and_the_reports_setting() -> None:
    """The exact state includes physical copies and whether engines send reports: a reload of
    ``expected_blocks`` or ``ckf_seed`` must not turn a held copy into a lost block."""
    toks = np.arange(12, dtype=np.uint32)
    for reports in (False, True):
        old = Pool(256, 5, 4, 1, reports=reports)
        mid = old.add_member(1, 0)
        old.apply(mid, BatchBuilder().store([1, 2, 3], toks, parent=None).build())
        old.apply(mid, BatchBuilder().store([3], toks[8:], parent=2).build())
        assert old.copies(mid) == {3: 2}
        new = old.refiltered(1024, 7)
        assert new.reports is reports
        assert new.copies(mid) == {3: 2}
        new.apply(mid, BatchBuilder().remove([3]).build())
        assert 3 in new.lineage(mid), "one copy of block 3 is still held"
