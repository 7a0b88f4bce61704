"""Copy-before-write: a pool's arrays as they were at one instant, read while the pool changes.

A checkpoint must write one consistent cut of a pool while ingest goes on. A ``fork`` gives
that cut for free on the loop's side, but the kernel then takes a copy-on-write fault (a trap, a
huge-page split and a 4 KiB copy, several microseconds) at the relay's first write to each page,
and its first batch after the fork also faults on the interpreter's heap: on a 10M pool that
doubled the delta p99 while a checkpoint was written. Here the kernels that write the pool's
arrays do the copying themselves, only for what they are about to change, and only in 256-byte
chunks:

* **The cut** (on the event loop, between batches) *arms* each big array: a control block
  (``ctl``) says where the array lies, where its chunks' pre-images go and how much room there
  is. The kernels find the block where they already look: a packed table's meta word
  ``TM_COW``, the filter's dirty-log meta, the side tables' words the pool passes along.
* **Every write** to an armed array first calls :func:`touch` with the address it is about to
  write. The first write to a chunk copies the chunk as it is into the side store and records
  where (its slot word: ``k + 1``); any later write to that chunk costs one load and a branch.
  Unarmed (``ctl == 0``, no checkpoint running): one compare.
* **The reader** (:func:`read_into`, without the GIL, on the checkpoint's writer thread) copies
  each chunk of the live array, then reads its slot word again: if a write captured the chunk
  meanwhile, the pre-image is used instead; if not, the copy is the cut's and the chunk is marked
  read (``-1``), so no later write copies it. A chunk captured before the reader reached it is
  taken from the side store. The two sides order their accesses with fences (a write's capture
  is visible before the write itself; the reader's copy completes before it looks again), so a
  torn copy is always replaced by the pre-image.
* **Bounded**: each chunk is captured at most once, and only before the reader has passed it;
  the side store has a fixed size. A capture that finds it full marks the image *broken*
  (the chunk changes without a pre-image) and the reader's caller abandons the file.

Pointers are plain ``uint64`` values read at run time (never compiled-in constants, which
numba's on-disk cache would carry into another process); the loads, stores, fences and copies
on them are LLVM instructions emitted by the intrinsics below.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kvrelay._jit import inline, kernel
from kvrelay._madvise import MADV_POPULATE_WRITE, madvise

U8 = npt.NDArray[np.uint8]
U64 = npt.NDArray[np.uint64]

CHUNK_SHIFT = 8
CHUNK = 1 << CHUNK_SHIFT  # a slot of any table spans at most two chunks

# control block (u64[CTL_LEN]) of one armed array
CTL_BASE = 0  # address of the array's first byte
CTL_NBYTES = 1
CTL_SLOTS = 2  # address of its i32 slot words, one per chunk: 0 untouched, k + 1 captured, -1 read
CTL_SIDE = 3  # address of the image's side store (shared by its arrays)
CTL_CAP = 4  # chunks the side store holds
CTL_COUNT = 5  # address of the image's counters (u64[COUNT_LEN])
CTL_LEN = 8
# counters (u64[COUNT_LEN]), shared by every array of one image
CNT_USED = 0  # side store chunks used
CNT_BROKEN = 1  # 1 once a capture found the side store full
COUNT_LEN = 4

_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


@intrinsic  # type: ignore[misc]
def _ld(typingctx: Any, addr: Any) -> Any:
    """The u64 at ``addr``."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.load(builder.inttoptr(args[0], _I64.as_pointer()))

    return types.uint64(types.uint64), codegen


@intrinsic  # type: ignore[misc]
def _st(typingctx: Any, addr: Any, value: Any) -> Any:
    """Store u64 ``value`` at ``addr``."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.store(args[1], builder.inttoptr(args[0], _I64.as_pointer()))
        return context.get_dummy_value()

    return types.void(types.uint64, types.uint64), codegen


@intrinsic  # type: ignore[misc]
def _ld_slot(typingctx: Any, addr: Any) -> Any:
    """The i32 slot word at ``addr`` (an atomic load with acquire order)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.load_atomic(builder.inttoptr(args[0], _I32.as_pointer()), "acquire", 4)

    return types.int32(types.uint64), codegen


@intrinsic  # type: ignore[misc]
def _st_slot(typingctx: Any, addr: Any, value: Any) -> Any:
    """Store i32 ``value`` at ``addr`` (an atomic store with release order)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        v = context.cast(builder, args[1], signature.args[1], types.int32)
        builder.store_atomic(v, builder.inttoptr(args[0], _I32.as_pointer()), "release", 4)
        return context.get_dummy_value()

    return types.void(types.uint64, value), codegen


@intrinsic  # type: ignore[misc]
def _fence(typingctx: Any) -> Any:
    """A full (sequentially consistent) memory fence: no load or store crosses it."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic  # type: ignore[misc]
