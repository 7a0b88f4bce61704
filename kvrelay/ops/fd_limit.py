"""The open-file soft limit, raised at start to what the relay's own caps need.

Why: container runtimes (containerd 2, Docker 25 and later) start a container's processes with
a soft ``RLIMIT_NOFILE`` of 1024 under a much higher hard limit. The relay holds a descriptor per
gRPC connection (``max_connections``, 4096 by default) besides its ZMQ sockets, state files and
workers' pipes, so at 1024 it would refuse routers (asyncio's accept backs off on ``EMFILE``)
and fail engine sockets long before its own caps are reached. Any process may raise its soft
limit up to the hard one without privilege (Go's runtime does so at every start). Child
processes (fan-out workers, a hot upgrade's successor) inherit the raised limit.
"""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass

#: Descriptors the relay needs besides its gRPC connections (ZMQ sockets and their internal
#: pipes, state and log files, listeners, worker pipes), asked for on top of ``max_connections``.
HEADROOM = 4096
#: The most the soft limit is raised to, whatever the hard limit (an unlimited hard limit
#: would otherwise size per-descriptor tables in libraries that allocate by the limit).
CEILING = 1 << 20


@dataclass(frozen=True)
class FdLimit:
    before: int
    after: int
    hard: int
    wanted: int

    @property
    def short(self) -> bool:
        """The hard limit keeps the soft one below what ``max_connections`` needs."""
        return self.after < self.wanted


def raise_soft_limit(max_connections: int) -> FdLimit:
    """Raise the soft ``RLIMIT_NOFILE`` to ``max_connections + HEADROOM`` (never lower it, never
    past the hard limit or ``CEILING``); what it was, is, and could be."""
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + HEADROOM
    cap = CEILING if hard == resource.RLIM_INFINITY else min(hard, CEILING)
    target = min(wanted, cap)
    if before != resource.RLIM_INFINITY and before < target:
        with contextlib.suppress(ValueError, OSError):  # left as it was: reported short
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    after = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return FdLimit(before=_finite(before), after=_finite(after), hard=_finite(hard),
                   wanted=wanted)  # fmt: skip


def _finite(n: int) -> int:
    return CEILING if n == resource.RLIM_INFINITY else int(n)
