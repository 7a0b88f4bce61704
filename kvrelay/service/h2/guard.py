"""Per-connection HTTP/2 budgets: rapid reset, stream, empty-frame and DATA floods, PING, SETTINGS
and WINDOW_UPDATE floods, oversized headers; the work one read may cost the loop; connections per
peer.

Why: h2 and grpclib answer every frame a client sends, however many. A client that opens a
stream and resets it in a loop (CVE-2023-44487, "rapid reset"), or floods PING or SETTINGS
frames (each answered with an ACK), keeps the relay's one event loop busy and grows its
buffers while every other client waits. ``FrameGuard`` reads the frame headers of what the
client sends before h2 does (a few bytes per frame: the 9-byte header; payloads are skipped by
length) and counts, per connection and per ``window_s``, the frames that cost the server work
without giving it any. Past a budget it writes GOAWAY with ``ENHANCE_YOUR_CALM`` (the code
RFC 9113 gives for this) and closes the connection; other connections are untouched.

RST_STREAM counts by the age of the stream it resets. The attack resets streams as soon as it
opens them, before the server did anything useful with them; a client that closes many streams
it held open for a while (a router leaving hundreds of pools' streams at once, every stream of a
channel that shuts down) is no attack, and it may reset at once as many streams as the connection
may hold. So a reset of a stream opened less than ``held_stream_s`` ago counts against
``max_resets``; one of a stream held longer counts against ``max_held_resets`` (the server sets
it from its stream limit per connection), which only bounds a flood of RST_STREAM frames on
streams long gone. Each stream still cost a new stream to open (``max_streams`` below).

Streams count when they open, however they end: a client that gets h2 itself to reset each
stream (a stream ended, then DATA on it) is a rapid reset the RST_STREAM count never sees. Frames
that carry nothing and ask nothing the relay needs (PRIORITY, an empty DATA frame that does not
end its stream, an empty CONTINUATION, a frame type HTTP/2 does not define, a PING or SETTINGS
ACK) have a budget of their own. An ACK answers one of the relay's own keepalive PINGs or
SETTINGS, a few per window; unbudgeted, a flood of them (1.5 million in 8 s from one
connection) kept the relay's CPU busy for as long as it lasted, never closed nor counted.

So does DATA or HEADERS on a stream the client has already ended (END_STREAM) or reset, or never
opened below its newest one: h2 drops what it carries and answers each frame with RST_STREAM
(STREAM_CLOSED). Nothing bounded them: one connection sending one-byte DATA frames on a closed
stream, and reading nothing, kept a core busy and grew the relay by about 1 MiB a second of
RST_STREAM frames queued for it, for as long as it went on. The guard knows the streams whose
client side is open (at most ``max_open_streams``, oldest forgotten first: the server sets it
from its stream limit per connection); a request's own frames never count. A stream the relay
refuses as it opens (over the stream limit, ``mend.py``) is closed from then on
(``server_closed``): its client's frames on it, each answered with RST_STREAM, count too. So
is one the relay has ended while its client's side stays open (a status such as
INVALID_REQUEST, then RST_STREAM): the first DATA frame on it after the end finds it so in h2
(``internals.server_ended``), and it and every later one count, but for one ending the client's
side (its own close, once). Unread, one connection sent 377,447 one-byte DATA frames in 12 s on
such a stream, each answered with RST_STREAM, and a router on another connection waited 40 to
50 ms for each delta instead of about 1.

DATA that does not end a stream still open has a budget too: ``max_data_frames`` per window,
plus one per stream opened in it. A request is one frame or a few (every valid one is under
1 KiB; 1 MiB, the most read, is 64 frames of 16 KiB), and only reflection's streams take more
than one request; a request dribbled one byte per frame (4 connections of 8 streams) kept the
loop busy until the request timeout ended those streams, 10 s in which a router on another
connection waited 125 to 160 ms for each delta and 0.7 to 1.1 s for GetRelayInfo.

WINDOW_UPDATE frames cannot have a fixed budget: a client sends them to give back the window the
relay's DATA used, so a router reading thousands of deltas a second sends them in proportion.
Beyond that they cost the relay work without giving it any: a flood of them (1.3 million in 5 s
from one connection, increment 1) kept a core busy for as long as it lasted, never closed nor
counted. A receiver acknowledges at most each DATA frame it got, once for its stream and once for
the connection (grpclib's and grpcio's clients send far fewer: one per half window or so), sizes
a stream's window when it opens it, and may resize every stream's at once (grpcio does as its
estimate of the link's bandwidth-delay product grows: six times in the first ten seconds of a
busy connection measured here, rarely after; the server makes ``max_window_updates`` at least
four such rounds of every stream a connection may hold). So a connection may send per window
``max_window_updates``, plus one per stream it opened in the window, plus
``window_updates_per_frame`` per DATA frame the relay sent it since the window before began.
Acknowledgements trail the DATA: a client that stopped reading for a while acknowledges what it
was sent meanwhile when it reads again, and windows begin with a frame from the client, so the
window before reaches back to its last frame before, however long ago.

The DATA frames are not counted as they are written: grpclib's per-connection counts of messages
and DATA bytes, which every writer of this package keeps as grpclib's own send does, bound them
from above (one per message, one more per 16 KiB, the smallest frame limit HTTP/2 allows;
``internals.data_frames_sent``). They are read when a window begins and when its count passes
what was last allowed, so a WINDOW_UPDATE below that costs a counter. Where the installed grpclib
lacks those counts, WINDOW_UPDATE has no budget.

One read hands h2 at most ``MAX_FEED_BYTES``: a read of tiny frames (up to 256 KiB, thousands of
frames) kept the one event loop for seconds. The rest waits for the next loop turn, the
transport's reading paused meanwhile, so other connections are served in between.

``ConnectionCaps`` bounds the TCP connections one peer address may hold and the connections the
port holds in all: each costs a file descriptor and its buffers, and one client could otherwise
take every descriptor the process has. A connection over a cap is closed as it is accepted.

The frames are read on the plain-text side (after TLS), as h2 sees them. The guard wraps the
protocol's public ``data_received``; of grpclib's private state it reads only the counts of what
the connection sent, and of h2's the state of a stream the client sends DATA on, through
``internals.py``.
"""

