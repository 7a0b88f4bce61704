"""Crash-consistent checkpoints: each pool's exact state and member cursors, written periodically.

A clean stop saves every pool's state (``handover.py``); a crash (SIGKILL, the OOM killer, a node
reboot) saves nothing, and the next start keeps only what the engines' replay buffers still
hold. So every ``checkpoint_interval_s`` the relay also writes each pool's file while it runs.

* **One consistent cut, on the event loop, for almost nothing.** Batches are applied whole
  inside the loop, so between two callbacks the pool's exact state and every member's resume
  point (last applied sequence and batch digest) agree. The cut is ``Pool.open_image()``
  (``pool/image.py``): the small arrays are copied, the big ones are armed for copy-before-write
  (``pool/cow.py``). Ingest goes on; the kernels keep a 256-byte pre-image of each chunk they
  are the first to change, and only until the writer has read it.
* **Written by one thread of the relay**, which reads the image without the GIL and writes it
  through the same writer as a clean stop (``handover.save_state``: one file per pool,
  ``O_EXCL|O_NOFOLLOW`` temporary file, fsync, rename, fsync of the directory), so the old file
  is replaced only by a complete new one and a crash mid-write leaves the previous checkpoint.
  Nothing is forked: no copy-on-write faults, no page tables copied, no child to reap.
* **Bounded**: one pool's image at a time, cut when the writer is ready for it (pools due
  together wait their turn uncut, so each image is armed only while it is written); at most one
  checkpoint per pool in flight (a pool still queued or being written skips the round, counted
  ``checkpoint_busy``); an image keeps at most half its armed bytes of pre-images. A pool that
  rewrites more than that while it is written breaks its image: that checkpoint is abandoned,
  counted ``checkpoint_overrun``, and the previous file stays.

After a crash the start restores the newest checkpoint exactly as a clean stop's file: each
member resumes from its checkpointed cursor once its engine vouches for it (the same
incarnation, a replay that still holds that batch with the same bytes) — the engine's replay
buffer is the log that brings it from the checkpoint to now. A member whose engine cannot vouch
is rebuilt. A clean stop waits for the checkpoint being written before its final save, so that
save is the last word.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay import logging
from kvrelay.logging import get_logger
from kvrelay.pool.image import ImageBroken, PoolImage
from kvrelay.pool.pool import Pool
from kvrelay.relay import handover
from kvrelay.relay.engines import PoolIdentity
from kvrelay.relay.handover import MemberResume
from kvrelay.relay.settings import PoolSpec

_log = get_logger(__name__)

WRITTEN = "checkpointed"
FAILED = "checkpoint_failed"
BUSY = "checkpoint_busy"
OVERRUN = "checkpoint_overrun"
#: ``state_checkpoint_failed`` (and ``state_dir_unusable``) is logged at most once per reason this
#: often: a full or read-only disk fails every pool's every round (each one is counted all the
#: same).
FAILURE_LOG_S = 60.0


@dataclass(frozen=True, slots=True)
class Cut:
    """What one pool's checkpoint writes, taken at the cut."""

    spec: PoolSpec
    identity: PoolIdentity
    pool: Pool
    members: list[MemberResume]


#: Called on the event loop at the moment of the cut; None when there is nothing to write now
#: (the pool has no generation any more).
Cutter = Callable[[], Cut | None]


@dataclass(slots=True)
class _Job:
    name: str
    state_dir: Path
    cutter: Cutter
    image: PoolImage | None = None
    pacer: _Pacer | None = None
    members: int = 0
    started: float = 0.0
    read_s: float = 0.0
    done: asyncio.Future[None] = field(default_factory=lambda: _loop().create_future())


