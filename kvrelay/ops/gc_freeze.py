"""Keep what the daemon holds for its whole life out of the cyclic garbage collector's walks.

A full collection (generation 2) visits every tracked object in the process, on the event loop,
with nothing else running. Most of them are there from start-up to exit: modules, classes,
functions, numba's dispatchers and compiled kernels, llvmlite's leftovers: about 137,000 objects
in a warm relay. CPython runs a full collection whenever enough objects have survived two younger
ones: a daemon with 64 pools, its 64 simulated engines stepping 5 times a second, ran 2 a minute
(``python_gc_collections_total{generation="2"}``), each a pause on the loop that every delta
arriving then waits behind. Its length is in ``benchmarks/results/fleet_planes.json``
(``gc_full_collection_ms``, frozen as here, and ``…_unfrozen_ms``).

:func:`freeze_startup_objects` moves every object alive after the warm-up into the permanent
generation (``gc.freeze``), which no collection visits. Reference counting still frees a frozen
object when its last reference goes. Only a reference cycle among frozen objects would never be
collected, so this runs once: after the imports and the kernels, before any pool, connection or
subscriber exists.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect once, then freeze every object still alive; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
