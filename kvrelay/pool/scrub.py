"""One online check of a pool against itself, in bounded steps: the scrub.

No fault test catches a bit flip in RAM or a kernel bug that corrupts a table silently; left
alone, a wrong filter lives until the next restart. A scrub pass checks one consistent state of
the pool however much is applied meanwhile: a copy taken when it starts, or (what the relay does,
``relay/scrubber.py``) the frozen copy-on-write image a forked child sees:

1. **lineage vs owner counts**: every member's lineage edges are counted per owner slot
   (``count_payloads_range``), then every owner's refcount must equal its edges, no edge may name
   a free slot, and the overflow table must hold exactly the counts above the in-slot maximum
   (``check_counts_range``); the resident owners must be as many as the pool says;
2. **filter vs resident owners**: the filter must hold exactly the resident owners'
   fingerprints, each in one of its two buckets (``pool/verify.py``'s digests).

Each :meth:`ScrubPass.step` does at most ``step_words`` words of one table, so the caller can
run one step per event-loop turn. A failure in (1) means the exact state itself is in doubt; in
(2) only the filter is: the two are reported apart (``Finding.exact_state``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvrelay.pool.owners import check_counts_range
from kvrelay.pool.packed import TM_CAP, count_payloads_range
from kvrelay.pool.pool import Pool
from kvrelay.pool.tables import EMPTY32
from kvrelay.pool.verify import (
    ACC_COUNT,
    ACC_MISSING,
    ACC_SUM,
    filter_digest,
    new_acc,
    owners_digest,
)

#: Words (8 slots of a packed table, or 1 filter bucket) one step checks.
STEP_WORDS = 1 << 14


@dataclass(frozen=True, slots=True)
class Finding:
    """What a pass found wrong (a passing pass finds nothing)."""

    why: str
    exact_state: bool  # the exact state disagrees with itself (else only the filter is wrong)


class ScrubPass:
    """A full check of one pool, ``step`` by ``step``; ``finding`` is set once it is done."""

    def __init__(self, pool: Pool, step_words: int = STEP_WORDS, *, copy: bool = True) -> None:
        """``copy=False``: check the pool's own arrays (a forked child's frozen image of them;
        in the live process they must not change until the pass is done)."""
        meta, arrays = pool.export_state()
        self._a: dict[str, npt.NDArray[Any]] = {
            k: np.array(a, copy=True) if copy else a for k, a in arrays.items()
        }
        self._mids = [int(row[0]) for row in meta["members"]]
        self._resident = pool.occupancy
        self._seed = np.uint64(pool.seed)
        self._deltas = pool._deltas  # a function of the seed only: never written
        self._step = max(1, step_words)
        self.done = False
        self.finding: Finding | None = None
        self.nbytes = sum(int(a.nbytes) for a in self._a.values())
        self._work = self._run()

    def step(self) -> bool:
        """Check the next bounded piece; True once the pass is over (``finding`` then says)."""
        if not self.done:
            try:
                next(self._work)
            except StopIteration:
                self.done = True
        return self.done

    def run(self) -> Finding | None:
        """The whole pass at once (tests, tools)."""
        while not self.step():
            pass
        return self.finding

    def _fail(self, why: str, exact_state: bool) -> None:
        self.finding = Finding(why, exact_state)

    def _run(self) -> Iterator[None]:
        a, n = self._a, self._step
        otm, ow = a["own.tm"], a["own.w"]
        xk, xv = a["ovf.keys"], a["ovf.counts"]
        owords = int(otm[TM_CAP]) >> 3
        edges = np.zeros(int(otm[TM_CAP]), dtype=np.uint32)
        for mid in self._mids:
            ltm, lw = a[f"m{mid}.lin.tm"], a[f"m{mid}.lin.w"]
            for q in range(0, int(ltm[TM_CAP]) >> 3, n):
                if not count_payloads_range(ltm, lw, edges, q, q + n):
                    self._fail(f"member {mid}: lineage names a slot outside the owners", True)
                    return
                yield
        counts = np.zeros(2, dtype=np.int64)
        for q in range(0, owords, n):
            if not check_counts_range(otm, ow, xk, xv, edges, q, q + n, counts):
                self._fail("owner refcounts differ from the lineage", True)
                return
            yield
        if int(counts[1]) != int(np.count_nonzero(xv != EMPTY32)):
            self._fail("the overflow table holds other counts than the owners say", True)
            return
        if int(counts[0]) != self._resident:
            self._fail(f"{int(counts[0])} resident owners, the pool counts {self._resident}", True)
            return
        table = a["table"]
        own = new_acc()
        for q in range(0, owords, n):
            owners_digest(otm, ow, table, self._seed, self._deltas, q, q + n, own)
            yield
        filt = new_acc()
        for b in range(0, table.shape[0], n):
            filter_digest(table, self._deltas, b, b + n, filt)
            yield
        if own[ACC_MISSING]:
            self._fail(f"{int(own[ACC_MISSING])} resident owners' fingerprints are in neither "
                       "bucket", False)  # fmt: skip
        elif filt[ACC_COUNT] != own[ACC_COUNT] or filt[ACC_SUM] != own[ACC_SUM]:
            self._fail(f"the filter holds {int(filt[ACC_COUNT])} fingerprints, not exactly the "
                       f"{int(own[ACC_COUNT])} of the resident owners", False)  # fmt: skip
