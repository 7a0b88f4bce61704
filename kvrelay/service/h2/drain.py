"""A graceful GOAWAY on each connection when the relay drains (grpclib's server sends none).

Why: a drain (SIGTERM, a hot upgrade's hand-over) ends every stream with a status, and routers
reopen at once. Without a GOAWAY the reopened call goes out on the same connection, to the
draining process: it is refused UNAVAILABLE, or lost as that connection closes under it ("Socket
closed" in grpcio). In a hot upgrade it should reach the successor, already accepting on the
same port. GOAWAY ``NO_ERROR`` is how an HTTP/2 server says "new calls on a new connection"
(RFC 9113 §6.8), and gRPC clients (grpc-core, grpc-go, tonic) do so.

Sent on each connection once it has no stream left open: at the drain's start for an idle one,
else right after its last stream's trailers, in the same write (h2's buffer is flushed first).
The last stream id is the highest the relay has received, so a call the client sent meanwhile
is one it may retry elsewhere; the relay still answers it (refused, as every call during a
drain). A connection whose streams outlast the drain's grace gets its GOAWAY as it is closed
(``final``).

grpclib's client is the exception, known by the ``user-agent`` of its requests (as grpc-core
keys its own workarounds): it ignores the last stream id and fails every stream it still holds
on any GOAWAY, at once, including one whose trailers came in the same read and were not read
yet. Its connections get no GOAWAY: they are closed as before, and grpclib sees the end of the
connection only after its streams have had their turn to read what came before it.

Uses grpclib's private protocol parts and h2's outbound buffer (``internals.PROTOCOL_NEEDS`` and
``DRAIN_NEEDS``); without them no notice is sent and connections close as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from kvrelay.service.h2.guard import goaway
from kvrelay.service.h2.internals import H2Protocol, missing_in_drain, missing_in_protocol

__all__ = ["DrainNotice"]

_NO_ERROR = 0x0
_GRPCLIB_AGENT = "grpc-python-grpclib/"


class DrainNotice:
    """One connection's open streams and its graceful GOAWAY (see the module docstring)."""

    __slots__ = ("_draining", "_grpclib", "_open", "_proto", "sent")

    def __init__(self, proto: H2Protocol) -> None:
        # weak: the server maps each protocol to its notice in a WeakKeyDictionary, and a strong
        # reference back would keep every connection ever accepted
        self._proto = weakref.ref(proto)
        self._open = 0
        self._draining = False
        self._grpclib = False  # a grpclib client's: never told (see the module docstring)
        self.sent = False

    @classmethod
    def install(cls, proto: H2Protocol) -> DrainNotice | None:
        """Count the streams this connection's handler accepts; None (nothing installed) when
        grpclib lacks the parts it needs."""
        if missing_in_protocol(proto):
            return None
        notice = cls(proto)
        handler: Any = proto.handler
        accept = handler.accept

        def accept_counted(stream: Any, headers: Any, release_stream: Callable[[], Any]) -> None:
            if not notice._grpclib:
                notice._grpclib = _from_grpclib(headers)
            accept(stream, headers, release_stream)
            task = handler._tasks.get(stream)  # none: refused before a task (mend.py)
            if task is not None and not task.done():
                notice._open += 1
                task.add_done_callback(notice._ended)

        handler.accept = accept_counted
        return notice

    def _ended(self, _task: Any) -> None:
        self._open -= 1
        if self._draining and self._open == 0:
            self._send()

    def drain(self) -> None:
        """The relay drains: notify now if nothing is open, else after the last stream ends."""
        self._draining = True
        if self._open == 0:
            self._send()

    def final(self) -> None:
        """The connection is about to be closed: notify if that has not happened yet."""
        self._send()

    def _send(self) -> None:
        proto = self._proto()
        if self.sent or self._grpclib or proto is None or missing_in_drain(proto):
            return  # (a grpclib client's connection is never told; none before connection_made)
        conn: Any = proto.connection
        if conn._transport.is_closing():
            return
        self.sent = True
        h2 = conn._connection
        try:
            h2._data_to_send += goaway(h2.highest_inbound_stream_id, _NO_ERROR)
            conn.flush()  # after what h2 already holds: the trailers go first
        except Exception:  # the connection broke meanwhile: nothing left to tell
            return


def _from_grpclib(headers: Any) -> bool:
    for name, value in headers:
        if name == "user-agent":
            return isinstance(value, str) and value.startswith(_GRPCLIB_AGENT)
    return False
