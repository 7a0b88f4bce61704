"""A pool image (``Pool.open_image``, ``pool/image.py``, ``pool/cow.py``) holds the exported state
of the instant it was opened, byte for byte, however the pool changes while it is read.

The oracle is a plain copy of ``export_state()`` taken at the same instant. The pool goes on
under random engine histories (stores with LoRA and namespace salts, physical copies, removals,
clears, resets, members added and removed, refcounts above the in-slot maximum, and every table
growing, the owners table included, which rewrites every lineage table), driven together with the
pure-Python reference model, so the barrier is also shown not to change what the kernels do.
Small arrays are armed too (``eager_bytes=0``), so the barrier of every kind of table is used.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvrelay.pool import ckf
from kvrelay.pool import packed as pk
from kvrelay.pool.cow import CHUNK
from kvrelay.pool.image import ImageArray, ImageBroken, PoolImage
from kvrelay.pool.pool import Pool
from tests.pool.test_pool_vs_model import BS, Clear, Remove, Store, build, check_state
from tests.support.pool_model import Counts, RefPool

SEED = 0x5DEECE66D1B54A33
MEMBERS = 10  # more than 7 share documents: owner counts go to the overflow table


def _exported(pool: Pool) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta, arrays = pool.export_state()
    return meta, {k: a.copy() for k, a in arrays.items()}


def _history(
    rng: random.Random, n: int, docs: int, *, clears: float = 0.03
) -> Iterator[tuple[int, list[Any]]]:
    """Batches over ``docs`` documents (made as they are taken); many documents make every
    table grow."""
    for _ in range(n):
        evts: list[Any] = []
        for _ in range(rng.randint(1, 6)):
            r = rng.random()
            if r < 0.75:
                evts.append(Store(
                    doc=rng.randrange(docs), start=rng.choice([0, 0, 0, 1, 2, 3]),
                    count=rng.randint(1, 4), lora=int(rng.random() < 0.3),
                    ns=int(rng.random() < 0.3), wrong=False, bad_tokens=False, self_ref=False,
                    origin=rng.choice([0] * 6 + [1, 1, 2]),
                ))  # fmt: skip
            elif r < 1 - clears:
                keys = tuple(
                    (rng.randrange(docs), rng.randrange(6), int(rng.random() < 0.3),
                     int(rng.random() < 0.3))
                    for _ in range(rng.randint(1, 3))
                )  # fmt: skip
                evts.append(Remove(keys, 0))
            else:
                evts.append(Clear())
        yield rng.randrange(MEMBERS), evts


class _Driver:
    """The pool and the reference model, fed the same batches (members by index)."""

    def __init__(self, docs: int) -> None:
        self.pool = Pool(1 << 10, SEED, BS, 1, 500, layout_seed=7)
        self.model = RefPool(1 << 10, SEED, BS, 1, 500)
        self.mids = [self.pool.add_member(100 + i, 0) for i in range(MEMBERS)]
        self.docs = docs

    def apply(self, member: int, evts: list[Any], *, model: bool = True) -> None:
        batch = build(evts, False)
        self.pool.apply(self.mids[member], batch)
        if model:
            self.model.apply(member, batch)
        self.pool.take_publication()

    def reset(self, member: int) -> None:
        self.pool.reset_member(self.mids[member])
        self.model.clear(member, Counts())

    def replace(self, member: int, worker: int) -> None:
        """A member goes (its engine left) and another comes in its place."""
        self.reset(member)
        self.pool.remove_member(self.mids[member])
        self.mids[member] = self.pool.add_member(worker, 0)

    def check(self) -> None:
        check_state(self.pool, self.model, self.mids)


def _read_all(image: PoolImage, rng: random.Random, between: Any) -> dict[str, np.ndarray]:
    """Every array of the image, armed ones read in pieces of random whole-chunk sizes, in a
    random order of arrays, with ``between()`` (the pool changing) after each piece."""
    out: dict[str, np.ndarray] = {}
    sources: list[tuple[str, ImageArray]] = []
    for name, a in image.arrays():
        if isinstance(a, np.ndarray):
            out[name] = a
        else:
            sources.append((name, a))
    rng.shuffle(sources)
    for name, src in sources:
        buf = np.empty(src.nbytes, dtype=np.uint8)
        at = 0
        while at < src.nbytes:
            k = min(src.nbytes - at, CHUNK * rng.randint(1, 16))
            piece = src.read(at, at + k, np.empty(k, dtype=np.uint8))
            buf[at:at + k] = np.frombuffer(piece, dtype=np.uint8)
            at += k
            between()
        out[name] = buf.view(src.dtype).reshape(src.shape)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_an_image_holds_the_cut_while_the_pool_changes(seed: int) -> None:
    rng = random.Random(seed)
    d = _Driver(docs=60)
    for member, evts in _history(rng, 120, d.docs):
        d.apply(member, evts)
    meta, oracle = _exported(d.pool)
    own_cap = d.pool._own.cap
    image = d.pool.open_image(eager_bytes=0)
    assert image.armed_bytes > 0 and set(dict(image.arrays())) == set(oracle)
    later = iter(_history(rng, 10_000, docs=400))  # growth of every table while it is read
    workers = iter(range(1000, 2000))

    def between() -> None:
        for _ in range(3):
            member, evts = next(later)
            r = rng.random()
            if r < 0.02:
                d.reset(member)
            elif r < 0.04:
                d.replace(member, next(workers))
            else:
                d.apply(member, evts)

    got = _read_all(image, rng, between)
    assert not image.broken
    assert d.pool._own.cap > own_cap, "the owners table grew (every lineage table rewritten)"
    image.close()
    for name, a in oracle.items():
        assert np.array_equal(got[name], a), name
    assert meta == image.meta
    d.check()  # the barrier changed nothing the kernels did
    restored = Pool.from_state(meta, got, bucket_count=1 << 10, seed=SEED, block_size=BS,
                               hash_format=1)  # fmt: skip
    assert restored.memberships == int(sum(oracle[f"m{m}.lin.tm"][pk.TM_LIVE]
                                           for m in range(MEMBERS)))  # fmt: skip


def test_a_reader_thread_and_the_pool_racing_give_the_cut() -> None:
    """The reader runs without the GIL in another thread while this one applies batches: chunks
    copied while a write captured them are replaced by their pre-image. (The seeded test above
    holds the pool to the model under the barrier; this one only races.)"""
    rng = random.Random(99)
    d = _Driver(docs=2000)
    for member, evts in _history(rng, 3000, d.docs, clears=0):
        d.apply(member, evts, model=False)
    assert d.pool.memberships > 5000
    _race_rounds(d, rng)


def _race_rounds(d: _Driver, rng: random.Random) -> None:
    for _ in range(5):
        _, oracle = _exported(d.pool)
        image = d.pool.open_image(eager_bytes=0)
        got: dict[str, np.ndarray] = {}
        errors: list[BaseException] = []

        def read(
            image: PoolImage = image, got: dict[str, np.ndarray] = got,
            errors: list[BaseException] = errors,
        ) -> None:
            try:
                got.update(_read_all(image, random.Random(1), lambda: time.sleep(0.0002)))
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        t = threading.Thread(target=read)
        t.start()
        # the pool changes while the reader runs; the writer hands the GIL over every 16
        # batches: left to the switch interval, the reader got one piece per ~400 batches and a
        # round took 10 s (a slow reader may still outlast the history: it then reads the rest
        # of a pool that no longer changes)
        for i, (member, evts) in enumerate(_history(rng, 100_000, d.docs, clears=0.001)):
            if not t.is_alive():
                break
            d.apply(member, evts, model=False)
            if i % 16 == 15:
                time.sleep(0)
        t.join()
        assert not errors
        assert image.captured_bytes > 0 or image.armed_bytes == 0
        image.close()
        for name, a in oracle.items():
            assert np.array_equal(got[name], a), name


def test_closing_disarms_every_table_and_exports_stay_clean() -> None:
    d = _Driver(docs=40)
    for member, evts in _history(random.Random(3), 80, d.docs):
        d.apply(member, evts)
    pool = d.pool
    image = pool.open_image(eager_bytes=0)
    members = list(pool._members.values())
    assert pool._own.tm[pk.TM_COW] != 0 and pool._dmeta[ckf.DM_COW] != 0
    assert all(m.lin.tm[pk.TM_COW] != 0 and m.cow.all() for m in members)
    _, armed_export = pool.export_state()  # e.g. a hot upgrade's cut while a checkpoint runs
    assert all(a[pk.TM_COW] == 0 for n, a in armed_export.items() if n.endswith(".tm"))
    with pytest.raises(RuntimeError):
        pool.open_image()
    image.close()
    image.close()  # idempotent
    assert pool._own.tm[pk.TM_COW] == 0 and pool._dmeta[ckf.DM_COW] == 0
    assert not pool._pcow.any()
    assert all(m.lin.tm[pk.TM_COW] == 0 and not m.cow.any() for m in members)
    armed = next(a for _, a in image.arrays() if isinstance(a, ImageArray))
    with pytest.raises(RuntimeError):
        armed.read(0, CHUNK, np.empty(CHUNK, np.uint8))
    meta, arrays = pool.export_state()
    Pool.from_state(meta, arrays, bucket_count=1 << 10, seed=SEED, block_size=BS, hash_format=1)
    pool.open_image().close()  # the next one opens


def test_an_image_whose_side_store_fills_up_is_broken() -> None:
    """Each chunk is captured at most once, into a store of a fixed size: past it the image no
    longer holds the cut and its last read says so."""
    d = _Driver(docs=300)
    rng = random.Random(5)
    for member, evts in _history(rng, 300, d.docs):
        d.apply(member, evts)
    image = d.pool.open_image(side_bytes=4 * CHUNK, eager_bytes=0)
    for member, evts in _history(rng, 200, d.docs):
        d.apply(member, evts)
    assert image.broken is False  # known only once read
    with pytest.raises(ImageBroken):
        _read_all(image, rng, lambda: None)
    assert image.broken and image.captured_bytes == 4 * CHUNK
    image.close()
    d.check()  # the pool itself is exact: only the image gave up
