"""The numba pool against the pure-Python reference model, over random multi-member histories.

Shared documents give shared prefixes across members; external hashes are a deterministic function
of (document, block, LoRA, namespace) like an engine fleet with one hash seed. Tiny tables force
kicks and capacity omissions. After every batch the full state is compared with the model, and a
replica rebuilt only from ``take_publication()`` must equal the producer table byte for byte.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import event, given, settings
from hypothesis import strategies as st
from numba import njit

from kvrelay.pool import ckf
from kvrelay.pool import packed as pk
from kvrelay.pool.apply import ST_CAPACITY
from kvrelay.pool.batch import BatchBuilder, EventBatch, PackedBatch
from kvrelay.pool.pool import Pool
from tests.support.pool_model import Counts, RefPool, lora_salt

BS = 2
DOC_BLOCKS = 6
N_DOCS = 2
LORAS = [None, "adapter-a"]
NAMESPACES = [None, "tenant-x"]


def ns_component(ns: str | None) -> int:
    return xxhash.xxh3_64_intdigest(ns.encode(), seed=1) if ns else 0


def doc_tokens(doc: int, wrong: bool = False) -> np.ndarray:
    rng = np.random.default_rng(doc)
    t = rng.integers(0, 50, size=DOC_BLOCKS * BS + 1).astype(np.uint32)
    if wrong:
        t = t + np.uint32(1000)
    return t


def ext_hash(doc: int, blk: int, lora: int, ns: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{doc}/{blk}/{lora}/{ns}".encode())


@dataclass(frozen=True)
class Store:
    doc: int
    start: int
    count: int
    lora: int
    ns: int
    wrong: bool
    bad_tokens: bool
    self_ref: bool
    origin: int = 0  # what the engine says the store is (EventBatch.origin)


@dataclass(frozen=True)
class Remove:
    keys: tuple[tuple[int, int, int, int], ...]
    unknown: int


@dataclass(frozen=True)
class Clear:
    pass


stores = st.builds(
    Store,
    doc=st.integers(0, N_DOCS - 1),
    start=st.sampled_from([0, 0, 0, 0, 1, 2, 2, 3, 4, 5]),
    count=st.integers(1, 4),
    lora=st.sampled_from([0, 0, 0, 1]),
    ns=st.sampled_from([0, 0, 0, 1]),
    wrong=st.sampled_from([False] * 12 + [True]),
    bad_tokens=st.sampled_from([False] * 15 + [True]),
    self_ref=st.sampled_from([False] * 15 + [True]),
    origin=st.sampled_from([0] * 8 + [1, 2]),
)
removes = st.builds(
    Remove,
    keys=st.lists(
        st.tuples(
            st.integers(0, N_DOCS - 1),
            st.integers(0, DOC_BLOCKS - 1),
            st.integers(0, 1),
            st.integers(0, 1),
        ),
        min_size=1,
        max_size=3,
    ).map(tuple),
    unknown=st.integers(0, 1),
)
events = st.one_of(stores, stores, stores, stores, stores, removes, removes, st.just(Clear()))
batches = st.tuples(
    st.integers(0, 3),
    st.sampled_from(["batch"] * 9 + ["reset"]),
    st.lists(events, min_size=1, max_size=5),
)


def build(evts: list[Store | Remove | Clear], eagle: bool) -> EventBatch:
    """As the decoder writes it: a root store names its namespace, each other store takes its
    parent's (a namespace component of 0 is no namespace)."""
    bb = BatchBuilder()
    for e in evts:
        if isinstance(e, Store):
            count = min(e.count, DOC_BLOCKS - e.start)
            toks = doc_tokens(e.doc, e.wrong)
            win_end = (e.start + count) * BS + (1 if eagle else 0)
            tokens = toks[e.start * BS : win_end]
            if e.bad_tokens:
                tokens = tokens[:-1]
            hashes = [ext_hash(e.doc, e.start + j, e.lora, e.ns) for j in range(count)]
            parent = ext_hash(e.doc, e.start - 1, e.lora, e.ns) if e.start > 0 else None
            if e.self_ref:
                if parent is not None:
                    hashes[-1] = parent
                else:
                    hashes.append(hashes[0])
                    tokens = toks[e.start * BS : win_end + BS]
            base = lora_salt(LORAS[e.lora])
            ns = ns_component(NAMESPACES[e.ns])
            root = parent is None
            bb.store(
                hashes,
                tokens,
                parent=parent,
                salt=(base + (ns if root else 0)) & 0xFFFF_FFFF_FFFF_FFFF,
                ns_part=ns if root else 0,
                ns_inherit=not root,
                origin=e.origin,
            )
        elif isinstance(e, Remove):
            hs = [ext_hash(*k) for k in e.keys] + [0xDEAD_0000 + i for i in range(e.unknown)]
            bb.remove(hs)
        else:
            bb.clear()
    return bb.build()


