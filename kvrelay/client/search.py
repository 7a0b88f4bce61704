"""Cached-prefix depth search over a probabilistic membership test (``docs/contract.md`` §11).

Probing every block of a long prompt costs one filter lookup per block. Dynamo's consumer instead
probes position 0, then 1, 2, 4, 8, … until a miss, binary-searches the boundary between the last
hit and the first miss, then re-checks a short linear window just below the boundary (default 2).
A false positive at a sampled position can move the boundary past the true depth; the window
catches the common case where that inflation is only a block or two. Because every position below
the true (linear) depth answers "present", the search never reports LESS than the linear depth:
filters have no false negatives, so neither does the search. It reads the boundary right only
where present positions form a prefix: a hole (a block evicted while the blocks after it stay)
can be stepped over, so ``RelayClient.overlap``, which has every position's answer at once,
takes the first miss instead.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

Probe = Callable[[int], bool]


def first_miss(present: npt.NDArray[np.bool_]) -> int:
    """The exact depth from every position's answer at once: the first absent position (or
    the length when all are present)."""
    absent = np.flatnonzero(~present)
    return int(absent[0]) if absent.shape[0] else int(present.shape[0])


def prefix_depth(n: int, probe: Probe, window: int = 2) -> int:
    """Depth in blocks of the present prefix of positions ``0..n-1`` (``probe(i)`` = present).

    Each position is probed at most once.
    """
    if window < 0:
        raise ValueError("window must be >= 0")
    if n <= 0:
        return 0
    seen: dict[int, bool] = {}

    def hit(i: int) -> bool:
        v = seen.get(i)
        if v is None:
            v = seen[i] = bool(probe(i))
        return v

    if not hit(0):
        return 0
    lower, upper = 0, n  # lower: a present position; upper: an absent position (or n)
    pos = 1
    while pos < n:
        if hit(pos):
            lower = pos
            pos *= 2
        else:
            upper = pos
            break
    while upper - lower > 1:
        mid = lower + (upper - lower) // 2
        if hit(mid):
            lower = mid
        else:
            upper = mid
    for p in range(max(0, upper - window), upper):
        if not hit(p):
            return p
    return upper


def linear_depth(n: int, probe: Probe) -> int:
    """Reference: first absent position (the exact longest present prefix)."""
    for i in range(max(n, 0)):
        if not probe(i):
            return i
    return max(n, 0)
