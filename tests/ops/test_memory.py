"""Memory settings: smaps parsing, which mappings may be dropped, and that dropping LLVM's pages
leaves the kernels (and later compiles) working, checked against independent references."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import xxhash

from kvrelay.ops import memory

SMAPS = """\
7f0000000000-7f0000100000 r--p 00000000 fe:00 42   /x/libllvmlite.so
Rss:                1024 kB
Private_Clean:      1024 kB
Private_Dirty:         0 kB
Shared_Dirty:          0 kB
Anonymous:             0 kB
VmFlags: rd mr mw me sd
7f0000100000-7f0000200000 r-xp 00100000 fe:00 42   /x/libllvmlite.so
Rss:                 512 kB
Private_Dirty:         0 kB
Shared_Dirty:          0 kB
Anonymous:             0 kB
7f0000200000-7f0000210000 r--p 00200000 fe:00 42   /x/libllvmlite.so
Rss:                  64 kB
Private_Dirty:        64 kB
Shared_Dirty:          0 kB
Anonymous:            64 kB
7f0000210000-7f0000220000 rw-p 00210000 fe:00 42   /x/libllvmlite.so
Rss:                  16 kB
Private_Dirty:        16 kB
Anonymous:            16 kB
7f0000300000-7f0000400000 rw-p 00000000 00:00 0
Rss:                 100 kB
Anonymous:           100 kB
"""


def test_parse_smaps_fields_and_droppable() -> None:
    maps = memory.parse_smaps(SMAPS)
    assert [m.perms for m in maps] == ["r--p", "r-xp", "r--p", "rw-p", "rw-p"]
    assert maps[0].start == 0x7F0000000000 and maps[0].end == 0x7F0000100000
    assert [m.rss_kb for m in maps] == [1024, 512, 64, 16, 100]
    assert maps[4].path == ""
    # clean read-only pages only: relocated (dirty) and writable mappings are never dropped
    assert [m.droppable for m in maps] == [True, True, False, False, False]


def test_operator_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert memory.tune_malloc() is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc/Linux only")
def test_tune_malloc_applies_on_glibc() -> None:
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    assert memory.tune_malloc() is True
    big = np.ones(4 << 20, dtype=np.uint8)  # above the threshold: mapped, and unmapped on free
    assert int(big.sum()) == 4 << 20


def _llvm_resident_kb() -> int:
    with open("/proc/self/smaps") as f:
        maps = memory.parse_smaps(f.read())
    return sum(m.rss_kb for m in maps if memory.COMPILER_LIBRARY in m.path and m.droppable)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")
def test_release_compiler_pages_keeps_kernels_and_compiler_working() -> None:
    import numba

    from kvrelay.hashing.xxh3 import xxh3_64_u64

    seed = np.uint64(0x5DEECE66D1B54A33)
    before = int(xxh3_64_u64(np.uint64(12345), seed))  # loaded (or compiled) before the release

    @numba.njit(cache=False)
    def warm(x: int) -> int:
        return x + 1

    assert warm(1) == 2  # LLVM runs: its pages are resident even if an earlier test dropped them
    if _llvm_resident_kb() == 0:
        pytest.skip("llvmlite not mapped from a file here")
    memory._CHECKED.clear()  # read smaps afresh (a re-drop of known ranges reports 0 bytes)
    released = memory.release_compiler_pages()
    assert released > 0 and _llvm_resident_kb() == 0
    # the kernels still run, bit-exact with the xxhash package
    for x in (0, 1, 12345, 2**63 + 7):
        got = int(xxh3_64_u64(np.uint64(x), seed))
        assert got == xxhash.xxh3_64_intdigest(x.to_bytes(8, "little"), seed=int(seed))
    assert int(xxh3_64_u64(np.uint64(12345), seed)) == before

    # and LLVM itself still works: a new function compiles after its pages were dropped
    @numba.njit(cache=False)
    def tri(n: int) -> int:
        s = 0
        for i in range(n + 1):
            s += i
        return s

    assert tri(1000) == 500500


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")
async def test_pages_brought_back_by_a_later_compile_are_dropped_again() -> None:
    import asyncio

    import numba

    memory.release_compiler_pages()

    @numba.njit(cache=False)
    def sq(x: int) -> int:
        return x * x

    assert sq(12) == 144  # compiling ran LLVM: its pages are resident again
    if _llvm_resident_kb() == 0:
        pytest.skip("llvmlite not mapped from a file here")
    task = asyncio.create_task(memory.keep_compiler_pages_released(period_s=0.01))
    try:
        for _ in range(500):
            await asyncio.sleep(0.01)
            if _llvm_resident_kb() == 0:
                break
        assert _llvm_resident_kb() == 0
    finally:
        task.cancel()
    assert sq(13) == 169


def test_link_modules_are_released_and_parsed_again_when_a_later_compile_links_them() -> None:
    """The numba internals ``release_link_modules`` relies on, named: a code library's
    ``_shared_module`` (the LLVM module kept for linking), ``CPUCodeLibrary.
    _get_module_for_linking`` (what linking asks for), a dispatcher's ``overloads`` and each
    overload's ``library``. After the release a kernel still runs, bit-exact; a new function that
    calls it compiles (its module parsed again) and agrees with the xxhash package."""
    import numba
    from numba.core.codegen import CPUCodeLibrary

    from kvrelay import _jit
    from kvrelay.hashing.xxh3 import xxh3_64_u64

    assert hasattr(CPUCodeLibrary, "_get_module_for_linking")
    seed = np.uint64(0x5DEECE66D1B54A33)
    before = int(xxh3_64_u64(np.uint64(99), seed))
    libs = [cres.library for cres in xxh3_64_u64.overloads.values()]
    assert libs and all(hasattr(lib, "_shared_module") for lib in libs)
    _jit.release_link_modules()
    assert all(lib._shared_module is None for lib in libs)  # released (this or an earlier call)
    assert int(xxh3_64_u64(np.uint64(99), seed)) == before

    @numba.njit(cache=False)
    def twice(x: np.uint64) -> np.uint64:
        return xxh3_64_u64(xxh3_64_u64(x, seed), seed)

    first = xxhash.xxh3_64_intdigest((7).to_bytes(8, "little"), seed=int(seed))
    want = xxhash.xxh3_64_intdigest(first.to_bytes(8, "little"), seed=int(seed))
    assert int(twice(np.uint64(7))) == want
    assert all(lib._shared_module is not None for lib in libs)  # parsed again to link


def test_release_after_warmup_keeps_nothing_twice() -> None:
    """After one release every loaded module is kept as bitcode: a second releases nothing."""
    memory.release_after_warmup()
    assert memory.release_after_warmup().link_bitcode == 0