from __future__ import annotations

import asyncio
import socket
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.service.h2.internals import (
    data_frames_sent,
    missing_in_ended,
    missing_in_sent,
    once_connected,
    server_ended,
)

__all__ = [
    "ABUSE_REASONS",
    "MAX_FEED_BYTES",
    "ConnectionCaps",
    "FrameGuard",
    "H2Budgets",
    "H2Counters",
    "peer_address",
    "server_closed",
]

PREFACE_LEN = 24  # b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PING, WINDOW_UPDATE, CONTINUATION = 0x6, 0x8, 0x9
LAST_DEFINED = 0x9  # RFC 9113 defines types 0x0..0x9
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
ENHANCE_YOUR_CALM = 0xB
ABUSE_REASONS = (
    "rapid_reset", "stream_flood", "empty_frames", "ping_flood", "settings_flood",
    "oversized_headers", "too_many_connections", "tls_handshake", "tls_handshake_evicted",
    "window_update_flood", "data_flood",
)  # fmt: skip
#: The bytes of one read handed to h2 in one loop turn (see the module docstring).
MAX_FEED_BYTES = 16 * 1024


@dataclass(frozen=True, slots=True)
class H2Budgets:
    """Frames one connection may send per ``window_s`` (defaults far above any gRPC client's)."""

    window_s: float = 10.0
    max_resets: int = 256  # RST_STREAM from the client on a stream it opened < held_stream_s ago
    held_stream_s: float = 1.0  # a stream open this long is held, not part of a rapid reset
    max_held_resets: int = 4096  # RST_STREAM on streams held longer (at least 2 x the streams
    # a connection may hold: all of them cancelled, reopened and cancelled again in one window)
    max_streams: int = 2048  # streams opened (HEADERS on a new stream id)
    max_empty_frames: int = 4096  # PRIORITY, empty DATA not ending a stream, ACKs (module doc)
    max_pings: int = 64  # PING without ACK
    max_settings: int = 64  # SETTINGS without ACK
    max_window_updates: int = 4096  # WINDOW_UPDATE beyond what the relay's DATA earns (module doc)
    max_data_frames: int = 4096  # DATA that does not end its open stream, beyond one per stream
    # opened in the window (module doc)
    window_updates_per_frame: int = 2  # per DATA frame sent: its stream's and the connection's
    max_header_block_bytes: int = 65536  # one HEADERS + CONTINUATION sequence
    max_open_streams: int = 1024  # streams whose client side the guard tracks as open


@dataclass(slots=True)
class H2Counters:
    """HTTP/2 abuse by reason: connections closed (GOAWAY, or refused over a cap) and streams
    ended for what their client sent or never sent."""

    closed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ABUSE_REASONS, 0))

    def count(self, reason: str, n: int = 1) -> None:
        self.closed[reason] = self.closed.get(reason, 0) + n


