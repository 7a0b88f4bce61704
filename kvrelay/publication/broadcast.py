"""Latest-value broadcast with versioned wake-ups: the shared core of every plane.

Each relay stream (catalog, readiness, load) sends complete snapshots, so a slow subscriber never
needs the intermediate versions it missed: it only needs the newest one. Keeping exactly one
message bounds memory regardless of how many subscribers there are or how slowly they drain, and
lets coalescing happen for free (revisions "may skip", §4.2). Waiters sleep on an
:class:`asyncio.Event` that is replaced at every publish, so there is no polling and cancelling one
waiter never disturbs the others.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

from kvrelay.publication.plane import PlaneClosed

__all__ = ["BroadcastError", "NonMonotonicVersionError", "PlaneClosed", "VersionedBroadcast"]

T = TypeVar("T")


class BroadcastError(Exception):
    """Base class of publish-side misuse of a :class:`VersionedBroadcast`."""


class NonMonotonicVersionError(BroadcastError, ValueError):
    """``publish`` was given a version that is not strictly greater than the current one.

    Subscribers resume with ``wait_newer(last_seen)``; a version that goes backwards or repeats
    would make them either miss the message or re-send a different message under an old version.
    """

    def __init__(self, current: int, offered: int) -> None:
        super().__init__(f"version {offered} is not greater than current version {current}")
        self.current = current
        self.offered = offered


class VersionedBroadcast(Generic[T]):
    """Holds ``(version, message)``; many async readers wait for a newer version.

    Implements the ``Plane`` protocol of ``kvrelay.service.view``. Must be used from one event
    loop thread (``publish``/``close`` are synchronous and never block).
    """

    __slots__ = ("_closed", "_event", "_message", "_version")

    def __init__(self, version: int, message: T) -> None:
        if version < 0:
            raise NonMonotonicVersionError(0, version)
        self._version = version
        self._message = message
        self._closed = False
        self._event = asyncio.Event()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def version(self) -> int:
        return self._version

    def current(self) -> tuple[int, T]:
        """The latest complete message; still readable after ``close()``."""
        return self._version, self._message

    async def wait_newer(self, version: int) -> tuple[int, T]:
        """Return the latest ``(v, msg)`` with ``v > version``, sleeping until one exists.

        Raises :class:`PlaneClosed` once the broadcast is closed (even if a newer message exists:
        closing means the stream must end, and the consumer already had the chance to read it).
        """
        while True:
            if self._closed:
                raise PlaneClosed("plane closed")
            if self._version > version:
                return self._version, self._message
            await self._event.wait()

    def publish(self, version: int, message: T) -> None:
        """Replace the message and wake every waiter.

        Raises :class:`NonMonotonicVersionError` if ``version <= current`` and
        :class:`PlaneClosed` after ``close()``; in both cases nothing changes.
        """
        if self._closed:
            raise PlaneClosed("publish on a closed plane")
        if version <= self._version:
            raise NonMonotonicVersionError(self._version, version)
        self._version = version
        self._message = message
        self._wake()

    def close(self) -> None:
        """Wake all waiters with :class:`PlaneClosed`; idempotent."""
        if not self._closed:
            self._closed = True
            self._wake()

    def _wake(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()
