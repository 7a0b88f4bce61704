"""Process memory settings of the daemon: glibc malloc tuning and LLVM's code pages.

Why this exists, measured on a warm relay (kernel cache present):

* About 85 MiB of a ~190 MiB resident set is llvmlite's shared library (LLVM). LLVM is needed to
  load or compile the numba kernels, never to run them: once they are loaded its code pages sit
  in memory unused. They are clean, read-only file pages, so ``release_compiler_pages`` tells the
  kernel to drop them (``MADV_DONTNEED``); if LLVM runs again (a kernel compiled, or loaded from
  the cache on first use) they are read back from the page cache on first touch, and
  ``keep_compiler_pages_released`` drops them again. Mappings holding modified pages
  (relocations) are never touched.
* The kernels loaded from numba's cache keep their LLVM modules for linking into kernels
  compiled later, which a warmed relay never does: ``release_after_warmup`` has them kept as
  compressed bitcode instead (``kvrelay._jit.release_link_modules``, parsed again if a later
  compilation needs one) and returns the freed heap to the system (``malloc_trim``): about 9 MiB
  of a ~108 MiB resident set after the warm-up.
* glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), after which
  multi-MiB buffers — snapshot cuts and chunks, one set per joining subscriber — come from the
  heap, where fragmentation keeps them resident long after they are freed (64 subscribers joining
  at once left ~430 MiB resident instead of ~210). ``tune_malloc`` pins the threshold at 1 MiB
  (blocks above it are mapped and returned on free) and caps malloc arenas at 2 (the relay runs
  one event loop; its few helper threads need no arena each).

Both are Linux/glibc only and do nothing elsewhere (musl has no ``mallopt``). An operator's own
``MALLOC_*`` / ``GLIBC_TUNABLES`` environment wins over ``tune_malloc``.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import sys
from dataclasses import dataclass

from kvrelay._madvise import MADV_DONTNEED, madvise
from kvrelay._text import is_decimal

#: mallopt parameters (glibc <malloc.h>).
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MMAP_THRESHOLD = 1 << 20
ARENA_MAX = 2
#: Path fragment of the shared library whose clean pages are dropped after warm-up.
COMPILER_LIBRARY = "libllvmlite"
#: How often ``keep_compiler_pages_released`` looks again (a kernel loaded on first use, such as
#: a table rehash, runs LLVM and brings ~25 MiB of its pages back).
RELEASE_PERIOD_S = 30.0

_OPERATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX", "GLIBC_TUNABLES")


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD, arena_max: int = ARENA_MAX) -> bool:
    """Pin glibc's mmap threshold and cap its arenas; True when both were applied."""
    if any(k in os.environ for k in _OPERATOR_ENV):
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok_threshold = bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1)
    ok_arenas = bool(mallopt(_M_ARENA_MAX, int(arena_max)) == 1)
    return ok_threshold and ok_arenas


def trim_heap() -> bool:
    """Return the heap's free pages to the system (glibc ``malloc_trim(0)``); True when some
    were returned."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0) == 1)


@dataclass(frozen=True, slots=True)
class Released:
    """What ``release_after_warmup`` gave back (bytes)."""

    compiler_pages: int
    link_bitcode: int


def release_after_warmup() -> Released:
    """Once every kernel is warm: LLVM's code pages (``release_compiler_pages``), the kernels'
    LLVM modules kept for linking (``release_link_modules``) and the heap they leave free."""
    from kvrelay._jit import release_link_modules

    bitcode = release_link_modules()  # LLVM runs here (bitcode out, modules freed): first
    if bitcode:
        trim_heap()
    return Released(compiler_pages=release_compiler_pages(), link_bitcode=bitcode)


@dataclass(frozen=True, slots=True)
class Mapping:
    """One line of /proc/self/smaps with the fields ``release_compiler_pages`` needs (kB)."""

    start: int
    end: int
    perms: str
    path: str
    rss_kb: int = 0
    anonymous_kb: int = 0
    dirty_kb: int = 0

    @property
    def droppable(self) -> bool:
        """Read-only and never modified: its pages are exactly the file's, safe to drop."""
        return "w" not in self.perms and self.anonymous_kb == 0 and self.dirty_kb == 0


def parse_smaps(text: str) -> list[Mapping]:
    """The mappings of an smaps text (address range, permissions, path, Rss/Anonymous/dirty)."""
    out: list[Mapping] = []
    head: tuple[int, int, str, str] | None = None
    rss = anon = dirty = 0
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        key = parts[0]
        if "-" in key and not key.endswith(":"):
            if head is not None:
                out.append(Mapping(*head, rss_kb=rss, anonymous_kb=anon, dirty_kb=dirty))
            lo, _, hi = key.partition("-")
            perms = parts[1] if len(parts) > 1 else ""
            head = (int(lo, 16), int(hi, 16), perms, parts[5] if len(parts) > 5 else "")
            rss = anon = dirty = 0
        elif head is not None and len(parts) >= 2 and is_decimal(parts[1]):
            if key == "Rss:":
                rss = int(parts[1])
            elif key == "Anonymous:":
                anon = int(parts[1])
            elif key in ("Private_Dirty:", "Shared_Dirty:"):
                dirty += int(parts[1])
    if head is not None:
        out.append(Mapping(*head, rss_kb=rss, anonymous_kb=anon, dirty_kb=dirty))
    return out


#: library -> (its lines of /proc/self/maps when last checked, the droppable ranges then)
_CHECKED: dict[str, tuple[tuple[str, ...], tuple[tuple[int, int], ...]]] = {}


def release_compiler_pages(library: str = COMPILER_LIBRARY) -> int:
    """Drop the resident pages of ``library``'s read-only, unmodified mappings; returns how many
    bytes were resident in them (0 when nothing applied, or when only re-dropped).

    Which mappings qualify is read from /proc/self/smaps (~6 ms) the first time and whenever
    the library's lines in /proc/self/maps (~0.2 ms) changed; otherwise the ranges found then are
    dropped again as they are (a read-only mapping cannot gain modified pages)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        with open("/proc/self/maps") as f:
            lines = tuple(line for line in f.read().splitlines() if library in line)
        cached = _CHECKED.get(library)
        resident = 0
        if cached is not None and cached[0] == lines:
            ranges = cached[1]
        else:
            with open("/proc/self/smaps") as f:
                maps = parse_smaps(f.read())
            found = [m for m in maps if library in m.path and m.droppable]
            ranges = tuple((m.start, m.end) for m in found)
            resident = sum(m.rss_kb for m in found) * 1024
            _CHECKED[library] = (lines, ranges)
    except OSError:
        return 0
    ok = [madvise(start, end - start, MADV_DONTNEED) == 0 for start, end in ranges]
    return resident if all(ok) else 0


async def keep_compiler_pages_released(period_s: float = RELEASE_PERIOD_S) -> None:
    """Run for ever: drop LLVM's pages again if something (a kernel loaded from the cache on
    first use) brought them back — soon after start, when that happens (at ``period_s`` / 6,
    / 3, / 1.5), then every ``period_s``. Under a millisecond per look (see
    ``release_compiler_pages``), in a worker thread so the event loop never waits for it."""
    for delay in (period_s / 6, period_s / 6, period_s / 3, period_s / 3):
        await asyncio.sleep(delay)
        await asyncio.to_thread(release_compiler_pages)
    while True:
        await asyncio.sleep(period_s)
        await asyncio.to_thread(release_compiler_pages)