def goaway(last_stream_id: int, code: int = ENHANCE_YOUR_CALM) -> bytes:
    """A GOAWAY frame (RFC 9113 §6.8): length 8, type 7, stream 0, last stream id, code."""
    payload = (last_stream_id & 0x7FFFFFFF).to_bytes(4, "big") + code.to_bytes(4, "big")
    return len(payload).to_bytes(3, "big") + b"\x07\x00" + b"\x00\x00\x00\x00" + payload


class FrameGuard:
    """The frame-header reader of one server connection (see the module docstring)."""

    __slots__ = (
        "_budgets",
        "_counters",
        "_data",
        "_empty",
        "_head",
        "_header_bytes",
        "_held_resets",
        "_in_headers",
        "_last_stream",
        "_open",
        "_pings",
        "_preface",
        "_recent",
        "_recent_ids",
        "_resets",
        "_sent_marks",
        "_settings",
        "_skip",
        "_streams",
        "_transport",
        "_updates",
        "_updates_allowed",
        "_window_end",
        "ended",
        "sent",
        "tripped",
    )  # fmt: skip

    def __init__(self, transport: Any, budgets: H2Budgets, counters: H2Counters) -> None:
        self._transport = transport
        self._budgets = budgets
        self._counters = counters
        self._preface = PREFACE_LEN
        self._head = b""  # a frame header split across reads
        self._skip = 0  # payload bytes of the current frame still to pass
        self._in_headers = False
        self._header_bytes = 0
        self._last_stream = 0
        self._window_end = time.monotonic() + budgets.window_s
        self._resets = self._pings = self._settings = self._streams = self._empty = 0
        self._held_resets = self._data = 0
        #: DATA frames the relay sent on the connection so far, at most (``data_frames_sent``;
        #: None: not known, WINDOW_UPDATE has no budget)
        self.sent: Callable[[], int] | None = None
        #: whether the relay has ended a stream its client opened (``server_ended``; None: not
        #: known, such a stream's frames count once its client ends or resets it)
        self.ended: Callable[[int], bool] | None = None
        self._updates = 0  # WINDOW_UPDATE frames in this window
        self._updates_allowed = budgets.max_window_updates  # as last computed
        #: ``sent()`` when the previous window and this one began
        self._sent_marks = (0, 0)
        #: streams opened less than ``held_stream_s`` ago: (when, stream id), oldest first, and
        #: their ids (bounded by the streams a window may open)
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_ids: set[int] = set()
        #: streams the client opened and has neither ended nor reset, oldest first (module doc)
        self._open: dict[int, None] = {}
        self.tripped: str | None = None

    def feed(self, data: bytes) -> bool:
        """Account for ``data``; False once the connection broke a budget (it is closed)."""
        if self.tripped is not None:
            return False
        pos, n = 0, len(data)
        if self._preface:
            take = min(self._preface, n)
            self._preface -= take
            pos = take
        while pos < n:
            if self._skip:
                take = min(self._skip, n - pos)
                self._skip -= take
                pos += take
                continue
            need = 9 - len(self._head)
            chunk = data[pos : pos + need]
            pos += len(chunk)
            if len(chunk) < need:
                self._head += chunk
                break
            head = self._head + chunk if self._head else chunk
            self._head = b""
            reason = self._frame(head)
            if reason is not None:
                self._trip(reason)
                return False
        return True

    def _frame(self, head: bytes) -> str | None:
        length = int.from_bytes(head[0:3], "big")
        kind, flags = head[3], head[4]
        stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
        self._skip = length
        now = time.monotonic()
        if now >= self._window_end:
            self._new_window(now)
        b = self._budgets
        if kind == HEADERS:
            if stream > self._last_stream:  # a new stream (trailers come on an open one)
                self._last_stream = stream
                self._streams += 1
                if self._streams > b.max_streams:
                    return "stream_flood"
                self._forget_held(now)
                self._recent.append((now, stream))
                self._recent_ids.add(stream)
                if not flags & END_STREAM:
                    self._opened(stream)
            elif stream not in self._open:
                reason = self._empty_frame()  # on a closed stream: module doc
                if reason is not None:
                    return reason
            elif flags & END_STREAM:
                del self._open[stream]  # trailers end the request
            self._header_bytes = length
            self._in_headers = not flags & END_HEADERS
        elif kind == CONTINUATION and self._in_headers:
            self._header_bytes += length
            self._in_headers = not flags & END_HEADERS
            if not length:
                return self._empty_frame()
        elif kind == DATA:
            if stream in self._open:
                if self.ended is not None and self.ended(stream):
                    del self._open[stream]  # the relay ended it: on a closed stream from now on
                    if not flags & END_STREAM:  # (but the client's own end: module doc)
                        return self._empty_frame()
                elif flags & END_STREAM:
                    del self._open[stream]
                elif not length:
                    return self._empty_frame()
                else:
                    self._data += 1  # a request's own frame, or one dribbled (module doc)
                    if self._data > b.max_data_frames + self._streams:
                        return "data_flood"
            elif 0 < stream <= self._last_stream or (not length and not flags & END_STREAM):
                return self._empty_frame()  # on a closed stream (module doc), or empty
        elif kind == WINDOW_UPDATE:
            self._updates += 1
            if self._updates > self._updates_allowed:
                return self._window_updates()
        elif kind == PRIORITY or kind > LAST_DEFINED:
            return self._empty_frame()
        elif kind == RST_STREAM:
            self._open.pop(stream, None)
            self._forget_held(now)
            if 0 < stream <= self._last_stream and stream not in self._recent_ids:
                self._held_resets += 1  # a stream held a while (or long gone): module doc
                if self._held_resets > b.max_held_resets:
                    return "rapid_reset"
            else:
                self._resets += 1
                if self._resets > b.max_resets:
                    return "rapid_reset"
        elif kind == PING and not flags & ACK:
            self._pings += 1
            if self._pings > b.max_pings:
                return "ping_flood"
        elif kind == SETTINGS and not flags & ACK:
            self._settings += 1
            if self._settings > b.max_settings:
                return "settings_flood"
        elif kind in (PING, SETTINGS):  # an ACK: the relay asked for one per PING or SETTINGS
            return self._empty_frame()
        if kind in (HEADERS, CONTINUATION) and self._header_bytes > b.max_header_block_bytes:
            return "oversized_headers"
        return None

    def _new_window(self, now: float) -> None:
        """Start a budget window (the DATA sent in the one ending still counts: module doc)."""
        self._window_end = now + self._budgets.window_s
        self._resets = self._pings = self._settings = self._streams = self._empty = 0
        self._held_resets = self._updates = self._data = 0
        self._updates_allowed = self._budgets.max_window_updates
        if self.sent is not None:
            self._sent_marks = (self._sent_marks[1], self.sent())

    def _window_updates(self) -> str | None:
        """Past what was last allowed: allowed now, with the DATA sent since (module doc)?"""
        b = self._budgets
        if self.sent is None:
            self._updates_allowed = 1 << 62  # not known: no budget
            return None
        frames = self.sent() - self._sent_marks[0]
        allowed = b.max_window_updates + self._streams + b.window_updates_per_frame * frames
        if self._updates > allowed:
            return "window_update_flood"
        self._updates_allowed = allowed
        return None

    def _opened(self, stream: int) -> None:
        """Track ``stream``'s client side as open, forgetting the oldest past the bound."""
        opened = self._open
        opened[stream] = None
        if len(opened) > self._budgets.max_open_streams:
            del opened[next(iter(opened))]

    def _forget_held(self, now: float) -> None:
        """Drop the streams opened ``held_stream_s`` ago or earlier from the recent ones."""
        recent, cutoff = self._recent, now - self._budgets.held_stream_s
        while recent and recent[0][0] <= cutoff:
            self._recent_ids.discard(recent.popleft()[1])

    def _empty_frame(self) -> str | None:
        self._empty += 1
        return "empty_frames" if self._empty > self._budgets.max_empty_frames else None

    def _trip(self, reason: str) -> None:
        self.tripped = reason
        self._counters.count(reason)
        t = self._transport
        if not t.is_closing():
            t.write(goaway(self._last_stream))
            t.close()  # flushes the GOAWAY, then closes


