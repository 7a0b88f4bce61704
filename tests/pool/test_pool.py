"""Targeted pool behaviour: typed rejections leave state untouched, refcount/residency rules,
re-offers, spec hashing vectors through the apply kernel, and memory accounting."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvrelay.pool.batch import OP_STORE, BatchBuilder, EventBatch
from kvrelay.pool.errors import (
    InvalidBlockSequence,
    MalformedBatch,
    ParentBlockNotFound,
    TokenCountMismatch,
    UnknownMember,
    UnknownOp,
)
from kvrelay.pool.pool import Pool
from tests.support.pool_model import RefCKF, chain, lora_salt

SEED = 0x5DEECE66D1B54A33


def root_canon(tokens: list[int], salt: int = 1337) -> int:
    return xxhash.xxh3_64_intdigest(np.asarray(tokens, "<u4").tobytes(), seed=salt)


def snapshot(pool: Pool) -> tuple[object, ...]:
    return (
        *pool.snapshot_state(),
        pool.pending_dirty,
        pool.lane.rng.copy().tolist(),
        pool.memberships,
        pool.occupancy,
    )


def seeded_pool(block_size: int = 4, fmt: int = 1) -> tuple[Pool, int]:
    pool = Pool(1024, SEED, block_size, fmt)
    m = pool.add_member(7, 0)
    extra = 1 if fmt == 2 else 0
    pool.apply(m, BatchBuilder().store([1, 2], list(range(2 * block_size + extra))).build())
    return pool, m


@pytest.mark.parametrize(
    ("batch", "exc"),
    [
        (BatchBuilder().store([10], [1, 2, 3]).build(), TokenCountMismatch),
        (BatchBuilder().store([10, 11], [1, 2, 3, 4, 5]).build(), TokenCountMismatch),
        (BatchBuilder().store([10], [1, 2, 3, 4], parent=999).build(), ParentBlockNotFound),
        (BatchBuilder().store([10, 10], list(range(8))).build(), InvalidBlockSequence),
        (BatchBuilder().store([10, 2], list(range(8)), parent=2).build(), InvalidBlockSequence),
        # conflicting re-store: ext 1 is already a root of tokens 0..3, now different tokens
        (BatchBuilder().store([1], [9, 9, 9, 9]).build(), InvalidBlockSequence),
        # ext 2 re-stored as a root (different canonical than its chained one)
        (BatchBuilder().store([2], [4, 5, 6, 7]).build(), InvalidBlockSequence),
        # valid first block, conflicting second block: whole event rejected
        (BatchBuilder().store([50, 1], list(range(20, 28))).build(), InvalidBlockSequence),
        (
            BatchBuilder().store([*range(100, 140), 100], list(range(41 * 4))).build(),
            InvalidBlockSequence,
        ),
    ],
)
def test_rejected_event_leaves_state_unchanged(batch: EventBatch, exc: type) -> None:
    pool, m = seeded_pool()
    pool.take_publication()
    before = snapshot(pool)
    res = pool.apply(m, batch)
    assert res.events_rejected == 1 and res.events_applied == 0
    assert len(res.errors) == 1 and isinstance(res.errors[0][1], exc)
    assert res.errors[0][0] == 0
    assert snapshot(pool) == before
    assert pool.take_publication() is None
    assert pool.errors_by_kind[exc.kind] == 1
    assert pool.first_error is not None and isinstance(pool.first_error[1], exc)
    assert pool.events_rejected == 1


def test_rejection_is_per_event_and_later_events_apply() -> None:
    pool, m = seeded_pool()
    b = (
        BatchBuilder()
        .store([10], [1, 2, 3], parent=2)
        .store([11], [1, 2, 3, 4], parent=2)
        .store([12], [1, 2, 3, 4], parent=404)
        .remove([11])
        .build()
    )
    res = pool.apply(m, b)
    assert [(i, type(e)) for i, e in res.errors] == [
        (0, TokenCountMismatch),
        (2, ParentBlockNotFound),
    ]
    assert (res.events_applied, res.blocks_stored, res.blocks_removed) == (2, 1, 1)
    assert set(pool.lineage(m)) == {1, 2}
    assert isinstance(pool.first_error[1], TokenCountMismatch)  # type: ignore[index]
    assert isinstance(pool.last_error[1], ParentBlockNotFound)  # type: ignore[index]


def test_eagle_token_counts() -> None:
    pool, m = seeded_pool(block_size=2, fmt=2)
    # 2 blocks need 5 tokens in Eagle; 4 is a mismatch
    assert isinstance(
        pool.apply(m, BatchBuilder().store([5, 6], [0, 1, 2, 3]).build()).errors[0][1],
        TokenCountMismatch,
    )
    res = pool.apply(m, BatchBuilder().store([5, 6], [0, 1, 2, 3, 4]).build())
    assert res.blocks_stored == 2
    # §12.1: Eagle windows of tokens 0..5, B=2 are [0,1,2] and [2,3,4]
    b0 = root_canon([0, 1, 2])
    b1 = xxhash.xxh3_64_intdigest(np.asarray([2, 3, 4], "<u4").tobytes(), seed=1337)
    assert pool.lineage(m)[5] == b0 and pool.lineage(m)[6] == chain(b0, b1)


def test_spec_sequence_vector_through_kernel() -> None:
    """docs/contract.md §12.5: tokens 0..31, bs 16 → sequence hashes."""
    pool = Pool(1024, SEED, 16, 1)
    m = pool.add_member(1, 0)
    pool.apply(m, BatchBuilder().store([1, 2], list(range(32))).build())
    assert pool.lineage(m) == {1: 0xD47A8F41C833328A, 2: 0xBF15DFFB16447F38}
    pool.apply(
        m,
        BatchBuilder()
        .store(
            [3],
            [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
            salt=lora_salt("adapter-a"),
        )
        .build(),
    )
    assert pool.lineage(m)[3] == root_canon(list(range(1, 17)), lora_salt("adapter-a"))


def test_multimodal_hashes_are_appended_sorted() -> None:
    pool = Pool(1024, SEED, 2, 1)
    m = pool.add_member(1, 0)
    pool.apply(m, BatchBuilder().store([1, 2], [5, 6, 7, 8], mm=[[30, 10], []]).build())
    raw = (
        np.asarray([5, 6], "<u4").tobytes()
        + (10).to_bytes(8, "little")
        + (30).to_bytes(8, "little")
    )
    c0 = xxhash.xxh3_64_intdigest(raw, seed=1337)
    assert pool.lineage(m)[1] == c0
    assert pool.lineage(m)[2] == chain(c0, root_canon([7, 8]))


@pytest.mark.parametrize("block_size", [61, 64, 128])
def test_long_blocks_take_the_xxh3_long_path_inside_the_kernel(block_size: int) -> None:
    """Blocks over 240 bytes (> 60 tokens) hash through XXH3's long-input path, which the apply
    kernel reaches without numba's runtime (caller-owned scratch), with and without a salt and
    with multimodal values appended."""
    rng = np.random.default_rng(block_size)
    toks = rng.integers(0, 2**32, size=2 * block_size, dtype=np.uint64).astype(np.uint32)
    salt = lora_salt("adapter-a")
    pool = Pool(1024, SEED, block_size, 1)
    m = pool.add_member(1, 0)
    result = pool.apply(
        m,
        BatchBuilder()
        .store([1, 2], toks, salt=salt)
        .store([3], toks[:block_size], mm=[[99, 7]])
        .build(),
    )
    assert result.events_rejected == 0
    b0 = xxhash.xxh3_64_intdigest(toks[:block_size].astype("<u4").tobytes(), seed=salt)
    b1 = xxhash.xxh3_64_intdigest(toks[block_size:].astype("<u4").tobytes(), seed=salt)
    mm_raw = (
        toks[:block_size].astype("<u4").tobytes()
        + (7).to_bytes(8, "little")
        + (99).to_bytes(8, "little")
    )
    assert pool.lineage(m) == {
        1: b0,
        2: chain(b0, b1),
        3: xxhash.xxh3_64_intdigest(mm_raw, seed=1337),
    }


def test_namespace_inheritance() -> None:
    ns = xxhash.xxh3_64_intdigest(b"tenant", seed=1)
    pool = Pool(1024, SEED, 2, 1)
    m = pool.add_member(1, 0)
    pool.apply(m, BatchBuilder().store([1], [1, 2], salt=1337 + ns, ns_part=ns).build())
    pool.apply(m, BatchBuilder().store([2], [3, 4], parent=1, ns_inherit=True).build())
    pool.apply(m, BatchBuilder().store([3], [5, 6], parent=2, ns_inherit=True).build())
    c1 = root_canon([1, 2], 1337 + ns)
    c2 = chain(c1, root_canon([3, 4], 1337 + ns))
    c3 = chain(c2, root_canon([5, 6], 1337 + ns))
    assert pool.lineage(m) == {1: c1, 2: c2, 3: c3}
    # the namespace follows edges: after removing block 2, a re-store of 2 no longer sees it
    pool.apply(m, BatchBuilder().remove([2, 3]).build())
    pool.apply(m, BatchBuilder().store([2], [3, 4], parent=1, ns_inherit=True).build())
    assert pool.lineage(m)[2] == c2
    pool.apply(m, BatchBuilder().clear().build())
    assert pool.lineage(m) == {} and pool.memberships == 0


def test_refcount_and_one_fingerprint_per_canonical() -> None:
    pool = Pool(1024, SEED, 2, 1)
    a, b, c = (pool.add_member(w, r) for w, r in [(1, 0), (1, 1), (2, 0)])
    for mem, ext in [(a, 10), (b, 20), (c, 30)]:
        pool.apply(mem, BatchBuilder().store([ext], [1, 2]).build())
    # alias inside one member: different external hash, same canonical → counts separately
    pool.apply(a, BatchBuilder().store([11], [1, 2]).build())
    h = root_canon([1, 2])
    assert pool.owners() == {h: (4, True)}
    assert pool.occupancy == 1 and pool.distinct_canonical == 1 and pool.memberships == 4
    nz = int(
        sum(((pool.table >> np.uint64(16 * s)) & np.uint64(0xFFFF) != 0).sum() for s in range(4))
    )
    assert nz == 1
    pool.apply(b, BatchBuilder().clear().build())  # only that rank
    assert pool.owners() == {h: (3, True)}
    pool.remove_member(c)
    pool.apply(a, BatchBuilder().remove([10, 10, 999]).build())
    assert pool.owners() == {h: (1, True)} and pool.unknown_removals == 2
    pool.apply(a, BatchBuilder().remove([11]).build())
    assert pool.owners() == {} and not pool.table.any()
    assert pool.contains([h]).tolist() == [False]
    with pytest.raises(UnknownMember):
        pool.apply(c, BatchBuilder().clear().build())
    assert pool.add_member(2, 0) != c  # ids are not reused


def _fill_to_omission(pool: Pool, member: int) -> tuple[int, int]:
    """Store single-block roots until one is capacity-omitted; returns (ext, canonical)."""
    for i in range(1, 200):
        res = pool.apply(member, BatchBuilder().store([i], [i, 0]).build())
        if res.capacity_omissions:
            return i, root_canon([i, 0])
    raise AssertionError("table never filled")


def _freed_bucket(pool: Pool, c: int) -> int:
    """The bucket whose slot a removal of resident ``c`` frees (bucket a is searched first)."""
    fp, ba, bb = RefCKF(pool.bucket_count, SEED).addr(c)
    word = int(pool.table[ba])
    return ba if fp in [(word >> (16 * s)) & 0xFFFF for s in range(4)] else bb


def test_non_resident_owner_rules() -> None:
    pool = Pool(8, SEED, 2, 1, max_kicks=500)
    a, b = pool.add_member(1, 0), pool.add_member(2, 0)
    ext, h = _fill_to_omission(pool, a)
    assert pool.owners()[h] == (1, False)
    assert not pool.contains([h])[0]
    ref = RefCKF(8, SEED)
    _, ha, hb = ref.addr(h)
    # Free a slot far from h's home buckets: kicks could now place h, home buckets still full.
    # (Candidates in external-hash order: the choice must not depend on the table layout.)
    others = {e: c for e, c in sorted(pool.lineage(a).items()) if e != ext}
    far = [
        e
        for e, c in others.items()
        if not set(RefCKF(8, SEED).addr(c)[1:]) & {ha, hb} and pool.owners()[c][1]
    ]
    assert far
    pool.apply(a, BatchBuilder().remove([far[0]]).build())
    # n→n+1 for a non-resident owner: admission without relocation only → still omitted
    pool.apply(b, BatchBuilder().store([ext], [ext, 0]).build())
    assert pool.owners()[h] == (2, False)
    # Free a slot in a home bucket, then a re-offer (same ext, same canonical) admits it.
    home = [
        e
        for e, c in others.items()
        if e in pool.lineage(a) and pool.owners()[c][1] and _freed_bucket(pool, c) in (ha, hb)
    ]
    pool.apply(a, BatchBuilder().remove([home[0]]).build())
    res = pool.apply(a, BatchBuilder().store([ext], [ext, 0]).build())
    assert res.blocks_stored == 0  # re-offer creates no ownership
    assert pool.owners()[h][1] is True
    assert pool.contains([h])[0]


def test_malformed_batches_are_refused_whole() -> None:
    pool, m = seeded_pool()
    before = snapshot(pool)
    good = BatchBuilder().store([9], [1, 2, 3, 4]).build()
    bad_off = EventBatch(
        **{**{f: getattr(good, f) for f in good.__slots__}, "blk_off": np.array([0, 2], np.int64)}
    )
    bad_len = EventBatch(
        **{**{f: getattr(good, f) for f in good.__slots__}, "salt": np.zeros(3, np.uint64)}
    )
    bad_tok = EventBatch(
        **{**{f: getattr(good, f) for f in good.__slots__}, "tok_off": np.array([0, 9], np.int64)}
    )
    clr = BatchBuilder().clear().build()
    bad_clear = EventBatch(
        **{
            **{f: getattr(clr, f) for f in clr.__slots__},
            "blk_off": np.array([0, 1], np.int64),
            "ext_hashes": np.array([1], np.uint64),
        }
    )
    bad_dtype = EventBatch(
        **{**{f: getattr(good, f) for f in good.__slots__}, "tokens": np.array([1.5, 2, 3, 4])}
    )
    for bad in (bad_off, bad_len, bad_tok, bad_clear, bad_dtype):
        with pytest.raises(MalformedBatch):
            pool.apply(m, bad)
    assert pool.errors_by_kind["malformed_batch"] == 5
    assert snapshot(pool) == before
    odd = EventBatch(
        **{**{f: getattr(good, f) for f in good.__slots__}, "ops": np.array([9], np.uint8)}
    )
    res = pool.apply(m, odd)
    assert isinstance(res.errors[0][1], UnknownOp) and snapshot(pool)[:3] == before[:3]
    assert good.ops[0] == OP_STORE
    # convertible dtypes (python ints, int32 offsets) are accepted
    conv = EventBatch(
        **{
            **{f: getattr(good, f) for f in good.__slots__},
            "tok_off": np.array([0, 4], np.int32),
            "tokens": [1, 2, 3, 4],
        }
    )
    assert pool.apply(m, conv).blocks_stored == 1
    assert pool.lineage(m)[9] == root_canon([1, 2, 3, 4])


def test_memory_accounting_counts_real_arrays() -> None:
    pool = Pool(1 << 12, SEED, 1, 1)
    m = pool.add_member(1, 0)
    n = 5000
    bb = BatchBuilder().store(np.arange(1, n + 1, dtype=np.uint64), np.arange(n) % 65536)
    pool.apply(m, bb.build())
    assert pool.memberships == n
    per = pool.memory_bytes() / n
    assert 12 < per < 48
