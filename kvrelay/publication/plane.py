"""The ``Plane`` protocol: a versioned stream of complete messages (catalog, readiness, load).

Readers only ever need the newest message, so a plane keeps one and lets waiters ask for anything
newer than the version they hold; a slow reader skips versions instead of queueing them.

A plane whose publisher is itself a stream (a mirror re-serving another relay's plane) can lose
its source: ``current`` then raises the ``RelayError`` a new reader must get, and ``wait_newer``
ends the readers of the lost source with its status (``RelayError``) or cleanly (``PlaneEnded``).
"""

from __future__ import annotations

from typing import Protocol, TypeVar

T_co = TypeVar("T_co", covariant=True)


class PlaneClosed(Exception):
    """The plane will never publish again (shutdown or publisher failure)."""


class PlaneEnded(Exception):
    """This reader's stream ends cleanly (status OK): the source it was reading shut down."""


class PlaneUnsupported(Exception):
    """This source does not implement the plane's RPC at all (a mirror of a relay that predates
    it): a new reader's stream ends ``UNIMPLEMENTED``, as the source's own would."""


class Plane(Protocol[T_co]):
    """A versioned stream of complete messages; readers only ever need the newest one."""

    def current(self) -> tuple[int, T_co]:
        """(version, full message). Catalog/readiness: revision; load: window_sequence.

        May raise ``RelayError`` when no message can be vouched for right now, and
        ``PlaneUnsupported`` when the source does not implement the plane."""
        ...

    async def wait_newer(self, version: int) -> tuple[int, T_co]:
        """Return once a version > ``version`` exists; raise PlaneClosed on close, PlaneEnded or
        ``RelayError`` when the reader's stream must end."""
        ...