#: The streams each guarded connection's client holds open (``FrameGuard._open``), by protocol:
#: ints only, so the protocol is not kept alive by its entry.
_OPEN: weakref.WeakKeyDictionary[Any, dict[int, None]] = weakref.WeakKeyDictionary()


def server_closed(proto: Any, stream: int) -> None:
    """The relay closed ``stream`` of ``proto``'s connection before its client ended it (refused
    as it opened): the client's frames on it from now on are frames on a closed stream."""
    opened = _OPEN.get(proto)
    if opened is not None:
        opened.pop(stream, None)


def guard_protocol(proto: Any, budgets: H2Budgets, counters: H2Counters) -> None:
    """Put a ``FrameGuard`` in front of ``proto.data_received``, handing h2 at most
    ``MAX_FEED_BYTES`` per loop turn. Installed before the transport exists: uvloop's
    transports keep the protocol's ``data_received`` as it is when they are made, so a
    replacement made in ``connection_made`` would never be called there. Through
    ``once_connected``: the guard is made before grpclib's ``connection_made``, and reads the
    counts of what the connection sent (``SENT_NEEDS``) and h2's streams (``ENDED_NEEDS``) once
    grpclib has made it."""
    received: Callable[[bytes], None] = proto.data_received
    waiting: deque[bytes] = deque()  # read, not yet handed on (reading paused meanwhile)
    guard: FrameGuard | None = None
    transport: Any = None

    def guarded(t: Any) -> None:  # (before grpclib's ``connection_made``)
        nonlocal guard, transport
        transport = t
        guard = FrameGuard(t, budgets, counters)
        _OPEN[proto] = guard._open

    def count_sent(_t: Any) -> None:  # (grpclib's connection exists from then)
        if guard is not None:
            guard.sent = data_frames_sent(proto)
            guard.ended = server_ended(proto)

    def hand_on(data: bytes) -> bool:
        if guard is None or not guard.feed(data):
            waiting.clear()
            return False
        received(data)
        return True

    def data_received(data: bytes) -> None:
        if waiting:
            waiting.append(data)  # (a read that was under way as reading paused)
            return
        if len(data) <= MAX_FEED_BYTES:
            hand_on(data)
            return
        waiting.append(data)
        _pause(transport)
        drain()

    def drain() -> None:
        budget = MAX_FEED_BYTES
        while waiting and budget > 0:
            if transport.is_closing():  # closed between turns: nothing more for h2
                waiting.clear()
                return
            data = waiting.popleft()
            if len(data) > budget:
                waiting.appendleft(data[budget:])
                data = data[:budget]
            budget -= len(data)
            try:
                if not hand_on(data):
                    return
            except Exception:  # (on a later turn no transport error path would close it)
                waiting.clear()
                transport.abort()
                raise
        if waiting:
            asyncio.get_running_loop().call_soon(drain)
        else:
            _resume(transport)

    once_connected(proto, _missing_both, count_sent, before=guarded)
    proto.data_received = data_received


