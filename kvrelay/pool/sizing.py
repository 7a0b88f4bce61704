"""Capacity policy of the packed tables: when to grow or shrink, and to which bucket counts.

A table keeps its live entries under a max load; above it the table grows by ``step``, under a
quarter of it (after mass removals) it shrinks back with one step of headroom. The allocated
slack averages ``(g − 1) / ln g`` of the max-load size for a growth factor ``g``: small steps keep
it low, and a rebuild is a streaming pass (``packed.rebuild``), so the amortised work per entry,
``1 / (g − 1)`` moves, stays cheap.

All subtables keep one bucket count: the tables balance entries across subtables when they are
inserted, and only a whole-table rebuild rebalances (enlarging one subtable would leave the
others as full as they were, and multiple-choice placement would degrade into single choice).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Policy:
    d: int  # subtables
    b: int  # slots per bucket
    load: tuple[int, int]  # max load, num/den
    step: tuple[int, int]  # growth factor, num/den

    def bounds(self, nb: int) -> tuple[int, int]:
        """``(lo, hi)``: live entries a table of ``nb`` buckets per subtable holds without a
        resize; above ``hi`` it grows, under ``lo`` it shrinks (``lo`` is 0 at minimum size)."""
        num, den = self.load
        room = nb * self.d * self.b * num
        return (0 if nb == 1 else -(-room // (den * 4))), room // den

    def grown(self, nb: int) -> int:
        num, den = self.step
        return max(nb + 1, -(-nb * num // den))

    def sized(self, nb: int, need: int) -> int:
        """Buckets per subtable for ``need`` live entries: ``nb`` while they fit, else grown step
        by step; shrunk with one step of headroom when under a quarter of the max load."""
        lo, hi = self.bounds(nb)
        if need > hi:
            while need > self.bounds(nb)[1]:
                nb = self.grown(nb)
            return nb
        if need < lo:
            num, den = self.load
            snum, sden = self.step
            want = -(-(need * snum * den) // (sden * self.d * self.b * num))
            return max(1, min(nb, want))
        return nb


LINEAGE = Policy(d=2, b=8, load=(97, 100), step=(23, 20))
OWNERS = Policy(d=3, b=16, load=(92, 100), step=(23, 20))