def packed_if_possible(batch: EventBatch) -> EventBatch | PackedBatch:
    """The batch as the walker would write it, when it could (no namespace, no origin)."""
    try:
        return PackedBatch.pack(batch)
    except ValueError:
        return batch


def check_state(pool: Pool, model: RefPool, mids: list[int]) -> None:
    assert np.array_equal(pool.table, model.ckf.words())
    owners = {c: (o[0], bool(o[1])) for c, o in model.owners.items()}
    assert pool.owners() == owners
    assert pool.distinct_canonical == len(owners)
    assert pool.occupancy == sum(1 for o in owners.values() if o[1])
    nz = sum(
        int(((pool.table >> np.uint64(16 * s)) & np.uint64(0xFFFF) != 0).sum()) for s in range(4)
    )
    assert nz == pool.occupancy
    for i, mid in enumerate(mids):
        assert pool.lineage(mid) == model.lineage.get(i, {})
        assert pool.copies(mid) == model.copies.get(i, {})
        assert set(pool.owned_canonical(mid).tolist()) == model.owned(i)
        res = model.resident(i)
        assert set(pool.resident_canonical(mid).tolist()) == res
        if res:
            assert pool.contains(np.array(sorted(res), dtype=np.uint64)).all()
    assert pool.memberships == sum(len(v) for v in model.lineage.values())


@dataclass
class RunStats:
    errors: dict[str, int]
    capacity: int
    max_ref: int
    ns_recorded: bool
    publications: int
    duplicates: int = 0
    reports: int = 0
    ambiguous: int = 0
    copy_removals: int = 0