def _missing_both(proto: Any) -> list[str]:
    """What the protocol lacks of both ``SENT_NEEDS`` and ``ENDED_NEEDS``: either is used alone."""
    sent = missing_in_sent(proto)
    return sent and missing_in_ended(proto)


def _pause(transport: Any) -> None:
    try:
        transport.pause_reading()
    except Exception:  # a closing transport: nothing more comes
        return


def _resume(transport: Any) -> None:
    try:
        if not transport.is_closing():
            transport.resume_reading()
    except Exception:  # closed meanwhile
        return


def peer_address(transport: Any) -> str | None:
    """The TCP peer's IP address, as the per-address caps count it; None for other sockets."""
    peer = transport.get_extra_info("peername")
    sock = transport.get_extra_info("socket")
    tcp = sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6)
    return str(peer[0]) if tcp and isinstance(peer, tuple) and peer else None


class ConnectionCaps:
    """Connections held per TCP peer address and in all (see the module docstring); UNIX
    socket peers (the daemon's own fan-out workers) count in the total only."""

    def __init__(self, per_address: int, total: int, counters: H2Counters) -> None:
        self.per_address = per_address
        self.total = total
        self._counters = counters
        self._by_address: dict[str, int] = {}
        self.open = 0

    def admit(
        self, transport: Any, make_room: Callable[[str | None], bool] | None = None
    ) -> Callable[[], None] | None:
        """Take a place for a new connection: its release, or None when a cap is reached (the
        caller closes it; counted as ``too_many_connections``). ``make_room(address)``: asked
        when a cap is reached (the peer's address: its own cap; None: the total), it frees a
        place under that cap (giving it back before it returns) and says whether it did; the
        connection then goes on to the next cap."""
        addr = peer_address(transport)
        if (
            addr is not None
            and self._by_address.get(addr, 0) >= self.per_address
            and (make_room is None or not make_room(addr))
        ) or (self.open >= self.total and (make_room is None or not make_room(None))):
            self._counters.count("too_many_connections")
            return None
        self.open += 1
        if addr is not None:
            self._by_address[addr] = self._by_address.get(addr, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self.open -= 1
            if addr is not None:
                left = self._by_address[addr] - 1
                if left:
                    self._by_address[addr] = left
                else:
                    del self._by_address[addr]

        return release
