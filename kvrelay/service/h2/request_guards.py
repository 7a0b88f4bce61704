"""What bounds the requests being read on one gRPC port, in all: their bytes and their streams.

Why: before its request arrives, a stream costs the relay about 18 KiB (grpclib's and h2's
stream state, the request task), and it may wait 10 s for it; a larger request holds its body
until it is whole. Per connection both are bounded (100 streams, 1 MiB a request), but the port
holds thousands of connections: 100 connections of 100 streams that never sent a request held
180 MiB, and four connections of 100 streams sending requests of just under 1 MiB held 520 MiB,
for as long as their clients kept opening them. Both are now bounded for the whole port:

* ``RequestBytes``: the bodies of requests over ``SMALL_REQUEST_BYTES`` (no valid request is)
  hold places in one budget, ``max_request_bytes_in_flight``; one that would pass it is refused
  before its body is read.
* ``PendingRequests``: at most ``max_pending_requests`` streams wait for their request longer
  than ``PENDING_GRACE_S``; past that, each new stream ends the one that has waited longest. A
  real client sends its request with its headers, so it waits microseconds and is never the
  one ended; a stream that sends nothing is, within a second, whoever opens them.

Refusals are RESOURCE_EXHAUSTED / RESOURCE_LIMIT, counted in ``H2Counters`` (``request_bytes``,
``request_evicted``).

A drain whose grace runs out ends every stream still waiting for its request (``end_all``): its
call ends with the status given (the relay's "shutting down" refusal), where the server's close
would cut it without one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from kvrelay.contract.errors import RelayError
from kvrelay.contract.limits import RelayLimits
from kvrelay.service.h2.guard import H2Counters

__all__ = [
    "PENDING_GRACE_S",
    "SMALL_REQUEST_BYTES",
    "PendingRequests",
    "RequestBytes",
    "RequestGuards",
    "Waiting",
]

#: Requests up to this size are read without a place in the ``RequestBytes`` budget (a stream
#: pins at most this much then, as its own state does).
SMALL_REQUEST_BYTES = 16 * 1024
#: A stream waiting for its request is ended to make room only after it has waited this long.
PENDING_GRACE_S = 1.0


class RequestBytes:
    """The bytes of larger requests being read, in all, under a limit."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


class Waiting:
    """One stream's wait for its request: the read to cancel if it must make room (or the
    drain's grace ran out), and the call's task."""

    __slots__ = ("ending", "read", "since", "task")

    def __init__(
        self, read: asyncio.Future[Any], since: float, task: asyncio.Task[Any] | None = None
    ) -> None:
        self.read = read
        self.since = since
        self.task = task
        #: what the call ends with, once its wait was ended here (None: it was not)
        self.ending: RelayError | None = None

    def end(self, error: RelayError) -> None:
        self.ending = error
        self.read.cancel()


def _over(read: asyncio.Future[Any]) -> bool:
    """The wait is over already (its request came, or its call was cancelled: a client's
    reset), only not yet left."""
    return read.done() or (isinstance(read, asyncio.Task) and read.cancelling() > 0)


class PendingRequests:
    """The streams waiting for their request, oldest first (see the module docstring)."""

    __slots__ = ("_waiting", "grace_s", "limit")

    def __init__(self, limit: int, grace_s: float = PENDING_GRACE_S) -> None:
        self.limit = limit
        self.grace_s = grace_s
        self._waiting: dict[Waiting, None] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self._waiting)

    def enter(self, read: asyncio.Future[Any]) -> tuple[Waiting, int]:
        """Register ``read`` (the task reading a request); returns its place and how many older
        waits it ended to make room (their reads are cancelled)."""
        now = time.monotonic()
        ended = 0
        waiting = self._waiting
        while len(waiting) >= self.limit:
            oldest = next(iter(waiting))
            if _over(oldest.read):
                del waiting[oldest]  # not ended here
                continue
            if now - oldest.since < self.grace_s:
                break  # a burst of streams, not a wait: let it through
            del waiting[oldest]
            oldest.end(RelayError.resource_limit(
                f"no request message within {self.grace_s} s while {self.limit} streams "
                "waited for theirs"
            ))  # fmt: skip
            ended += 1
        place = Waiting(read, now, asyncio.current_task())
        waiting[place] = None
        return place, ended

    def leave(self, place: Waiting) -> None:
        self._waiting.pop(place, None)

    def end_all(self, error: RelayError) -> list[asyncio.Task[Any]]:
        """End every wait: each call ends with ``error`` (the drain's grace ran out, and the
        server's close would cut them without a status). Returns the calls' tasks, to let them
        write their status first."""
        tasks: list[asyncio.Task[Any]] = []
        for place in tuple(self._waiting):
            if _over(place.read):
                continue
            place.end(error)
            if place.task is not None:
                tasks.append(place.task)
        self._waiting.clear()
        return tasks


@dataclass(frozen=True, slots=True)
class RequestGuards:
    """One port's request bounds, shared by every service on it, and where refusals count."""

    budget: RequestBytes
    pending: PendingRequests
    counters: H2Counters

    @classmethod
    def of(cls, limits: RelayLimits, counters: H2Counters) -> RequestGuards:
        return cls(
            RequestBytes(limits.max_request_bytes_in_flight),
            PendingRequests(limits.max_pending_requests),
            counters,
        )