def run_history(
    buckets: int,
    max_kicks: int,
    eagle: bool,
    history: list[tuple[int, str, list[Store | Remove | Clear]]],
    restore_every: int = 0,
    reports: bool = False,
    packed: bool = False,
) -> RunStats:
    """Drive pool and model with the same history, checking everything after each batch;
    with ``restore_every``, the pool is replaced by ``Pool.from_state`` of its own export that
    often (a relay restart with state handover): the model does not notice. ``packed``: the
    pool gets every batch a walker could write as a ``PackedBatch`` (the model the batch)."""
    seed = 0x5DEECE66D1B54A33
    fmt = 2 if eagle else 1
    pool = Pool(buckets, seed, BS, fmt, max_kicks, reports=reports)
    model = RefPool(buckets, seed, BS, fmt, max_kicks, reports=reports)
    dup = [0, 0, 0, 0]
    mids = [pool.add_member(100 + i // 2, i % 2) for i in range(4)]
    assert mids == [pool.add_member(100 + i // 2, i % 2) for i in range(4)]
    replica = pool.table.copy()
    errors_seen = 0
    cap_seen = 0
    max_ref = 0
    ns_rec = False
    pubs = 0
    names = {"ParentBlockNotFound": 1, "InvalidBlockSequence": 2, "TokenCountMismatch": 3}
    for step, (member, kind, evts) in enumerate(history):
        if restore_every and step % restore_every == restore_every - 1:
            meta, arrays = pool.export_state()
            counted = (dict(pool.errors_by_kind), pool.capacity_omissions)
            pool = Pool.from_state(
                meta, {k: a.copy() for k, a in arrays.items()}, bucket_count=buckets, seed=seed,
                block_size=BS, hash_format=fmt, max_kicks=max_kicks, reports=reports,
            )  # fmt: skip
            assert [pool.add_member(100 + i // 2, i % 2) for i in range(4)] == mids
            check_state(pool, model, mids)
            # counters are per process: carry them over so the totals below still add up
            pool.errors_by_kind.update(counted[0])
            pool._stats[ST_CAPACITY] = counted[1]
        if kind == "reset":
            pool.reset_member(mids[member])
            model.clear(member, Counts())
        else:
            batch = build(evts, eagle)
            res = pool.apply(mids[member], packed_if_possible(batch) if packed else batch)
            exp = model.apply(member, batch)
            assert res.events_applied == exp.applied
            assert res.events_rejected == exp.rejected
            assert [(i, c) for i, c in enumerate(exp.codes) if c] == [
                (i, names[type(e).__name__]) for i, e in res.errors
            ]
            assert res.blocks_stored == exp.stored
            assert res.blocks_removed == exp.removed
            assert res.unknown_removals == exp.unknown
            assert res.capacity_omissions == exp.capacity
            got = (res.duplicate_stores, res.report_stores, res.ambiguous_stores, res.copy_removals)
            assert got == (exp.duplicate, exp.report, exp.ambiguous, exp.copy_removed)
            for j, v in enumerate(got):
                dup[j] += v
            errors_seen += exp.rejected
            cap_seen += exp.capacity
        check_state(pool, model, mids)
        max_ref = max([max_ref] + [o[0] for o in model.owners.values()])
        ns_rec = ns_rec or any(len(v) for v in model.ns.values())
        pub = pool.take_publication()
        if pub is not None:
            pubs += 1
            bk, words = pub
            assert bk.size > 0
            replica[bk] = words
        assert np.array_equal(replica, pool.table)
        assert pool.take_publication() is None
    assert sum(pool.errors_by_kind.values()) == errors_seen
    assert pool.capacity_omissions == cap_seen
    assert pool.invariant_violations == 0
    return RunStats(dict(pool.errors_by_kind), cap_seen, max_ref, ns_rec, pubs, *dup)


@settings(max_examples=120, deadline=None)
@given(
    buckets=st.sampled_from([2, 4, 8, 16, 1024]),
    max_kicks=st.sampled_from([0, 2, 500]),
    eagle=st.booleans(),
    history=st.lists(batches, min_size=4, max_size=30),
    reports=st.booleans(),
)
def test_pool_matches_model(
    buckets: int,
    max_kicks: int,
    eagle: bool,
    history: list[tuple[int, str, list[Store | Remove | Clear]]],
    reports: bool,
) -> None:
    r = run_history(buckets, max_kicks, eagle, history, reports=reports)
    event(f"duplicates: {r.duplicates > 0}, copy removals: {r.copy_removals > 0}")
    event(f"ambiguous: {r.ambiguous > 0}")
    for kind in r.errors:
        event(f"error:{kind}")
    event(f"capacity omissions: {'yes' if r.capacity else 'no'}")
    event(f"max refcount seen: {min(r.max_ref, 3)}")
    event(f"namespaces recorded: {r.ns_recorded}")


def _random_history(
    rng: random.Random, n: int, docs: int = N_DOCS, p_variant: float = 0.3
) -> list[tuple[int, str, list[Store | Remove | Clear]]]:
    out: list[tuple[int, str, list[Store | Remove | Clear]]] = []
    for _ in range(n):
        evts: list[Store | Remove | Clear] = []
        for _ in range(rng.randint(1, 5)):
            r = rng.random()
            if r < 0.7:
                evts.append(
                    Store(
                        doc=rng.randrange(docs),
                        start=rng.choice([0, 0, 0, 1, 2, 3, 4, 5]),
                        count=rng.randint(1, 4),
                        lora=int(rng.random() < p_variant),
                        ns=int(rng.random() < p_variant),
                        wrong=rng.random() < 0.05,
                        bad_tokens=rng.random() < 0.05,
                        self_ref=rng.random() < 0.05,
                        origin=rng.choice([0] * 8 + [1, 2]),
                    )
                )
            elif r < 0.95:
                keys = tuple(
                    (
                        rng.randrange(N_DOCS),
                        rng.randrange(DOC_BLOCKS),
                        int(rng.random() < 0.3),
                        int(rng.random() < 0.3),
                    )
                    for _ in range(rng.randint(1, 3))
                )
                evts.append(Remove(keys, rng.randint(0, 1)))
            else:
                evts.append(Clear())
        out.append((rng.randrange(4), "reset" if rng.random() < 0.05 else "batch", evts))
    return out


def test_seeded_histories_cover_every_path() -> None:
    """Long seeded histories; asserts the interesting paths were actually exercised."""
    totals: dict[str, int] = {}
    cap = 0
    max_ref = 0
    ns = False
    dups = [0, 0, 0, 0]
    for i in range(24):
        rng = random.Random(i)
        buckets = [2, 4, 8, 16, 64, 1024][i % 6]
        r = run_history(
            buckets, [500, 2, 0][i % 3], i % 4 == 3, _random_history(rng, 40), reports=i % 2 == 1
        )
        for j, v in enumerate((r.duplicates, r.reports, r.ambiguous, r.copy_removals)):
            dups[j] += v
        for k, v in r.errors.items():
            totals[k] = totals.get(k, 0) + v
        cap += r.capacity
        max_ref = max(max_ref, r.max_ref)
        ns = ns or r.ns_recorded
    for i in range(16):
        # Heavy sharing in tiny tables: non-resident owners gaining members, re-offers.
        rng = random.Random(1000 + i)
        r = run_history(
            [4, 8][i % 2],
            [500, 3][i % 2 // 1 % 2],
            False,
            _random_history(rng, 40, docs=1, p_variant=0.5),
        )
        cap += r.capacity
    assert set(totals) == {
        "parent_block_not_found",
        "invalid_block_sequence",
        "token_count_mismatch",
    }
    assert cap > 0 and max_ref >= 3 and ns
    assert all(dups), dups  # copies counted, reports taken, ambiguous stores, copies removed


class _PackedCalls:
    """Counts what ``apply_packed`` answered (the real kernel runs; only its answers are
    tallied), so a test can show the one-call path and its continuations were taken."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import kvrelay.pool.pool as pool_module

        self.applied = self.general = self.continued = 0
        kernel = pool_module.apply_packed

        def counted(*args: Any) -> int:
            code = int(kernel(*args))
            assert not args[-1].any()  # its zeros (a batch's namespace columns) stay zero
            if code == pool_module.PACKED_APPLIED:
                self.applied += 1
            elif code == pool_module.PACKED_STOPPED:  # the general loop went on from IO_STOP
                io = args[12]
                assert 0 <= io[3] < args[1]
                self.applied += 1
                self.continued += 1
            else:
                self.general += 1
            return code

        monkeypatch.setattr(pool_module, "apply_packed", counted)


def test_packed_batches_match_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch a walker could write goes to the pool packed: the one-call path, its
    continuations after a CLEAR or a table without room, and its fallbacks to the general path
    (a table to resize first, a batch that fails its checks) agree with the model batch by
    batch, state, results and publications alike."""
    calls = _PackedCalls(monkeypatch)
    totals: dict[str, int] = {}
    cap = 0
    for i in range(24):
        rng = random.Random(5000 + i)
        r = run_history(
            [2, 4, 8, 16, 64, 1024][i % 6], [500, 2, 0][i % 3], i % 4 == 3,
            _random_history(rng, 40, p_variant=0.15), reports=i % 2 == 1, packed=True,
        )  # fmt: skip
        for k, v in r.errors.items():
            totals[k] = totals.get(k, 0) + v
        cap += r.capacity
    assert calls.applied > 250 and calls.general > 20 and calls.continued > 40, vars(calls)
    kinds = {"parent_block_not_found", "invalid_block_sequence", "token_count_mismatch"}
    assert set(totals) == kinds
    assert cap > 0


@settings(max_examples=60, deadline=None)
@given(
    buckets=st.sampled_from([2, 8, 1024]),
    max_kicks=st.sampled_from([0, 500]),
    eagle=st.booleans(),
    history=st.lists(batches, min_size=4, max_size=30),
)
def test_packed_batches_match_the_model_on_any_history(
    buckets: int,
    max_kicks: int,
    eagle: bool,
    history: list[tuple[int, str, list[Store | Remove | Clear]]],
) -> None:
    run_history(buckets, max_kicks, eagle, history, packed=True)


def test_a_packed_batch_unpacks_to_the_batch_it_was_packed_from() -> None:
    rng = random.Random(3)
    for _ in range(50):
        evts = _random_history(rng, 1, p_variant=0.0)[0][2]
        evts = [dataclasses.replace(e, origin=0) if isinstance(e, Store) else e for e in evts]
        batch = build(evts, rng.random() < 0.5)
        got = PackedBatch.pack(batch).unpack()
        for name in ("ops", "parent", "has_parent", "salt", "ns_part", "ns_inherit", "blk_off",
                     "ext_hashes", "tok_off", "tokens"):  # fmt: skip
            a, b = getattr(got, name), getattr(batch, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        assert got.n_events == batch.n_events and got.n_blocks == batch.n_blocks
    with pytest.raises(ValueError):
        PackedBatch.pack(BatchBuilder().store([1], np.arange(2, dtype=np.uint32), origin=1).build())


def test_a_restored_pool_goes_on_exactly_like_the_model() -> None:
    """Export + ``from_state`` every few batches, kicks and omissions included: the restored pool
    keeps agreeing with the model batch by batch (state, table and publications)."""
    cap = 0
    copies = 0
    for i in range(12):
        rng = random.Random(5000 + i)
        r = run_history([4, 16, 1024][i % 3], [500, 2][i % 2], i % 4 == 3,
                        _random_history(rng, 40), restore_every=3, reports=i % 2 == 0)  # fmt: skip
        cap += r.capacity
        copies += r.duplicates
    assert cap > 0 and copies > 0


def _exported(pool: Pool) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta, arrays = pool.export_state()
    return copy.deepcopy(meta), {k: a.copy() for k, a in arrays.items()}


def _restore(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> Pool:
    return Pool.from_state(meta, arrays, bucket_count=64, seed=7, block_size=BS, hash_format=1)


def _used_slots(tm: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Used slots of an exported packed table (a slot's tag byte has its high bit set)."""
    tags = w.view(np.uint8)[: int(tm[pk.TM_CAP])]
    return np.flatnonzero(tags & 0x80)


@njit(cache=False)
def _pay(tm, w, s):  # type: ignore[no-untyped-def]
    return pk.pay_of(tm, w, s)


@njit(cache=False)
def _set_pay(tm, w, s, p):  # type: ignore[no-untyped-def]
    pk.set_pay(tm, w, s, p)


def _sharing_pool() -> tuple[Pool, EventBatch]:
    """Nine members share one chain (counts above the in-slot maximum), member 0 also holds a
    namespaced chain of its own (count 1, namespace entries); and a batch to go on with."""
    pool = Pool(64, 7, BS, 1)
    for i in range(9):
        mid = pool.add_member(9, i)
        pool.apply(mid, build([Store(0, 0, 4, 0, 0, False, False, False)], False))
    pool.apply(0, build([Store(1, 0, 3, 0, 1, False, False, False)], False))
    pool.take_publication()
    more = build([Remove(((0, 3, 0, 0),), 0), Store(1, 3, 2, 0, 1, False, False, False)], False)
    return pool, more


def test_a_restored_sharing_pool_equals_the_saved_one_and_goes_on_like_it() -> None:
    pool, more = _sharing_pool()
    assert max(c for c, _ in pool.owners().values()) == 9  # the overflow table is in use
    restored = _restore(*_exported(pool))
    assert restored.snapshot_state() == pool.snapshot_state()
    assert restored.memory_breakdown() == pool.memory_breakdown()
    for p in (pool, restored):
        p.apply(0, more)
        p.add_member(10, 0)
    assert restored.snapshot_state() == pool.snapshot_state()
    a, b = pool.take_publication(), restored.take_publication()
    assert a is not None and b is not None
    assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()
    again_meta, again = _exported(restored)
    meta, arrays = _exported(pool)
    assert again_meta == meta and again.keys() == arrays.keys()


def test_an_inconsistent_state_is_refused() -> None:
    """Each way a saved state can disagree with itself is refused (by the check meant for it),
    never loaded as exact."""
    pool, _ = _sharing_pool()
    State = tuple[dict[str, Any], dict[str, np.ndarray]]

    def flip_table(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        a["table"][int(np.flatnonzero(a["table"])[0])] = 0

    def drop_edge(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        tm, w = a["m0.lin.tm"], a["m0.lin.w"]
        w.view(np.uint8)[_used_slots(tm, w)[0]] = 0
        tm[pk.TM_LIVE] -= 1

    def drop_entry_not_count(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        tm, w = a["m0.lin.tm"], a["m0.lin.w"]
        w.view(np.uint8)[_used_slots(tm, w)[0]] = 0

    def bump_ref(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        tm, w = a["own.tm"], a["own.w"]
        s = next(int(s) for s in _used_slots(tm, w) if _pay(tm, w, s) & 7 == 0)
        _set_pay(tm, w, s, _pay(tm, w, s) + np.uint64(1))

    def bump_big_ref(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        c = a["ovf.counts"]
        c[int(np.flatnonzero(c != 0xFFFFFFFF)[0])] += 1

    def drop_big_ref(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        c = a["ovf.counts"]
        c[int(np.flatnonzero(c != 0xFFFFFFFF)[0])] = 0xFFFFFFFF

    def wrong_dtype(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        a["own.w"] = a["own.w"].astype(np.int64)

    def twice(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        m["members"] = [m["members"][0], m["members"][0]]

    def missing(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        del a["m1.lin.w"]

    def resized(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        a["table"] = np.zeros(128, dtype=np.uint64)

    def resized_lineage(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        a["m0.lin.w"] = np.append(a["m0.lin.w"], np.zeros(4, dtype=np.uint64))

    def other_salt(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        m["members"][1][3] ^= 1

    def stray_namespace(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        k, v = a["m0.nkeys"], a["m0.nvals"]
        k[int(np.flatnonzero(v)[0])] ^= 1

    def dangling(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        tags = a["own.w"].view(np.uint8)[: int(a["own.tm"][pk.TM_CAP])]
        free = int(np.flatnonzero((tags & 0x80) == 0)[0])
        tm, w = a["m0.lin.tm"], a["m0.lin.w"]
        _set_pay(tm, w, int(_used_slots(tm, w)[0]), np.uint64(free))

    def moved_fingerprint(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        t = a["table"]  # same count, but the fingerprint now sits outside both its buckets
        src = int(np.flatnonzero(t)[0])
        fp = int(t[src]) & 0xFFFF
        dst = next(x for x in range(t.shape[0]) if int(t[x]) == 0 and x != src
                   and x != src ^ int(ckf.make_deltas(np.uint64(7), np.uint64(63))[fp]))
        t[src] = np.uint64(int(t[src]) & ~0xFFFF)
        t[dst] = np.uint64(fp)

    refs = r"refcounts \(or their overflow counts\) differ"
    cases = {
        flip_table: "resident owners", drop_edge: refs, drop_entry_not_count: "entries are not",
        bump_ref: refs, bump_big_ref: refs, drop_big_ref: "overflow counts",
        wrong_dtype: "'own.w' missing or of the wrong type", twice: "repeated",
        missing: "'m1.lin.w' missing", resized: "buckets", resized_lineage: "size disagrees",
        other_salt: "shape or salt", stray_namespace: "namespace entries", dangling: refs,
        moved_fingerprint: "in neither bucket",
    }  # fmt: skip
    for mutate, why in cases.items():
        state: State = _exported(pool)
        _restore(*state)  # each mutation starts from a state that loads
        mutate(*state)
        with pytest.raises(ValueError, match=why):
            _restore(*state)


def test_deterministic_volume_against_model() -> None:
    """A longer deterministic history (table growth, slab free-list reuse) vs the model."""
    rng = np.random.default_rng(1)
    seed = 0xC0FFEE
    pool = Pool(256, seed, BS, 1, 500)
    model = RefPool(256, seed, BS, 1, 500)
    mids = [pool.add_member(i, 0) for i in range(3)]
    live: list[list[int]] = [[], [], []]
    for step in range(400):
        m = int(rng.integers(0, 3))
        bb = BatchBuilder()
        if rng.random() < 0.6 or not live[m]:
            k = int(rng.integers(1, 8))
            base = int(rng.integers(0, 40))
            hashes = [(m * 10**6 + step * 100 + j) for j in range(k)]
            toks = (np.arange(k * BS) + base).astype(np.uint32)
            parent = live[m][-1] if live[m] and rng.random() < 0.5 else None
            bb.store(hashes, toks, parent=parent)
            live[m].extend(hashes)
        else:
            pick = [
                live[m].pop(int(rng.integers(0, len(live[m]))))
                for _ in range(min(len(live[m]), int(rng.integers(1, 4))))
            ]
            bb.remove(pick)
        batch = bb.build()
        res = pool.apply(mids[m], batch)
        exp = model.apply(m, batch)
        assert (res.events_applied, res.blocks_stored, res.blocks_removed) == (
            exp.applied,
            exp.stored,
            exp.removed,
        )
        if step % 50 == 49:
            check_state(pool, model, mids)
    check_state(pool, model, mids)
    for i, mid in enumerate(mids):
        pool.remove_member(mid)
        model.clear(i, Counts())
    assert pool.owners() == {} and not pool.table.any()
    assert ckf.contains(pool.table, seed, np.arange(10, dtype=np.uint64)).sum() == 0
