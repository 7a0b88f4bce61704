"""``PoolImage``: a pool's exported state as it was at one instant, read while the pool changes.

``Pool.open_image()`` takes it on the event loop between two batches (the instant of the cut):
the metadata and the small arrays (table metas, counters, tiny side tables) are copied then and
there; every other array is armed for copy-before-write (``pool/cow.py``) and read later, from
another thread, without the GIL, in the state file's order. The image is the same named arrays
``Pool.export_state`` gives, so a state file written from it is byte for byte the file a stopped
pool in that state would have written.

The image is closed on the event loop: as soon as its armed arrays have all been read (the
writer then no longer needs the pre-images, and writes stop paying for the barrier), or when its
write ends in any way. Closing disarms every place a kernel could find a control block before the
side store is returned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvrelay.pool.cow import CHUNK, Armed

#: An armable array this small is copied at the cut instead (cheaper than its control block).
EAGER_BYTES = 4096
#: A side store may always hold this much (a small pool's whole state: it never overruns).
SIDE_FLOOR = 4 << 20
#: Side store faulted in ahead of the captures, by the reading thread: more than the event loop
#: captures while one piece of the file is read.
POPULATE_AHEAD = 4 << 20


class ImageBroken(Exception):
    """The pool rewrote more than the side store holds while the image was read: it no longer
    holds the cut (the checkpoint is abandoned)."""


@dataclass(frozen=True, slots=True)
class Arming:
    """Where the kernels look for one array's control block: word ``index`` of ``holder``."""

    holder: npt.NDArray[Any]
    index: int


class ImageArray:
    """One armed array of an image, as the state file's writer reads it (``state_file.Source``)."""

    __slots__ = ("_image", "_index", "dtype", "nbytes", "shape")

    def __init__(self, image: PoolImage, index: int, a: npt.NDArray[Any]) -> None:
        self._image = image
        self._index = index
        self.dtype = a.dtype
        self.shape = a.shape
        self.nbytes = int(a.nbytes)

    def read(self, lo: int, hi: int, out: npt.NDArray[np.uint8]) -> memoryview:
        """Bytes ``[lo, hi)`` as at the cut (``lo`` a multiple of the chunk size, every byte read
        once, in any thread)."""
        return self._image._read(self._index, lo, hi, out)


class PoolImage:
    """Metadata and arrays of a pool at the cut (see the module docstring)."""

    def __init__(
        self,
        meta: dict[str, Any],
        arrays: dict[str, npt.NDArray[Any]],
        armings: dict[str, Arming],
        side_bytes: int | None = None,
        on_close: Callable[[], None] | None = None,
        eager_bytes: int = EAGER_BYTES,
    ) -> None:
        self.meta = meta
        armed: list[tuple[str, npt.NDArray[Any], Arming]] = []
        self._copies: dict[str, npt.NDArray[Any]] = {}
        for name, a in arrays.items():
            how = armings.get(name)
            if how is None or a.nbytes <= eager_bytes:
                self._copies[name] = a.copy()
            else:
                armed.append((name, a, how))
        tracked = sum(int(a.nbytes) for _, a, _ in armed)
        chunks = sum(-(-int(a.nbytes) // CHUNK) for _, a, _ in armed)
        if side_bytes is None:
            # Each armed chunk is captured at most once, and only before it is read: half the
            # armed bytes, the slot words included, keeps an image under 1.5x the state whatever
            # the pool does meanwhile; a small pool may keep up to SIDE_FLOOR (all of itself).
            side_bytes = min(chunks * CHUNK, max(SIDE_FLOOR, tracked // 2 - 4 * chunks))
        #: Bound of the side store.
        self.side_bytes = max(CHUNK, side_bytes)
        self._armed = Armed([a for _, a, _ in armed], self.side_bytes)
        self._names = list(arrays)
        self._sources: dict[str, ImageArray] = {}
        self._left = [int(a.nbytes) for _, a, _ in armed]  # bytes of each not read yet
        self._unread = sum(1 for n in self._left if n)
        self._holders: list[Arming] = []
        for i, (name, a, how) in enumerate(armed):
            self._sources[name] = ImageArray(self, i, a)
            how.holder[how.index] = self._armed.ctl(i)
            self._holders.append(how)
        self.armed_bytes = tracked
        self.closed = False
        self._on_close = on_close
        #: Called (from the reading thread) once every armed byte has been read.
        self.on_read_done: Callable[[], None] | None = None
        #: Called (from the reading thread) with each armed piece's size before it is read: a
        #: writer that spreads the reading over time waits there.
        self.pace: Callable[[int], None] | None = None
        self.captured_bytes = 0
        self.broken = False
        if self._unread == 0:
            self._finish_reads()

    def arrays(self) -> Iterator[tuple[str, npt.NDArray[Any] | ImageArray]]:
        """Every array in export order: a copy, or an armed array to read."""
        for name in self._names:
            copy = self._copies.get(name)
            yield name, self._sources[name] if copy is None else copy

    def as_dict(self) -> dict[str, npt.NDArray[Any] | ImageArray]:
        return dict(self.arrays())

    def prepare(self) -> None:
        """Fault in the image's bookkeeping ahead of the event loop's captures (call first, from
        the reading thread)."""
        if not self.closed:
            self._armed.populate(POPULATE_AHEAD)

    def _read(self, i: int, lo: int, hi: int, out: npt.NDArray[np.uint8]) -> memoryview:
        if self.closed:
            raise RuntimeError("the image was closed before it was read")
        if self.pace is not None:
            self.pace(hi - lo)
        self._armed.populate(POPULATE_AHEAD)
        self._armed.read(i, lo, hi, out)
        n = hi - lo
        self._left[i] -= n
        if self._left[i] == 0 and n:
            self._unread -= 1
            if self._unread == 0:
                self._finish_reads()
        return out.data[:n]

    @property
    def fill(self) -> float:
        """How full the side store is (0 to 1; any thread)."""
        return self._armed.captured_bytes / self.side_bytes

    def _finish_reads(self) -> None:
        self.captured_bytes = self._armed.captured_bytes
        self.broken = self._armed.broken
        if self.on_read_done is not None:
            self.on_read_done()
        if self.broken:
            raise ImageBroken(f"the pool changed more than the {self.side_bytes} bytes the "
                              "image keeps while it was read")  # fmt: skip

    def close(self) -> None:
        """Disarm and free (on the event loop, between batches; idempotent)."""
        if self.closed:
            return
        self.closed = True
        for how in self._holders:
            how.holder[how.index] = 0
        self._holders = []
        self.captured_bytes = self._armed.captured_bytes
        self.broken = self.broken or self._armed.broken
        self._armed.release()
        if self._on_close is not None:
            self._on_close()
