"""Crash-consistent checkpoints: each pool's exact state and member cursors, written periodically.

A clean stop saves every pool's state (``handover.py``); a crash (SIGKILL, the OOM killer, a node
reboot) saves nothing, and the next start keeps only what the engines' replay buffers still
hold. So every ``checkpoint_interval_s`` the relay also writes each pool's file while it runs.

* **One consistent cut, for free, on the event loop.** Batches are applied whole inside the loop,
  so between two callbacks the pool's exact state and every member's resume point (last applied
  sequence and batch digest) agree. The cut is a ``fork()`` (``relay/forked.py``): the child sees
  the memory as it was at that instant (copy-on-write), the parent goes on at once.
* **Serialized and written by the child**, through the same writer as a clean stop
  (``handover.save_state``: one file per pool, ``O_EXCL|O_NOFOLLOW`` temporary file, fsync,
  rename, fsync of the directory), so the old file is replaced only by a complete new one and a
  crash mid-write leaves the previous checkpoint; a killed relay leaves no writer behind.
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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrelay.logging import get_logger
from kvrelay.pool.pool import Pool
from kvrelay.relay import forked, handover
from kvrelay.relay.engines import PoolIdentity
from kvrelay.relay.handover import MemberResume
from kvrelay.relay.settings import PoolSpec

_log = get_logger(__name__)

WRITTEN = "checkpointed"
FAILED = "checkpoint_failed"
BUSY = "checkpoint_busy"


@dataclass(slots=True)
class _Writer:
    child: forked.Child
    members: int
    started: float
    #: The arrays the child writes, kept until it ends: the ranges it reports as given back
    #: stay the pool's (not memory a replaced generation freed and something else reused).
    arrays: dict[str, Any]


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

    def pids(self) -> list[int]:
        """Writers running now (benchmarks measure their memory)."""
        return [w.child.pid for w in self._inflight.values()]

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
        meta, arrays = pool.export_state()  # views: the child's copy-on-write image keeps them

        def write() -> str:
            return str(handover.save_state(state_dir, spec, identity, meta, arrays, members,
                                           written=forked.give_back))  # fmt: skip

        wr = _Writer(forked.Child(write), len(members), time.monotonic(), arrays)
        self._inflight[name] = wr
        wr.child.done.add_done_callback(lambda f: self._done(name, wr, f))
        return True

    def _done(self, name: str, wr: _Writer, fut: asyncio.Future[tuple[bool, str]]) -> None:
        self._inflight.pop(name, None)
        ok, text = fut.result()
        if not ok or not text.isdigit():
            self._count(FAILED)
            _log.error("state_checkpoint_failed", pool=name, error=text)
            return
        self._count(WRITTEN)
        self.last_unix[name] = time.time()
        _log.debug("state_checkpointed", pool=name, members=wr.members, bytes=int(text),
                   write_s=round(time.monotonic() - wr.started, 3))  # fmt: skip

    async def drain(self) -> None:
        """Wait for every checkpoint in flight (before a clean stop's final save)."""
        while self._inflight:
            await asyncio.gather(*(w.child.done for w in self._inflight.values()))
            await asyncio.sleep(0)  # the done callbacks

    def close(self) -> None:
        """Stop writers still running (after ``drain`` there are none)."""
        for wr in list(self._inflight.values()):
            wr.child.kill()
