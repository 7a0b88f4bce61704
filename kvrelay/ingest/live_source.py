"""Where a subscriber's live messages and connection events come from: libzmq's SUB socket and
its monitor (pyzmq), or the ZMTP reader on the event loop (``ingest/zmtp.py``).

Both give the subscriber the same four things, in the same order: connection events
(``CONNECTED``, ``DISCONNECTED``) before messages, messages one at a time, a callback when either
may be waiting, and ``close``. ``reader = "zmtp"`` (the default) reads ``tcp://`` and ``ipc://``
endpoints with the ZMTP reader and anything else with libzmq; ``"libzmq"`` always uses libzmq.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvrelay.ingest import zmtp
from kvrelay.ingest.frames import MAX_FRAME_BYTES

__all__ = [
    "READERS",
    "LiveSource",
    "PyzmqSource",
    "next_message",
    "open_source",
    "readable",
    "recv_message",
    "require_reader",
]

READERS = ("zmtp", "libzmq")


def require_reader(reader: str, name: str = "reader") -> str:
    """``reader`` when it names one of ``READERS``, else ``ValueError`` naming ``name``."""
    if reader not in READERS:
        raise ValueError(f"{name} must be one of {READERS}, got {reader!r}")
    return reader


_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
assert (zmtp.CONNECTED, zmtp.DISCONNECTED) == (zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED)


def readable(sock: zmq.Socket[Any]) -> bool:
    """A message is waiting. Reading ZMQ_EVENTS also re-arms the socket's FD (ZMQ signals
    changes, not levels), so this is checked before every wait."""
    return bool(int(sock.getsockopt(_EVENTS)) & _POLLIN)


def recv_message(sock: zmq.Socket[Any]) -> list[bytes]:
    """One waiting message, every frame as bytes (``recv_multipart(NOBLOCK)``). Each frame's
    MORE flag is read from the frame itself: ``recv_multipart`` asks ``getsockopt(RCVMORE)``,
    which builds a ``SocketOption`` enum in Python for every frame. ZMQ delivers a message's
    frames together, so only the first read can find nothing (``zmq.Again``)."""
    frame = sock.recv(_NOBLOCK, copy=False)
    parts = [frame.bytes]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        parts.append(frame.bytes)
    return parts


def next_message(sock: zmq.Socket[Any], woken: bool) -> list[bytes] | None:
    """The next waiting message, or None when there is none (the FD is re-armed either way).

    ``woken``: the first read after the socket's FD signalled. A wake almost always means a
    message, and a non-blocking read that finds none processes ZMQ's pending commands itself
    before it gives up (``zmq.Again``), which re-arms the FD as ``readable`` would: so it reads
    straight away and saves one ``ZMQ_EVENTS`` read per wake (several µs on cold caches). The
    reads after it ask ``readable`` first, as a drain would otherwise end in an exception."""
    if woken:
        try:
            return recv_message(sock)
        except zmq.Again:
            return None
    return recv_message(sock) if readable(sock) else None


class LiveSource(Protocol):
    """One endpoint's live stream, as the subscriber reads it."""

    endpoint: str

    def open(self, notify: Callable[[], None]) -> None:
        """Start delivering; ``notify`` is called on the loop whenever input may be waiting."""

    async def wait_ready(self, timeout: float) -> bool:
        """Until the stream is subscribed at the publisher, at most ``timeout`` s (True at once
        where that cannot be known: libzmq subscribes on its own thread as it connects)."""

    def detach(self) -> None:
        """Stop calling ``notify`` (the subscriber's task ended); ``close`` still to come."""

    def close(self) -> None: ...

    def has_events(self) -> bool: ...

    def take_events(self) -> list[int]:
        """The connection events waiting, oldest first (``zmtp.CONNECTED``/``DISCONNECTED``)."""

    def readable(self) -> bool: ...

    def next_message(self, woken: bool = False) -> list[bytes] | None:
        """The next message, or None. ``woken``: the first read after ``notify``."""