def _loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def _lower_priority() -> None:
    """The writer thread yields the CPU to the event loop (``nice`` 10 for this thread only, as
    Linux schedules threads): on a busy machine a write may take longer, a delta never waits."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


class _Pacer:
    """Spreads an image's reading over time at ``rate`` bytes per second. The reader streams
    the whole state through memory; at full speed (about 1.6 GB/s here) that evicted the CPU
    caches the event loop's next batch needed, and a delta during a checkpoint took longer than
    one without. Once the side store is a quarter full (the pool is rewriting its state faster
    than it is read), the rest is read at full speed: finishing soon is then what keeps it from
    overrunning."""

    HURRY_FILL = 0.25

    def __init__(self, rate: int, image: PoolImage) -> None:
        self.rate = rate
        self.image = image
        self.start = time.monotonic()
        self.sent = 0

    def __call__(self, n: int) -> None:
        if self.rate <= 0 or self.image.fill >= self.HURRY_FILL:
            return
        wait = self.start + self.sent / self.rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self.sent += n


def failure_reason(exc: BaseException) -> str:
    """What a failed checkpoint is logged under: the errno's name for an ``OSError``
    (``ENOSPC``, ``EROFS``, ``ENOENT``...), else the exception's type."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, f"errno_{exc.errno}")
    return type(exc).__name__


class LogThrottle(logging.LogThrottle):
    """``kvrelay.logging.LogThrottle`` at ``FAILURE_LOG_S`` (read at each call): an error that
    recurs every round while its cause lasts (a full disk) is logged once a minute per reason."""

    __slots__ = ()

    def period_s(self) -> float:
        return FAILURE_LOG_S


class _FailureLog:
    """Logs failed checkpoints at a bounded rate. A full disk fails every pool at every round:
    at the default 30 s that was one error line per pool and round, and at a short interval
    several a second, for as long as the disk stayed full. Now one line per reason per
    ``FAILURE_LOG_S`` (saying how many failures went unlogged meanwhile), and once one of those
    lines went out, one ``state_checkpoint_resumed`` when a pool that failed is written again."""

    def __init__(self) -> None:
        self._throttle = LogThrottle()
        self._streak: dict[str, int] = {}  # pool → failures since its last checkpoint written
        self._told = False  # a failure line went out since the last ``resumed`` line

    def failed(self, pool: str, exc: BaseException) -> None:
        self._streak[pool] = self._streak.get(pool, 0) + 1
        reason = failure_reason(exc)
        not_logged = self._throttle.due(reason)
        if not_logged is None:
            return
        self._told = True
        _log.error("state_checkpoint_failed", pool=pool, reason=reason, error=repr(exc),
                   failures_not_logged=not_logged)  # fmt: skip

    def written(self, pool: str) -> None:
        failures = self._streak.pop(pool, 0)
        if failures and self._told:
            self._told = False
            _log.info("state_checkpoint_resumed", pool=pool, failures=failures)

    def keep_only(self, names: set[str]) -> None:
        for name in [n for n in self._streak if n not in names]:
            del self._streak[name]


