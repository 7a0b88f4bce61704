"""Keep what the daemon holds for its whole life out of the cyclic garbage collector's walks.

A full collection (generation 2) visits every tracked object in the process, on the event loop,
with nothing else running. Most of them are there from start-up to exit: modules, classes,
functions, numba's dispatchers and compiled kernels, llvmlite's leftovers. Measured at 64 pools
(``benchmarks/bench_fleet_planes.py``), that is about three objects of four, and a full collection
took a multiple of what it takes once they are frozen. CPython runs one whenever enough objects
have survived two younger collections, so a relay that runs for days takes such a pause from
time to time, and every delta arriving then waits behind it.

:func:`freeze_startup_objects` moves every object alive after the warm-up into the permanent
generation (``gc.freeze``), which no collection visits. Reference counting still frees a frozen
object when its last reference goes. Only a reference cycle among frozen objects would never be
collected, so this runs once: after the imports and the kernels, before any pool, connection or
configuration that the relay later replaces exists.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect once, then freeze every object still alive; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
