"""Folding huge pages back after a forked child (``relay/hugepages.py``): which mappings are
picked, and that a real fold changes no byte and puts a split array back on huge pages."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from kvrelay.relay import hugepages
from kvrelay.relay.forked import Child

MIB = 1 << 20

SMAPS = """\
7f0000000000-7f0000a00000 rw-p 00000000 00:00 0
Size:              10240 kB
Rss:                9216 kB
AnonHugePages:         0 kB
VmFlags: rd wr mr mw me ac
7f0000a00000-7f0001400000 rw-p 00000000 00:00 0
Size:              10240 kB
Rss:                1024 kB
AnonHugePages:         0 kB
7f0002000000-7f0002600000 rw-p 00000000 00:00 0
Size:               6144 kB
Rss:                6144 kB
AnonHugePages:      6144 kB
7f0003000000-7f0003400000 r--p 00000000 00:00 0
Size:               4096 kB
Rss:                4096 kB
AnonHugePages:         0 kB
7f0004000000-7f0004400000 rw-p 00000000 08:01 1234    /usr/lib/libfoo.so
Size:               4096 kB
Rss:                4096 kB
AnonHugePages:         0 kB
7f0005100000-7f0005500000 rw-p 00000000 00:00 0                          [heap]
Size:               4096 kB
Rss:                4096 kB
AnonHugePages:         0 kB
7f0006000000-7f0006100000 rw-p 00000000 00:00 0
Size:               1024 kB
Rss:                1024 kB
AnonHugePages:         0 kB
"""


def test_dense_spans_picks_dense_private_anonymous_mappings_not_yet_huge() -> None:
    spans = hugepages.dense_spans(SMAPS)
    assert spans == [
        (0x7F0000000000, 10 * MIB),  # dense (9 of 10 MiB resident), aligned: all of it
        (0x7F0005200000, 2 * MIB),  # [heap]: only its 2 MiB-aligned interior
    ]
    # Not picked: a sparse mapping (1 of 10 MiB), one already all huge, a read-only one, a
    # file mapping, one smaller than a huge page.


def _anon_huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping holding ``addr`` (numpy's ``madvise`` starts at the first
    whole page of the data, so the allocator's header page is a mapping of its own: callers ask
    for an address well inside the array)."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and ":" not in head[0]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                found = lo <= addr < hi
            elif found and line.startswith("AnonHugePages:"):
                return int(head[1])
    raise AssertionError("no mapping holds the array")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_a_child_s_end_folds_back_what_its_image_split_and_changes_no_byte() -> None:
    a = np.arange(16 * MIB // 8, dtype=np.uint64)  # 16 MiB: numpy asks for huge pages
    inside = a.ctypes.data + 4 * MIB
    # a pass an earlier test's child started may still run on its closed loop's thread: it
    # would fold the pages the writes below split, before they are counted
    deadline = time.monotonic() + 30
    while not hugepages.idle():
        assert time.monotonic() < deadline, "a fold pass never ended"
        time.sleep(0.01)
    before = _anon_huge_kib(inside)
    passes = hugepages.stats.passes
    split = [0]

    async def fork_and_write() -> tuple[bool, str]:
        # the child stays a while: a child that already ended shares nothing
        child = Child(lambda: (str(int(a[:: 4096 // 8].sum())), time.sleep(0.5))[0])
        a[:: 4096 // 8] += np.uint64(1)  # one write per 4 KiB page while the child shares them
        split[0] = _anon_huge_kib(inside)
        return await child.done  # its end starts a fold; asyncio.run waits for the executor

    ok, text = asyncio.run(fork_and_write())
    expect = np.arange(16 * MIB // 8, dtype=np.uint64)
    assert ok and int(text) == int(expect[:: 4096 // 8].sum())  # the child saw the old image
    expect[:: 4096 // 8] += np.uint64(1)
    assert np.array_equal(a, expect)  # folding moves pages, never their bytes
    if before == 0 or not hugepages._supported:
        pytest.skip("this kernel gives the array no huge pages, or has no MADV_COLLAPSE")
    assert split[0] < before  # the writes split huge pages the child shared
    assert hugepages.stats.passes > passes  # the child's end started a fold
    assert _anon_huge_kib(inside) >= before  # and it put them back
