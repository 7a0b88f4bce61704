"""``pool/scrub.py``: a pass over a healthy pool finds nothing, in many bounded steps, whatever
is applied meanwhile; a flipped filter word is a filter divergence, a wrong refcount or a stray
overflow count an exact-state one."""

from __future__ import annotations

import numpy as np

from kvrelay.pool.batch import BatchBuilder
from kvrelay.pool.scrub import ScrubPass
from tests.pool.test_pool_vs_model import _pay, _set_pay, _used_slots
from tests.pool.test_verify import _pool


def test_a_healthy_pool_passes_in_bounded_steps_despite_changes_meanwhile() -> None:
    pool = _pool(21, chains=60)
    sp = ScrubPass(pool, step_words=4)
    steps = 0
    while not sp.step():
        steps += 1
        if steps == 3:  # the pool goes on changing: the pass checks the copy it took
            b = BatchBuilder()
            b.store([2**61 + 5], np.arange(4, dtype=np.uint32) + 9, parent=None)
            pool.apply(next(iter(pool.members())), b.build())
            pool.table[:] = 0  # even this: the pass does not see it
    assert sp.finding is None and steps > 20


def test_a_flipped_filter_word_is_a_filter_divergence() -> None:
    pool = _pool(22)
    x = int(np.flatnonzero(pool.table)[0])
    pool.table[x] ^= np.uint64(1 << 5)
    f = ScrubPass(pool).run()
    assert f is not None and not f.exact_state and "neither bucket" in f.why
    pool.table[x] ^= np.uint64(1 << 5)
    assert ScrubPass(pool).run() is None


def test_a_wrong_refcount_is_an_exact_state_divergence() -> None:
    pool = _pool(23)
    tm, w = pool._own.tm, pool._own.w
    s = next(int(s) for s in _used_slots(tm, w) if _pay(tm, w, s) & 7 == 0)
    _set_pay(tm, w, s, _pay(tm, w, s) + np.uint64(1))
    f = ScrubPass(pool).run()
    assert f is not None and f.exact_state and "refcounts" in f.why
