"""``pool/verify.py``: the filter-versus-owners digests agree with their pure-Python twins, add up
over any split of the tables (what a scrub relies on), and tell a right filter from a wrong one."""

from __future__ import annotations

import itertools
import random

import numpy as np

from kvrelay.pool import verify
from kvrelay.pool.batch import BatchBuilder
from kvrelay.pool.packed import TM_CAP
from kvrelay.pool.pool import Pool, filter_divergence

BC, SEED = 256, 99


def _pool(seed: int, chains: int = 40) -> Pool:
    """A pool with shared and unshared blocks over three members (kicks included: 256 buckets
    holding several hundred fingerprints)."""
    rng = random.Random(seed)
    pool = Pool(BC, SEED, 4, 1)
    mids = [pool.add_member(1, r) for r in range(3)]
    for c in range(chains):
        b = BatchBuilder()
        n = rng.randint(1, 12)
        hashes = [rng.getrandbits(63) for _ in range(n)]
        tokens = np.arange(4 * n, dtype=np.uint32) + 1000 * c
        b.store(hashes, tokens, parent=None)
        for mid in rng.sample(mids, rng.randint(1, 3)):
            pool.apply(mid, b.build())
    return pool


def _twins(pool: Pool) -> tuple[tuple[int, int, int], tuple[int, int]]:
    resident = [h for h, (_c, res) in pool.owners().items() if res]
    words = [int(w) for w in pool.table]
    return (verify.owners_digest_py(resident, words, SEED, BC),
            verify.filter_digest_py(words, SEED))  # fmt: skip


def test_kernels_equal_their_twins_and_add_up_over_any_split() -> None:
    for seed in range(3):
        pool = _pool(seed)
        own, filt = _twins(pool)
        assert own[1] == pool.occupancy > 0 and own[2] == 0 and own[:2] == filt
        otm, ow = pool._own.tm, pool._own.w
        nwords = int(otm[TM_CAP]) >> 3
        rng = random.Random(seed)
        cuts = sorted({0, nwords, *(rng.randrange(nwords) for _ in range(5))})
        acc = verify.new_acc()
        for lo, hi in itertools.pairwise(cuts):
            verify.owners_digest(otm, ow, pool.table, np.uint64(SEED), pool._deltas, lo, hi, acc)
        assert (int(acc[0]), int(acc[1]), int(acc[2])) == own
        bcuts = sorted({0, BC, *(rng.randrange(BC) for _ in range(5))})
        facc = verify.new_acc()
        for lo, hi in itertools.pairwise(bcuts):
            verify.filter_digest(pool.table, pool._deltas, lo, hi, facc)
        assert (int(facc[0]), int(facc[1])) == filt
        assert filter_divergence(otm, ow, pool.table, np.uint64(SEED), pool._deltas) is None


def test_a_flipped_missing_or_extra_fingerprint_is_a_divergence() -> None:
    pool = _pool(7)
    otm, ow, deltas = pool._own.tm, pool._own.w, pool._deltas
    occupied = [(x, s) for x in range(BC) for s in range(4)
                if (int(pool.table[x]) >> (16 * s)) & 0xFFFF]  # fmt: skip
    free = [(x, s) for x in range(BC) for s in range(4)
            if not (int(pool.table[x]) >> (16 * s)) & 0xFFFF]  # fmt: skip
    assert occupied and free
    x, s = occupied[len(occupied) // 2]
    fx, fs = free[0]
    for mutate in ("flip", "drop", "extra"):
        table = pool.table.copy()
        if mutate == "flip":
            table[x] ^= np.uint64(1 << (16 * s + 3))
        elif mutate == "drop":
            table[x] &= ~np.uint64(0xFFFF << (16 * s))
        else:
            table[fx] |= np.uint64(0x1234 << (16 * fs))
        why = filter_divergence(otm, ow, table, np.uint64(SEED), deltas)
        assert why is not None, mutate
        # the twins see the same divergence
        resident = [h for h, (_c, res) in pool.owners().items() if res]
        words = [int(w) for w in table]
        o = verify.owners_digest_py(resident, words, SEED, BC)
        f = verify.filter_digest_py(words, SEED)
        assert o[2] > 0 or o[:2] != f, mutate
