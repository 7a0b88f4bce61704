"""Write a small pre-encoded message on a grpclib server stream at once, when nothing must wait.

Why: a delta published to N subscribers otherwise wakes N stream tasks, and each goes through
grpclib's ``send_message`` (event dispatch, codec, framing into a ``BytesIO``, h2's frame
objects): at a few hundred deltas a second that machinery is most of the relay's CPU, and with
many subscribers it is nearly all of it. ``direct_writer`` returns a synchronous function the
publication hub calls while a stream's pump is idle: it writes the gRPC message as one HTTP/2
DATA frame straight to the transport and returns True, or returns False without touching
anything whenever grpclib's own path could have to wait or would do more — the initial headers
not sent yet, the transport paused (its buffer is above the high-water mark), either
flow-control window too small, the message larger than one frame, the stream or connection not
open. The caller then queues the frame for the stream's pump, which sends it through grpclib.

For each frame it does what h2's ``send_data`` does (connection and stream state transitions,
both windows debited) and what grpclib's ``send_data`` and ``send_message`` count. The two
transitions are skipped on an open stream of an open connection, where h2 makes them without an
action and without leaving the state: the state machines' enum lookups were a measurable part of
each frame.

One write per connection per publication: the frame is appended to h2's own outbound buffer —
the buffer grpclib writes out after every h2 operation — and the connection is flushed once at
the end of the event-loop iteration. A delta fanned out to the 8–11 streams of one connection
thus costs one system call and wakes the client once instead of 8–11 times, and order is kept
with everything grpclib writes meanwhile (its writes drain the same buffer first). The bytes
buffered this way are bounded by the flow-control windows and by the transport's high-water
mark, which is checked before each frame.

Uses grpclib 0.4 / h2 4 internals, all listed in ``internals.py``; returns None when they are
not there, and every frame then goes through grpclib.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Callable
from typing import Any

from kvrelay.service.h2.internals import SEND_DATA_CONNECTION, SEND_DATA_STREAM, live_internals
from kvrelay.service.h2.internals import SEND_DATA_CONNECTION_NOOP as CONN_NOOP
from kvrelay.service.h2.internals import SEND_DATA_STREAM_NOOP as STREAM_NOOP

#: HTTP/2 frame header: 24-bit length (as 8 + 16 bits), type 0 (DATA), flags 0, stream id.
_DATA_HEADER = struct.Struct(">BHBBI")
_GRPC_PREFIX = struct.Struct(">BI")  # compressed flag 0, message length


def direct_writer(stream: Any) -> Callable[[bytes], bool] | None:
    """A synchronous writer for this grpclib server stream (see the module docstring), or None
    when grpclib/h2 do not have the internals it needs."""
    parts = live_internals(stream)
    if parts is None:
        return None
    _, inner, conn, h2 = parts
    write_ready = conn.write_ready
    transport = inner._transport
    # kept: ``asyncio.get_running_loop`` makes a ``getpid`` system call each time (its fork check)
    call_soon = asyncio.get_running_loop().call_soon

    def write_now(message: bytes) -> bool:
        if not stream._send_initial_metadata_done or not write_ready.is_set():
            return False
        sid = inner.id
        h2_stream = h2.streams.get(sid)
        size = len(message) + _GRPC_PREFIX.size
        if (
            h2_stream is None
            or transport.is_closing()
            or size > h2.max_outbound_frame_size
            or size > h2.outbound_flow_control_window
            or size > h2_stream.outbound_flow_control_window
        ):
            return False
        conn_sm, stream_sm = h2.state_machine, h2_stream.state_machine
        if conn_sm.state is not CONN_NOOP or stream_sm.state not in STREAM_NOOP:
            try:  # the same transitions h2's send_data makes; they raise when the stream is over
                conn_sm.process_input(SEND_DATA_CONNECTION)
                stream_sm.process_input(SEND_DATA_STREAM)
            except Exception:
                return False
        # else: an open stream on an open connection, where both are no-ops (internals.py)
        h2.outbound_flow_control_window -= size
        h2_stream.outbound_flow_control_window -= size
        out = h2._data_to_send
        out += _DATA_HEADER.pack(size >> 16, size & 0xFFFF, 0, 0, sid)
        out += _GRPC_PREFIX.pack(0, len(message))
        out += message
        if not getattr(conn, _FLUSH_PENDING, False):  # at the end of the iteration, once
            setattr(conn, _FLUSH_PENDING, True)
            call_soon(_flush, conn)
        inner.data_sent += size
        conn.data_sent += size
        conn.data_send_process()
        stream._send_message_done = True
        stream._messages_sent += 1
        conn.messages_sent += 1
        conn.last_message_sent = time.monotonic()
        return True

    return write_now


_FLUSH_PENDING = "_kvrelay_flush_pending"


def _flush(conn: Any) -> None:
    setattr(conn, _FLUSH_PENDING, False)
    try:  # not contextlib.suppress: three Python calls more on every delta
        conn.flush()
    except Exception:  # transport closed: the stream's error path reports it
        return
