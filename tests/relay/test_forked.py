"""``relay/forked.py``: the child sees memory as it was at the fork, its result or error comes back
on the event loop, and a killed or finished child leaves no process behind."""

from __future__ import annotations

import asyncio
import mmap
import os
import resource
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from kvrelay._madvise import madvise
from kvrelay.relay import forked, hugepages
from kvrelay.relay.forked import Child


async def test_the_child_sees_the_memory_of_the_fork_and_reports_back() -> None:
    """Also: the fork of a process with threads (the relay has some: the executor's, the
    follower's) raises no warning; from Python 3.12 it raised a DeprecationWarning, which the
    child, taking no lock, does not deserve (``relay/forked.py``)."""
    a = np.arange(1000, dtype=np.uint64)
    gate = threading.Event()
    thread = threading.Thread(target=gate.wait)
    thread.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            child = Child(lambda: str(int(a.sum())))
    finally:
        gate.set()
        thread.join()
    assert [str(w.message) for w in caught] == []
    a[:] = 0  # the parent goes on changing it: the child's image does not
    ok, text = await asyncio.wait_for(child.done, 30)
    assert ok and text == str(sum(range(1000)))
    assert not os.path.exists(f"/proc/{child.pid}")


async def test_the_child_is_the_first_the_oom_killer_takes() -> None:
    """Its copy-on-write image counts against it as against the relay, which holds the state:
    the child says so to the kernel; the relay's own score is unchanged."""
    own = Path("/proc/self/oom_score_adj").read_text()
    child = Child(lambda: Path("/proc/self/oom_score_adj").read_text().strip())
    ok, text = await asyncio.wait_for(child.done, 30)
    assert ok and text == "1000"  # (the most there is: whatever the relay inherited)
    assert Path("/proc/self/oom_score_adj").read_text() == own


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



def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


async def _given_back_then_written(others: int) -> tuple[int, int, int]:
    while not hugepages.idle():  # a fold would make the pages writable too
        await asyncio.sleep(0.01)
    """The relay writes to each huge page of a 16 MiB array once (which splits its mapping, as
    ingest does while a checkpoint's child runs); the child then gives the array back and stays
    alive. Once its follower is done, the relay writes one byte per small page of the given-back
    huge pages: (pages written, the writing thread's faults, bytes the follower made writable).
    ``others`` more children hold the image meanwhile."""
    arr = np.ones(8 * forked.HUGE, dtype=np.uint8)
    base = int(arr.ctypes.data)
    lo = (base + forked.HUGE - 1) // forked.HUGE * forked.HUGE - base
    hi = (base + arr.nbytes) // forked.HUGE * forked.HUGE - base
    holders = [Child(lambda: (time.sleep(3), "held")[1]) for _ in range(others)]
    child = Child(lambda: (time.sleep(0.3), forked.give_back(arr, 0, arr.nbytes),
                           time.sleep(3), "ok")[3])  # fmt: skip
    arr[lo + 8192:hi:forked.HUGE] = 1  # before the give-back: a copy, and a split mapping
    # and kept split: khugepaged, which scans every 10 s, would fold it into new huge pages,
    # writable, and the writes below would take no fault whatever the follower did
    assert madvise(base + lo, hi - lo, mmap.MADV_NOHUGEPAGE) == 0
    await asyncio.sleep(0.8)  # the child gave back at 0.3 s and sleeps on (for 3 s)
    deadline = time.monotonic() + 2  # a slow machine: the follower may still be at work
    while 0 < child.follower.populated < hi - lo and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    pages = arr[lo:hi:4096]
    before = _faults()
    pages += 1  # one write per small page
    faults = _faults() - before
    populated = child.follower.populated
    for c in [child, *holders]:
        c.kill()
    assert np.count_nonzero(arr != 1) == pages.size and np.all(pages == 2)  # no byte changed
    return pages.size, faults, populated


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux's")
async def test_the_relay_takes_no_fault_on_pages_a_child_gave_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The follower makes every given-back page writable again off the event loop, without
    changing a byte; with it off, the relay's first write to each page is a fault."""
    monkeypatch.setattr(hugepages, "_supported", False)  # no fold after a child: only the follower
    if not forked._Follower.supported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    pages, faults, populated = await _given_back_then_written(0)
    assert populated >= 7 * forked.HUGE
    assert faults < pages // 16
    monkeypatch.setattr(forked._Follower, "supported", False)
    pages, faults, populated = await _given_back_then_written(0)
    assert populated == 0 and faults >= pages // 2


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux's")
async def test_the_follower_copies_nothing_while_another_child_shares_the_image(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a second child alive, writing a given-back range would copy it into the relay:
    the follower leaves it alone (the relay takes those faults itself)."""
    monkeypatch.setattr(hugepages, "_supported", False)
    pages, faults, populated = await _given_back_then_written(1)
    assert populated == 0 and faults >= pages // 2
