"""How long each garbage collection held the process, by generation, for ``/metrics``.

prometheus_client's own GC collector counts collections; it does not time them, and a full
collection is a pause of the event loop that every delta then arriving waits behind (see
``ops/gc_freeze.py``). One ``gc.callbacks`` hook per process times every collection.

The hook keeps plain integers and floats. It runs inside whatever allocation started the
collection, on any thread. Taking a lock there (a prometheus_client ``Histogram`` takes one)
could wait on a lock that the same thread already holds. The families are built from those
numbers at scrape time (``ops/metrics.gc_pause_families``).
"""

from __future__ import annotations

import gc
import time
from bisect import bisect_left
from typing import Any

#: Upper bounds (seconds) of the pause histogram.
BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
GENERATIONS = (0, 1, 2)
_KEYS = (*(repr(b) for b in BUCKETS_S), "+Inf")


class GcPauses:
    """Per generation: a count per bucket keyed by its bound's text (not cumulative, as the
    ingest lag histogram keeps them), the sum of seconds."""

    def __init__(self) -> None:
        self.counts: list[dict[str, int]] = [dict.fromkeys(_KEYS, 0) for _ in GENERATIONS]
        self.sums = [0.0 for _ in GENERATIONS]
        self._started = 0.0

    def hook(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks`` entry: ``start`` notes the time, ``stop`` files the pause."""
        if phase == "start":
            self._started = time.perf_counter()
            return
        gen = info.get("generation")
        if gen not in GENERATIONS or not self._started:
            return
        took = time.perf_counter() - self._started
        self.counts[gen][_KEYS[bisect_left(BUCKETS_S, took)]] += 1
        self.sums[gen] += took


_pauses: GcPauses | None = None


def pauses() -> GcPauses:
    """This process's one timer, hooked into ``gc.callbacks`` on first use."""
    global _pauses
    if _pauses is None:
        _pauses = GcPauses()
        gc.callbacks.append(_pauses.hook)
    return _pauses
