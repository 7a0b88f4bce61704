"""ops/gc_freeze: what the daemon freezes after its warm-up stays out of every collection, and
what it makes afterwards is collected as before. Run in a fresh interpreter: a freeze is for the
whole process, and this one runs the rest of the suite."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import gc, weakref
from kvrelay.ops.gc_freeze import freeze_startup_objects
import kvrelay.relay.relay  # what a relay imports before its pools exist

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

tracked = len(gc.get_objects())
frozen = freeze_startup_objects()
print("frozen", frozen, "tracked before", tracked, "after", len(gc.get_objects()))
later = cycle()
gc.collect()
print("a cycle made after the freeze collected:", later() is None)
"""


def test_a_freeze_takes_the_startup_objects_and_leaves_later_garbage_collectable() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("frozen "))
    _, frozen, _, _, before, _, after = line.split()
    # every object still alive after one collection: nearly all of what was tracked (a few
    # more on Python 3.12, which tracks some containers only once a collection looked at them)
    assert int(before) * 0.9 <= int(frozen) <= int(before) * 1.05 and int(frozen) > 10_000
    assert int(after) < int(before) // 10  # a full collection now walks almost nothing of it
    assert "a cycle made after the freeze collected: True" in out
