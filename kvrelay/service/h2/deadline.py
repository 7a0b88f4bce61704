"""A call whose deadline passed before its handler started ends ``DEADLINE_EXCEEDED``.

grpclib's server arms a call's deadline timer as the handler starts; a deadline already passed by
then (a ``grpc-timeout`` of a few nanoseconds or microseconds, or one the event loop reached
late) raised at once, outside the wrapper's own cancellation. grpclib took that for an unexpected
error: it logged it at ERROR with a traceback and answered ``UNKNOWN`` ("Internal Server
Error"), so anyone could write an ERROR line per stream, and a real client whose deadline ran
out on the way was told of a server bug. Here the timer is armed whatever is left, 0 included:
the call is cancelled at the loop's next turn, as a running call is at its deadline, and grpclib
answers ``DEADLINE_EXCEEDED`` (its "Deadline exceeded" line is demoted to DEBUG by
``kvrelay.logging``).

Replaces ``grpclib.server.DeadlineWrapper`` (``internals.DEADLINE_NEEDS``); the client side's is
grpclib's own. Without those internals nothing is replaced.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import grpclib.server
from grpclib.metadata import Deadline
from grpclib.utils import DeadlineWrapper

from kvrelay.service.h2.internals import missing_in_deadline

__all__ = ["ArmedDeadline", "install"]


class ArmedDeadline(DeadlineWrapper):
    """grpclib's deadline wrapper, whose timer is armed even for a deadline already passed."""

    @contextmanager
    def start(self, deadline: Deadline) -> Iterator[None]:
        timer = asyncio.get_running_loop().call_later(
            deadline.time_remaining(), self.cancel, TimeoutError("Deadline exceeded")
        )
        try:
            yield
        finally:
            timer.cancel()


def install() -> bool:
    """Make grpclib's server use ``ArmedDeadline`` (idempotent); False where its internals are
    not there."""
    if missing_in_deadline():
        return False
    setattr(grpclib.server, "DeadlineWrapper", ArmedDeadline)  # noqa: B010 (a private name)
    return True
