"""A plane of complete windows on a timer: the load (§10) and serving-load planes share it.

A window is a full picture, so a subscriber that misses windows loses nothing but freshness; the
broadcast keeps only the newest one. Windows are numbered from 0 (the window available at
construction) and the timer makes the next one due every ``window_ms``; a late tick is delayed,
never bursted, so the sequence advances by exactly 1 per window. If building a window fails,
that window is skipped (counted in ``provider_errors``, logged) rather than published empty,
which would falsely withdraw everything it lists; it stays due, so its number is never reused
(the next window built, at the next read or tick, is numbered past it).

A window is built when it is due only while a stream waits for the next one. With nobody
waiting, the due windows are counted and the newest is built when it is first read
(``current``, ``wait_newer``), with ``observed_ms`` the time of that build: a reader sees the
same sequence as if every window had been built on time, and fresher content. An idle relay
(or one whose routers do not subscribe to load) then spends nothing on windows, where it
spent a provider call and a message per plane every second.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.envelope import copy_relay
from kvrelay.contract.wire import PROTOCOL_VERSION
from kvrelay.logging import get_logger
from kvrelay.publication.broadcast import VersionedBroadcast

__all__ = ["MAX_WINDOW_MS", "WindowPlane", "unix_ms"]

_log = get_logger(__name__)

MAX_WINDOW_MS = 365 * 24 * 3600 * 1000  # §3.4: any duration must be > 0 and <= 1 year
M = TypeVar("M")


def unix_ms() -> int:
    return time.time_ns() // 1_000_000


class WindowPlane(Generic[M]):
    """A ``Plane[M]`` whose version is the window sequence. Subclasses build one window in
    :meth:`_build` (None: skip it) and call :meth:`_init_windows` at the end of ``__init__``."""

    #: Names the plane in its log events (``load``, ``serving_load``).
    _plane_name = "load"

    def __init__(self, relay_identity: pb.RelayIdentity, window_ms: int, task_name: str) -> None:
        if isinstance(window_ms, bool) or not isinstance(window_ms, int):
            raise TypeError(f"window_ms must be int, got {window_ms!r}")
        if not 0 < window_ms <= MAX_WINDOW_MS:
            raise ValueError(f"window_ms must be in (0, {MAX_WINDOW_MS}], got {window_ms}")
        self._relay = copy_relay(relay_identity)
        self._window_ms = window_ms
        self._task_name = task_name
        self._task: asyncio.Task[None] | None = None
        self.provider_errors = 0
        self._due = 0  # windows the timer passed that are not built yet (nobody was waiting)
        self._waiting = 0  # streams in wait_newer: while any, windows are built when due

    def _header(self, seq: int) -> dict[str, Any]:
        """The fields every window message of either plane starts with."""
        return {
            "protocol_version": PROTOCOL_VERSION, "relay": self._relay, "window_sequence": seq,
            "observed_ms": unix_ms(), "window_ms": self._window_ms,
        }  # fmt: skip

    def _build(self, seq: int) -> tuple[M, Callable[[], bytes]] | None:
        """Window ``seq``, and how to write its wire bytes (``bytes(message)``, from
        ``window_wire``'s cached pieces: called only once someone is to be sent it)."""
        raise NotImplementedError

    def _initial(self) -> tuple[M, Callable[[], bytes]]:
        """Window 0 (built even if the provider fails: then it lists nothing)."""
        raise NotImplementedError

    def _init_windows(self) -> None:
        message, wire = self._initial()
        self._bc: VersionedBroadcast[M] = VersionedBroadcast(0, message)
        self._wire: tuple[int, Callable[[], bytes] | bytes] = (0, wire)

    def wire(self, version: int) -> bytes | None:
        """The wire bytes of window ``version`` while it is the newest (else None): what a
        subscriber is sent, written from the window's pieces once, not serialized again."""
        seq, data = self._wire
        if seq != version:
            return None
        if not isinstance(data, bytes):
            try:
                data = data()
            except Exception:  # never the stream's failure: the caller serializes the message
                self.provider_errors += 1
                _log.exception("load_window_wire_failed", plane=self._plane_name)
                return None
            self._wire = (seq, data)
        return data

    @property
    def window_ms(self) -> int:
        return self._window_ms

    @property
    def version(self) -> int:
        """The newest window's sequence, built or due (what a reader would be sent now)."""
        return self._bc.version + self._due

    def current(self) -> tuple[int, M]:
        self._build_due()
        return self._bc.current()

    async def wait_newer(self, version: int) -> tuple[int, M]:
        self._build_due()
        self._waiting += 1
        try:
            return await self._bc.wait_newer(version)
        finally:
            self._waiting -= 1

    def start(self) -> None:
        """Start the window timer on the running loop; idempotent while running."""
        if self._bc.closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=self._task_name
            )

    def close(self) -> None:
        """Stop the timer and wake subscribers with ``PlaneClosed``; idempotent."""
        if self._task is not None:
            self._task.cancel()
        self._bc.close()

    async def wait_closed(self) -> None:
        """After :meth:`close`, wait until the window task has actually finished."""
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def publish_window(self) -> bool:
        """Build and publish the next window now; False if building it failed (skipped)."""
        self._due += 1
        return self._build_due()

    def _build_due(self) -> bool:
        """Build the newest due window, numbered as if every due one had been built; False if
        that failed (the due windows are skipped: the last good window stays the newest, and
        they stay due, so the next window built is numbered past them, never reusing one)."""
        due, self._due = self._due, 0
        if not due or self._bc.closed:
            return True
        seq = self._bc.version + due
        try:
            built = self._build(seq)
        except Exception:  # a reader or the timer must outlive any single bad window
            self.provider_errors += 1
            _log.exception("load_window_failed", plane=self._plane_name,
                           errors=self.provider_errors)  # fmt: skip
            self._due += due
            return False
        if built is None:
            self._due += due
            return False
        self._wire = (seq, built[1])
        self._bc.publish(seq, built[0])
        return True

    def _tick(self) -> None:
        """The timer: one more window due, built now if a stream waits for it."""
        self._due += 1
        if self._waiting:
            self._build_due()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        period = self._window_ms / 1000.0
        deadline = loop.time() + period
        while True:
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            if self._bc.closed:
                return
            self._tick()
            now = loop.time()
            deadline += period
            if deadline <= now:  # fell behind (loop stall): delay, do not burst missed windows
                deadline = now + period