class Checkpointer:
    """Writes pools' checkpoints from one writer thread; ``count(result)`` records each outcome
    (``checkpointed``, ``checkpoint_failed``, ``checkpoint_busy``, ``checkpoint_overrun``)."""

    def __init__(
        self,
        count: Callable[[str], None],
        rate: Callable[[], int] = lambda: 0,
        side_bytes: int | None = None,
    ) -> None:
        self._count = count
        self._rate = rate  # bytes per second an image is read at (0: unpaced); read at each cut
        self._side_bytes = side_bytes  # the images' bound (None: ``Pool.open_image``'s)
        self._queue: deque[_Job] = deque()
        self._active: _Job | None = None
        self._names: set[str] = set()  # queued or being written
        self._executor: ThreadPoolExecutor | None = None
        #: Wall-clock time of each pool's last written checkpoint (a gauge).
        self.last_unix: dict[str, float] = {}
        #: Pre-image bytes the last image kept (what its writes cost it), for benchmarks.
        self.last_captured_bytes = 0
        self._failures = _FailureLog()

    def keep_only(self, names: set[str]) -> None:
        """Forget the last checkpoint time of pools not in ``names`` (removed by a reload),
        so their gauge goes with them."""
        for name in [n for n in self.last_unix if n not in names]:
            del self.last_unix[name]
        self._failures.keep_only(names)

    def busy(self, name: str) -> bool:
        return name in self._names

    def submit(self, name: str, state_dir: Path, cutter: Cutter) -> bool:
        """Checkpoint pool ``name`` as soon as the writer is free (call on the event loop):
        ``cutter`` runs then, between batches, and gives what the cut holds. False (counted)
        when the pool's previous checkpoint is still queued or being written."""
        if name in self._names:
            self._count(BUSY)
            return False
        self._names.add(name)
        self._queue.append(_Job(name, state_dir, cutter))
        self._next()
        return True

    def _next(self) -> None:
        """Cut and start the next queued pool, if the writer is free."""
        while self._active is None and self._queue:
            job = self._queue.popleft()
            try:
                cut = job.cutter()
                if cut is not None:
                    job.image = cut.pool.open_image(self._side_bytes)
            except Exception as exc:  # a cut that cannot be taken: this round is skipped
                self._count(FAILED)
                self._failures.failed(job.name, exc)
                cut = None
            if cut is None or job.image is None:
                self._finish(job)
                continue
            self._active = job
            job.members = len(cut.members)
            job.started = time.monotonic()
            loop = asyncio.get_running_loop()
            image = job.image

            def read_done(
                job: _Job = job, image: PoolImage = image, loop: asyncio.AbstractEventLoop = loop
            ) -> None:
                job.read_s = time.monotonic() - job.started
                loop.call_soon_threadsafe(image.close)  # the rest of the write needs no image

            image.on_read_done = read_done
            image.pace = job.pacer = _Pacer(self._rate(), image)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    1, thread_name_prefix="kvrelay-checkpoint", initializer=_lower_priority
                )  # fmt: skip
            fut = loop.run_in_executor(self._executor, self._write, job.state_dir, cut, image)
            fut.add_done_callback(functools.partial(self._done, job))

    @staticmethod
    def _write(state_dir: Path, cut: Cut, image: PoolImage) -> int:
        """The writer thread: the image, streamed into the pool's file."""
        image.prepare()
        return handover.save_state(state_dir, cut.spec, cut.identity, image.meta,
                                   image.as_dict(), cut.members)  # fmt: skip

    def _done(self, job: _Job, fut: asyncio.Future[int]) -> None:
        image = job.image
        assert image is not None
        image.close()
        self.last_captured_bytes = image.captured_bytes
        self._active = None
        exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        if isinstance(exc, ImageBroken):
            self._count(OVERRUN)
            _log.warning("state_checkpoint_overrun", pool=job.name, error=str(exc),
                         side_bytes=image.side_bytes)  # fmt: skip
        elif exc is not None:
            self._count(FAILED)
            self._failures.failed(job.name, exc)
        else:
            self._count(WRITTEN)
            self.last_unix[job.name] = time.time()
            self._failures.written(job.name)
            _log.debug("state_checkpointed", pool=job.name, members=job.members,
                       bytes=fut.result(), captured_bytes=image.captured_bytes,
                       read_s=round(job.read_s, 3),
                       write_s=round(time.monotonic() - job.started, 3))  # fmt: skip
        self._finish(job)
        self._next()

    def _finish(self, job: _Job) -> None:
        self._names.discard(job.name)
        if not job.done.done():
            job.done.set_result(None)

    async def drain(self) -> None:
        """Drop the pools still waiting for their turn and wait for the one being written (before
        a clean stop's final save, which is the last word)."""
        while self._queue or self._active is not None:
            while self._queue:
                self._finish(self._queue.popleft())
            if self._active is not None:
                if self._active.pacer is not None:
                    self._active.pacer.rate = 0  # a stop waits for it: no more spreading out
                await asyncio.shield(self._active.done)

    def close(self) -> None:
        """Forget queued pools; a write under way finishes in its thread (its file is complete or
        absent), and the thread ends after it."""
        while self._queue:
            self._finish(self._queue.popleft())
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