def _copy(typingctx: Any, dst: Any, src: Any, n: Any) -> Any:
    """``memcpy(dst, src, n)`` on addresses (non-overlapping)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d = builder.inttoptr(args[0], _I8P)
        s = builder.inttoptr(args[1], _I8P)
        cgutils.raw_memcpy(builder, d, s, args[2], 1)  # type: ignore[no-untyped-call]
        return context.get_dummy_value()

    return types.void(types.uint64, types.uint64, types.uint64), codegen


# Typed views for callers (numba passes ``typingctx`` itself).
ld: Callable[[Any], np.uint64] = _ld  # type: ignore[assignment]
st: Callable[[Any, Any], None] = _st  # type: ignore[assignment]
ld_slot: Callable[[Any], int] = _ld_slot  # type: ignore[assignment]
st_slot: Callable[[Any, Any], None] = _st_slot  # type: ignore[assignment]
fence: Callable[[], None] = _fence  # type: ignore[assignment]
copy: Callable[[Any, Any, Any], None] = _copy  # type: ignore[assignment]

_ONE = np.uint64(1)
_SHIFT = np.uint64(CHUNK_SHIFT)
_CHUNK = np.uint64(CHUNK)


@njit(cache=True, _nrt=False, no_cpython_wrapper=True, no_cfunc_wrapper=True)  # type: ignore[misc,call-overload,untyped-decorator]
def _capture(ctl: np.uint64, c: np.uint64, sa: np.uint64) -> None:
    """First write to chunk ``c`` of the array of ``ctl`` (slot word at ``sa``): copy it as it
    is into the side store, then publish where, before the caller writes (the fence)."""
    cnt = ld(ctl + np.uint64(8 * CTL_COUNT))
    k = ld(cnt)
    if k >= ld(ctl + np.uint64(8 * CTL_CAP)):
        st(cnt + np.uint64(8 * CNT_BROKEN), _ONE)
        return
    lo = c << _SHIFT
    n = ld(ctl + np.uint64(8 * CTL_NBYTES)) - lo
    copy(ld(ctl + np.uint64(8 * CTL_SIDE)) + (k << _SHIFT),
          ld(ctl + np.uint64(8 * CTL_BASE)) + lo, n if n < _CHUNK else _CHUNK)  # fmt: skip
    st(cnt, k + _ONE)
    st_slot(sa, np.int32(k + _ONE))
    fence()


@inline
def touch(ctl: np.uint64, addr: np.uint64) -> None:
    """Before writing the byte(s) at ``addr``: if ``ctl`` arms the array holding it and the
    chunk was neither captured nor read yet, capture it. ``ctl == 0``: nothing armed."""
    if ctl != np.uint64(0):
        off = addr - ld(ctl + np.uint64(8 * CTL_BASE))  # wraps above NBYTES when addr < base
        if off < ld(ctl + np.uint64(8 * CTL_NBYTES)):
            c = off >> _SHIFT
            sa = ld(ctl + np.uint64(8 * CTL_SLOTS)) + (c << np.uint64(2))
            if ld_slot(sa) == 0:
                _capture(ctl, c, sa)


@inline
def touch_item(ctl: np.uint64, a: Any, i: Any) -> None:
    """:func:`touch` for element ``i`` of array ``a``."""
    if ctl != np.uint64(0):
        touch(ctl, np.uint64(a.ctypes.data) + np.uint64(i) * np.uint64(a.itemsize))


@inline
def touch_all(ctl: np.uint64, a: Any) -> None:
    """:func:`touch` for every chunk of array ``a`` (before a whole-array fill)."""
    if ctl != np.uint64(0):
        base = np.uint64(a.ctypes.data)
        n = np.uint64(a.size) * np.uint64(a.itemsize)
        at = np.uint64(0)
        while at < n:
            touch(ctl, base + at)
            at += _CHUNK


@kernel(  # type: ignore[misc]
    "pool", types.int64(types.uint64, types.uint8[::1], types.int64, types.int64), nogil=True
)
def read_into(ctl: np.uint64, out: U8, lo: int, hi: int) -> int:
    """Bytes ``[lo, hi)`` of the armed array of ``ctl`` as they were at the cut, into
    ``out[:hi - lo]`` (``lo`` a multiple of ``CHUNK``; each chunk read once). Runs without the
    GIL while the loop writes the array. Returns the chunks taken from the side store, or -1 if
    a chunk was read before (a caller's bug)."""
    base = ld(ctl + np.uint64(8 * CTL_BASE))
    n = ld(ctl + np.uint64(8 * CTL_NBYTES))
    slots = ld(ctl + np.uint64(8 * CTL_SLOTS))
    side = ld(ctl + np.uint64(8 * CTL_SIDE))
    dst = np.uint64(out.ctypes.data)
    ulo = np.uint64(lo)
    uhi = np.uint64(hi) if np.uint64(hi) < n else n
    from_side = 0
    c = ulo >> _SHIFT
    while (c << _SHIFT) < uhi:
        at = c << _SHIFT
        m = uhi - at if uhi - at < _CHUNK else _CHUNK
        d = dst + (at - ulo)
        sa = slots + (c << np.uint64(2))
        s = ld_slot(sa)
        if s < 0:
            return -1
        if s == 0:
            copy(d, base + at, m)
            fence()  # the copy is complete before the slot is looked at again
            s = ld_slot(sa)
            if s == 0:
                st_slot(sa, np.int32(-1))
        if s > 0:
            copy(d, side + ((np.uint64(s) - _ONE) << _SHIFT), m)
            from_side += 1
        c += _ONE
    return from_side


_BYTES_IN = types.Array(types.uint8, 1, "C", readonly=True)  # any bytes, read-only or not


@kernel(  # type: ignore[misc]
    "pool", types.void(types.uint8[::1], types.int64, _BYTES_IN, types.int64, types.int64),
    nogil=True,
)
def copy_bytes(dst: U8, at: int, src: U8, start: int, n: int) -> None:
    """``dst[at:at + n] = src[start:start + n]`` without the GIL (a writer thread's copies must
    not hold the event loop's interpreter)."""
    copy(np.uint64(dst.ctypes.data) + np.uint64(at), np.uint64(src.ctypes.data) + np.uint64(start),
          np.uint64(n))  # fmt: skip


class Armed:
    """The control blocks, slot words and side store of one image's armed arrays.

    ``arrays`` are kept referenced until :meth:`release`: their memory must not be freed (and
    reused by another array an old control block would then capture) while any kernel could
    still find a block. Slot words and side store are one anonymous private mapping: pages cost
    memory only once written, :meth:`populate` (from the reading thread) writes them ahead so
    that the event loop's captures do not take the page faults, and all of it is returned at
    once."""

    def __init__(self, arrays: Sequence[npt.NDArray[Any]], side_bytes: int) -> None:
        self.arrays = list(arrays)
        nbytes = [int(a.nbytes) for a in self.arrays]
        chunks = [-(-n // CHUNK) for n in nbytes]
        self.ctls = np.zeros((len(self.arrays), CTL_LEN), dtype=np.uint64)
        self.count = np.zeros(COUNT_LEN, dtype=np.uint64)
        cap = max(1, side_bytes // CHUNK)
        self._slot_bytes = -(-4 * max(1, sum(chunks)) // mmap.PAGESIZE) * mmap.PAGESIZE
        self._map = mmap.mmap(-1, self._slot_bytes + cap * CHUNK,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # fmt: skip
        self._buf = np.frombuffer(self._map, dtype=np.uint8)
        self._base = int(self._buf.ctypes.data)
        self._populated = 0  # bytes of the mapping written ahead so far
        side_at, count_at = self._base + self._slot_bytes, self.count.ctypes.data
        slot_at = self._base
        for i, a in enumerate(self.arrays):
            if not a.flags.c_contiguous:
                raise ValueError("only C-contiguous arrays can be armed")
            self.ctls[i] = (a.ctypes.data, nbytes[i], slot_at, side_at, cap, count_at, 0, 0)
            slot_at += 4 * chunks[i]

    def ctl(self, i: int) -> int:
        """Address of array ``i``'s control block (what the kernels are given)."""
        return int(self.ctls.ctypes.data) + i * CTL_LEN * 8

    def populate(self, ahead: int) -> None:
        """Fault in the slot words and the side store up to ``ahead`` bytes past what captures
        used so far (from the reading thread, without the GIL; best effort: a kernel without
        ``MADV_POPULATE_WRITE`` leaves the faults to whoever writes first)."""
        want = min(len(self._buf), self._slot_bytes + self.captured_bytes + ahead)
        want = -(-want // mmap.PAGESIZE) * mmap.PAGESIZE
        at = self._base + self._populated
        if want > self._populated and madvise(at, want - self._populated, MADV_POPULATE_WRITE) == 0:
            self._populated = want

    def read(self, i: int, lo: int, hi: int, out: U8) -> int:
        """Bytes ``[lo, hi)`` of array ``i`` as at the cut, into ``out`` (any thread; no GIL
        held while copying); the chunks that came from the side store."""
        got = int(read_into(np.uint64(self.ctl(i)), out, lo, hi))
        if got < 0:
            raise RuntimeError("a chunk of an armed array was read twice")
        return got

    @property
    def broken(self) -> bool:
        """A write found the side store full: the image no longer holds the cut."""
        return bool(self.count[CNT_BROKEN])

    @property
    def captured_bytes(self) -> int:
        return int(self.count[CNT_USED]) * CHUNK

    def release(self) -> None:
        """Drop the arrays and return the mapping (once nothing can find a block)."""
        self.arrays = []
        self._buf = np.zeros(0, dtype=np.uint8)
        with contextlib.suppress(BufferError):  # a view still alive somewhere: freed with it
            self._map.close()
