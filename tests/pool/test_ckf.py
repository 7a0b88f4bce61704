"""CKF kernels: §12.2 golden vectors, §6.2 sizing, and the numba lane vs the naive model."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.pool import ckf
from tests.support.pool_model import RefCKF

A2_SEED = 0x1234_5678_9ABC_DEF0


def test_a2_golden_vectors() -> None:
    hs = [0, 1, 0x0123456789ABCDEF, 0xFFFFFFFFFFFFFFFF]
    fps, a, b = ckf.probe(A2_SEED, 1024, hs)
    assert fps.tolist() == [7750, 64153, 45802, 31767]
    assert a.tolist() == [587, 348, 865, 112]
    assert b.tolist() == [372, 36, 909, 217]


def test_a2_properties_first_10000() -> None:
    hs = np.arange(10000, dtype=np.uint64)
    fps, a, b = ckf.probe(A2_SEED, 1024, hs)
    assert np.all(fps != 0)
    assert np.all(a != b)
    deltas = ckf.make_deltas(np.uint64(A2_SEED), np.uint64(1023))
    assert np.array_equal(b ^ deltas[fps], a)  # alt(b, fp) == a
    ref = RefCKF(1024, A2_SEED)
    for h in range(0, 10000, 97):
        assert ref.addr(h) == (int(fps[h]), int(a[h]), int(b[h]))


def test_bucket_sizing_examples() -> None:
    cases = {1: 2, 16: 8, 32: 16, 64: 32, 256: 128, 1_048_576: 524_288, 10_000_000: 4_194_304}
    for expected, buckets in cases.items():
        assert ckf.bucket_count_for(expected) == buckets


def test_lane_rng_matches_spec_formula() -> None:
    m = 0xFFFF_FFFF_FFFF_FFFF
    seed = 0x5DEECE66D1B54A33
    s = (seed ^ 0x9E3779B97F4A7C15) + 0x9E3779B97F4A7C15 & m
    z = ((s ^ (s >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    assert ckf.lane_rng_state(seed) == z ^ (z >> 31)


@settings(max_examples=60, deadline=None)
@given(
    buckets=st.sampled_from([2, 4, 8, 16, 64]),
    max_kicks=st.sampled_from([0, 1, 3, 20, 500]),
    seed=st.integers(0, 2**64 - 1),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 120)), min_size=1, max_size=150),
)
def test_lane_matches_naive_model(
    buckets: int, max_kicks: int, seed: int, ops: list[tuple[bool, int]]
) -> None:
    """Insert/remove sequences (kicks, rollbacks, duplicates) give byte-identical tables; the
    replayed publications rebuild the table; rolled-back inserts leave no dirty trace."""
    lane = ckf.Lane(buckets, seed, max_kicks)
    ref = RefCKF(buckets, seed)
    replica = lane.table.copy()
    present: list[int] = []
    for is_insert, key in ops:
        h = (key * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
        if is_insert:
            before_tab = lane.table.copy()
            before_dirty = lane.pending_dirty
            ok = bool(lane.insert([h])[0])
            assert ok == ref.insert(h, max_kicks)
            if ok:
                present.append(h)
            else:
                assert np.array_equal(lane.table, before_tab)
                assert lane.pending_dirty == before_dirty
        elif h in present:
            present.remove(h)
            assert bool(lane.remove([h])[0]) and ref.remove(h)
        assert np.array_equal(lane.table, ref.words())
        if present:
            assert lane.contains(present).all()
        pub = lane.take_publication()
        if pub is not None:
            bk, words = pub
            assert bk.size > 0 and len(set(bk.tolist())) == bk.size
            assert np.all(replica[bk] != words)  # only net changes are shipped
            replica[bk] = words
        assert np.array_equal(replica, lane.table)


def test_net_reverted_buckets_are_not_published() -> None:
    lane = ckf.Lane(1024, 7)
    hs = np.arange(1, 200, dtype=np.uint64)
    assert lane.insert(hs).all()
    assert lane.remove(hs).all()
    assert lane.pending_dirty > 0
    assert lane.take_publication() is None
    assert lane.pending_dirty == 0
    assert not lane.table.any()


def test_publication_first_touch_order() -> None:
    lane = ckf.Lane(1 << 16, 99)
    hs = np.array([11, 22, 33], dtype=np.uint64)
    _, a, _ = ckf.probe(99, 1 << 16, hs)
    assert lane.insert(hs).all()
    pub = lane.take_publication()
    assert pub is not None
    assert pub[0].tolist() == list(dict.fromkeys(a.tolist()))
    assert np.array_equal(pub[1], lane.table[pub[0]])


def test_remove_unknown_reports_false_and_changes_nothing() -> None:
    lane = ckf.Lane(64, 5)
    lane.insert(np.arange(10, dtype=np.uint64))
    lane.take_publication()
    before = lane.table.copy()
    hs = np.arange(1000, 1050, dtype=np.uint64)
    present = lane.contains(hs)
    ok = lane.remove(hs[~present])
    assert not ok.any()
    assert np.array_equal(before, lane.table)
    assert lane.take_publication() is None


def test_capacity_exhaustion_rolls_back_byte_identical() -> None:
    lane = ckf.Lane(2, 3, max_kicks=50)
    ok = lane.insert(np.arange(1, 40, dtype=np.uint64))
    assert ok.sum() <= 8 and not ok.all()
    ref = RefCKF(2, 3)
    assert [ref.insert(h, 50) for h in range(1, 40)] == ok.tolist()
    assert np.array_equal(lane.table, ref.words())


def test_plain_contains_over_copied_table() -> None:
    lane = ckf.Lane(4096, 0xABC)
    hs = np.arange(5000, 6000, dtype=np.uint64)
    lane.insert(hs)
    copy = lane.table.copy()
    assert ckf.contains(copy, 0xABC, hs).all()
    ref = RefCKF(4096, 0xABC)
    for h in hs.tolist():
        ref.insert(h, 500)
    probes = np.arange(10**6, 10**6 + 3000, dtype=np.uint64)
    got = ckf.contains(copy, 0xABC, probes)
    assert got.tolist() == [ref.contains(h) for h in probes.tolist()]
