"""Who is on the other end of a UNIX socket: the kernel's ``SO_PEERCRED``.

Why: the daemon's internal socket (``workers = N``) serves the ingest process's full contract
with limits sized for its own workers. Its private directory (mode 0700) keeps other users out;
this check is the second wall: a connection whose peer is neither this process's user nor root
is closed before HTTP/2 starts, whatever the file modes turned out to be.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

from kvrelay.logging import LogThrottle, get_logger

_LOG = get_logger("kvrelay.service.peercred")
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int] | None:
    """``(pid, uid, gid)`` of a UNIX socket's peer; None where the platform has no
    ``SO_PEERCRED``."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, opt, _UCRED.size))
    return pid, uid, gid


class SameUserOnly:
    """A transport check: the peer runs as this process's user, or as root. Counts refusals."""

    def __init__(self) -> None:
        self.uid = os.geteuid()
        self.refused = 0
        self._log = LogThrottle()  # a process that reconnects in a loop: one line per 10 s

    def __call__(self, transport: Any) -> bool:
        sock = transport.get_extra_info("socket")
        if sock is None:
            return True
        try:
            creds = peer_credentials(sock)
        except OSError:
            creds = (0, -1, -1)  # unreadable: refuse
        if creds is None or creds[1] in (0, self.uid):
            return True
        self.refused += 1
        not_logged = self._log.due("refused")
        if not_logged is not None:
            _LOG.warning("internal_peer_refused", pid=creds[0], uid=creds[1], gid=creds[2],
                         refused_not_logged=not_logged)  # fmt: skip
        return False
