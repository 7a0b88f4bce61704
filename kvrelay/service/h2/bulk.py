"""Large pre-encoded messages (snapshot chunks) written as HTTP/2 DATA frames by the relay itself.

Why: grpclib hands a message to h2 one DATA frame at a time (16 KiB at a client's default
``SETTINGS_MAX_FRAME_SIZE``): a 4 MiB chunk is copied into the gRPC frame, into a ``BytesIO``,
into every h2 frame object and h2's output buffer, and each 16 KiB frame is its own socket write.
That is ~7 ms of relay CPU per chunk per subscriber. This writer builds the frames from the
message's parts (gRPC prefix, FilterUpdate head, the CBI1 payload every joiner shares, the marker)
so the payload is copied once, into socket writes of up to ``WRITE_BYTES``. It does what h2's own
``send_data`` does for each frame — the connection and stream state checks, both flow-control
windows, the peer's maximum frame size — and never sends END_STREAM (trailers end the stream).

Scheduling: the snapshots of the streams of one HTTP/2 connection are written one after another,
in the order the streams started sending them, instead of frame by frame in turn. Of several
subscribers joining at once, the first then holds its complete snapshot about as early as if it
were alone, and none finishes later than with interleaving (the bytes to move are the same). A
stream whose own window is empty — its client is not reading that stream — steps aside until it
opens, so it never holds up the others; waiting for the connection window or the socket keeps
its turn, since every stream of the connection waits for those alike. Small messages (deltas,
heartbeats) keep going through grpclib and are never queued behind a large one. ``acquire``
waits for the turn without writing: the hub starts a snapshot's clocks there, and a stream that
failed while it waited gives its turn up (``close``) before its first byte.

Uses grpclib 0.4 / h2 4 internals (the same ones grpclib's own ``send_data`` uses), all listed in
``internals.py``; ``bulk_sender`` returns None when they are not there, and the caller sends
through grpclib.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
import weakref
from collections.abc import Sequence
from typing import Any

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from kvrelay.service.h2.internals import (
    CANCEL,
    SEND_DATA_CONNECTION,
    SEND_DATA_STREAM,
    live_internals,
)

#: Payload bytes per socket write (several DATA frames joined): one copy, one system call.
WRITE_BYTES = 256 * 1024

_FRAME_HEADER = struct.Struct(">BHBBI")  # 24-bit length (as 8 + 16), type 0 (DATA), flags, id


class _Cursor:
    """Reads the concatenation of the parts without joining them."""

    __slots__ = ("_i", "_off", "_views", "left")

    def __init__(self, parts: Sequence[bytes]) -> None:
        self._views = [memoryview(p) for p in parts if len(p)]
        self._i = 0
        self._off = 0
        self.left = sum(len(v) for v in self._views)

    def take(self, n: int, out: list[bytes | memoryview]) -> None:
        self.left -= n
        while n:
            view = self._views[self._i]
            k = min(n, len(view) - self._off)
            out.append(view[self._off : self._off + k])
            self._off += k
            n -= k
            if self._off == len(view):
                self._i += 1
                self._off = 0


class _Turn:
    """One stream's place in its connection's order."""

    __slots__ = ("idle", "waiter")

    def __init__(self) -> None:
        self.idle = True  # not writing now: between messages, or its own window is empty
        self.waiter: asyncio.Future[None] | None = None


class _Lane:
    """The bulk senders of one connection, in the order they first sent; the first one that is
    not idle is the one that writes."""

    __slots__ = ("_turns",)

    def __init__(self) -> None:
        self._turns: list[_Turn] = []

    def join(self) -> _Turn:
        t = _Turn()
        self._turns.append(t)
        return t

    def leave(self, t: _Turn) -> None:
        if t in self._turns:
            self._turns.remove(t)
            self.wake()

    def set_idle(self, t: _Turn, idle: bool) -> None:
        t.idle = idle
        self.wake()

    def _writer(self) -> _Turn | None:
        for t in self._turns:
            if not t.idle:
                return t
        return None

    def wake(self) -> None:
        w = self._writer()
        if w is not None and w.waiter is not None and not w.waiter.done():
            w.waiter.set_result(None)

    async def wait(self, t: _Turn) -> None:
        """Return once ``t`` is the one that writes (at once if it is)."""
        while self._writer() is not t:
            t.waiter = asyncio.get_running_loop().create_future()
            try:
                await t.waiter
            finally:
                t.waiter = None


_LANES: weakref.WeakKeyDictionary[Any, _Lane] = weakref.WeakKeyDictionary()


class BulkSender:
    """Sends whole messages given as parts on one grpclib server stream (``await sender(parts)``);
    ``close()`` gives up the stream's place in its connection's order."""

    def __init__(self, stream: Any, inner: Any, max_message_bytes: int) -> None:
        self._stream = stream
        self._inner = inner
        self._conn: Any = inner.connection
        self._h2: Any = inner._h2_connection
        self._transport: Any = inner._transport
        self._max = max_message_bytes
        lane = _LANES.get(self._conn)
        if lane is None:
            lane = _LANES[self._conn] = _Lane()
        self._lane = lane
        self._turn: _Turn | None = None

    async def acquire(self) -> None:
        """Return once this stream is the one of its connection that writes (its turn), kept
        until its next message is sent or ``close``: nothing is written meanwhile."""
        if self._turn is None:
            self._turn = self._lane.join()
        me = self._turn
        self._lane.set_idle(me, False)
        try:
            await self._lane.wait(me)
        except BaseException:
            self._lane.set_idle(me, True)
            raise

    async def __call__(self, parts: Sequence[bytes]) -> None:
        """Send one message. Cancelled before its first byte (the hub ends a stream whose chunk
        waits for a window: a drain, a fence), it leaves nothing behind and gives its turn to
        the next stream, so the trailers can follow at once; cancelled in the middle of the
        message, it resets the stream (``abandon``)."""
        stream, inner, conn, h2 = self._stream, self._inner, self._conn, self._h2
        if not stream._send_initial_metadata_done:
            await stream.send_initial_metadata()
        size = sum(len(p) for p in parts)
        if size > self._max:  # the codec's bound, as for any other message
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED, f"outbound message of {size} bytes exceeds {self._max}"
            )
        cur = _Cursor((b"\x00" + size.to_bytes(4, "big"), *parts))
        lane = self._lane
        if self._turn is None:
            self._turn = lane.join()
        me = self._turn
        lane.set_idle(me, False)
        total = cur.left
        try:
            while cur.left:
                await lane.wait(me)
                if not conn.write_ready.is_set():
                    await conn.write_ready.wait()
                    continue
                window = h2.local_flow_control_window(inner.id)  # raises once the stream closed
                if window > 0:
                    self._write(cur, window)
                    continue
                # the stream's own window is empty (its client is not reading it): step aside
                # until it opens, then go on before the streams that started later
                own = h2.streams[inner.id].outbound_flow_control_window <= 0
                if own:
                    lane.set_idle(me, True)
                inner.window_updated.clear()
                await inner.window_updated.wait()
                if own:
                    lane.set_idle(me, False)
        except BaseException:  # e.g. the call's deadline, while the client reads slowly
            if 0 < cur.left < total:
                abandon(stream, inner)
            raise
        finally:
            lane.set_idle(me, True)
        stream._send_message_done = True
        stream._messages_sent += 1
        conn.messages_sent += 1
        conn.last_message_sent = time.monotonic()

    def _write(self, cur: _Cursor, window: int) -> None:
        """DATA frames for up to ``window`` bytes in one socket write; synchronous, so nothing
        else touches h2 in between. The same checks and accounting as h2's ``send_data``."""
        inner, h2, conn = self._inner, self._h2, self._conn
        sid = inner.id
        h2_stream = h2.streams[sid]
        h2.state_machine.process_input(SEND_DATA_CONNECTION)  # raises when closed
        h2_stream.state_machine.process_input(SEND_DATA_STREAM)
        n = min(window, cur.left, WRITE_BYTES)
        pieces: list[bytes | memoryview] = []
        pending = h2.data_to_send()  # h2's own frames first (they may precede ours)
        if pending:
            pieces.append(pending)
        frame = h2.max_outbound_frame_size
        left = n
        while left:
            k = min(left, frame)
            pieces.append(_FRAME_HEADER.pack(k >> 16, k & 0xFFFF, 0, 0, sid))
            cur.take(k, pieces)
            left -= k
        h2.outbound_flow_control_window -= n
        h2_stream.outbound_flow_control_window -= n
        self._transport.write(b"".join(pieces))
        inner.data_sent += n
        conn.data_sent += n
        conn.data_send_process()

    def close(self) -> None:
        if self._turn is not None:
            self._lane.leave(self._turn)
            self._turn = None


def abandon(stream: Any, inner: Any) -> None:
    """A message cut short (its writer cancelled, e.g. by the call's deadline) cannot be followed
    by trailers: its client would read them as the rest of the message and report a framing
    error instead of the status. The stream is reset (RST_STREAM CANCEL) and grpclib told it is
    cancelled, so it writes no trailers; the client sees the stream cancelled."""
    with contextlib.suppress(Exception):  # already closed: nothing left to reset
        inner.reset_nowait(CANCEL)
    stream._cancel_done = True


def bulk_sender(stream: Any, max_message_bytes: int) -> BulkSender | None:
    """A ``BulkSender`` for this grpclib server stream; None when the grpclib/h2 internals it
    needs are missing (the caller then sends through grpclib)."""
    parts = live_internals(stream)
    if parts is None:
        return None
    return BulkSender(stream, parts.inner, max_message_bytes)
