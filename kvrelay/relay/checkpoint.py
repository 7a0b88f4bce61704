"""Crash-consistent checkpoints: each pool's exact state and member cursors, written periodically.

A clean stop saves every pool's state (``handover.py``); a crash (SIGKILL, the OOM killer, a node
reboot) saves nothing, and the next start keeps only what the engines' replay buffers still
hold. So every ``checkpoint_interval_s`` the relay also writes each pool's file while it runs.

* **One consistent cut, for free, on the event loop.** Batches are applied whole inside the loop,
  so between two callbacks the pool's exact state and every member's resume point (last applied
  sequence and batch digest) agree. The cut is a ``fork()``: the child process sees the memory
  as it was at that instant (copy-on-write), the parent goes on at once. Copying the arrays
  instead cost the loop hundreds of milliseconds for a large pool (page faults of a fresh copy)
  and doubled its memory; with the fork the loop pays for the page tables only, and memory grows
  only by the pages ingest writes while the child is writing.
* **Serialized and written by the child**, through the same writer as a clean stop
  (``handover.save_state``: one file per pool, ``O_EXCL|O_NOFOLLOW`` temporary file, fsync,
  rename, fsync of the directory), so the old file is replaced only by a complete new one and a
  crash mid-write leaves the previous checkpoint. The child touches nothing but that file (no
  logging, no sockets, no event loop), runs at a lower priority (``nice`` 10: the relay's own work
  goes first), ends with ``os._exit`` and dies with its parent
  (``PR_SET_PDEATHSIG``), so a killed relay leaves no writer behind. The parent learns the
  outcome through a ``pidfd`` and a pipe, on its event loop.
* **Bounded**: at most one checkpoint per pool in flight; a pool whose previous checkpoint is
  still being written skips the round (counted ``checkpoint_busy``).

After a crash the start restores the newest checkpoint exactly as a clean stop's file: each
member resumes from its checkpointed cursor once its engine vouches for it (the same
incarnation, a replay that still holds that batch with the same bytes) — the engine's replay
buffer is the log that brings it from the checkpoint to now. A member whose engine cannot vouch
is rebuilt. A clean stop waits for checkpoints in flight before its final save, so that save is
the last word.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.logging import get_logger
from kvrelay.pool.pool import Pool
from kvrelay.relay import handover
from kvrelay.relay.engines import PoolIdentity
from kvrelay.relay.handover import MemberResume
from kvrelay.relay.settings import PoolSpec

_log = get_logger(__name__)

WRITTEN = "checkpointed"
FAILED = "checkpoint_failed"
BUSY = "checkpoint_busy"
_PR_SET_PDEATHSIG = 1
_REPORT_MAX = 4096


@dataclass(slots=True)
class _Writer:
    """One checkpoint being written by a child process."""

    name: str
    pid: int
    pidfd: int
    report: int  # read end of the child's pipe
    members: int
    started: float
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop()
                                       .create_future())  # fmt: skip


class Checkpointer:
    """Writes pools' checkpoints from forked children; ``count(result)`` records each outcome
    (``checkpointed``, ``checkpoint_failed``, ``checkpoint_busy``)."""

    def __init__(self, count: Callable[[str], None]) -> None:
        self._count = count
        self._inflight: dict[str, _Writer] = {}
        #: Wall-clock time of each pool's last written checkpoint (a gauge).
        self.last_unix: dict[str, float] = {}

    def busy(self, name: str) -> bool:
        return name in self._inflight

    def submit(
        self,
        state_dir: Path,
        spec: PoolSpec,
        identity: PoolIdentity,
        pool: Pool,
        members: list[MemberResume],
    ) -> bool:
        """Cut ``pool`` now (call on the event loop, between batches) and have a child write it;
        False (counted) when the pool's previous checkpoint is still being written."""
        name = "/".join(spec.triple)
        if name in self._inflight:
            self._count(BUSY)
            return False
        meta, arrays = pool.export_state()  # views: the child's copy-on-write memory keeps them
        loop = asyncio.get_running_loop()
        r, w = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: write the file, report, exit; nothing else
            code = 1
            try:
                os.close(r)
                _die_with_parent(parent)
                with contextlib.suppress(OSError):
                    os.nice(10)  # the relay's own work goes first
                n = handover.save_state(state_dir, spec, identity, meta, arrays, members)
                os.write(w, f"ok {n}".encode())
                code = 0
            except BaseException as exc:
                with contextlib.suppress(BaseException):
                    os.write(w, f"{type(exc).__name__}: {exc}".encode()[:_REPORT_MAX])
            finally:
                os._exit(code)
        os.close(w)
        pidfd = os.pidfd_open(pid)
        wr = _Writer(name, pid, pidfd, r, len(members), time.monotonic())
        self._inflight[name] = wr
        loop.add_reader(pidfd, self._reap, wr)
        return True

    def _reap(self, wr: _Writer) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(wr.pidfd)
        _pid, status = os.waitpid(wr.pid, 0)
        try:
            report = os.read(wr.report, _REPORT_MAX).decode(errors="replace")
        except OSError:
            report = ""
        os.close(wr.report)
        os.close(wr.pidfd)
        self._inflight.pop(wr.name, None)
        if not wr.done.done():
            wr.done.set_result(None)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 or not report.startswith("ok "):
            self._count(FAILED)
            _log.error("state_checkpoint_failed", pool=wr.name,
                       error=report or f"writer exited with {code}")  # fmt: skip
            return
        self._count(WRITTEN)
        self.last_unix[wr.name] = time.time()
        _log.debug("state_checkpointed", pool=wr.name, members=wr.members,
                   bytes=int(report.split()[1]),
                   write_s=round(time.monotonic() - wr.started, 3))  # fmt: skip

    async def drain(self) -> None:
        """Wait for every checkpoint in flight (before a clean stop's final save)."""
        while self._inflight:
            await asyncio.gather(*(w.done for w in self._inflight.values()))

    def close(self) -> None:
        """Stop writers still running (after ``drain`` there are none)."""
        for wr in list(self._inflight.values()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(wr.pid, signal.SIGKILL)
            self._reap(wr)


def _die_with_parent(parent: int) -> None:
    """The child is killed when the relay dies (Linux): a killed relay leaves no writer."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the relay died before the signal was armed
        os._exit(1)
