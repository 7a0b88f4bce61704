"""Put the relay's dense memory back on huge pages after a forked child ends, so the next fork
(a scrub's or an upgrade's cut, ``relay/forked.py``) stays cheap.

A ``fork`` costs the event loop one copy of the page tables. The pool's big arrays start on
transparent huge pages (numpy asks for them), where 2 MiB is one entry. But while a child holds
the copy-on-write image, every first write the relay makes to a huge page splits it into 512
small entries, and the kernel folds them back only slowly (``khugepaged``). On a
10M-membership pool the next cut then copies ~4× more entries: measured here, 5 ms fresh,
12–28 ms after one child had written. So when a child ends, one background thread asks the kernel to
fold the dense anonymous mappings back (``MADV_COLLAPSE``, Linux 6.1+); it does not change a
byte of memory, and the event loop is not involved (``madvise`` releases the GIL).

Only mappings that are at least 3/4 resident are folded, so a sparse mapping (a thread stack)
is not inflated to whole huge pages: the memory added is bounded by a quarter of what is folded.
Best effort: where the kernel lacks ``MADV_COLLAPSE`` (EINVAL) the first attempt turns it off for
the process; a transient refusal (EAGAIN, ENOMEM, a range being written) waits for the next
child. At most one pass runs at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import sys
import threading
import time
from dataclasses import dataclass

from kvrelay._madvise import MADV_COLLAPSE, madvise
from kvrelay.logging import get_logger

_log = get_logger(__name__)

HUGE = 2 << 20
_DENSE = 0.75


@dataclass(slots=True)
class Stats:
    passes: int = 0
    folded_bytes: int = 0
    refused: int = 0


stats = Stats()
_supported = sys.platform == "linux"
_running: asyncio.Future[int] | None = None
#: Held by the pass running now, whichever loop's executor runs it (a closed loop's thread may
#: still be in one): passes never overlap, and ``idle`` sees them all.
_pass = threading.Lock()


def dense_spans(smaps: str) -> list[tuple[int, int]]:
    """The 2 MiB-aligned interiors of the private, writable, anonymous mappings in ``smaps`` (the
    text of ``/proc/self/smaps``) that are at least 3/4 resident and not already all on huge
    pages: ``(start, length)`` each."""
    spans: list[tuple[int, int]] = []
    cur: tuple[int, int, int] | None = None  # (mapping size, aligned start, aligned end)
    rss = 0
    for line in smaps.splitlines():
        head = line.split(None, 5)
        if head and "-" in head[0] and ":" not in head[0] and len(head) >= 5:
            cur = None
            perms = head[1]
            name = head[5].strip() if len(head) > 5 else ""
            if perms.startswith("rw") and perms.endswith("p") and name in ("", "[heap]"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                start, end = (lo + HUGE - 1) // HUGE * HUGE, hi // HUGE * HUGE
                if end > start:
                    cur = (hi - lo, start, end)
        elif cur is not None and line.startswith("Rss:"):
            rss = int(line.split()[1]) * 1024
        elif cur is not None and line.startswith("AnonHugePages:"):
            size, start, end = cur
            huge = int(line.split()[1]) * 1024
            if rss >= _DENSE * size and huge < end - start:
                spans.append((start, end - start))
            cur = None
    return spans


def fold(pause_s: float = 0.0005) -> int:
    """One pass over this process's dense mappings, 2 MiB at a time with a short pause between
    (the kernel holds the mapping's lock while it copies one huge page, so the relay's own page
    faults never wait for more than one); the bytes the kernel folded (0 when it cannot: not
    Linux, no ``MADV_COLLAPSE``, nothing to fold)."""
    with _pass:
        return _fold(pause_s)


def _fold(pause_s: float) -> int:
    global _supported
    if not _supported:
        return 0
    try:
        with open("/proc/self/smaps") as f:
            spans = dense_spans(f.read())
    except OSError:
        return 0
    folded = 0
    for start, length in spans:
        for at in range(start, start + length, HUGE):
            err = madvise(at, HUGE, MADV_COLLAPSE)
            if err == 0:
                folded += HUGE
            elif err in (errno.EINVAL, errno.ENOSYS) and folded == 0 and stats.passes == 0:
                _supported = False  # an older kernel: no MADV_COLLAPSE
                return 0
            else:
                stats.refused += 1  # EAGAIN / ENOMEM / a mapping that changed: the next pass
            time.sleep(pause_s)
    stats.passes += 1
    stats.folded_bytes += folded
    return folded


def idle() -> bool:
    """No pass is running, started from any loop (tests wait for it)."""
    return not _pass.locked()


def fold_soon() -> None:
    """Start a pass on a worker thread, unless one is running (call on the event loop)."""
    global _running
    if not _supported:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no running loop (a child, a closing loop)
        return
    if _running is not None and not _running.done() and _running.get_loop() is loop:
        return  # one pass at a time (a pass left pending by another, closed loop is not one)
    with contextlib.suppress(RuntimeError):  # the loop's executor is shutting down
        _running = loop.run_in_executor(None, fold)
        _running.add_done_callback(_logged)


def _logged(fut: asyncio.Future[int]) -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        _log.warning("hugepage_fold_failed", error=str(exc))
    else:
        _log.debug("hugepages_folded", mib=round((fut.result() or 0) / 2**20))