#: TCP keepalive on the SUB connection, so a silent network partition shows up as a disconnect.
KEEPALIVE = (10, 5, 3)  # idle s, interval s, probes
#: How long after a disconnect libzmq may take to connect again before the source renews the
#: connection itself: libzmq never reconnects to a peer that broke the protocol (a port taken
#: over by another service, a publisher that sent a bad frame), so without this one such peer
#: would end the member's live stream until the relay restarts.
RENEW_AFTER_S = 1.0


class PyzmqSource:
    """libzmq's SUB socket plus a monitor socket for its connect/disconnect events.

    ``renewals``: how often a disconnect was not followed by a connect within
    ``RENEW_AFTER_S``, and the source disconnected and connected the endpoint again (once per
    disconnect: an engine that is simply down is retried by libzmq as before)."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, hwm: int) -> None:
        self.endpoint = endpoint
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, hwm)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            sub.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sub.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE[0])
            sub.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE[1])
            sub.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE[2])
            sub.setsockopt(zmq.SUBSCRIBE, b"")  # topic prefix checked in frames.py: counted
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sub.connect(endpoint)
        except BaseException:
            sub.close(linger=0)
            raise
        self._sub: zmq.Socket[Any] | None = sub
        self._mon: zmq.Socket[Any] | None = monitor
        self._fds: tuple[int, ...] = ()
        self._connected = False
        self._renew: asyncio.TimerHandle | None = None
        self.renewals = 0

    def open(self, notify: Callable[[], None]) -> None:
        assert self._sub is not None and self._mon is not None
        loop = asyncio.get_running_loop()
        self._fds = (int(self._sub.getsockopt(zmq.FD)), int(self._mon.getsockopt(zmq.FD)))
        for fd in self._fds:
            loop.add_reader(fd, notify)

    async def wait_ready(self, timeout: float) -> bool:
        return True

    def detach(self) -> None:
        if self._fds:
            loop = asyncio.get_running_loop()
            for fd in self._fds:
                loop.remove_reader(fd)
            self._fds = ()

    def close(self) -> None:
        self.detach()
        if self._renew is not None:
            self._renew.cancel()
            self._renew = None
        sub, mon = self._sub, self._mon
        self._sub = self._mon = None
        if sub is not None:
            if mon is not None:
                sub.disable_monitor()
                mon.close(linger=0)
            sub.close(linger=0)

    def has_events(self) -> bool:
        return self._mon is not None and readable(self._mon)

    def take_events(self) -> list[int]:
        out: list[int] = []
        mon = self._mon
        while mon is not None:
            try:
                msg = mon.recv_multipart(_NOBLOCK)
            except zmq.Again:
                break
            event = int(parse_monitor_message(msg)["event"])
            out.append(event)
            if event == zmtp.CONNECTED:
                self._connected = True
                if self._renew is not None:
                    self._renew.cancel()
                    self._renew = None
            elif event == zmtp.DISCONNECTED:
                self._connected = False
                if self._renew is None:
                    loop = asyncio.get_running_loop()
                    self._renew = loop.call_later(RENEW_AFTER_S, self._renew_connection)
        return out

    def _renew_connection(self) -> None:
        self._renew = None
        sub = self._sub
        if sub is None or self._connected:
            return
        with contextlib.suppress(zmq.ZMQError):  # nothing of it left to end
            sub.disconnect(self.endpoint)
        sub.connect(self.endpoint)  # it was accepted once
        self.renewals += 1

    def readable(self) -> bool:
        return self._sub is not None and readable(self._sub)

    def next_message(self, woken: bool = False) -> list[bytes] | None:
        return None if self._sub is None else next_message(self._sub, woken)


def open_source(
    ctx: zmq.Context[Any],
    endpoint: str,
    hwm: int,
    reader: str,
    on_error: Callable[[str], None] | None = None,
) -> LiveSource:
    """The source for ``endpoint``: the ZMTP reader where ``reader`` asks for it and it can
    connect there (``on_error`` gets the kind of each protocol error of its peers), else
    libzmq."""
    if require_reader(reader) == "zmtp" and zmtp.supports(endpoint):
        return zmtp.ZmtpSource(endpoint, hwm=hwm, keepalive=KEEPALIVE, on_error=on_error)
    return PyzmqSource(ctx, endpoint, hwm)
