"""Crash-consistent checkpoints: each pool's exact state and member cursors, written periodically.

A clean stop saves every pool's state (``handover.py``); a crash (SIGKILL, the OOM killer, a node
reboot) saves nothing, and the next start keeps only what the engines' replay buffers still
hold. So every ``checkpoint_interval_s`` the relay also writes each pool's file while it runs.

* **One consistent cut, cheaply, on the event loop.** Batches are applied whole inside the loop,
  so between two callbacks the pool's exact state and every member's resume point (last applied
  sequence and batch digest) agree. The cut copies the exported numpy arrays (one ``memcpy``
  each, no Python object per entry) and the member cursors; nothing else runs meanwhile.
* **Serialized and written in a thread**, through the same writer as a clean stop
  (``handover.save_state``: one file per pool, ``O_EXCL|O_NOFOLLOW`` temporary file, fsync,
  rename, fsync of the directory), so the old file is replaced only by a complete new one and a
  crash mid-write leaves the previous checkpoint.
* **Bounded**: one writer thread, at most one checkpoint per pool in flight; a pool whose previous
  checkpoint is still being written skips the round (counted ``checkpoint_busy``). The memory a
  checkpoint adds is one copy of each pool's state, until its file is written.

After a crash the start restores the newest checkpoint exactly as a clean stop's file: each
member resumes from its checkpointed cursor once its engine vouches for it (the same
incarnation, a replay that still holds that batch with the same bytes) — the engine's replay
buffer is the log that brings it from the checkpoint to now. A member whose engine cannot vouch
is rebuilt. A clean stop waits for checkpoints in flight before its final save, so that save is
the last word.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

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


@dataclass(frozen=True, slots=True)
class Cut:
    """A copy of one pool's exact state and member cursors at one point of its streams."""

    spec: PoolSpec
    identity: PoolIdentity
    meta: dict[str, Any]
    arrays: dict[str, npt.NDArray[Any]]
    members: tuple[MemberResume, ...]

    @property
    def name(self) -> str:
        return "/".join(self.spec.triple)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())


def cut(spec: PoolSpec, identity: PoolIdentity, pool: Pool, members: list[MemberResume]) -> Cut:
    """Copy ``pool``'s exported state (call on the event loop, between batches)."""
    meta, arrays = pool.export_state()
    return Cut(spec, identity, copy.deepcopy(meta),
               {k: np.array(a, copy=True) for k, a in arrays.items()}, tuple(members))  # fmt: skip


class Checkpointer:
    """One writer thread for every pool's checkpoints; ``count(result)`` records each outcome
    (``checkpointed``, ``checkpoint_failed``, ``checkpoint_busy``)."""

    def __init__(self, count: Callable[[str], None]) -> None:
        self._count = count
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: dict[str, asyncio.Future[int]] = {}
        #: Wall-clock time of each pool's last written checkpoint (a gauge).
        self.last_unix: dict[str, float] = {}

    def busy(self, name: str) -> bool:
        return name in self._inflight

    def submit(self, state_dir: Path, c: Cut) -> bool:
        """Write ``c`` in the writer thread; False (counted) when the pool's previous checkpoint
        is still being written."""
        if c.name in self._inflight:
            self._count(BUSY)
            return False
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrelay-ckpt")
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        fut = loop.run_in_executor(self._executor, _write, state_dir, c)
        self._inflight[c.name] = fut
        fut.add_done_callback(lambda f: self._done(c, f, started))
        return True

    def _done(self, c: Cut, fut: asyncio.Future[int], started: float) -> None:
        self._inflight.pop(c.name, None)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self._count(FAILED)
            _log.error("state_checkpoint_failed", pool=c.name,
                       error=f"{type(exc).__name__}: {exc}")  # fmt: skip
            return
        self._count(WRITTEN)
        self.last_unix[c.name] = time.time()
        _log.debug("state_checkpointed", pool=c.name, members=len(c.members), bytes=fut.result(),
                   write_s=round(time.monotonic() - started, 3))  # fmt: skip

    async def drain(self) -> None:
        """Wait for every checkpoint in flight (before a clean stop's final save)."""
        while self._inflight:
            await asyncio.gather(*self._inflight.values(), return_exceptions=True)
            await asyncio.sleep(0)  # let the done callbacks run

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _write(state_dir: Path, c: Cut) -> int:
    return handover.save_state(state_dir, c.spec, c.identity, c.meta, c.arrays, list(c.members))
