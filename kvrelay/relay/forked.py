"""Work on a frozen image of the relay's memory, in a forked child: scrub passes and a hot
upgrade's cut.

Both need one consistent view of the pools while ingest goes on, and both need more than
streaming it out: a scrub looks owners up in the filter, an upgrade's cut takes every pool at
one instant. Copying the arrays costs the event loop a ``memcpy`` of the whole state and doubles
its memory; a ``fork`` between two batches gives the child the memory as it was at that instant
(copy-on-write), costs the loop only the page tables, and adds only the pages the relay writes
while the child runs. (A periodic checkpoint only streams one pool out, and does without a
fork: ``pool/image.py``.)

The child runs one function, writes its text result to a pipe and ends with ``os._exit``: no
logging, no sockets, no event loop, nothing that could take a lock another thread held at the
fork (so Python 3.12's warning about forking a process with threads is silenced there). It
runs at a lower priority (``nice`` 10, the relay's own work goes first), is the first process
the kernel's OOM killer takes (``_oom.py``), and is killed
if the relay dies (``PR_SET_PDEATHSIG``), so a crash leaves no child behind. The parent learns
the outcome through a ``pidfd`` on its event loop: :class:`Child.done` resolves to
``(ok, text)``. Once it has ended, ``relay/hugepages.py`` folds the huge pages the child's
copy-on-write image made the relay split, so the next fork costs what the first one did.

While the child holds the image, every first write the relay makes to a shared page is a
copy-on-write fault, and on a huge page it also splits the relay's mapping: measured on a 10M
pool, that cost, spread over the whole write, not the fork itself, doubled the delta p99 while
a child wrote a checkpoint (when checkpoints still forked). So a child that has written a
stretch of an array gives its share of the whole huge pages in it back (:func:`give_back`,
``MADV_DONTNEED`` in the child only): the relay then owns them alone again, and its next write
there reuses the page in place instead of copying it.

That reuse is still one fault per small page the relay had split: its page table keeps every
entry of the image write-protected until it is written once. So the child also tells the relay,
through a second pipe, each range it gave back, and one thread of the relay (:class:`_Follower`)
makes those ranges writable again ahead of the event loop (``MADV_POPULATE_WRITE``, Linux 5.14+:
the kernel takes the faults, nothing is copied, no byte changes). The ranges are the relay's
own pages again by then, so this adds no memory (it is skipped while another child, whose image
could still share them, is running).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import selectors
import signal
import struct
import sys
import threading
import warnings
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvrelay._madvise import MADV_DONTNEED, MADV_POPULATE_WRITE, madvise
from kvrelay._oom import CHILD, prefer_killing
from kvrelay.relay import hugepages

_PR_SET_PDEATHSIG = 1
REPORT_MAX = 16 << 10  # well under a pipe's capacity: the child never blocks on it
HUGE = hugepages.HUGE
_RANGE = struct.Struct("=QQ")  # (start, length) of a range given back: one atomic pipe write
_in_child = False
_ranges_w = -1  # in a child: where give_back reports its ranges
_live: set[int] = set()  # the relay's children not yet reaped


class Child:
    """One forked child running ``work``; ``done`` resolves to ``(ok, text)``."""

    def __init__(self, work: Callable[[], str]) -> None:
        loop = asyncio.get_running_loop()
        self.done: asyncio.Future[tuple[bool, str]] = loop.create_future()
        r, w = os.pipe()
        ranges_r, ranges_w = os.pipe()
        parent = os.getpid()
        with warnings.catch_warnings():
            # Python 3.12+ warns at every fork of a process with threads: a child could wait
            # for ever on a lock another thread held. This child takes none (the docstring).
            warnings.filterwarnings("ignore", r"This process .*is multi-threaded, use of fork",
                                    DeprecationWarning)  # fmt: skip
            pid = os.fork()
        if pid == 0:  # the child: the work, its report, exit; nothing else
            code = 1
            try:
                global _in_child, _ranges_w
                _in_child = True
                os.close(r)
                os.close(ranges_r)
                os.set_blocking(ranges_w, False)  # a full pipe drops a range, never blocks
                _ranges_w = ranges_w
                _die_with(parent)
                with contextlib.suppress(OSError):
                    os.nice(10)
                prefer_killing(CHILD)  # under memory pressure, the kernel takes it first
                out = work().encode()[:REPORT_MAX]
                os.write(w, out)
                code = 0
            except BaseException as exc:
                with contextlib.suppress(BaseException):
                    os.write(w, f"{type(exc).__name__}: {exc}".encode()[:REPORT_MAX])
            finally:
                os._exit(code)
        os.close(w)
        os.close(ranges_w)
        _live.add(pid)
        self.follower = _follower.watch(ranges_r)
        self.pid = pid
        self._report = r
        self._pidfd = -1
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:  # no pidfd (an old kernel, a seccomp filter): a thread waits instead
            fut = loop.run_in_executor(None, os.waitpid, pid, 0)
            fut.add_done_callback(lambda f: self._reap(f.result()[1]))
        else:
            loop.add_reader(self._pidfd, self._reap)

    def _reap(self, status: int | None = None) -> None:
        if self.done.done():
            return
        if self._pidfd >= 0:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        if status is None:
            _pid, status = os.waitpid(self.pid, 0)
        chunks = []
        with contextlib.suppress(OSError):
            while chunk := os.read(self._report, REPORT_MAX):
                chunks.append(chunk)
        os.close(self._report)
        _live.discard(self.pid)
        code = os.waitstatus_to_exitcode(status)
        text = b"".join(chunks).decode(errors="replace") or f"child exited with {code}"
        if not self.done.done():
            self.done.set_result((code == 0, text))
        hugepages.fold_soon()  # the child split huge pages: fold them before the next cut

    def kill(self) -> None:
        """End the child now (its result: not ok)."""
        if self.done.done():
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if self._pidfd >= 0:
            self._reap()


def _die_with(parent: int) -> None:
    """Killed when the relay dies (Linux); exits at once if it already has."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def give_back(raw: npt.NDArray[np.uint8], start: int, end: int) -> None:
    """In a forked child: drop the child's copy of the whole huge pages within bytes
    ``[0, end)`` of ``raw`` that ``[start, end)`` completes (written out, never read again), so
    the relay owns them alone again. Anywhere else it does nothing: in the relay it would zero
    live state. Best effort: a refusal only leaves the pages shared."""
    if not _in_child or sys.platform != "linux":
        return
    base = int(raw.ctypes.data)
    lo = max((base + start) // HUGE * HUGE, (base + HUGE - 1) // HUGE * HUGE)
    hi = (base + end) // HUGE * HUGE
    if hi <= lo:
        return
    if madvise(lo, hi - lo, MADV_DONTNEED) == 0 and _ranges_w >= 0:
        with contextlib.suppress(OSError):  # a full pipe: the relay takes those faults itself
            os.write(_ranges_w, _RANGE.pack(lo, hi - lo))


class Ranges:
    """What one child reports: the ranges it gave back, read by the follower thread."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = b""
        #: Bytes made writable again so far (tests and benchmarks read it).
        self.populated = 0

    def read(self) -> bool:
        """Take what the pipe holds and make those ranges writable; False at its end."""
        try:
            chunk = os.read(self.fd, _RANGE.size * 256)
        except BlockingIOError:
            return True
        except OSError:
            chunk = b""
        if not chunk:
            return False
        buf = self._buf + chunk
        whole = len(buf) - len(buf) % _RANGE.size
        for at, length in _RANGE.iter_unpack(buf[:whole]):
            if _Follower.supported:
                self._populate(at, length)
        self._buf = buf[whole:]
        return True

    def _populate(self, at: int, length: int) -> None:
        """2 MiB at a time, so the relay's own faults on the mapping never wait long."""
        for lo in range(at, at + length, HUGE):
            if len(_live) > 1:  # another child's image may share it: writing would copy it
                return
            step = min(HUGE, at + length - lo)
            err = madvise(lo, step, MADV_POPULATE_WRITE)
            if err == 0:
                self.populated += step
            elif err in (errno.EINVAL, errno.ENOSYS):
                _Follower.supported = False  # a kernel before 5.14: the loop takes the faults
                return
            # another error (ENOMEM: the range was unmapped since; EFAULT): nothing to do


class _Follower:
    """In the relay: one thread, started with the first child and kept, that makes each range a
    child gave back writable again, off the event loop, until that child closes its end (it
    ended). Only while that child is the relay's only one: another child's image may still share
    the range, and writing it would copy it. Then the loop takes those faults, and the fold after
    the children end (``hugepages``) repairs the mapping. One kept thread, not one per child:
    starting a thread costs the loop about half a millisecond, a fifth of the fork itself."""

    supported = sys.platform == "linux"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._new: list[Ranges] = []
        self._wake_w = -1
        self._thread: threading.Thread | None = None

    def watch(self, fd: int) -> Ranges:
        """Follow the ranges a new child reports on ``fd`` (call on the event loop)."""
        ranges = Ranges(fd)
        try:
            os.set_blocking(fd, False)
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    wake_r, self._wake_w = os.pipe()
                    os.set_blocking(self._wake_w, False)  # a full pipe is already a wake-up
                    self._thread = threading.Thread(
                        target=self._run, args=(wake_r,), name="kvrelay-cow-follower",
                        daemon=True,
                    )  # fmt: skip
                    self._thread.start()
                self._new.append(ranges)
        except (OSError, RuntimeError):  # out of descriptors or threads: the loop takes the faults
            os.close(fd)
            return ranges
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")
        return ranges

    def _run(self, wake_r: int) -> None:
        sel = selectors.DefaultSelector()
        sel.register(wake_r, selectors.EVENT_READ, None)
        while True:
            for key, _ in sel.select():
                if key.data is None:
                    with contextlib.suppress(OSError):
                        os.read(wake_r, 4096)
                    with self._lock:
                        new, self._new = self._new, []
                    for r in new:
                        try:
                            sel.register(r.fd, selectors.EVENT_READ, r)
                        except (OSError, ValueError):
                            os.close(r.fd)
                    continue
                r = key.data
                if not r.read():
                    sel.unregister(r.fd)
                    os.close(r.fd)


_follower = _Follower()
