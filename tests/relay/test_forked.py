"""``relay/forked.py``: the child sees memory as it was at the fork, its result or error comes back
on the event loop, and a killed or finished child leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from kvrelay.relay import forked
from kvrelay.relay.forked import Child


async def test_the_child_sees_the_memory_of_the_fork_and_reports_back() -> None:
    a = np.arange(1000, dtype=np.uint64)
    child = Child(lambda: str(int(a.sum())))
    a[:] = 0  # the parent goes on changing it: the child's image does not
    ok, text = await asyncio.wait_for(child.done, 30)
    assert ok and text == str(sum(range(1000)))
    assert not os.path.exists(f"/proc/{child.pid}")


async def test_an_error_in_the_child_comes_back_as_text() -> None:
    def boom() -> str:
        raise ValueError("no room on the disk")

    ok, text = await asyncio.wait_for(Child(boom).done, 30)
    assert not ok and text == "ValueError: no room on the disk"


async def test_a_killed_child_is_reaped() -> None:
    def slow() -> str:
        time.sleep(60)
        return "late"

    child = Child(slow)
    child.kill()
    ok, text = await asyncio.wait_for(child.done, 30)
    assert not ok and "exited with" in text
    assert not os.path.exists(f"/proc/{child.pid}")


async def test_without_pidfd_a_thread_waits_for_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pidfd(_pid: int) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    ok, text = await asyncio.wait_for(Child(lambda: "done").done, 30)
    assert ok and text == "done"


def _released(raw: np.ndarray, start: int, end: int) -> range:
    """Indices of uint64 elements in the whole huge pages ``give_back`` drops for a piece."""
    base = int(raw.ctypes.data)
    lo = max((base + start) // forked.HUGE * forked.HUGE,
             (base + forked.HUGE - 1) // forked.HUGE * forked.HUGE)  # fmt: skip
    hi = (base + end) // forked.HUGE * forked.HUGE
    return range((lo - base) // 8, (hi - base) // 8) if hi > lo else range(0)


async def test_a_child_gives_back_only_whole_written_huge_pages_and_the_relay_keeps_its_bytes(
) -> None:
    """In the child the pages it gave back read as zeros (they are gone from its image); the
    relay's copy is untouched, and in the relay itself ``give_back`` does nothing."""
    n = 3 * forked.HUGE // 8 + 1234
    arr = np.arange(1, n + 1, dtype=np.uint64)  # no zero anywhere
    raw = arr.view(np.uint8)
    half = raw.nbytes // 2
    first, second = _released(raw, 0, half), _released(raw, half, raw.nbytes)
    assert len(first) + len(second) >= forked.HUGE // 8  # at least one whole huge page

    def work() -> str:
        forked.give_back(raw, 0, half)
        after_first = int(np.count_nonzero(arr == 0))
        forked.give_back(raw, half, raw.nbytes)
        zero = np.flatnonzero(arr == 0)
        return f"{after_first} {zero.size} {zero.min() if zero.size else -1}"

    ok, text = await Child(work).done
    assert ok, text
    after_first, zeros, lowest = (int(x) for x in text.split())
    assert after_first == len(first)
    assert zeros == len(first) + len(second)
    assert lowest == min([*first, *second])
    forked.give_back(raw, 0, raw.nbytes)  # the relay: a no-op
    assert np.array_equal(arr, np.arange(1, n + 1, dtype=np.uint64))
